"""Kernel choices for quantized linears, measured: one SmolLM2 forward's worth of linears (30 layers
of qkv, o, gate_up, down with SmolLM2's shapes and random Q4_1 codes, streamed from memory, not
cache-resident) plus the tied Q8_0 LM head, per activation row count M.

    graphexec-bench quant_kernels                      # M = 1 2 4 8 16 32 64 128 256
    graphexec-bench quant_kernels --rows 1 8 --rounds 9

Sides, paired (A B A B ...) in one process (single-threaded Python driving the same OpenMP team):
  qlinear fp32      graphexec::qlinear, fp32 activations (the block-streaming kernel)
  qlinear q8        graphexec::qlinear_q8 (model.activations=q8): activations quantized per block
                    to 8 bits, integer dot products on rows interleaved by 16
  qlinear bf16      graphexec::qlinear, bf16 activations (streaming below 48 rows, tile GEMM above)
  deq+mm bf16       dequantize the whole weight to bf16, then at::mm (the tile path's upper bound)
  dense fp32/bf16   F.linear over dense weights of the same shapes (what model.weights=dequantize reads)
  int4pack bf16     torch's _weight_int4pack_mm_for_cpu (group 32; scale = d, zero = m + 8d), bf16 only:
                    its fp32 path was ~17x slower than dense fp32 (docs: ../shared/CPU-CALIBRATION.md)
The LM head runs for M <= 64 only (prefill prunes to one row per request).
"""

from __future__ import annotations

import argparse

import torch

from bench.tables import header, machine_line, row
from bench.timing import paired_ms
from graphexec.quant import QuantizedWeight, ensure_kernels
from graphexec.quant.ops import QBLOCK
from graphexec.quant.repack import repack_rows16

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [N, K]
VOCAB = 49152


def _weights(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def q4(n, k):
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        return codes, (torch.rand(n, k // 32, generator=gen) * 0.01).half(), (-torch.rand(n, k // 32, generator=gen) * 0.05).half()

    linears = [q4(n, k) for _ in range(LAYERS) for n, k in SHAPES]
    head = (torch.randint(-128, 128, (VOCAB, 576), dtype=torch.int8, generator=gen), (torch.rand(VOCAB, 18, generator=gen) * 0.01).half(), None)
    return linears, head


def _sides(rows: int, linears, head, dense: bool) -> dict:
    xs = {dt: {k: torch.randn(rows, k).to(dt) for k in (576, 1536)} for dt in (torch.float32, torch.bfloat16)}
    with_head = rows <= 64
    qlinear = torch.ops.graphexec.qlinear

    def run_q(dt):
        def run():
            for codes, scales, mins in linears:
                qlinear(xs[dt][codes.shape[1] * 2], codes, scales, mins)
            if with_head:
                qlinear(xs[dt][576], *head)
        return run

    def run_deq_mm():
        for codes, scales, mins in linears:
            w = torch.ops.graphexec.qdequantize(codes, scales, mins, torch.bfloat16)
            xs[torch.bfloat16][w.shape[1]] @ w.T

    q8_linears = [_rows16(*w) for w in linears]
    q8_head = _rows16(*head)

    def run_q8():
        for packed in q8_linears:
            torch.ops.graphexec.qlinear_q8(xs[torch.float32][packed[0].shape[1] * QBLOCK], *packed)
        if with_head:
            torch.ops.graphexec.qlinear_q8(xs[torch.float32][576], *q8_head)

    sides = {"qlinear fp32": run_q(torch.float32), "qlinear q8": run_q8, "qlinear bf16": run_q(torch.bfloat16),
             "deq+mm bf16": run_deq_mm}
    if dense:
        for dt, name in ((torch.float32, "dense fp32"), (torch.bfloat16, "dense bf16")):
            ws = [torch.ops.graphexec.qdequantize(c, s, m, dt) for c, s, m in linears]

            def run_dense(ws=ws, dt=dt):
                for w in ws:
                    torch.nn.functional.linear(xs[dt][w.shape[1]], w)
            sides[name] = run_dense
        packed = [_int4pack(c, s, m) for c, s, m in linears]

        def run_int4():
            for w, sz, k in packed:
                torch.ops.aten._weight_int4pack_mm_for_cpu(xs[torch.bfloat16][k], w, 32, sz)
        sides["int4pack bf16"] = run_int4
    return sides


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


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-dense", action="store_true", help="skip the dense and int4pack sides (1 GB of weights)")
    args = parser.parse_args(argv)
    ensure_kernels()
    linears, head = _weights()
    print(f"{machine_line()}\nmedian ms per forward's linears\n")
    print(header(["M", *_sides(1, linears, head, not args.no_dense)]))
    for rows in args.rows:
        sides = _sides(rows, linears, head, not args.no_dense)
        with torch.inference_mode():
            result = paired_ms(sides, rounds=args.rounds, steps=1)
        print(row([rows, *(f"{r['median_ms']:.2f}" for r in result.values())]), flush=True)
