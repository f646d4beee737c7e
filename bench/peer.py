"""Peer suite: graphexec against llama.cpp on the same GGUF file; the parallel suite is this one
with bench.tp_sizes (bench/README.md, "peer" and "parallel").

Boundary: this module orchestrates and reports: the prompts as token ids in a spec file, each side a
fresh `graphexec-bench peer_worker` process per round (two live OpenMP teams in one process slow both:
docs/STATUS.md, "Threads"), then spreads over rounds, ratios, table and plots.  The measuring is
bench/peer_worker.py's."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.report import Bars, Report, Table
from bench.stats import first_difference, median, spread
from bench.tables import times
from bench.workers import alternate, run_command

COMPARE_UNIT = "tok/s"  # which summary numbers a multirun comparison plots
PEER = "llamacpp"
ACTIVATIONS = ("float", "q8")  # model.activations modes, in side order
SPEC_FILE = "peer_spec.json"
# What the report says of the graphexec side's configuration (the worker's "engine" facts).
ENGINE_FACTS = ("weights", "dtype", "capture_plan", "attention_backend", "max_prefill_tokens", "kv_slots")
INSTALL_HINT = "pip install 'graphexec[peer]' (llama-cpp-python)"

# Ordinary English, so the ids are ordinary tokens; prompts repeat or rotate its ids to any length.
PROMPT_TEXT = (
    "The river town woke slowly. Fishermen checked their nets by the grey light, bakers pulled the "
    "first loaves from brick ovens, and the ferryman counted coins for the morning crossing. Along "
    "the quay, children raced paper boats between the moored barges while gulls argued over scraps. "
    "In the library above the square, an old cartographer unrolled a map of the delta, tracing each "
    "channel that had shifted since her apprenticeship, and wrote careful notes in the margin about "
    "sandbanks, tides, lanterns and the names the villagers gave to every bend of the water."
)
# Short, answerable questions for bench.agreement: greedy continuations of ordinary chat turns.
QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
             "Write a haiku about the sea.", "What is 12 times 7?", "Give one tip for sleeping better.",
             "Why is the sky blue?", "Translate 'good morning' into Spanish.")


def run(cfg, ctx) -> dict[str, Any]:
    from graphexec.config import EngineConfig

    opts = options(cfg.bench)
    source = EngineConfig.from_dictconfig(cfg).model
    ours = graphexec_sides(opts["activations"], source, opts["tp_sizes"])
    gguf = gguf_path(source)
    peer = peer_status(opts, gguf, source)
    requantized = requantize(opts, gguf, ctx.say) if opts["requantize"] is not None else None
    gguf = Path(requantized["file"]) if requantized else gguf
    spec = build_spec(tokenizer_of(source, gguf), opts, gguf)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = ctx.out_dir / SPEC_FILE
    spec_path.write_text(json.dumps(spec))

    def one(side: str, round_index: int) -> dict[str, Any]:
        overrides = engine_overrides(side, ctx.overrides, gguf if requantized else None)
        return run_worker(side, spec_path, overrides, opts["threads"], opts["worker_timeout_s"])

    raw, sequence = alternate([*ours, PEER] if peer["available"] else ours, opts["rounds"], one, ctx.say, "peer suite")
    return assemble(opts, spec, peer, source, ctx.overrides, raw, sequence) | {"requantized": requantized}


def side_mode(side: str) -> str:
    return "float" if side == "graphexec" else side.removeprefix("graphexec_")


def label(side: str) -> str:
    return "llama.cpp" if side == PEER else f"graphexec ({side_mode(side)})"


def engine_overrides(side: str, overrides: Sequence[str], requantized: Path | None) -> list[str]:
    """A graphexec side's: the command line's, the re-quantized file, its axis (the last wins)."""
    if side == PEER:
        return []
    mode = side_mode(side)
    axis = f"parallel.tp_size={mode.removeprefix('tp')}" if mode.startswith("tp") else f"model.activations={mode}"
    return [*overrides, *([f"model.path='{requantized}'"] if requantized else []), axis]


def graphexec_sides(activations: list[str] | None, source, tp_sizes: list[int] | None = None) -> list[str]:
    """bench.activations as side names (null: every mode the model runs), or with bench.tp_sizes one
    side per tensor-parallel size (`graphexec_tp2`, float activations)."""
    if tp_sizes is not None:
        if activations is not None:
            raise ValueError("bench.tp_sizes and bench.activations are both set: give one axis")
        return [f"graphexec_tp{n}" for n in tp_sizes]
    if source.activations != "float":
        raise ValueError(f"model.activations={source.activations} is this suite's axis: give "
                         f"bench.activations=[{source.activations}] instead")
    runnable = list(ACTIVATIONS) if source.source == "gguf" and source.weights == "native" else ["float"]
    modes = runnable if activations is None else activations
    if (not isinstance(modes, list) or not modes or not all(isinstance(m, str) for m in modes)
            or len(set(modes)) < len(modes) or not set(modes) <= set(ACTIVATIONS)):
        raise ValueError(f"bench.activations={modes!r} must be null or a non-empty list of distinct modes from {list(ACTIVATIONS)}")
    if not set(modes) <= set(runnable):
        raise ValueError(f"bench.activations={modes} includes q8, which needs model.source=gguf with model.weights=native "
                         f"(got model.source={source.source}, model.weights={source.weights})")
    return ["graphexec" if m == "float" else f"graphexec_{m}" for m in modes]  # float keeps the suite's old side name


def options(bench_cfg) -> dict[str, Any]:
    """bench.* as plain values, checked; errors name the option."""
    from bench.suites import checked_options

    # decode tokens >= 2: decode time is measured between tokens.
    ints = dict.fromkeys(("rounds", "repeats", "threads", "worker_timeout_s", "decode.prompt_len", "batch.prompt_len",
                          "llamacpp.n_ctx", "llamacpp.n_batch", "agreement.new_tokens"), 1)
    o = checked_options(bench_cfg, ints | {"decode.new_tokens": 2, "batch.new_tokens": 2},
                        {"prefill.lengths": 1, "batch.sizes": 0})
    prompts, nats, tp, kind = o["agreement"]["prompts"], o["agreement"]["near_tie_nats"], o["tp_sizes"], o["requantize"]
    if not isinstance(prompts, int) or not 0 <= prompts <= len(QUESTIONS):
        raise ValueError(f"bench.agreement.prompts={prompts!r} must be an integer from 0 (off) to {len(QUESTIONS)}")
    if not isinstance(nats, (int, float)) or nats < 0:
        raise ValueError(f"bench.agreement.near_tie_nats={nats!r} must be a number >= 0")
    if tp is not None and (not isinstance(tp, list) or not tp or not all(isinstance(n, int) and n >= 1 for n in tp)):
        raise ValueError(f"bench.tp_sizes={tp!r} must be null or a non-empty list of integers >= 1")
    if kind is not None and not (isinstance(kind, str) and kind.isidentifier()):
        raise ValueError(f"bench.requantize={kind!r} must be null or a llama.cpp file type such as Q4_K_M")
    return o


def gguf_path(source) -> Path | None:
    """The GGUF both sides read, or None when the model is not one (llama.cpp then has no peer)."""
    if source.source != "gguf":
        return None
    from graphexec.loader import default_smollm2_gguf

    return Path(source.path) if source.path is not None else default_smollm2_gguf()


def llamacpp_importable() -> bool:
    # find_spec locates without importing: the orchestrator never loads llama.cpp's OpenMP runtime.
    return importlib.util.find_spec("llama_cpp") is not None


def peer_status(opts: dict[str, Any], gguf: Path | None, source) -> dict[str, Any]:
    llama = opts["llamacpp"]
    if not llama["enabled"]:
        reason = "bench.llamacpp.enabled=false"
    elif gguf is None:
        reason = f"model={source.name} is model.source={source.source}: llama.cpp reads GGUF files only"
    elif not llamacpp_importable():
        reason = f"llama_cpp is not importable; {INSTALL_HINT}"
    else:
        need = max(opts["decode"]["prompt_len"] + opts["decode"]["new_tokens"], max(opts["prefill"]["lengths"]) + 1)
        if llama["n_ctx"] < need:
            raise ValueError(f"bench.llamacpp.n_ctx={llama['n_ctx']} is too small: the longest request needs {need} tokens")
        try:
            version = importlib.metadata.version("llama-cpp-python")
        except importlib.metadata.PackageNotFoundError:
            version = None
        return {"available": True, "reason": None, "version": version}
    return {"available": False, "reason": reason, "version": None}


def requantize(opts: dict[str, Any], gguf: Path | None, say: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """bench.requantize's file, made once by a worker (never llama.cpp's OpenMP runtime in here)."""
    kind = opts["requantize"]
    if gguf is None:
        raise ValueError(f"bench.requantize={kind} needs a GGUF model (model.source=gguf)")
    if not llamacpp_importable():
        raise ValueError(f"bench.requantize={kind} needs llama_cpp to quantize; {INSTALL_HINT}")
    dst = requantized_path(gguf, kind, opts["requantize_dir"])
    reused = dst.is_file()
    if not reused:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")  # renamed when complete: no half file is ever reused
        say(f"peer suite: re-quantizing {gguf.name} to {kind} (llama.cpp, once) ...")
        out = run_command("peer_worker", ["--quantize", kind, str(gguf), str(tmp), "--threads", str(opts["threads"])],
                          opts["worker_timeout_s"], label="quantize worker", option="bench.worker_timeout_s")
        if out.get("error"):
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"bench.requantize={kind}: {out['error']}")
        tmp.replace(dst)
    return {"type": kind, "source": str(gguf), "file": str(dst), "reused": reused, "mib": dst.stat().st_size / 2**20,
            "tensor_types": tensor_types(dst)}


def tensor_types(gguf: Path) -> dict[str, int]:
    """Tensors per type, most first: a K-quant "file type" is a mix."""
    from graphexec.loader.gguf_file import read_gguf

    return dict(Counter(t.qtype.name for t in read_gguf(gguf).tensors).most_common())


def requantized_path(gguf: Path, kind: str, cache_dir: str | None) -> Path:
    """<cache>/<stem>.<key>.<kind>.gguf; the key (path, size, mtime) re-quantizes a changed source."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "graphexec" / "peer"
    return (Path(cache_dir).expanduser() if cache_dir else root) / f"{gguf.stem}.{key}.{kind}.gguf"


