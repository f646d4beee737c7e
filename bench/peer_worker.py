"""One side of the peer suite (bench/peer.py) in a fresh process, on the spec file's prompts.

    graphexec-bench peer_worker --side graphexec --spec peer_spec.json model=tiny-llama capture=eager
    graphexec-bench peer_worker --side llamacpp --spec peer_spec.json   # llama-cpp-python
    graphexec-bench peer_worker --quantize Q4_K_M SRC.gguf DST.gguf --threads 2   # bench.requantize's file

Boundary: this module measures one side and reports raw per-repeat numbers as one JSON line; it does
not compare, aggregate over rounds or render anything (bench/peer.py does)."""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from bench.capture import config_without_progress_bars, peak_rss_bytes
from bench.workers import emit


def measure(spec: dict[str, Any], requests: Callable[[list[list[int]], int], list[dict[str, Any]]],
            batched: bool = True) -> dict[str, Any]:
    """Every shape of the spec, `repeats` times each, through a side's `requests(prompts, new_tokens)`:
    the prompts submitted together, greedy, each one's `timed_request` back with the side's extras."""
    d, b, runs = spec["decode"], spec["batch"], range(spec["repeats"])
    sizes = b["sizes"] if batched else []

    def prefill(prompt: list[int]) -> dict[str, Any]:
        (r,) = requests([prompt], 1)  # timed to the first token; the prefix-cache hits where the side counts them
        cached = {"cached_tokens": r["cached_tokens"]} if "cached_tokens" in r else {}
        return {"ttft_s": r["ttft_s"], "tokens_per_s": len(prompt) / r["ttft_s"]} | cached

    def batch(size: int) -> dict[str, Any]:
        rs = requests(b["prompts"][:size], b["new_tokens"])
        return batch_throughput(rs) | {"cached_tokens": sum(r["cached_tokens"] for r in rs)}

    if spec["warmup"]:  # first requests pay one-off costs (allocator growth, lazy init, first graph replays)
        requests([d["prompt"]], min(8, d["new_tokens"]))
        for p in spec["prefill"]:
            requests([p["prompt"]], 1)
        for size in sizes:
            requests(b["prompts"][:size], min(4, b["new_tokens"]))
    return {"decode": [requests([d["prompt"]], d["new_tokens"])[0] for _ in runs],
            "prefill": {str(p["tokens"]): [prefill(p["prompt"]) for _ in runs] for p in spec["prefill"]},
            "batch": {str(size): [batch(size) for _ in runs] for size in sizes}}


def timed_request(ttft: float, tpot: float | None, latency: float, token_ids: Sequence[int]) -> dict[str, Any]:
    """One request's numbers, the same for both sides: decode ms/token excludes the prefill (the first
    token); the whole-request ms/token includes it."""
    return {"tokens": len(token_ids), "ttft_s": ttft, "decode_ms_per_token": None if tpot is None else tpot * 1e3,
            "latency_s": latency, "request_ms_per_token": latency * 1e3 / len(token_ids), "token_ids": list(token_ids)}


