"""The lent GPU machine's measurements, one part per process (scripts/gpu_check.sh runs each part
as `python -m bench.cli gpu_check --part P --out F` and merges them; docs/GPU.md):

  parity        triton vs torch_native attention: the logits of one decode step per decode bucket and
                of every token of one prefill per extend bucket, same random weights, eager forwards
  decode_graph  full_graph (CUDA graphs over the compiled forward) vs eager, one decode step per
                bucket, triton attention; goal: >= 5x at B=1
  capture       breakable vs tc_piecewise: seconds to capture each token bucket, each variant in a
                fresh process on an empty inductor and Triton cache; goal: breakable >= 3x faster

`--rehearse` runs the same code on the CPU with the tiny model: Triton's interpreter for the kernels
and the op tape where the GPU records CUDA graphs (capture/recorders.py), so the logic is exercised
on machines without a GPU.  Its numbers mean nothing.  A part that raises records its error in its
JSON; one that never writes (killed by the script's timeout) is reported as missing by --merge.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.workers import cache_env, run_command

DECODE_GOAL = 5.0  # full_graph vs eager at B=1
CAPTURE_GOAL = 3.0  # tc_piecewise capture seconds / breakable capture seconds
PARTS = ("parity", "decode_graph", "capture")
VARIANTS = ("breakable", "tc_piecewise")
# Largest |triton - torch_native| over the largest |torch_native| logit, per model dtype.
PARITY_TOLERANCE = {"float32": 2e-3, "bfloat16": 5e-2}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What each part runs on: the GPU's real shapes, or the rehearsal's tiny CPU ones."""

    rehearsal: bool  # the CPU rehearsal (--rehearse): its numbers mean nothing
    engine: tuple[str, ...]  # overrides every engine shares
    dtype: str  # decode_graph and capture
    parity_dtypes: tuple[str, ...]
    decode_buckets: tuple[int, ...]
    decode_context: int  # tokens of KV per row before the timed decode step
    extend_buckets: tuple[int, ...]
    rounds: int
    steps: int
    decode_graph: tuple[str, ...]  # overrides of the decode capture
    variant_options: dict[str, dict[str, Any]]  # per capture variant, besides buckets
    variant_timeout_s: dict[str, float]  # each variant's capture process


GPU = Shapes(
    rehearsal=False, engine=("model=smollm2-135m-random", "device=cuda", "cache.num_slots=65536"),
    dtype="bfloat16", parity_dtypes=("float32", "bfloat16"),
    decode_buckets=(1, 8, 32), decode_context=512, extend_buckets=(64, 256, 1024), rounds=5, steps=20,
    # The C++ wrapper pays on the CPU, where the wrapper runs every step; a replayed CUDA graph runs
    # none of it, and compiling it would cost the run tens of seconds per bucket.
    decode_graph=("capture.decode.graph=cuda_graph", "capture.decode.compile.cpp_wrapper=false"),
    variant_options={"breakable": {}, "tc_piecewise": {}},  # graph auto: cuda_graph; compiler inductor
    # breakable records the eager pieces (nothing to compile); tc_piecewise compiles its pieces cold.
    variant_timeout_s={"breakable": 50, "tc_piecewise": 100},
)
REHEARSAL = Shapes(
    rehearsal=True, engine=("model=tiny-llama", "device=cpu", "cache.num_slots=2048"),
    dtype="float32", parity_dtypes=("float32",),
    decode_buckets=(1, 2), decode_context=8, extend_buckets=(8, 16), rounds=1, steps=1,
    decode_graph=("capture.decode.graph=tape",),
    # The op tape records aten calls, which compiled pieces do not make: tc_piecewise's pieces stay eager.
    variant_options={"breakable": {"graph": "tape"}, "tc_piecewise": {"graph": "tape", "compiler": "eager"}},
    variant_timeout_s={"breakable": 120, "tc_piecewise": 120},
)


# -- parity -------------------------------------------------------------------------------------


def parity(shapes: Shapes) -> dict[str, Any]:
    rows = []
    for dtype in shapes.parity_dtypes:
        engines = {name: _engine(shapes, dtype, ["capture=eager", f"attention_backend={name}"])
                   for name in ("triton", "torch_native")}
        cases = [("decode", b) for b in shapes.decode_buckets] + [("extend", b) for b in shapes.extend_buckets]
        for phase, bucket in cases:
            got = {name: _logits(engine, phase, bucket, shapes.decode_context) for name, engine in engines.items()}
            rows.append({"dtype": dtype, "phase": phase, "bucket": bucket}
                        | compare_logits(got["triton"], got["torch_native"], PARITY_TOLERANCE[dtype]))
        for engine in engines.values():
            engine.shutdown()
    return {"rows": rows, "ok": all(row["ok"] for row in rows)}