def tokenizer_of(source, gguf: Path | None):
    """Only the tokenizer (no weights) of the configured model (the serve suite's too)."""
    from graphexec.loader import load_gguf_tokenizer
    from graphexec.text.tokenizer import ByteTokenizer, Tokenizer

    if gguf is not None:
        return load_gguf_tokenizer(gguf)
    if source.source == "random":
        return ByteTokenizer(vocab_size=source.architecture.get("vocab_size", 258))
    if not (Path(source.path) / "tokenizer.json").is_file():
        raise ValueError(f"model.path={source.path} has no tokenizer.json: the suite builds its prompts from text")
    return Tokenizer.from_hf_dir(source.path)


def build_spec(tokenizer, opts: dict[str, Any], gguf: Path | None) -> dict[str, Any]:
    """What every worker reads: the prompts as token ids, and the sizes and knobs of each side."""
    make = prompt_maker(tokenizer.encode(PROMPT_TEXT), tokenizer.bos_token_id)
    decode, batch, llama = opts["decode"], opts["batch"], opts["llamacpp"]
    return {
        "threads": opts["threads"], "warmup": bool(opts["warmup"]), "repeats": opts["repeats"],
        "decode": {"prompt": make(decode["prompt_len"]), "new_tokens": decode["new_tokens"]},
        "prefill": [{"tokens": n, "prompt": make(n)} for n in opts["prefill"]["lengths"]],
        # Rotations start at different tokens, so no batch prompt is a prefix of another.
        "batch": {"sizes": batch["sizes"], "new_tokens": batch["new_tokens"],
                  "prompts": [make(batch["prompt_len"], offset=7 * i) for i in range(max(batch["sizes"], default=0))]},
        "agreement": {"prompts": [tokenizer.encode(_chat(tokenizer, q)) for q in QUESTIONS[:opts["agreement"]["prompts"]]],
                      "new_tokens": opts["agreement"]["new_tokens"]},
        "llamacpp": {"gguf": None if gguf is None else str(gguf), "n_ctx": llama["n_ctx"], "n_batch": llama["n_batch"],
                     "flash_attn": bool(llama["flash_attn"])},
    }


