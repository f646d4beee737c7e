"""GGUF K-quant / 5-bit linears (graphexec::qlinear_blocks), measured: one SmolLM2 forward's worth of
linears (30 layers of qkv, o, gate_up with K=576 in a 5-bit type, down with K=1536 in a K-quant:
what llama-quantize's Q4_K_M makes of a 576-wide model), random valid blocks streamed from memory,
not cache-resident, per activation row count M.

    graphexec-bench kquant_kernels                              # Q5_0 + Q4_K, M = 1 2 4 8 16 32 64
    graphexec-bench kquant_kernels --narrow Q5_1 --wide Q6_K --rows 1 8 --rounds 9

Sides, paired (A B A B ...) in one process:
  blocks fp32    graphexec::qlinear_blocks, fp32 activations (streamed below 24 rows, tile GEMM above)
  Q4_1 fp32      graphexec::qlinear over Q4_1 weights of the same shapes (the packed-array kernel)
  dense fp32     F.linear over the dequantized weights (what model.weights=dequantize reads)
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from bench.tables import header, machine_line, row
from bench.timing import paired_ms
from graphexec.quant import BlockWeight, ensure_kernels
from graphexec.quant.kquants import BLOCK_FORMATS

LAYERS = 30
NARROW = [(960, 576), (576, 576), (3072, 576)]  # qkv, o, gate_up: [N, K], K not a multiple of 256
WIDE = (576, 1536)  # down


def _blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> BlockWeight:
    """Random bytes with small fp16 scales where the format keeps them: valid blocks."""
    fmt = BLOCK_FORMATS[qtype]
    raw = rng.integers(0, 256, (n * k // fmt.elements, fmt.nbytes), dtype=np.uint8)
    for at in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2)}[qtype]:
        raw[:, at : at + 2] = rng.uniform(1e-4, 2e-3, raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return BlockWeight.from_gguf(raw.reshape(n, -1), qtype, (n, k))


def _q4_1(n: int, k: int, gen: torch.Generator):
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    return codes, (torch.rand(n, k // 32, generator=gen) * 0.01).half(), (-torch.rand(n, k // 32, generator=gen) * 0.05).half()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--narrow", default="Q5_0", choices=["Q5_0", "Q5_1"], help="type of the K=576 linears")
    parser.add_argument("--wide", default="Q4_K", choices=["Q4_K", "Q5_K", "Q6_K"], help="type of down_proj (K=1536)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    ensure_kernels()
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    shapes = [(args.narrow, n, k) for n, k in NARROW] + [(args.wide, *WIDE)]
    blocks = [_blocks(qtype, n, k, rng) for _ in range(LAYERS) for qtype, n, k in shapes]
    q41 = [_q4_1(n, k, gen) for _ in range(LAYERS) for _, n, k in shapes]
    dense = [w.dequantize() for w in blocks]
    print(f"{machine_line()}\nmedian ms per forward's linears ({args.narrow} at K=576, {args.wide} at K=1536)\n")
    print(header(["M", "blocks fp32", "Q4_1 fp32", "dense fp32"]))
    op, q = torch.ops.graphexec.qlinear_blocks, torch.ops.graphexec.qlinear
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        sides = {
            "blocks": lambda: [op(xs[w.shape[1]], w.blocks, w.format.type_id) for w in blocks],
            "q4_1": lambda: [q(xs[c.shape[1] * 2], c, s, m) for c, s, m in q41],
            "dense": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in dense],
        }
        with torch.inference_mode():
            result = paired_ms(sides, rounds=args.rounds, steps=1)
        print(row([rows, *(f"{r['median_ms']:.2f}" for r in result.values())]), flush=True)