def _logits(engine, phase: str, bucket: int, context: int):
    """Decode: the step's `bucket` rows.  Extend: every token of a `bucket`-token prefill."""
    import torch

    from bench.decode import decode_batch
    from bench.prefill import extend_batch

    fb, release = decode_batch(engine, bucket, context) if phase == "decode" else extend_batch(engine, bucket)
    try:
        with torch.inference_mode():
            return engine.runner.model.compute_logits(engine.runner.forward(fb)).float().cpu()
    finally:
        release()


def compare_logits(got, expected, tolerance: float) -> dict[str, Any]:
    scale = float(expected.abs().max())
    max_abs = float((got - expected).abs().max())
    agree = float((got.argmax(-1) == expected.argmax(-1)).float().mean())
    rel = max_abs / scale if scale else max_abs
    return {"max_abs_diff": max_abs, "max_abs_logit": scale, "rel_diff": rel, "argmax_agree": agree,
            "tolerance": tolerance, "ok": rel <= tolerance}


# -- decode graph vs eager ----------------------------------------------------------------------


def decode_graph(shapes: Shapes) -> dict[str, Any]:
    from bench.decode import paired_bucket
    from graphexec.batch.forward_mode import ForwardMode

    buckets = ",".join(map(str, shapes.decode_buckets))
    t0 = time.perf_counter()
    engine = _engine(shapes, shapes.dtype, [
        "capture=graph_first", f"capture.decode.buckets=[{buckets}]", "capture.decode.progress=false",
        "capture.extend.backend=eager", "attention_backend=triton", *shapes.decode_graph,
    ])  # fmt: skip
    start_seconds = time.perf_counter() - t0
    graph = engine.runner.backends[ForwardMode.DECODE]
    rows = []
    for bucket in shapes.decode_buckets:
        try:
            rows.append(paired_bucket(engine, graph, bucket, shapes.decode_context, shapes.rounds, shapes.steps))
        except Exception as exc:  # one bucket's failure keeps the others' numbers
            rows.append({"bucket": bucket, "capture_seconds": graph.stats.capture_seconds.get(bucket),
                         "error": _error(exc)})
    mechanism = getattr(graph, "mechanism", None)
    engine.shutdown()
    return {"backend": graph.name, "mechanism": mechanism, "dtype": shapes.dtype, "context": shapes.decode_context,
            "engine_start_seconds": start_seconds, "buckets": rows}


# -- capture cost: breakable vs tc_piecewise ----------------------------------------------------


def capture(shapes: Shapes) -> dict[str, Any]:
    """Each variant in a fresh process with empty caches: compile seconds are what is compared."""
    variants = {}
    for name in VARIANTS:
        with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as cache:
            args = ["--part", "capture_variant", "--variant", name, *(["--rehearse"] if shapes.rehearsal else [])]
            variants[name] = run_command("gpu_check", args, shapes.variant_timeout_s[name], env=cache_env(cache),
                                         label=f"{name} capture")
    return {"buckets": list(shapes.extend_buckets), "dtype": shapes.dtype, "variants": variants}


def capture_variant(shapes: Shapes, variant: str) -> dict[str, Any]:
    import torch

    from bench.prefill import extend_batch
    from capture import create_backend

    # Triton attention as on the GPU (auto would build the C++ CPU kernels in a rehearsal).
    engine = _engine(shapes, shapes.dtype, ["capture=eager", "attention_backend=triton"])
    runner = engine.runner
    options = {"buckets": list(shapes.extend_buckets), "progress": False} | shapes.variant_options[variant]
    backend = create_backend(variant, runner.capture_env, options, "gpu_check.capture")
    t0 = time.perf_counter()
    runner.capture_backend(backend)
    stats = backend.stats
    result = {"variant": variant, "mechanism": getattr(backend, "mechanism", None),
              "capture_total_seconds": time.perf_counter() - t0,
              "capture_seconds": {str(b): s for b, s in sorted(stats.capture_seconds.items())},
              "capture_mib": {str(b): n / 2**20 for b, n in sorted(stats.capture_bytes.items())}}
    # The smallest bucket, replayed, against eager: a fast capture that computes wrong is no win.
    fb, release = extend_batch(engine, shapes.extend_buckets[0])
    try:
        with torch.inference_mode():
            replayed, eager = runner.execute(backend, fb).float(), runner.execute(runner.eager, fb).float()
        result["max_abs_hidden_diff_vs_eager"] = float((replayed - eager).abs().max())
    except Exception as exc:  # the capture seconds still count
        result["check_error"] = _error(exc)
    finally:
        release()
    engine.shutdown()
    return result