def _chat(tokenizer, question: str) -> str:
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    except ValueError:  # no chat template: the plain question
        return question


def prompt_maker(ids: Sequence[int], bos_token_id: int | None) -> Callable[..., list[int]]:
    """Prompts of exactly n tokens: the text's ids cycled from `offset`, behind its BOS if the
    tokenizer adds one (a BOS in the middle of a prompt would be out of distribution)."""
    head = list(ids[:1]) if ids and bos_token_id is not None and ids[0] == bos_token_id else []
    body = list(ids[len(head):])
    if not body:
        raise ValueError("the peer prompt text encodes to no tokens")

    def make(n: int, offset: int = 0) -> list[int]:
        if n <= len(head):
            raise ValueError(f"a {n}-token prompt has no room after the BOS token")
        return head + [body[(offset + j) % len(body)] for j in range(n - len(head))]

    return make


def run_worker(side: str, spec_path: Path, overrides: Sequence[str], threads: int, timeout_s: float) -> dict[str, Any]:
    """One side in a fresh process (one graphexec worker for any mode); its JSON, or {"error": ...}."""
    # Both sides' OpenMP runtimes read these at start: the same team size whatever the machine.
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    worker_side, extra = (PEER, []) if side == PEER else ("graphexec", list(overrides))
    # On a shared machine other work competing for the cores is the main noise: record it.
    return {"busy_cores_before": busy_cores(), "error": None} | run_command(
        "peer_worker", ["--side", worker_side, "--spec", str(spec_path), *extra], timeout_s, env=env, option="bench.worker_timeout_s")


