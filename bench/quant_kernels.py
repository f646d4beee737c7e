"""Kernel choices for quantized linears, measured: one SmolLM2 forward's worth of linears (30
layers of qkv, o, gate_up, down with SmolLM2's shapes and random codes, streamed from memory, not
cache-resident), per activation row count M.  Sides are paired (A B A B ...) in one process
(single-threaded Python driving the same OpenMP team); cells are median ms per forward's linears.

    graphexec-bench quant_kernels                      # Q4_1, M = 1 2 4 8 16 32 64 128 256
    graphexec-bench quant_kernels --rows 1 8 --rounds 9
    graphexec-bench quant_kernels --kquant             # GGUF K-quant / 5-bit: Q5_0 + Q4_K, M up to 64
    graphexec-bench quant_kernels --kquant --narrow Q5_1 --wide Q6_K --rows 1 8

Q4_1 sides (plus the tied Q8_0 LM head for M <= 64: prefill prunes to one row per request):
  qlinear fp32      graphexec::qlinear, fp32 activations (the block-streaming kernel)
  qlinear q8        graphexec::qlinear_q8 (model.activations=q8): activations quantized per block
                    to 8 bits, integer dot products on rows interleaved by 16
  qlinear bf16      graphexec::qlinear, bf16 activations (streaming below 48 rows, tile GEMM above)
  deq+mm bf16       dequantize the whole weight to bf16, then at::mm (the tile path's upper bound)
  dense fp32/bf16   F.linear over dense weights of the same shapes (what model.weights=dequantize reads)
  int4pack bf16     torch's _weight_int4pack_mm_for_cpu (group 32; scale = d, zero = m + 8d), bf16 only:
                    its fp32 path was ~17x slower than dense fp32 (docs: ../shared/CPU-CALIBRATION.md)

`--kquant` sides (qkv, o, gate_up with K=576 in the `--narrow` 5-bit type, down with K=1536 in the
`--wide` K-quant: what llama-quantize's Q4_K_M makes of a 576-wide model):
  blocks fp32       graphexec::qlinear_blocks, fp32 activations (streamed below 24 rows, tile GEMM above)
  Q4_1 fp32         graphexec::qlinear over Q4_1 weights of the same shapes (the packed-array kernel)
  dense fp32        F.linear over the dequantized weights
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from bench.tables import header, machine_line, row
from bench.timing import paired_ms
from graphexec.quant import BlockWeight, QuantizedWeight, ensure_kernels
from graphexec.quant.kquants import BLOCK_FORMATS
from graphexec.quant.repack import repack_rows16

LAYERS, VOCAB, F32, BF16 = 30, 49152, torch.float32, torch.bfloat16
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [N, K]


def _q4_1(n: int, k: int, gen: torch.Generator):
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    return codes, (torch.rand(n, k // 32, generator=gen) * 0.01).half(), (-torch.rand(n, k // 32, generator=gen) * 0.05).half()


def _xs(rows: int, dtype=F32) -> dict[int, torch.Tensor]:
    return {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}


def _q4_1_sides(args, gen: torch.Generator):
    linears = [_q4_1(n, k, gen) for _ in range(LAYERS) for n, k in SHAPES]
    head = (torch.randint(-128, 128, (VOCAB, 576), dtype=torch.int8, generator=gen),
            (torch.rand(VOCAB, 18, generator=gen) * 0.01).half(), None)
    g, linear = torch.ops.graphexec, torch.nn.functional.linear

    def sides(rows: int) -> dict:
        xs = {dt: _xs(rows, dt) for dt in (F32, BF16)}
        # (K, weight) per call; the head only for M <= 64: prefill prunes to one row per request
        calls = [(c.shape[1] * 2, (c, s, m)) for c, s, m in linears] + ([(576, head)] if rows <= 64 else [])

        def each(op, dt, weights):
            def run():  # each output dropped at once: a list of them costs deq+mm a third (allocator)
                for k, w in weights:
                    op(xs[dt][k], *w)
            return run

        out = {"qlinear fp32": each(g.qlinear, F32, calls),
               "qlinear q8": each(g.qlinear_q8, F32, [(k, _rows16(*w)) for k, w in calls]),
               "qlinear bf16": each(g.qlinear, BF16, calls),
               "deq+mm bf16": each(lambda x, *w: x @ g.qdequantize(*w, BF16).T, BF16, calls[: len(linears)])}
        if args.no_dense:
            return out
        ws = {dt: [g.qdequantize(*w, dt) for w in linears] for dt in (F32, BF16)}
        packed = [_int4pack(*w) for w in linears]
        return out | {"dense fp32": lambda: [linear(xs[F32][w.shape[1]], w) for w in ws[F32]],
                      "dense bf16": lambda: [linear(xs[BF16][w.shape[1]], w) for w in ws[BF16]],
                      "int4pack bf16": lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[BF16][k], w, 32, sz)
                                                for w, sz, k in packed]}

    return "Q4_1", sides


def _rows16(codes, scales, mins):
    packed = repack_rows16(QuantizedWeight("bench", codes, scales, mins))
    return packed.codes, packed.scales, packed.mins, packed.rows


def _int4pack(codes, scales, mins):
    n, k = codes.shape[0], codes.shape[1] * 2
    blocks = codes.view(n, -1, 16)
    q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, k).to(torch.int32)
    w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    d, m = scales.float(), mins.float()
    sz = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().bfloat16()  # [groups, N, 2]
    return w, sz, k


def _blocks(qtype: str, n: int, k: int, rng):
    """Random bytes with small fp16 scales where the format keeps them: valid blocks."""
    fmt = BLOCK_FORMATS[qtype]
    raw = rng.integers(0, 256, (n * k // fmt.elements, fmt.nbytes), dtype=np.uint8)
    for at in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2)}[qtype]:
        raw[:, at : at + 2] = rng.uniform(1e-4, 2e-3, raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return BlockWeight.from_gguf(raw.reshape(n, -1), qtype, (n, k))


def _kquant_sides(args, gen: torch.Generator):
    rng = np.random.default_rng(0)
    types = [args.narrow] * 3 + [args.wide]  # K=576 linears in the narrow type, down (K=1536) in the wide one
    blocks = [_blocks(qtype, n, k, rng) for _ in range(LAYERS) for qtype, (n, k) in zip(types, SHAPES)]
    q41 = [_q4_1(n, k, gen) for _ in range(LAYERS) for n, k in SHAPES]
    dense = [w.dequantize() for w in blocks]
    op, q = torch.ops.graphexec.qlinear_blocks, torch.ops.graphexec.qlinear

    def sides(rows: int) -> dict:
        xs = _xs(rows)
        return {"blocks fp32": lambda: [op(xs[w.shape[1]], w.blocks, w.format.type_id) for w in blocks],
                "Q4_1 fp32": lambda: [q(xs[c.shape[1] * 2], c, s, m) for c, s, m in q41],
                "dense fp32": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in dense]}

    return f"{args.narrow} at K=576, {args.wide} at K=1536", sides


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", help="M (default: 1 to 256, --kquant 1 to 64)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-dense", action="store_true", help="skip the dense and int4pack sides (1 GB of weights)")
    parser.add_argument("--kquant", action="store_true", help="GGUF K-quant / 5-bit blocks (qlinear_blocks)")
    parser.add_argument("--narrow", default="Q5_0", choices=["Q5_0", "Q5_1"], help="--kquant: type of the K=576 linears")
    parser.add_argument("--wide", default="Q4_K", choices=["Q4_K", "Q5_K", "Q6_K"], help="--kquant: type of down_proj")
    args = parser.parse_args(argv)
    ensure_kernels()
    what, sides = (_kquant_sides if args.kquant else _q4_1_sides)(args, torch.Generator().manual_seed(0))
    print(f"{machine_line()}\nmedian ms per forward's linears ({what})\n")
    print(header(["M", *sides(1)]))
    for rows in args.rows or ([1, 2, 4, 8, 16, 32, 64] + ([] if args.kquant else [128, 256])):
        with torch.inference_mode():
            result = paired_ms(sides(rows), rounds=args.rounds, steps=1)
        print(row([rows, *(f"{r['median_ms']:.2f}" for r in result.values())]), flush=True)
