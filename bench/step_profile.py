"""Where one decode step goes: torch.profiler over the decode backend's forward plus the LM head
and sampler, for a batch of B requests with `--context` tokens of KV each.  Prints the ops by
self CPU time and the step's wall time (profiled steps run slower than unprofiled ones; read the
shares).  Any engine override works:

    graphexec-bench step_profile --batch 1 8 -- capture=eager
    graphexec-bench step_profile --batch 1 8 -- capture.decode.buckets=[1,8]
    graphexec-bench step_profile --batch 1 -- model.weights=dequantize capture=eager
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.decode import decode_batch
from bench.tables import machine_line
from graphexec.batch.forward_mode import ForwardMode
from graphexec.engine.threads import call_in_thread


def _profile(engine, batch: int, context: int, steps: int, rows: int) -> str:
    runner = engine.runner
    fb, release = decode_batch(engine, batch, context)
    backend = runner.backends[ForwardMode.DECODE]

    def step():
        runner.forward_and_sample(fb)

    with torch.inference_mode():
        for _ in range(3):
            step()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
    release()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return f"B={batch}, backend {backend.name}: {wall_ms:.2f} ms per step unprofiled (mean of {steps})\n{table}"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("overrides", nargs="*", help="engine overrides, after --")
    args = parser.parse_args(argv)
    from graphexec import Engine

    overrides = list(args.overrides)
    if "capture=eager" not in overrides:  # capture only the profiled buckets
        buckets = ",".join(str(b) for b in sorted(set(args.batch)))
        overrides += [f"capture.decode.buckets=[{buckets}]", "capture.extend.progress=false", "capture.decode.progress=false"]
    engine = Engine(overrides=[*overrides, "++capture.background=false"])
    print(machine_line(), flush=True)
    # On a thread that ends, like the engine's own setup, so only one OpenMP team is ever live.
    for batch in args.batch:
        print(call_in_thread(lambda: _profile(engine, batch, args.context, args.steps, args.rows)), flush=True)
    engine.shutdown()