def busy_cores(window_s: float = 0.5) -> float | None:
    """Cores busy with other work (stolen time included) while no worker runs; None off Linux.  Not
    the load average: it still carries the previous worker's threads for minutes."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields[:8]), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(window_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 0.0 if total1 == total0 else (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


# Aggregation: the workers' JSON as numbers per round, then spreads over rounds.
def round_metrics(worker: dict[str, Any]) -> dict[str, float]:
    """One round of one side as flat numbers (medians over its repeats); {} for a failed round."""
    if worker.get("error"):
        return {}
    decode, memory = worker["decode"], worker["memory"]
    decode_ms = median(d["decode_ms_per_token"] for d in decode)
    m = {"start_s": worker["start_seconds"], "process_s": worker["process_seconds"], "decode_ms": decode_ms,
         "decode_tok_s": 1e3 / decode_ms if decode_ms else None, "request_ms": median(d["request_ms_per_token"] for d in decode),
         "decode_ttft_s": median(d["ttft_s"] for d in decode)}
    m |= {f"pp_tok_s@{n}": median(r["tokens_per_s"] for r in reps) for n, reps in worker["prefill"].items()}
    m |= {f"batch_tok_s@{b}": median(r["decode_tokens_per_s"] for r in reps) for b, reps in worker["batch"].items()}
    m |= {f"{name}_mib": memory[f"{name}_bytes"] / 2**20 for name in ("peak_rss", "weight", "kv", "rope")
          if memory.get(f"{name}_bytes") is not None}
    return {k: v for k, v in m.items() if v is not None}


def table_rows(workload: dict[str, Any], per_side: dict[str, list[dict[str, float]]], ours: Sequence[str]) -> list[dict[str, Any]]:
    """The table's rows: key, label (↓ lower is better), the llama.cpp number compared (`peer_key`, its
    own key unless stated), a spread per side and each graphexec side's ratio to llama.cpp."""
    n, p = workload["decode_new_tokens"], workload["decode_prompt_tokens"]
    specs = [
        ("decode_ms", f"B=1 decode ms/token ({n} new tokens, prefill excluded) ↓"),
        ("decode_tok_s", "B=1 decode tok/s ↑"),
        ("request_ms", f"B=1 whole request ms/token ({p}-token prompt + {n} tokens) ↓"),
        ("decode_ttft_s", f"B=1 time to first token s ({p}-token prompt) ↓"),
        *[(f"pp_tok_s@{length}", f"prompt processing tok/s, {length} tokens ↑") for length in workload["prefill_lengths"]],
        *[(f"batch_tok_s@{b}", f"decode tok/s, graphexec B={b} vs llama.cpp B=1 ↑", "decode_tok_s") for b in workload["batch_sizes"]],
        ("start_s", "start-up s (load, and capture for graphexec) ↓"),
        ("peak_rss_mib", "peak RSS MiB ↓"),
        ("weight_mib", "weights MiB (graphexec: parameters + buffers, RoPE tables apart) ↓"),
        ("kv_mib", "KV cache MiB allocated ↓"),
        ("rope_mib", "RoPE cos/sin tables MiB"),
        ("process_s", "worker process s (imports to exit)"),
    ]
    rows = []
    for key, text, *compared in specs:
        peer_key = compared[0] if compared else key
        cells = {side: spread([m[key] for m in per_side.get(side, []) if key in m]) for side in ours}
        theirs = spread([m[peer_key] for m in per_side.get(PEER, []) if peer_key in m])
        ratios = {side: c["median"] / theirs["median"] if c and theirs and theirs["median"] else None for side, c in cells.items()}
        rows.append({"key": key, "label": text, "peer_key": peer_key} | cells | {PEER: theirs, "ratios": ratios})
    return rows


