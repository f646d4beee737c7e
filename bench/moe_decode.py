"""B=1 decode of a mixture of experts against its dense equivalent (the same weights read per token):
does the engine read only the routed experts, and at what cost?

    graphexec-bench moe_decode [--rounds 3] [--tokens 128] [--activations float q8]

Writes two random SmolLM2-shaped GGUF files (qwen3 / qwen3moe architecture, attention Q8_0, MLP
Q5_0 as most of SmolLM2's Q4_K_M is): `dense` with an MLP of 1536, `moe` with
8 experts of 768 and 2 a token, so both read the same MLP bytes per token from files of about 190
and 360 MiB.  Each (file, activations) side runs in a fresh process, sides alternated for
`--rounds`; a cell is the median ms/token of `--tokens` greedy tokens after a warm-up call.

Boundary: builds the files and times whole engines; the worker half is `--worker`.
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


def write_files(directory: Path) -> dict[str, Path]:
    import gguf
    import numpy as np

    q, rng = gguf.GGMLQuantizationType, np.random.default_rng(0)

    def weight(*shape: int, qtype=None):
        values = (rng.standard_normal(shape, dtype=np.float32) / shape[-1] ** 0.5).astype(np.float32)
        if qtype is None:
            return values
        return gguf.quants.quantize(values.reshape(-1, shape[-1]), qtype).reshape(*shape[:-1], -1), qtype

    attention = {"attn_q": weight(576, HIDDEN, qtype=q.Q8_0), "attn_k": weight(192, HIDDEN, qtype=q.Q8_0),
                 "attn_v": weight(192, HIDDEN, qtype=q.Q8_0), "attn_output": weight(HIDDEN, 576, qtype=q.Q8_0)}
    mlps = {
        "dense": {"ffn_gate": weight(2 * EXPERT_ROWS, HIDDEN, qtype=q.Q5_0), "ffn_up": weight(2 * EXPERT_ROWS, HIDDEN, qtype=q.Q5_0),
                  "ffn_down": weight(HIDDEN, 2 * EXPERT_ROWS, qtype=q.Q5_0)},
        "moe": {"ffn_gate_exps": weight(EXPERTS, EXPERT_ROWS, HIDDEN, qtype=q.Q5_0),
                "ffn_up_exps": weight(EXPERTS, EXPERT_ROWS, HIDDEN, qtype=q.Q5_0),
                "ffn_down_exps": weight(EXPERTS, HIDDEN, EXPERT_ROWS, qtype=q.Q5_0),
                "ffn_gate_inp": weight(EXPERTS, HIDDEN)},
    }
    embedding, paths = weight(VOCAB, HIDDEN) * HIDDEN**0.5, {}
    for kind, mlp in mlps.items():
        paths[kind] = directory / f"{kind}.gguf"
        writer = gguf.GGUFWriter(paths[kind], "qwen3moe" if kind == "moe" else "qwen3")
        for add, value in ((writer.add_block_count, LAYERS), (writer.add_context_length, 8192),
                           (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, 2 * EXPERT_ROWS),
                           (writer.add_head_count, 9), (writer.add_head_count_kv, 3), (writer.add_key_length, 64),
                           (writer.add_value_length, 64), (writer.add_layer_norm_rms_eps, 1e-5),
                           (writer.add_rope_freq_base, 1e5), (writer.add_vocab_size, VOCAB)):
            add(value)
        if kind == "moe":
            writer.add_expert_count(EXPERTS)
            writer.add_expert_used_count(2)
            writer.add_expert_feed_forward_length(EXPERT_ROWS)
            writer.add_expert_weights_norm(True)
        writer.add_tensor("token_embd.weight", embedding)
        writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
        for layer in range(LAYERS):  # every layer the same bytes: the timing reads each copy anew
            for norm, size in (("attn_norm", HIDDEN), ("ffn_norm", HIDDEN), ("attn_q_norm", 64), ("attn_k_norm", 64)):
                writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(size, np.float32))
            for name, tensor in {**attention, **mlp}.items():
                array, qtype = tensor if isinstance(tensor, tuple) else (tensor, None)
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
        return {"ms_per_token": 1000 * (time.perf_counter() - start) / tokens, "weight_mib": engine.runner.weight_nbytes() / 2**20}

    emit("moe_decode worker", measure)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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

        sides = [(kind, act) for act in args.activations for kind in ("dense", "moe")]
        runs, _ = alternate(sides, args.rounds, one)
    print(f"{machine_line()}\n")
    rows = []
    for act in args.activations:
        ms = {kind: spread([r["ms_per_token"] for r in runs[(kind, act)]]) for kind in ("dense", "moe")}
        for kind in ("dense", "moe"):
            ratio = ms[kind]["median"] / ms["dense"]["median"]
            rows.append([act, kind, f"{runs[(kind, act)][0]['weight_mib']:.0f}",
                         *(f"{ms[kind][k]:.1f}" for k in ("median", "min", "max")), f"{ratio:.2f}"])
    print(table(["activations", "model", "weights MiB", "median ms/token", "min", "max", "x dense"], rows))
    print("\n" + json.dumps({f"{k} {a}": [round(r["ms_per_token"], 2) for r in v] for (k, a), v in runs.items()}))
