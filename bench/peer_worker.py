"""One side of the peer suite (bench/peer.py) in a fresh process: graphexec through the public
`Engine` API, or llama.cpp through `llama-cpp-python`, on the prompts of a spec file the suite
wrote.  Prints its measurements as one JSON line on stdout.

    graphexec-bench peer_worker --side graphexec --spec peer_spec.json model=tiny-llama capture=eager
    graphexec-bench peer_worker --side llamacpp --spec peer_spec.json
    graphexec-bench peer_worker --quantize Q4_K_M SRC.gguf DST.gguf --threads 2   # bench.requantize's file

Boundary: this module measures one side and reports raw per-repeat numbers; it does not compare,
aggregate over rounds or render anything (bench/peer.py does).  Each side runs alone in its
process because two live OpenMP teams in one process slow both (docs/STATUS.md, "Threads").
On failure it exits non-zero with a one-line reason as the last line of stderr.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from bench.capture import config_without_progress_bars, peak_rss_bytes
from bench.workers import emit

SIDES = ("graphexec", "llamacpp")


# ---------------------------------------------------------------------------------------------
# graphexec


def graphexec_side(spec: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    from graphexec import Engine

    t0 = time.perf_counter()
    engine = Engine(config=config_without_progress_bars(list(overrides)))
    start_seconds = time.perf_counter() - t0
    try:
        if spec["warmup"]:
            _graphexec_warmup(engine, spec)
        out = {
            "side": "graphexec",
            "start_seconds": start_seconds,
            "torch_threads": torch.get_num_threads(),
            "decode": [_graphexec_decode(engine, spec["decode"]) for _ in range(spec["repeats"])],
            "prefill": {str(p["tokens"]): [_graphexec_prefill(engine, p["prompt"]) for _ in range(spec["repeats"])]
                        for p in spec["prefill"]},
            "batch": {str(b): [_graphexec_batch(engine, spec["batch"], b) for _ in range(spec["repeats"])]
                      for b in spec["batch"]["sizes"]},
            "engine": _engine_facts(engine),
            "agreement": _graphexec_agreement(engine, spec["agreement"]),
        }
    finally:
        engine.shutdown()
    return out | {"memory": graphexec_memory(engine)}


def _greedy(max_new_tokens: int):
    from graphexec import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def _graphexec_warmup(engine, spec: dict[str, Any]) -> None:
    """First requests pay one-off costs (allocator growth, lazy init, first graph replays): one
    short request of every shape measured, then the cache is emptied so nothing timed hits it."""
    engine.generate([spec["decode"]["prompt"]], _greedy(min(8, spec["decode"]["new_tokens"])))
    for p in spec["prefill"]:
        engine.flush_cache()
        engine.generate([p["prompt"]], _greedy(1))
    for b in spec["batch"]["sizes"]:
        engine.flush_cache()
        engine.generate(spec["batch"]["prompts"][:b], _greedy(min(4, spec["batch"]["new_tokens"])))
    engine.flush_cache()


def _graphexec_decode(engine, decode: dict[str, Any]) -> dict[str, Any]:
    engine.flush_cache()  # a repeat of the same prompt must prefill it again, as llama.cpp does
    (out,) = engine.generate([decode["prompt"]], _greedy(decode["new_tokens"]))
    return timed_request(out.ttft, out.tpot, out.latency, out.token_ids) | {"cached_tokens": out.cached_tokens}


def _graphexec_prefill(engine, prompt: list[int]) -> dict[str, Any]:
    engine.flush_cache()
    (out,) = engine.generate([prompt], _greedy(1))
    return {"ttft_s": out.ttft, "tokens_per_s": len(prompt) / out.ttft, "cached_tokens": out.cached_tokens}


def _graphexec_batch(engine, batch: dict[str, Any], size: int) -> dict[str, Any]:
    engine.flush_cache()
    outs = engine.generate(batch["prompts"][:size], _greedy(batch["new_tokens"]))
    return batch_throughput([(o.ttft, o.tpot, o.latency, len(o.token_ids)) for o in outs]) | {
        "cached_tokens": sum(o.cached_tokens for o in outs)
    }


def _graphexec_agreement(engine, agreement: dict[str, Any]) -> list[dict[str, Any]]:
    """Greedy tokens of the agreement prompts, each step's top-two log-probability gap beside them."""
    from graphexec import SamplingParams

    if not agreement["prompts"]:
        return []
    engine.flush_cache()
    params = SamplingParams(max_new_tokens=agreement["new_tokens"], temperature=0.0, ignore_eos=True, logprobs=2)
    return [{"token_ids": out.token_ids, "gaps": [step["top"][0][1] - step["top"][1][1] for step in out.logprobs]}
            for out in engine.generate(agreement["prompts"], params)]