def assemble(opts, spec, peer, source, overrides, raw, sequence) -> dict[str, Any]:
    from bench.e2e import agreement

    ours = [side for side in raw if side != PEER]
    ok = {side: [w for w in rounds if not w.get("error")] for side, rounds in raw.items()}
    last = {side: rounds[-1] for side, rounds in ok.items() if rounds}  # greedy tokens: each side's last good round
    tokens = {side: w["decode"][0]["token_ids"] for side, w in last.items()}
    firsts = [tokens[side] for side in ours if side in tokens]
    workload = {"decode_prompt_tokens": len(spec["decode"]["prompt"]), "decode_new_tokens": spec["decode"]["new_tokens"],
                "prefill_lengths": [p["tokens"] for p in spec["prefill"]], "batch_sizes": spec["batch"]["sizes"],
                "batch_prompt_tokens": opts["batch"]["prompt_len"], "batch_new_tokens": spec["batch"]["new_tokens"]}
    return {
        "sides": list(raw), "rounds": opts["rounds"], "repeats": opts["repeats"], "threads": opts["threads"],
        "model": {"name": source.name, "source": source.source, "gguf": spec["llamacpp"]["gguf"]},
        "engine_overrides": list(overrides),
        # The engine facts the setup line states are the same on every graphexec side but activations.
        "engine": next((w["engine"] for side in ours for w in ok[side]), None),
        "peer": peer,
        "llamacpp_options": {k: v for k, v in spec["llamacpp"].items() if k != "gguf"},
        "workload": workload,
        "sequence": sequence,
        "rows": table_rows(workload, {side: [round_metrics(w) for w in rounds] for side, rounds in raw.items()}, ours),
        "greedy_agreement": {side: agreement([tokens[side]], [tokens[PEER]]) if side in tokens and PEER in tokens else None
                             for side in ours},
        # Across the graphexec sides (activation modes or tensor-parallel sizes).
        "greedy_tokens_equal": all(t == firsts[0] for t in firsts) if len(firsts) > 1 else None,
        "near_tie_agreement": {side: verdict(last[side]["agreement"], last[PEER]["agreement"], opts["agreement"]["near_tie_nats"])
                               for side in ours if side in last and last.get(PEER, {}).get("agreement")},
        "batch_details": _batch_details([w for side in ours for w in ok[side]]),
        "errors": [{"round": r, "side": side, "error": w["error"]}
                   for side, rounds in raw.items() for r, w in enumerate(rounds) if w.get("error")],
        "raw": raw,
    }


