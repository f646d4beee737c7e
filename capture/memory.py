"""Memory in use on a device, for per-bucket capture cost (device memory on CUDA, RSS on CPU)."""

from __future__ import annotations

import os
import resource

import torch


def memory_in_use(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_reserved(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: peak RSS is the best portable figure
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
