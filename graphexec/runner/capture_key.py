"""What a stored capture plan is keyed by: everything that changes what a graph computes or how
fast it runs against eager.  A plan measured under one key is never applied under another
(capture/plan_store.py files each key apart).

The plan holds the decisions (which buckets keep their graphs, and the timings behind them) and,
beside it under the same key, the compiled-code artifacts (full_graph's `compile.aot` layer;
capture/artifacts.py), so the key errs on the side of measuring and compiling again: the model
file's identity, every resolved option but progress bars, library versions, device, thread count
and CPU.  What the key cannot see, an artifact checks itself on load: the sources it inlined
(an edited model file) and torch's own version and device checks (capture/aot_region.py).
Kernels' shared objects stay in inductor's own cache (TORCHINDUCTOR_CACHE_DIR).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any, Mapping

import torch

from graphexec.batch.forward_mode import ForwardMode
from graphexec.config import EngineConfig
from graphexec.loader import default_smollm2_gguf

# Options that change nothing a graph does.
_COSMETIC_OPTIONS = frozenset({"progress"})


def capture_key(config: EngineConfig, tp_size: int, tp_rank: int, attention_backend: str) -> dict[str, Any]:
    device = torch.device(config.device)
    return {
        "model": {f.name: _plain(getattr(config.model, f.name)) for f in dataclasses.fields(config.model)}
        | {"files": _model_files(config)},
        "plan": {
            mode.config_key: _spec(config, mode, device.type) for mode in ForwardMode
        },
        "device": str(device),
        "attention_backend": attention_backend,
        "kv_dtype": str(config.cache.dtype or config.model.dtype),
        "tp": [tp_size, tp_rank],
        "threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "graphexec": _version("graphexec"),
        },
        "cpu": _cpu_identity(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }


def _spec(config: EngineConfig, mode: ForwardMode, device_type: str) -> dict[str, Any]:
    spec = config.capture.for_mode(mode, device_type)
    return {"backend": spec.backend, "options": {k: _plain(v) for k, v in spec.options.items() if k not in _COSMETIC_OPTIONS}}


def _plain(value: Any) -> Any:
    """Mappings and sequences as JSON has them (config values arrive as read-only mappings)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _model_files(config: EngineConfig) -> list[list[Any]]:
    """(path, bytes, mtime ns) of every file the weights come from; random weights have none."""
    source = config.model
    if source.source == "gguf":
        paths = [Path(source.path if source.path is not None else default_smollm2_gguf())]
    elif source.source == "hf" and source.path is not None:
        root = Path(source.path)
        paths = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".json", ".bin")) if root.is_dir() else [root]
    else:
        return []
    files = []
    for path in paths:
        try:
            st = path.stat()
            files.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
        except OSError:
            files.append([str(path), None, None])  # the loader reports the missing file
    return files


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_identity() -> dict[str, Any]:
    """The CPU as torch dispatches on it, plus its model name (two CPUs with one ISA level still
    time differently)."""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "model": model,
        "machine": platform.machine(),
        "cores": os.cpu_count(),
    }
