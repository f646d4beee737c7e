"""Per-call cost of one attention layer: the old path (torch_native behind a custom_op, as the op
was before the C++ kernels) against the `cpu` backend's C++ kernels behind the dispatcher.

    graphexec-bench attention_kernels                 # all cases, SmolLM2 heads (9 q / 3 kv, dim 64)
    graphexec-bench attention_kernels --dtype bfloat16 --repeats 5
    graphexec-bench attention_kernels --cases decode-b1-c2048 extend-1024

Every measurement runs in a process of its own (old and new alternate, in both orders), so the
two never share an OpenMP team, an allocator or caches; each case reports the best of
`--repeats` processes of the median call (the machine is shared and noisy).  A call is what each layer of a forward
pays: the op call, the K/V write and the attention, cycling through the pool's layers; the
per-forward metadata preparation is reported on its own.  Slots are contiguous per request.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.tables import header, machine_line, row
from bench.timing import median_us_per_call
from bench.workers import run_command

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
DECODE = [(b, c) for b in (1, 8, 32) for c in (64, 512, 2048)]
EXTEND = [(256, 0), (1024, 0), (1024, 1024)]  # (new tokens, cached prefix)
POOL_BUDGET_BYTES = 1 << 30  # K+V of all layers: as many layers as fit, at most 30


def case_names() -> list[str]:
    names = [f"decode-b{b}-c{c}" for b, c in DECODE]
    return names + [f"extend-{n}" + (f"-p{p}" if p else "") for n, p in EXTEND]


# -- worker: one implementation, one case, in this process ---------------------------------------


def _worker(impl: str, case: str, dtype_name: str, seconds: float) -> dict:
    from graphexec.attention.backend import ForwardContext
    from graphexec.attention.forward_context import forward_context
    from graphexec.batch.forward_batch import ForwardBatch
    from graphexec.batch.forward_mode import ForwardMode
    from graphexec.cache.kv_pool import TokenToKVPool

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    kind, *parts = case.split("-")
    if kind == "decode":
        rows, context = int(parts[0][1:]), int(parts[1][1:])
        runs = [(context - 1, 1)] * rows  # (prefix, new tokens): the new token is the last key
    else:
        new, prefix = int(parts[0]), int(parts[1][1:]) if len(parts) > 1 else 0
        runs = [(prefix, new)]
    slots_needed = sum(p + n for p, n in runs)
    layer_bytes = 2 * (slots_needed + 1) * KV_HEADS * HEAD_DIM * dtype.itemsize
    layers = max(1, min(30, POOL_BUDGET_BYTES // layer_bytes))
    pool = TokenToKVPool(slots_needed, layers, KV_HEADS, HEAD_DIM, dtype)
    pool.k_pool.normal_()
    pool.v_pool.normal_()
    table = torch.zeros(len(runs) + 1, max(p + n for p, n in runs), dtype=torch.int64)
    next_slot, locs = 1, []
    for r, (p, n) in enumerate(runs):
        table[r + 1, : p + n] = torch.arange(next_slot, next_slot + p + n)
        locs.append(table[r + 1, p : p + n])
        next_slot += p + n
    tokens = sum(n for _, n in runs)

    def t(values):
        return torch.tensor(values, dtype=torch.int64)

    extend = kind == "extend"
    starts = [sum(n for _, n in runs[:r]) for r in range(len(runs))]
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND if extend else ForwardMode.DECODE,
        batch_size=len(runs),
        input_ids=torch.zeros(tokens, dtype=torch.int64),
        positions=torch.zeros(tokens, dtype=torch.int64),
        req_pool_indices=t(list(range(1, len(runs) + 1))),
        seq_lens=t([p + n for p, n in runs]),
        seq_lens_cpu=tuple(p + n for p, n in runs),
        seq_lens_sum=slots_needed,
        out_cache_loc=torch.cat(locs),
        extend_prefix_lens=t([p for p, _ in runs]) if extend else None,
        extend_seq_lens=t([n for _, n in runs]) if extend else None,
        extend_start_loc=t(starts) if extend else None,
        extend_prefix_lens_cpu=tuple(p for p, _ in runs) if extend else None,
        extend_seq_lens_cpu=tuple(n for _, n in runs) if extend else None,
        extend_num_tokens=tokens if extend else None,
        num_token_non_padded=tokens,
        sampling_info=None,
    )
    q = torch.randn(tokens, HEADS * HEAD_DIM, dtype=dtype)
    k = torch.randn(tokens, KV_HEADS * HEAD_DIM, dtype=dtype)
    v = torch.randn(tokens, KV_HEADS * HEAD_DIM, dtype=dtype)
    out = torch.empty_like(q)

    if impl == "new":
        from graphexec.attention.cpu import CpuAttnBackend

        backend = CpuAttnBackend(HEADS, KV_HEADS, HEAD_DIM)
        op = torch.ops.graphexec.attention.default
    else:
        import graphexec.attention.op  # noqa: F401  (graphexec::attention_py)
        from graphexec.attention.torch_native import TorchNativeAttnBackend

        backend = TorchNativeAttnBackend(HEADS, KV_HEADS, HEAD_DIM)
        op = _old_custom_op()

    ctx = ForwardContext(fb, backend, pool, None)
    with torch.inference_mode(), forward_context(ctx):
        backend.init_forward_metadata(fb, table)  # warm-up (loads the kernels for "new")
        init_us = median_us_per_call(lambda: backend.init_forward_metadata(fb, table), seconds / 4)
        backend.init_forward_metadata(fb, table)
        layer = [0]

        def call():
            op(q, k, v, out, layer[0])
            layer[0] = (layer[0] + 1) % layers

        call_us = median_us_per_call(call, seconds)
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


# -- driver -------------------------------------------------------------------------------------


def _run_worker(impl: str, case: str, dtype: str, seconds: float, threads: int) -> dict:
    args = ["--worker", impl, "--cases", case, "--dtype", dtype, "--seconds", str(seconds), "--threads", str(threads)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = run_command("attention_kernels", args, timeout_s=600, cwd=root)
    if "error" in result:
        raise RuntimeError(f"{impl} {case} failed: {result['error']}")
    return result


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=case_names(), help=f"default: all of {case_names()}")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=3, help="processes per implementation and case")
    parser.add_argument("--seconds", type=float, default=1.0, help="timing budget per process")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads per process (0: torch's default)")
    parser.add_argument("--worker", choices=["old", "new"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(_worker(args.worker, args.cases[0], args.dtype, args.seconds)))
        return

    threads = args.threads or torch.get_num_threads()
    print(f"{machine_line()}\nattention per layer call, {HEADS} q / {KV_HEADS} kv heads x {HEAD_DIM}, {args.dtype}, "
          f"{threads} threads; best of {args.repeats} processes each\n")
    print(header(["case", "old µs", "new µs", "speed-up", "old init µs", "new init µs"]))
    for case in args.cases:
        best: dict[str, dict] = {}
        for rep in range(args.repeats):
            for impl in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                result = _run_worker(impl, case, args.dtype, args.seconds, args.threads)
                if impl not in best or result["call_us"] < best[impl]["call_us"]:
                    best[impl] = result
        old, new = best["old"], best["new"]
        print(row([case, f"{old['call_us']:.1f}", f"{new['call_us']:.1f}", f"{old['call_us'] / new['call_us']:.1f}x",
                   f"{old['init_us']:.1f}", f"{new['init_us']:.1f}"]), flush=True)
    print("\ninit: µs per forward to prepare the metadata (once per step, not per layer)")
