"""One decode step of the sharded model at tp_size=1 vs tp_size=N: what a rank costs and holds.

    graphexec-bench tp_step [--tp 3] [--batch 1 8] [--steps 20] [--context 64] [--model smollm2-135m]

Boundary: measurement only.  Every side runs as spawned ranks (one thread each, gloo over a
file:// store; tp_size=1 is one spawned process), each loading its shard through the engine's own
path (graphexec/engine/rank_setup.py, capture=eager).  Rank 0 reports, per batch size: the median
step (forward + gathered logits), the collectives one step makes (counted on a step), the median
time of one all-reduce of [B, hidden] fp32 rows timed alone in a loop, the resident weight bytes
per rank and the peak RSS of every rank.  No speed-up is claimed: ranks are processes on the same
cores (tp_size=3 oversubscribes 2 cores); this shows what the all-reduces cost and what a rank holds.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
from contextlib import ExitStack
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.decode import decode_batch
from bench.tables import machine_line, table
from bench.timing import paired_ms
from graphexec.config import EngineConfig
from graphexec.engine.rank_setup import load_and_capture
from graphexec.parallel.group import SINGLE, TPGroup

COLUMNS = ["tp", "B", "step ms (median)", "all-reduces / step", "all-gathers / step", "ms / all-reduce [B, hidden]",
           "weights MiB / rank", "peak RSS MiB / rank (max)"]


def _rank(rank: int, size: int, store: str, args, out) -> None:
    torch.set_num_threads(1)
    if size > 1:
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=size)
    tp = TPGroup(rank, size, dist.group.WORLD) if size > 1 else SINGLE
    config = EngineConfig.from_overrides([f"model={args.model}", "capture=eager", "cache.num_slots=4096"])
    with torch.inference_mode():
        runner = load_and_capture(config, tp).runner
        rows = [_measure(runner, tp, batch, args) for batch in args.batch]
    out.put((rank, rows, runner.weight_nbytes() / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    if size > 1:
        dist.destroy_process_group()


def _median_ms(fn, calls: int) -> float:
    # a count of calls, never a time budget: every rank must make the same collectives
    return paired_ms({"": fn}, rounds=calls, steps=1)[""]["median_ms"]


def _measure(runner, tp, batch: int, args) -> dict:
    # decode_batch reads these four of an engine; a rank has a runner and its cache.
    rank = SimpleNamespace(runner=runner, kv_cache=runner.kv_cache, model_config=runner.model_config,
                           max_context=runner.max_context)
    fb, release = decode_batch(rank, batch, args.context)
    counts = _count_collectives(lambda: runner.forward_logits(fb))
    # re-running rewrites the same slots: every step sees the same state
    step_ms = _median_ms(lambda: runner.forward_logits(fb), args.steps)
    release()
    x = torch.ones(batch, runner.model_config.hidden_size)
    all_reduce_ms = _median_ms(lambda: dist.all_reduce(x, group=tp.group), 100) if tp.is_parallel else None
    return {"batch": batch, "step_ms": step_ms, **counts, "all_reduce_ms": all_reduce_ms}


def _count_collectives(step) -> dict:
    """Collectives one eager step makes, counted at TPGroup (the model's only way to them)."""
    with ExitStack() as stack:
        calls = {name: stack.enter_context(mock.patch.object(TPGroup, name, autospec=True, side_effect=getattr(TPGroup, name)))
                 for name in ("all_reduce", "all_gather")}
        step()
    return {f"{name}s": sum(call.args[0].is_parallel for call in m.call_args_list) for name, m in calls.items()}


def run_side(size: int, args) -> list[tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, size, f"file://{tmp}/store", args, out)) for r in range(size)]
        for p in procs:
            p.start()
        results = sorted((out.get(timeout=args.timeout_s) for _ in range(size)), key=lambda r: r[0])
        for p in procs:
            p.join(60)
    return results


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    args = parser.parse_args(argv)
    sides = {size: run_side(size, args) for size in (1, args.tp)}
    rows = [[size, row["batch"], f"{row['step_ms']:.1f}", row["all_reduces"], row["all_gathers"], row["all_reduce_ms"],
             f"{ranks[0][2]:.1f}", f"{max(r[3] for r in ranks):.0f}"] for size, ranks in sides.items() for row in ranks[0][1]]
    print(machine_line() + "\n\n" + table(COLUMNS, rows))
    print("\nRanks are processes on this machine's cores (one thread each): no speed-up is claimed here.")