def _batch_details(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per batch size, the worst first-token spread and prefix-cache hits: was the decode window clean?"""
    sizes = dict.fromkeys(b for worker in rounds for b in worker["batch"])
    return {b: {key: max([least, *(r[key] for worker in rounds for r in worker["batch"].get(b, []))])
                for key, least in (("first_token_spread_s", 0.0), ("cached_tokens", 0))} for b in sizes}


def verdict(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], near_tie_nats: float) -> dict[str, Any]:
    """Greedy agreement with llama.cpp (bench.agreement): a prompt agrees when its tokens are equal or
    first differ at a *near tie*, both sides' top-two logit gaps below `near_tie_nats`, where engines
    quantizing activations in other orders may honestly pick either token (later tokens: not compared)."""
    rows = []
    for a, b in zip(ours, theirs):
        at = first_difference(a["token_ids"], b["token_ids"])
        gaps = None if at is None else (a["gaps"][at], b["gaps"][at])
        rows.append({"first_difference": at, "gaps": gaps, "near_tie": gaps is not None and max(gaps) < near_tie_nats})
    equal, near = sum(r["first_difference"] is None for r in rows), sum(r["near_tie"] for r in rows)
    return {"prompts": len(rows), "new_tokens": len(ours[0]["token_ids"]) if ours else 0, "equal": equal,
            "after_near_tie": near, "agree": (equal + near) / len(rows) if rows else None,
            "near_tie_nats": near_tie_nats, "per_prompt": rows}


# Report: the table, notes, plots and summary, as data (bench/report.py renders them).
def report(result: dict[str, Any]) -> Report:
    every = list(result["sides"])  # llama.cpp's column only where it ran
    ours = [side for side in every if side != PEER]
    ratioed = ours if PEER in every else []
    unavailable = [] if result["peer"]["available"] else [
        f"**llama.cpp unavailable**: {result['peer']['reason']}. Only the graphexec sides ran."]
    return Report([
        _setup_line(result), *unavailable,
        f"Cells: median (min–max) over {result['rounds']} rounds, each side a fresh process per round, alternated "
        f"{' → '.join(map(label, every))}; ratio (mode) = that graphexec side's median / llama.cpp's "
        "median (↓ lower is better, ↑ higher).",
        Table(["metric", *map(label, every), *(f"ratio ({side_mode(s)})" for s in ratioed)],
              [[row["label"], *(row[s] for s in every), *(times(row["ratios"][s]) for s in ratioed)]
               for row in result["rows"] if any(row[s] is not None for s in every)]),
        "\n".join(_notes(result, result["engine"] or {}, result["workload"])),
    ], _plots(result, ours), _summary(result, ours))


def _setup_line(result: dict[str, Any]) -> str:
    m, engine, q = result["model"], result["engine"] or {}, result.get("requantized")
    gguf = f"`{Path(m['gguf']).name}`" if m["gguf"] else f"{m['name']} (model.source={m['source']}, no GGUF)"
    if q:
        mix = ", ".join(f"{kind} ×{n}" for kind, n in q["tensor_types"].items())
        gguf += (f" ({q['type']}, {q['mib']:.1f} MiB, tensors {mix}: `{Path(q['source']).name}` re-quantized by llama.cpp, "
                 f"{'reused from' if q['reused'] else 'written to'} {Path(q['file']).parent})")
    ours = ", ".join(f"{k}={engine[k]}" for k in ENGINE_FACTS if k in engine)
    theirs = ", ".join(f"{k}={v}" for k, v in result["llamacpp_options"].items())
    return (f"Model {gguf}, {result['threads']} threads per side. graphexec: {ours or 'did not start'} "
            f"(overrides: {' '.join(result['engine_overrides']) or 'none'}). "
            f"llama.cpp: llama-cpp-python {result['peer']['version'] or '—'}, {theirs}.")


def _notes(result: dict[str, Any], engine: dict[str, Any], w: dict[str, Any]) -> list[str]:
    llama, raw = result["llamacpp_options"], result["raw"]
    notes = [
        f"- Prompts are the same token ids on both sides; prefill lengths {w['prefill_lengths']} are timed to the first "
        f"token (max_new_tokens=1) with graphexec's prefix cache flushed and llama.cpp's context reset. Prefill chunks: "
        f"graphexec scheduler.max_prefill_tokens={engine.get('max_prefill_tokens', '—')}, llama.cpp n_batch={llama['n_batch']}.",
        f"- Batched decode: graphexec, B requests of {w['batch_prompt_tokens']} distinct prompt tokens and "
        f"{w['batch_new_tokens']} new tokens each, submitted together; decode tokens/s counts every token after each "
        f"request's first, between the earliest first token and the latest last one.",
        *(f"  - B={b}: first tokens spread over {d['first_token_spread_s']:.3f} s (prefill chunks), prefix-cache hits "
          f"{d['cached_tokens']} tokens." for b, d in result["batch_details"].items()),
        f"- KV cache: graphexec's pool is cache.num_slots={engine.get('kv_slots', '—')} tokens, allocated (and resident) "
        f"at start; llama.cpp's is n_ctx={llama['n_ctx']} tokens of f16 K and V (from the GGUF's shape). Override "
        "cache.num_slots to compare peak RSS at equal KV capacity. Peak RSS counts llama.cpp's mmapped weights as they "
        "are touched.",
    ]
    if agree := {side: a for side, a in result["greedy_agreement"].items() if a}:
        per_side = "; ".join(f"{label(s)} {'identical' if a['identical_requests'] else 'differs'}, "
                             f"{a['mean_prefix_fraction']:.0%} agree before the first difference" for s, a in agree.items())
        notes.append(f"- Greedy B=1 tokens against llama.cpp's (last round, {w['decode_new_tokens']} tokens): {per_side} "
                     "(a sanity check, not a fidelity test: llama.cpp quantizes activations to 8 bits for its quantized dot "
                     "products, as model.activations=q8 does, so near-ties can go either way).")
    if result.get("greedy_tokens_equal") is not None:
        notes.append(f"- Greedy B=1 tokens equal across the graphexec sides (last rounds): {result['greedy_tokens_equal']}.")
    if near := result.get("near_tie_agreement"):
        v = next(iter(near.values()))
        notes.append(f"- Greedy agreement on {v['prompts']} chat prompts × {v['new_tokens']} tokens (last round; "
                     "bench/peer.py defines a near tie): " + "; ".join(_verdict_note(s, x) for s, x in near.items()) + ".")
    internal = median(r.get("internal_decode_ms_per_token") for wk in raw.get(PEER, []) if not wk.get("error")
                      for r in wk["decode"])
    if internal is not None:
        notes.append(f"- llama.cpp's own eval timer: {internal:.3g} ms/token decode (the table's number is wall clock "
                     "between yielded tokens, Python included, as for graphexec).")
    busy = {side: [wk.get("busy_cores_before") for wk in rounds] for side, rounds in raw.items()}
    if any(v is not None for values in busy.values() for v in values):
        per_side = "; ".join(f"{label(s)} " + ", ".join("—" if v is None else f"{v:.1f}" for v in values)
                             for s, values in busy.items())
        notes.append(f"- Cores busy with other work just before each round's worker started: {per_side}. Where that "
                     "is well above 0, the worker shared its cores and that round's numbers are inflated.")
    notes += [f"- {label(side)} round {r + 1}: the worker printed its results, then exited with code {wk['exit_code']} "
              f"({wk['exit_error']}); its numbers are kept." for side, rounds in raw.items()
              for r, wk in enumerate(rounds) if wk.get("exit_error")]
    notes += [f"- **{label(e['side'])} round {e['round'] + 1} failed**: {e['error']}" for e in result["errors"]]
    return [*notes, "- Order run: " + " → ".join(label(s["side"]) for s in result["sequence"]) + "."]


def _verdict_note(side: str, v: dict[str, Any]) -> str:
    differ = [f"{r['first_difference']} (gaps {r['gaps'][0]:.2f}/{r['gaps'][1]:.2f})" for r in v["per_prompt"]
              if r["first_difference"] is not None]
    return (f"{label(side)}: {v['equal'] + v['after_near_tie']}/{v['prompts']} agree ({v['equal']} equal, "
            f"{v['after_near_tie']} first differ at a near tie, both top-two gaps < {v['near_tie_nats']} nats)"
            + (f"; first differences at token {', '.join(differ)} (ours/llama.cpp)" if differ else ""))


def _plots(result: dict[str, Any], ours: list[str]) -> list[Bars]:
    w, every, rows = result["workload"], [*ours, PEER], {r["key"]: r for r in result["rows"]}

    def series(keys: Sequence[str]) -> dict[str, list[float | None]]:
        # llama.cpp's bars only where it measured that very thing (not its B=1 rate under a B=8 group).
        return {label(s): [(rows[k][s] or {}).get("median") if k in rows and (s != PEER or rows[k]["peer_key"] == k) else None
                           for k in keys] for s in every}

    rates = [*(f"pp_tok_s@{n}" for n in w["prefill_lengths"]), "decode_tok_s", *(f"batch_tok_s@{b}" for b in w["batch_sizes"])]
    groups = [*(f"prefill {n}" for n in w["prefill_lengths"]), "decode B=1",
              *(f"decode B={b}\n(graphexec only)" for b in w["batch_sizes"])]
    return [
        Bars("peer_throughput.png", "tokens per second (median over rounds)", "tokens/s", groups, series(rates), log_y=True),
        Bars("peer_latency.png", "B=1 ms per token (median over rounds)", "ms/token", ["decode only", "whole request"],
             series(["decode_ms", "request_ms"])),
        Bars("peer_memory.png", "memory (median over rounds)", "MiB", ["peak RSS", "weights", "KV cache"],
             series(["peak_rss_mib", "weight_mib", "kv_mib"])),
    ]


def _summary(result: dict[str, Any], ours: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in result["rows"]:
        kind, _, n = row["key"].partition("@")
        name = {"pp_tok_s": f"prefill {n} tok/s", "batch_tok_s": f"decode B={n} tok/s", "decode_tok_s": "decode B=1 tok/s",
                "decode_ms": "decode B=1 ms/token", "peak_rss_mib": "peak RSS MiB", "start_s": "start-up s"}.get(kind)
        if name is None:
            continue
        # In a batch row llama.cpp's number is its B=1 rate: not a number of that name.
        sides = [*ours, PEER] if row["peer_key"] == row["key"] else ours
        out |= {f"{label(s)} {name}": row[s]["median"] for s in sides if row[s] is not None}
        if kind in ("decode_tok_s", "decode_ms", "pp_tok_s"):
            out |= {f"{label(s)}/llama.cpp {name} ×": row["ratios"][s] for s in ours if row["ratios"][s] is not None}
    for side, v in (result.get("near_tie_agreement") or {}).items():
        out[f"{label(side)} greedy agreement with llama.cpp"] = v["agree"]
    return out