def batch_throughput(requests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Decode-phase tokens/s of requests submitted together (their `timed_request`s): one `generate`
    call stamps them all with the same arrival time, so their times share a clock.  The first token
    of each comes out of its prefill; the decode phase is every later token (late requests' prefill
    chunks inside that window count against it, as they do in serving)."""
    firsts = [r["ttft_s"] for r in requests]
    lasts = [r["ttft_s"] + (r["decode_ms_per_token"] or 0.0) / 1e3 * (r["tokens"] - 1) for r in requests]
    decode_tokens, window = sum(r["tokens"] - 1 for r in requests), max(lasts) - min(firsts)
    return {"requests": len(requests), "decode_tokens": decode_tokens, "decode_s": window,
            "decode_tokens_per_s": decode_tokens / window if window > 0 else None,
            "request_tokens_per_s": sum(r["tokens"] for r in requests) / max(r["latency_s"] for r in requests),
            "first_token_spread_s": max(firsts) - min(firsts)}


# graphexec: the public Engine API.
def graphexec_side(spec: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    from graphexec import Engine

    t0 = time.perf_counter()
    engine = Engine(config=config_without_progress_bars(list(overrides)))
    out = {"side": "graphexec", "start_seconds": time.perf_counter() - t0, "torch_threads": torch.get_num_threads()}
    try:
        out |= measure(spec, partial(_requests, engine)) | {"engine": _engine_facts(engine)}
        agreement = spec["agreement"]  # each step's top-two log-probability gap beside the greedy token
        outs = _generate(engine, agreement["prompts"], agreement["new_tokens"], logprobs=2) if agreement["prompts"] else []
        out["agreement"] = [{"token_ids": o.token_ids, "gaps": [s["top"][0][1] - s["top"][1][1] for s in o.logprobs]}
                            for o in outs]
    finally:
        engine.shutdown()
    weights, rope = model_bytes(engine.runner.model)
    return out | {"memory": {"peak_rss_bytes": peak_rss_bytes(), "weight_bytes": weights, "rope_bytes": rope,
                             "kv_bytes": engine.kv_cache.token_pool.nbytes()}}


def _generate(engine, prompts: list[list[int]], new_tokens: int, **params) -> list:
    """Greedy, EOS ignored, the prefix cache flushed first: a repeat of the same prompt must prefill
    it again, as llama.cpp does, and no timed request may hit what a warm-up left."""
    from graphexec import SamplingParams

    engine.flush_cache()
    return engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, **params))


def _requests(engine, prompts: list[list[int]], new_tokens: int) -> list[dict[str, Any]]:
    return [timed_request(o.ttft, o.tpot, o.latency, o.token_ids) | {"cached_tokens": o.cached_tokens}
            for o in _generate(engine, prompts, new_tokens)]


def _engine_facts(engine) -> dict[str, Any]:
    import torch

    from graphexec.attention.backend import resolve_attention_backend

    cfg = engine.config
    return {"model": cfg.model.name, "weights": getattr(cfg.model, "weights", None), "activations": cfg.model.activations,
            "dtype": str(cfg.torch_dtype).removeprefix("torch."), "capture_plan": cfg.capture.name,
            "attention_backend": resolve_attention_backend(cfg.attention_backend, torch.device(cfg.device)),  # not "auto"
            "max_prefill_tokens": cfg.scheduler.max_prefill_tokens, "kv_slots": cfg.cache.num_slots}


def model_bytes(model) -> tuple[int, int]:
    """Resident bytes of the parameters and buffers (packed quantized arrays are buffers), each tensor
    once, and the RoPE cos/sin tables apart: llama.cpp computes RoPE on the fly."""
    tensors: dict[tuple[int, int, str], tuple[str, Any]] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        tensors.setdefault((t.data_ptr(), t.numel(), str(t.dtype)), (name, t))  # a tied weight is one tensor
    sizes = [(name.endswith(("cos_table", "sin_table")), t.numel() * t.element_size()) for name, t in tensors.values()]
    return sum(n for rope, n in sizes if not rope), sum(n for rope, n in sizes if rope)


# llama.cpp: llama-cpp-python, one sequence per context.
def llamacpp_side(spec: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    opts, threads = spec["llamacpp"], spec["threads"]
    t0 = time.perf_counter()
    llama = llama_cpp.Llama(model_path=opts["gguf"], n_threads=threads, n_threads_batch=threads, n_ctx=opts["n_ctx"],
                            n_batch=opts["n_batch"], n_ubatch=opts["n_batch"], flash_attn=opts["flash_attn"],
                            logits_all=False, verbose=False)
    out = {"side": "llamacpp", "start_seconds": time.perf_counter() - t0}
    out |= measure_llamacpp(llama, spec, _perf_counters(llama_cpp, llama))
    logits = lambda: np.ctypeslib.as_array(llama_cpp.llama_get_logits(llama.ctx), shape=(llama.n_vocab(),))  # noqa: E731
    out["agreement"] = [greedy_with_gaps(llama, logits, prompt, spec["agreement"]["new_tokens"])
                        for prompt in spec["agreement"]["prompts"]]
    return out | {"memory": _llamacpp_memory(llama_cpp, llama, opts["n_ctx"]),
                  "llamacpp": {"version": getattr(llama_cpp, "__version__", None)} | opts}


def measure_llamacpp(llama, spec: dict[str, Any], perf: Callable[[], dict[str, float]] = dict) -> dict[str, Any]:
    """The graphexec side's prompts through `llama` (reset() and llama-cpp-python's generate()), one
    after another: no batch sizes, its B=1 rate is the peer of graphexec's batched rates."""
    return measure(spec, lambda prompts, n: [generate_timed(llama, p, n, perf) for p in prompts], batched=False)