# -- verdicts -----------------------------------------------------------------------------------


def verdicts(result: dict[str, Any]) -> list[str]:
    """One line per goal: PASS, FAIL or NOT MEASURED, with the numbers behind it."""
    decode = result.get("decode_graph", {})
    b1 = next((row for row in decode.get("buckets", []) if row["bucket"] == 1), {})
    goal = f"decode graph >= {DECODE_GOAL:g}x eager at B=1"
    if "speedup" in b1:
        numbers = (f"{b1['speedup']:.2f}x: eager {b1['eager']['median_ms']:.3f} ms, "
                   f"full_graph {b1['full_graph']['median_ms']:.3f} ms")
        lines = [_verdict(goal, b1["speedup"] >= DECODE_GOAL, numbers)]
    else:
        lines = [_verdict(goal, None, b1.get("error") or decode.get("error", "no B=1 row"))]
    ratio, why = capture_ratio(result.get("capture", {}))
    lines.append(_verdict(f"breakable capture >= {CAPTURE_GOAL:g}x faster than tc_piecewise",
                          None if ratio is None else ratio >= CAPTURE_GOAL, why if ratio is None else f"{ratio:.2f}x; {why}"))
    par = result.get("parity", {})
    if "rows" not in par:
        return [*lines, _verdict("triton vs torch_native logits", None, par.get("error", "no rows"))]
    worst = max(par["rows"], key=lambda row: row["rel_diff"] / row["tolerance"])
    return [*lines, _verdict("triton vs torch_native logits", par["ok"],
                             f"worst: {worst['dtype']} {worst['phase']} {worst['bucket']}: rel diff {worst['rel_diff']:.2e} "
                             f"vs {worst['tolerance']:.0e}, argmax agree {worst['argmax_agree']:.3f}")]


def _verdict(goal: str, ok: bool | None, numbers: str) -> str:
    return f"{goal}: {'NOT MEASURED' if ok is None else 'PASS' if ok else 'FAIL'} ({numbers})"


def capture_ratio(cap: dict[str, Any]) -> tuple[float | None, str]:
    """tc_piecewise's total capture seconds over breakable's, over the buckets both captured."""
    variants = cap.get("variants", {})
    missing = [f"{v}: {variants.get(v, {}).get('error', 'missing')}" for v in VARIANTS
               if "capture_seconds" not in variants.get(v, {})]
    if "error" in cap or missing:
        return None, cap.get("error") or "; ".join(missing)
    fast, slow = variants["breakable"]["capture_seconds"], variants["tc_piecewise"]["capture_seconds"]
    common = sorted(set(fast) & set(slow), key=int)
    total_fast, total_slow = sum(fast[b] for b in common), sum(slow[b] for b in common)
    per_bucket = ", ".join(f"{b}: {fast[b]:.1f} s vs {slow[b]:.1f} s" for b in common)
    return (total_slow / total_fast if total_fast else None), f"breakable vs tc_piecewise per bucket {per_bucket}"


# -- running parts, merging, the environment ----------------------------------------------------


def run_part(part: str, shapes: Shapes, variant: str | None = None) -> dict[str, Any]:
    measure = {"parity": parity, "decode_graph": decode_graph, "capture": capture,
               "capture_variant": lambda shapes: capture_variant(shapes, variant or "")}[part]
    t0 = time.perf_counter()
    try:
        result = measure(shapes)
    except Exception as exc:  # recorded, so the other parts and the summary still come back
        result = {"error": _error(exc), "traceback": traceback.format_exc()[-4000:]}
    return result | {"seconds": time.perf_counter() - t0, "environment": environment(shapes.rehearsal)}


def merge(parts_dir: Path, rehearse: bool) -> dict[str, Any]:
    result: dict[str, Any] = {"rehearsal": rehearse, "environment": environment(rehearse)}
    for part in PARTS:
        path = parts_dir / f"{part}.json"
        result[part] = (json.loads(path.read_text()) if path.is_file()
                        else {"error": "no output: killed by its timeout or crashed (see gpu_check.log)"})
    return result


