"""Per-step cost of the sampler's logits processing (penalties, logit_bias, min_tokens) against
its fast path, at SmolLM2's vocabulary.

    graphexec-bench penalties                      # B = 1 and 16, 512 prompt + 256 output tokens
    graphexec-bench penalties --batch-sizes 1 16 64 --prompt 2048 --output 1024 --rounds 15
    graphexec-bench penalties --threads 1          # no OpenMP wake-ups: the ops' own cost

One step is what the engine pays per decode step for sampling: `SamplingBatchInfo.from_params`
(host: per-row tensors, and for the penalty sides the flat token histories) plus `Sampler()`
on [B, V] float32 logits.  Sides run alternately (`bench/timing.py`), so machine noise lands on
all of them alike; each reports the median and the best round (on a shared machine the best is
the steadier figure), and `build` is the from_params share of the step.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from bench.tables import machine_line, table
from bench.timing import paired_ms
from graphexec.sampling.sampler import Sampler, SamplingBatchInfo
from graphexec.sampling_params import SamplingParams

VOCAB = 49152

SIDES = {
    "fast path (greedy)": SamplingParams(max_new_tokens=4096),
    "presence+frequency": SamplingParams(max_new_tokens=4096, presence_penalty=0.5, frequency_penalty=0.5),
    "repetition": SamplingParams(max_new_tokens=4096, repetition_penalty=1.2),
    "logit_bias (4 ids)": SamplingParams(max_new_tokens=4096, logit_bias={1: 5.0, 2: -100.0, 3: 1.0, 4: 2.0}),
    "all five": SamplingParams(
        max_new_tokens=4096, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
        logit_bias={1: 5.0, 2: -100.0}, min_tokens=4096,
    ),
}


@dataclass
class History:
    prompt_ids: list[int]
    output_ids: list[int]
    eos_token_ids: tuple[int, ...] = (2,)


def measure(batch_size: int, prompt: int, output: int, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    generator = torch.Generator().manual_seed(0)
    histories = [History(*(torch.randint(VOCAB, (n,), generator=generator).tolist() for n in (prompt, output)))
                 for _ in range(batch_size)]
    logits = torch.randn(batch_size, VOCAB, generator=generator)
    sampler = Sampler()

    def build(params: SamplingParams) -> SamplingBatchInfo:
        return SamplingBatchInfo.from_params([params] * batch_size, [None] * batch_size, VOCAB, "cpu", histories)

    sides = {f"{name} | step": lambda p=p: sampler(logits, build(p)) for name, p in SIDES.items()}
    sides |= {f"{name} | build": lambda p=p: build(p) for name, p in SIDES.items()}
    return paired_ms(sides, rounds, steps)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    parser.add_argument("--output", type=int, default=256, help="generated tokens per row")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20, help="calls per timed round")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print the raw numbers as JSON too")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    print(f"{machine_line()}\nvocab {VOCAB}, {args.prompt} prompt + {args.output} output tokens per row, "
          f"torch threads {torch.get_num_threads()}; median ms per step (build = from_params share)")
    for batch_size in args.batch_sizes:
        timings = measure(batch_size, args.prompt, args.output, args.rounds, args.steps)
        results[batch_size] = timings
        fast = timings["fast path (greedy) | step"]
        rows = [[f"B={batch_size}", name, *(f"{t['median_ms']:.3f} ({t['min_ms']:.3f})" for t in (step, built)),
                 f"{step['min_ms'] / fast['min_ms']:.1f}x"]
                for name in SIDES for step, built in [(timings[f"{name} | step"], timings[f"{name} | build"])]]
        print("\n" + table(["B", "side", "step ms median (min)", "build ms median (min)", "vs fast (min)"], rows), flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