def batch_throughput(requests: Sequence[tuple[float, float | None, float, int]]) -> dict[str, Any]:
    """Decode-phase tokens/s of requests submitted together, from each one's (ttft, tpot, latency,
    tokens): one `generate` call stamps every request with the same arrival time, so first and last
    token times share a clock.  The first token of each comes out of its prefill, so the decode
    phase is every later token, between the earliest first token and the latest last one (prefill
    chunks of late requests that land inside that window count against it, as they do in serving)."""
    firsts = [ttft for ttft, _, _, _ in requests]
    lasts = [ttft + (tpot or 0.0) * (n - 1) for ttft, tpot, _, n in requests]
    decode_tokens = sum(n - 1 for _, _, _, n in requests)
    window = max(lasts) - min(firsts)
    wall = max(latency for _, _, latency, _ in requests)
    return {
        "requests": len(requests),
        "decode_tokens": decode_tokens,
        "decode_s": window,
        "decode_tokens_per_s": decode_tokens / window if window > 0 else None,
        "request_tokens_per_s": sum(n for *_, n in requests) / wall,
        "first_token_spread_s": max(firsts) - min(firsts),
    }


def timed_request(ttft: float, tpot: float | None, latency: float, token_ids: Sequence[int]) -> dict[str, Any]:
    """One B=1 request's numbers, the same for both sides: decode ms/token excludes the prefill
    (the first token); the whole-request ms/token includes it."""
    n = len(token_ids)
    return {
        "tokens": n,
        "ttft_s": ttft,
        "decode_ms_per_token": None if tpot is None else tpot * 1e3,
        "latency_s": latency,
        "request_ms_per_token": latency * 1e3 / n,
        "token_ids": list(token_ids),
    }


def _engine_facts(engine) -> dict[str, Any]:
    import torch

    from graphexec.attention.backend import resolve_attention_backend

    cfg = engine.config
    return {
        "model": cfg.model.name,
        "weights": getattr(cfg.model, "weights", None),
        "activations": cfg.model.activations,
        "dtype": str(cfg.torch_dtype).removeprefix("torch."),
        "capture_plan": cfg.capture.name,
        "attention_backend": resolve_attention_backend(cfg.attention_backend, torch.device(cfg.device)),  # not "auto"
        "max_prefill_tokens": cfg.scheduler.max_prefill_tokens,
        "kv_slots": cfg.cache.num_slots,
    }


def graphexec_memory(engine) -> dict[str, Any]:
    weights, rope = model_bytes(engine.runner.model)
    return {"peak_rss_bytes": peak_rss_bytes(), "weight_bytes": weights, "rope_bytes": rope,
            "kv_bytes": engine.kv_cache.token_pool.nbytes()}


def model_bytes(model) -> tuple[int, int]:
    """Resident bytes of the model's parameters and buffers (packed quantized arrays are buffers),
    each tensor once, with the RoPE cos/sin tables apart: they are a function of the context
    length, not weights, and llama.cpp computes RoPE on the fly."""
    seen: set[tuple[int, int, str]] = set()
    weights = rope = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        key = (t.data_ptr(), t.numel(), str(t.dtype))  # a tied weight is one tensor
        if key in seen:
            continue
        seen.add(key)
        if name.endswith(("cos_table", "sin_table")):
            rope += t.numel() * t.element_size()
        else:
            weights += t.numel() * t.element_size()
    return weights, rope