def environment(rehearse: bool) -> dict[str, Any]:
    """Versions, the device, and every installed distribution this process imported (the wheel list
    is checked against these: tests/test_gpu_check_script.py)."""
    import importlib.metadata
    import platform

    import torch

    by_module = importlib.metadata.packages_distributions()
    imported = sorted({dist for name in list(sys.modules) for dist in by_module.get(name.partition(".")[0], [])})
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "rehearsal": rehearse, "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            "imported_distributions": {dist: _version(dist) for dist in imported}}


def _version(distribution: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _error(exc: Exception) -> str:
    traceback.print_exc()  # into the script's log
    return f"{type(exc).__name__}: {exc}"[:2000]


def _engine(shapes: Shapes, dtype: str, overrides: list[str]):
    from graphexec import Engine

    return Engine(overrides=[*shapes.engine, f"model.dtype={dtype}", "++capture.background=false", *overrides])


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a part killed mid-write leaves no half a JSON


def details(result: dict[str, Any]) -> list[str]:
    """Every decode bucket's speedup, and whether each captured variant computes what eager does."""
    lines = []
    rows = result.get("decode_graph", {}).get("buckets", [])
    if rows:
        lines.append("decode full_graph vs eager: " + ", ".join(
            f"B={r['bucket']} " + (f"{r['speedup']:.2f}x (hidden diff {r.get('max_abs_hidden_diff', float('nan')):.1e})"
                                   if "speedup" in r else "ERROR") for r in rows))
    for name, variant in result.get("capture", {}).get("variants", {}).items():
        if "capture_seconds" in variant:
            check = variant.get("check_error") or f"max |hidden - eager| {variant['max_abs_hidden_diff_vs_eager']:.1e}"
            lines.append(f"capture {name}: {variant['capture_total_seconds']:.1f} s in all; {check}")
    return lines


def summary_text(result: dict[str, Any], pytest_log: Path | None) -> str:
    head = ["REHEARSAL on the CPU (tiny model, interpreter, op tape): the numbers mean nothing"] if result["rehearsal"] else []
    env = result["environment"]
    lines = head + [f"device {env['device']}, torch {env['torch']}, cuda {env['cuda']}, python {env['python']}"]
    lines += verdicts(result)
    lines += details(result)
    if pytest_log is not None:
        text = pytest_log.read_text() if pytest_log.is_file() else ""
        # Lines starting "==" are the script's own step headers, not pytest's.
        tail = [line for line in text.splitlines() if line.strip() and not line.startswith("== ")]
        lines.append(f"pytest -m gpu: {tail[-1] if tail else 'no output'}")
    lines += [f"{part}: ERROR {result[part]['error']}" if "error" in result[part]
              else f"{part}: {result[part].get('seconds', 0):.1f} s" for part in PARTS]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=[*PARTS, "capture_variant", "all"], help="all: every part here, then merged")
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--merge", type=Path, help="folder of part JSONs to merge into --out (and --summary)")
    parser.add_argument("--out", type=Path, help="where the JSON goes (capture_variant: one line on stdout)")
    parser.add_argument("--summary", type=Path)
    parser.add_argument("--pytest", type=Path, help="pytest's output, whose last line goes into the summary")
    parser.add_argument("--rehearse", action="store_true", help="CPU, tiny model, interpreter and op tape")
    args = parser.parse_args(argv)
    if (args.part is None) == (args.merge is None):
        parser.error("give exactly one of --part and --merge")
    if args.out is None and args.part != "capture_variant":
        parser.error("--out is required")
    if args.rehearse:
        # Before anything imports triton: without a GPU its kernels run only in the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shapes = REHEARSAL if args.rehearse else GPU
    if args.part == "capture_variant":  # a fresh process of the capture part (bench/workers.py reads the line)
        print(json.dumps(run_part(args.part, shapes, args.variant)))
    elif args.part in PARTS:
        _write(args.out, json.dumps(run_part(args.part, shapes), indent=1))
    else:
        _write_merged(args, shapes)


def _write_merged(args, shapes: Shapes) -> None:
    """--merge DIR, or --part all: every part run here first, into a folder of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        parts_dir = args.merge or Path(tmp)
        for part in PARTS if args.part == "all" else ():
            _write(parts_dir / f"{part}.json", json.dumps(run_part(part, shapes)))
        result = merge(parts_dir, args.rehearse)
    _write(args.out, json.dumps(result, indent=1))
    if args.summary is not None:
        text = summary_text(result, args.pytest)
        _write(args.summary, text)
        print(text, end="")
