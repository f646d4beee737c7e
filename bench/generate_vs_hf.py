"""Generation throughput: the graphexec engine vs Hugging Face `generate`, same weights, one process.

Runs are paired (engine, HF, engine, HF, ...) so machine noise hits both sides alike; reports the
median tokens/s of each and their ratio.  EOS is ignored so both generate exactly the same count.

    python -m bench.generate_vs_hf --requests 8 --prompt-len 32 --new-tokens 64 --rounds 3
    python -m bench.generate_vs_hf --overrides capture=eager model=smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> int:
    """Left-padded batch greedy generation, the usual way HF users batch; returns new tokens."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=pad_id,
    )
    return (out.shape[1] - width) * len(prompts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overrides", nargs="*", default=["capture=eager"])
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()

    from graphexec import Engine, SamplingParams
    from tests.reference import hf_smollm2

    engine = Engine(overrides=args.overrides)
    hf = hf_smollm2()
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    # Random ids in the ordinary-token range: same prompts for both, lengths spread around the mean.
    lengths = [max(1, args.prompt_len + d) for d in torch.randint(-8, 9, (args.requests,), generator=gen).tolist()]
    prompts = [torch.randint(100, vocab, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)

    def run_engine() -> int:
        return sum(o.completion_tokens for o in engine.generate(prompts, params))

    def run_hf() -> int:
        with torch.inference_mode():
            return _hf_generate(hf, prompts, args.new_tokens, pad_id=engine.model_config.eos_token_ids[0])

    run_engine(), run_hf()  # warm-up: first-call allocations and lazy inits on both sides
    rates = {"graphexec": [], "hf_generate": []}
    for _ in range(args.rounds):
        for name, fn in (("graphexec", run_engine), ("hf_generate", run_hf)):
            t0 = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "workload": vars(args) | {"prompt_lengths": lengths},
        "tokens_per_s": {k: {"median": med[k], "all": v} for k, v in rates.items()},
        "ratio_graphexec_over_hf": med["graphexec"] / med["hf_generate"],
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__},
    }
    print("| side | median tokens/s | runs |\n|---|---|---|")
    for k, v in rates.items():
        print(f"| {k} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    print(f"\ngraphexec / HF = {result['ratio_graphexec_over_hf']:.2f}x  ({args.requests} requests, "
          f"prompts ~{args.prompt_len} tokens, {args.new_tokens} new tokens, {torch.get_num_threads()} threads)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