# ---------------------------------------------------------------------------------------------
# llama.cpp


def llamacpp_side(spec: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    opts = spec["llamacpp"]
    t0 = time.perf_counter()
    llama = llama_cpp.Llama(
        model_path=opts["gguf"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
        n_ctx=opts["n_ctx"], n_batch=opts["n_batch"], n_ubatch=opts["n_batch"],
        flash_attn=opts["flash_attn"], logits_all=False, verbose=False,
    )
    start_seconds = time.perf_counter() - t0
    out = {"side": "llamacpp", "start_seconds": start_seconds} | measure_llamacpp(llama, spec, _perf_counters(llama_cpp, llama))
    logits = lambda: np.ctypeslib.as_array(llama_cpp.llama_get_logits(llama.ctx), shape=(llama.n_vocab(),))  # noqa: E731
    out["agreement"] = [greedy_with_gaps(llama, logits, prompt, spec["agreement"]["new_tokens"])
                        for prompt in spec["agreement"]["prompts"]]
    return out | {"memory": _llamacpp_memory(llama_cpp, llama, opts["n_ctx"]),
                  "llamacpp": {"version": getattr(llama_cpp, "__version__", None)} | opts}


def measure_llamacpp(llama, spec: dict[str, Any], perf: Callable[..., dict[str, float]] | None = None) -> dict[str, Any]:
    """The same prompts as the graphexec side through `llama` (anything with reset() and
    llama-cpp-python's generate()); batch sizes are not measured: one llama.cpp context decodes
    one sequence here, so its B=1 rate is the peer of graphexec's batched rates."""
    decode = spec["decode"]
    if spec["warmup"]:
        generate_timed(llama, decode["prompt"], min(8, decode["new_tokens"]))
        for p in spec["prefill"]:
            generate_timed(llama, p["prompt"], 1)
    decodes = []
    for _ in range(spec["repeats"]):
        r = generate_timed(llama, decode["prompt"], decode["new_tokens"], perf)
        decodes.append(timed_request(r["ttft_s"], r["tpot_s"], r["latency_s"], r["token_ids"]) | r["perf"])
    prefill = {}
    for p in spec["prefill"]:
        runs = [generate_timed(llama, p["prompt"], 1) for _ in range(spec["repeats"])]
        prefill[str(p["tokens"])] = [{"ttft_s": r["ttft_s"], "tokens_per_s": len(p["prompt"]) / r["ttft_s"]} for r in runs]
    return {"decode": decodes, "prefill": prefill, "batch": {}}


def greedy_with_gaps(llama, logits: Callable[[], Any], prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """Greedy decoding by hand (eval, then the last position's logits) so each step's top-two
    logit gap is seen: generate() samples inside llama.cpp and hands back no logits."""
    llama.reset()
    llama.eval(prompt)
    tokens, gaps = [], []
    for _ in range(new_tokens):
        row = np.asarray(logits(), dtype=np.float64)
        second, first = np.argpartition(row, -2)[-2:]
        if row[second] > row[first] or (row[second] == row[first] and second < first):
            first, second = second, first  # argmax's choice: the lowest id among equals
        tokens.append(int(first))
        gaps.append(float(row[first] - row[second]))
        if len(tokens) < new_tokens:
            llama.eval([int(first)])
    return {"token_ids": tokens, "gaps": gaps}


def generate_timed(llama, prompt: list[int], new_tokens: int, perf: Callable[..., dict[str, float]] | None = None) -> dict[str, Any]:
    """Greedy tokens with a timestamp each.  reset() first: llama-cpp-python's generate() reuses
    the longest cached prefix of the previous call, which would skip the prefill being measured.
    generate() itself never stops at EOS (only create_completion checks it), so the count is exact."""
    llama.reset()
    if perf is not None:
        perf(reset=True)
    stamps, tokens = [], []
    t0 = time.perf_counter()
    tokens_out = llama.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)
    try:
        for token in tokens_out:
            stamps.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
    finally:
        tokens_out.close()
    n = len(tokens)
    return {
        "ttft_s": stamps[0] - t0,
        "tpot_s": (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else None,
        "latency_s": stamps[-1] - t0,
        "token_ids": tokens,
        "perf": perf() if perf is not None else {},
    }


def _perf_counters(llama_cpp, llama) -> Callable[..., dict[str, float]] | None:
    """llama.cpp's own eval timers, a cross-check of the wall-clock stamps (decode ms/token
    without Python's share); None where this llama-cpp-python lacks them."""
    if not hasattr(llama_cpp, "llama_perf_context"):
        return None

    def read(reset: bool = False) -> dict[str, float]:
        if reset:
            llama_cpp.llama_perf_context_reset(llama.ctx)
            return {}
        data = llama_cpp.llama_perf_context(llama.ctx)
        # n_eval counts sampled-token evals; the last token sampled is never evaluated.
        return {"internal_decode_ms_per_token": data.t_eval_ms / data.n_eval if data.n_eval else None,
                "internal_prompt_ms": data.t_p_eval_ms}

    return read


def _llamacpp_memory(llama_cpp, llama, n_ctx: int) -> dict[str, Any]:
    meta = llama.metadata
    arch = meta.get("general.architecture", "llama")
    try:
        layers = int(meta[f"{arch}.block_count"])
        heads, kv_heads = int(meta[f"{arch}.attention.head_count"]), int(meta[f"{arch}.attention.head_count_kv"])
        head_dim = int(meta.get(f"{arch}.attention.key_length") or int(meta[f"{arch}.embedding_length"]) // heads)
        kv_dim = head_dim * kv_heads
        # K and V per layer per context slot, f16 (llama.cpp's default type_k/type_v).
        kv_bytes = n_ctx * layers * 2 * kv_dim * 2
    except (KeyError, ValueError, ZeroDivisionError):
        kv_bytes = None
    return {"peak_rss_bytes": peak_rss_bytes(), "weight_bytes": int(llama_cpp.llama_model_size(llama.model)),
            "kv_bytes": kv_bytes}


def quantize(kind: str, src: str, dst: str, threads: int) -> dict[str, Any]:
    """bench.requantize's file: `src` re-quantized by llama.cpp to `kind` (a LLAMA_FTYPE_MOSTLY_*
    name), from an already quantized file too (allow_requantize)."""
    import ctypes

    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}", None)
    if ftype is None:
        kinds = sorted(n.removeprefix("LLAMA_FTYPE_MOSTLY_") for n in dir(llama_cpp) if n.startswith("LLAMA_FTYPE_MOSTLY_"))
        raise ValueError(f"bench.requantize={kind} is not a llama.cpp file type; choose one of {kinds}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, threads
    status = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {kind}) returned {status}")
    return {"type": kind, "bytes": Path(dst).stat().st_size}


# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    job = parser.add_mutually_exclusive_group(required=True)
    job.add_argument("--side", choices=SIDES)
    job.add_argument("--quantize", nargs=3, metavar=("TYPE", "SRC", "DST"), help="write SRC re-quantized to TYPE into DST")
    parser.add_argument("--spec", type=Path, help="the JSON spec bench/peer.py wrote (--side)")
    parser.add_argument("--threads", type=int, default=1, help="quantizing threads (--quantize)")
    parser.add_argument("overrides", nargs="*", help="graphexec engine overrides (graphexec side only)")
    args = parser.parse_args(argv)
    if args.quantize:
        emit("quantize worker", lambda: quantize(*args.quantize, args.threads))
        return
    if args.spec is None:
        parser.error("--side needs --spec")

    def measure():
        spec = json.loads(args.spec.read_text())
        return graphexec_side(spec, args.overrides) if args.side == "graphexec" else llamacpp_side(spec)

    emit(f"{args.side} worker", measure)
