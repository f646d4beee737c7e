"""Per-call cost of one attention layer: the old path (torch_native behind a custom_op, as the op
was before the C++ kernels) against the `cpu` backend's C++ kernels behind the dispatcher.

    graphexec-bench attention_kernels                 # all cases, SmolLM2 heads (9 q / 3 kv, dim 64)
    graphexec-bench attention_kernels --dtype bfloat16 --repeats 5
    graphexec-bench attention_kernels --cases decode-b1-c2048 extend-1024

Every measurement runs in a process of its own (old and new alternate, in both orders), so the
two never share an OpenMP team, an allocator or caches; each case reports the best of `--repeats`
processes of the median call (the machine is shared and noisy).  A call is what each layer of a
forward pays: the op call, the K/V write and the attention, cycling through the pool's layers; the
per-forward metadata preparation is reported on its own.  Slots are contiguous per request.
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

from bench.tables import header, machine_line, row
from bench.timing import median_us_per_call
from bench.workers import emit, run_command

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
CASES = [*(f"decode-b{b}-c{c}" for b in (1, 8, 32) for c in (64, 512, 2048)), "extend-256", "extend-1024",
         "extend-1024-p1024"]
POOL_BUDGET_BYTES = 1 << 30  # K+V of all layers: as many layers as fit, at most 30


def runs_of(case: str) -> list[tuple[int, int]]:
    """(cached prefix, new tokens) per request: decode-b{B}-c{context} (each new token the last
    key) or extend-{new}[-p{prefix}]."""
    kind, first, *rest = case.split("-")
    if kind == "decode":
        return [(int(rest[0][1:]) - 1, 1)] * int(first[1:])
    return [(int(rest[0][1:]) if rest else 0, int(first))]


def _worker(impl: str, case: str, dtype: torch.dtype, seconds: float) -> dict:
    """One implementation, one case, in this process."""
    from bench.step_message import forward_batch
    from graphexec.attention.backend import ForwardContext
    from graphexec.attention.forward_context import forward_context
    from graphexec.batch.forward_mode import ForwardMode
    from graphexec.cache.kv_pool import TokenToKVPool

    torch.manual_seed(0)
    runs = runs_of(case)
    slots_needed, tokens = sum(p + n for p, n in runs), sum(n for _, n in runs)
    layers = max(1, min(30, POOL_BUDGET_BYTES // (2 * (slots_needed + 1) * KV_HEADS * HEAD_DIM * dtype.itemsize)))
    pool = TokenToKVPool(slots_needed, layers, KV_HEADS, HEAD_DIM, dtype)
    pool.k_pool.normal_()
    pool.v_pool.normal_()
    table = torch.zeros(len(runs) + 1, max(p + n for p, n in runs), dtype=torch.int64)
    next_slot, locs = 1, []
    for r, (p, n) in enumerate(runs):  # slots contiguous per request, slot 0 unused
        table[r + 1, : p + n] = torch.arange(next_slot, next_slot + p + n)
        locs.append(table[r + 1, p : p + n])
        next_slot += p + n
    mode = ForwardMode.DECODE if case.startswith("decode") else ForwardMode.EXTEND
    fb = forward_batch(mode, runs, range(1, len(runs) + 1), torch.cat(locs))
    q, k, v = (torch.randn(tokens, heads * HEAD_DIM, dtype=dtype) for heads in (HEADS, KV_HEADS, KV_HEADS))
    out = torch.empty_like(q)
    if impl == "new":
        from graphexec.attention.cpu import CpuAttnBackend

        backend, op = CpuAttnBackend(HEADS, KV_HEADS, HEAD_DIM), torch.ops.graphexec.attention.default
    else:
        import graphexec.attention.op  # noqa: F401  (graphexec::attention_py)
        from graphexec.attention.torch_native import TorchNativeAttnBackend

        backend, op = TorchNativeAttnBackend(HEADS, KV_HEADS, HEAD_DIM), _old_custom_op()
    with torch.inference_mode(), forward_context(ForwardContext(fb, backend, pool, None)):
        # the timer's warm-up call loads the kernels for "new"; its last call leaves the metadata set
        init_us = median_us_per_call(lambda: backend.init_forward_metadata(fb, table), seconds / 4)
        layer = itertools.cycle(range(layers))  # each call a layer of its own, as a forward pays
        call_us = median_us_per_call(lambda: op(q, k, v, out, next(layer)), seconds)
    return {"impl": impl, "case": case, "call_us": call_us, "init_us": init_us, "layers": layers,
            "threads": torch.get_num_threads()}


def _old_custom_op():
    """The op as it was before the C++ kernels: a torch.library.custom_op over the backend."""
    from graphexec.attention.forward_context import get_forward_context

    @torch.library.custom_op("graphexec_bench::attention_old", mutates_args=("out",))
    def attention_old(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_id: int) -> None:
        ctx = get_forward_context()
        ctx.attn_backend.forward(q, k, v, out, layer_id, ctx)

    return torch.ops.graphexec_bench.attention_old.default


def best_of(case: str, args) -> dict[str, dict]:
    """Each implementation's fastest of `--repeats` processes, old and new alternating in both orders."""
    worker = ["--cases", case, "--dtype", args.dtype, "--seconds", str(args.seconds), "--threads", str(args.threads)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's bench, installed or not
    results: dict[str, list[dict]] = {"old": [], "new": []}
    for rep in range(args.repeats):
        for impl in ("old", "new") if rep % 2 == 0 else ("new", "old"):
            result = run_command("attention_kernels", ["--worker", impl, *worker], timeout_s=600, cwd=root)
            if "error" in result:
                raise RuntimeError(f"{impl} {case} failed: {result['error']}")
            results[impl].append(result)
    return {impl: min(runs, key=lambda r: r["call_us"]) for impl, runs in results.items()}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=CASES, help=f"default: all of {CASES}")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=3, help="processes per implementation and case")
    parser.add_argument("--seconds", type=float, default=1.0, help="timing budget per process")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads per process (0: torch's default)")
    parser.add_argument("--worker", choices=["old", "new"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if args.threads:
            torch.set_num_threads(args.threads)
        dtype = getattr(torch, args.dtype)
        return emit("attention_kernels worker", lambda: _worker(args.worker, args.cases[0], dtype, args.seconds))
    print(f"{machine_line()}\nattention per layer call, {HEADS} q / {KV_HEADS} kv heads x {HEAD_DIM}, {args.dtype}, "
          f"{args.threads or torch.get_num_threads()} threads; best of {args.repeats} processes each\n")
    print(header(["case", "old µs", "new µs", "speed-up", "old init µs", "new init µs"]))
    for case in args.cases:
        old, new = best_of(case, args).values()
        print(row([case, *(f"{r['call_us']:.1f}" for r in (old, new)), f"{old['call_us'] / new['call_us']:.1f}x",
                   *(f"{r['init_us']:.1f}" for r in (old, new))]), flush=True)
    print("\ninit: µs per forward to prepare the metadata (once per step, not per layer)")