def generate_timed(llama, prompt: list[int], new_tokens: int, perf: Callable[[], dict[str, float]] = dict) -> dict[str, Any]:
    """Greedy tokens with a timestamp each.  reset() first: llama-cpp-python's generate() reuses
    the longest cached prefix of the previous call, which would skip the prefill being measured.
    generate() itself never stops at EOS (only create_completion checks it), so the count is exact."""
    llama.reset()
    perf()  # reading resets the counters
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
    tpot = (stamps[-1] - stamps[0]) / (len(tokens) - 1) if len(tokens) > 1 else None
    return timed_request(stamps[0] - t0, tpot, stamps[-1] - t0, tokens) | perf()


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


def _perf_counters(llama_cpp, llama) -> Callable[[], dict[str, float]]:
    """llama.cpp's own eval timers since the last read, which resets them: a cross-check of the
    wall-clock stamps (decode ms/token without Python's share); {} where llama-cpp-python lacks them."""
    if not hasattr(llama_cpp, "llama_perf_context"):
        return dict

    def read() -> dict[str, float]:
        data = llama_cpp.llama_perf_context(llama.ctx)
        llama_cpp.llama_perf_context_reset(llama.ctx)
        # n_eval counts sampled-token evals; the last token sampled is never evaluated.
        return {"internal_decode_ms_per_token": data.t_eval_ms / data.n_eval if data.n_eval else None,
                "internal_prompt_ms": data.t_p_eval_ms}

    return read


def _llamacpp_memory(llama_cpp, llama, n_ctx: int) -> dict[str, Any]:
    meta = llama.metadata
    arch = meta.get("general.architecture", "llama")
    try:
        heads = int(meta[f"{arch}.attention.head_count"])
        head_dim = int(meta.get(f"{arch}.attention.key_length") or int(meta[f"{arch}.embedding_length"]) // heads)
        # K and V per layer per context slot, f16 (llama.cpp's default type_k/type_v).
        kv_bytes = n_ctx * int(meta[f"{arch}.block_count"]) * 2 * head_dim * int(meta[f"{arch}.attention.head_count_kv"]) * 2
    except (KeyError, ValueError, ZeroDivisionError):
        kv_bytes = None
    return {"peak_rss_bytes": peak_rss_bytes(), "weight_bytes": int(llama_cpp.llama_model_size(llama.model)),
            "kv_bytes": kv_bytes}


def quantize(kind: str, src: str, dst: str, threads: int) -> dict[str, Any]:
    """bench.requantize's file: `src` re-quantized by llama.cpp to `kind`, a LLAMA_FTYPE_MOSTLY_* name."""
    import ctypes

    import llama_cpp

    prefix = "LLAMA_FTYPE_MOSTLY_"
    if not hasattr(llama_cpp, prefix + kind):
        kinds = sorted(n.removeprefix(prefix) for n in dir(llama_cpp) if n.startswith(prefix))
        raise ValueError(f"bench.requantize={kind} is not a llama.cpp file type; choose one of {kinds}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = getattr(llama_cpp, prefix + kind), True, threads
    status = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {kind}) returned {status}")
    return {"type": kind, "bytes": Path(dst).stat().st_size}


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    job = parser.add_mutually_exclusive_group(required=True)
    job.add_argument("--side", choices=("graphexec", "llamacpp"))
    job.add_argument("--quantize", nargs=3, metavar=("TYPE", "SRC", "DST"), help="write SRC re-quantized to TYPE into DST")
    parser.add_argument("--spec", type=Path, help="the JSON spec bench/peer.py wrote (--side)")
    parser.add_argument("--threads", type=int, default=1, help="quantizing threads (--quantize)")
    parser.add_argument("overrides", nargs="*", help="graphexec engine overrides (graphexec side only)")
    args = parser.parse_args(argv)
    if args.quantize:
        return emit("quantize worker", lambda: quantize(*args.quantize, args.threads))
    if args.spec is None:
        parser.error("--side needs --spec")
    side = graphexec_side if args.side == "graphexec" else lambda spec, _: llamacpp_side(spec)
    emit(f"{args.side} worker", lambda: side(json.loads(args.spec.read_text()), args.overrides))
