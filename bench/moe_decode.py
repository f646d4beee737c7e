"""B=1 decode of a mixture of experts against its dense equivalent (the same weights read per token):
does the engine read only the routed experts, and at what cost?

    graphexec-bench moe_decode [--rounds 3] [--tokens 128] [--activations float q8]

The two files and the sides: bench/README.md.  A cell is the median ms/token of `--tokens` greedy
tokens after a warm-up call.  Boundary: builds the files and times whole engines; the worker half
is `--worker`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.stats import spread
from bench.tables import machine_line, table
from bench.workers import alternate, emit, run_command

HIDDEN, LAYERS, VOCAB, EXPERTS, EXPERT_ROWS = 576, 30, 49152, 8, 768
KINDS = ("dense", "moe")
COLUMNS = ["activations", "model", "weights MiB", "median ms/token", "min", "max", "x dense"]
# Each layer's tensors, drawn in this order: attention Q8_0, MLPs Q5_0 as most of SmolLM2's Q4_K_M is
# (the router float).
ATTENTION = {"attn_q": (576, HIDDEN), "attn_k": (192, HIDDEN), "attn_v": (192, HIDDEN), "attn_output": (HIDDEN, 576)}
MLPS = {"dense": {"ffn_gate": (2 * EXPERT_ROWS, HIDDEN), "ffn_up": (2 * EXPERT_ROWS, HIDDEN),
                  "ffn_down": (HIDDEN, 2 * EXPERT_ROWS)},
        "moe": {"ffn_gate_exps": (EXPERTS, EXPERT_ROWS, HIDDEN), "ffn_up_exps": (EXPERTS, EXPERT_ROWS, HIDDEN),
                "ffn_down_exps": (EXPERTS, HIDDEN, EXPERT_ROWS), "ffn_gate_inp": (EXPERTS, HIDDEN)}}
KEYS = {"block_count": LAYERS, "context_length": 8192, "embedding_length": HIDDEN, "feed_forward_length": 2 * EXPERT_ROWS,
        "head_count": 9, "head_count_kv": 3, "key_length": 64, "value_length": 64, "layer_norm_rms_eps": 1e-5,
        "rope_freq_base": 1e5, "vocab_size": VOCAB}
MOE_KEYS = {"expert_count": EXPERTS, "expert_used_count": 2, "expert_feed_forward_length": EXPERT_ROWS,
            "expert_weights_norm": True}


def write_files(directory: Path) -> dict[str, Path]:
    import gguf
    import numpy as np

    q, rng = gguf.GGMLQuantizationType, np.random.default_rng(0)

    def weight(shape: tuple[int, ...], qtype=None) -> tuple:
        values = (rng.standard_normal(shape, dtype=np.float32) / shape[-1] ** 0.5).astype(np.float32)
        if qtype is None:
            return values, None
        return gguf.quants.quantize(values.reshape(-1, shape[-1]), qtype).reshape(*shape[:-1], -1), qtype

    attention = {name: weight(shape, q.Q8_0) for name, shape in ATTENTION.items()}
    mlps = {kind: {name: weight(shape, None if name == "ffn_gate_inp" else q.Q5_0) for name, shape in mlp.items()}
            for kind, mlp in MLPS.items()}
    embedding = weight((VOCAB, HIDDEN))[0] * HIDDEN**0.5
    paths = {kind: directory / f"{kind}.gguf" for kind in KINDS}
    for kind, mlp in mlps.items():
        writer = gguf.GGUFWriter(paths[kind], "qwen3moe" if kind == "moe" else "qwen3")
        for key, value in (KEYS | (MOE_KEYS if kind == "moe" else {})).items():
            getattr(writer, f"add_{key}")(value)
        writer.add_tensor("token_embd.weight", embedding)
        writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
        for layer in range(LAYERS):  # every layer the same bytes: the timing reads each copy anew
            for norm, size in (("attn_norm", HIDDEN), ("ffn_norm", HIDDEN), ("attn_q_norm", 64), ("attn_k_norm", 64)):
                writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(size, np.float32))
            for name, (array, qtype) in (attention | mlp).items():
                writer.add_tensor(f"blk.{layer}.{name}.weight", array, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return paths


def _worker(path: str, activations: str, tokens: int) -> None:
    def measure() -> dict:
        from graphexec import Engine, SamplingParams

        engine = Engine(overrides=["model=hf", "model.source=gguf", f"model.path={path}",
                                   f"model.activations={activations}", "capture=eager"])
        params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
        engine.generate([[5, 6, 7, 8]], params)
        start = time.perf_counter()
        engine.generate([[9, 10, 11, 12]], params)
        return {"ms_per_token": 1000 * (time.perf_counter() - start) / tokens,
                "weight_mib": engine.runner.weight_nbytes() / 2**20}

    emit("moe_decode worker", measure)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--activations", nargs="+", default=["float", "q8"], choices=["float", "q8"])
    parser.add_argument("--worker", nargs=2, metavar=("PATH", "ACTIVATIONS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(*args.worker, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_files(Path(tmp))

        def one(side: tuple[str, str], round_index: int) -> dict:
            kind, act = side
            result = run_command("moe_decode", ["--worker", str(paths[kind]), act, "--tokens", str(args.tokens)], 900)
            if "error" in result:
                raise SystemExit(f"{kind} {act}: {result['error']}")
            return result

        runs, _ = alternate([(kind, act) for act in args.activations for kind in KINDS], args.rounds, one)
    rows = []
    for act in args.activations:
        ms = {kind: spread([r["ms_per_token"] for r in runs[(kind, act)]]) for kind in KINDS}
        rows += [[act, kind, f"{runs[(kind, act)][0]['weight_mib']:.0f}", *(f"{ms[kind][k]:.1f}" for k in ("median", "min", "max")),
                  f"{ms[kind]['median'] / ms['dense']['median']:.2f}"] for kind in KINDS]
    print(machine_line() + "\n\n" + table(COLUMNS, rows))
    print("\n" + json.dumps({f"{k} {a}": [round(r["ms_per_token"], 2) for r in v] for (k, a), v in runs.items()}))
