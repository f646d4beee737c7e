"""The serve suite's numbers, from the per-request records of one run (one request rate), and its
report: tables, a latency CDF and a throughput plot, headline numbers.

Boundary: arithmetic over `RequestRecord`s (`summarize`) and formatting of the dict bench/serve.py
returns (and results.json holds); no I/O.  Definitions (as vLLM's `bench serve`):
- TTFT: sent → first chunk with text.  E2E latency: sent → end of the answer.
- TPOT, per request: (E2E − TTFT) / (output tokens − 1), output tokens from usage.
- ITL: the gaps between successive chunks with text, pooled over requests (a chunk may carry more
  than one token: graphexec-serve sends whole characters only).
- Throughputs divide the successful requests' token counts (from usage) by the run's wall time,
  first dispatch to last answer.  Goodput counts only requests within every SLO that is set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from bench.report import Bars, Report, Table
from bench.serve_client import RequestRecord
from bench.stats import distribution
from bench.tables import sig3 as _f

STAT_NAMES = ("mean", "median", "p90", "p99")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")  # bench.slo.*: a request meets them all or is not good


def tpot_ms(record: RequestRecord) -> float | None:
    if record.ttft_s is None or record.latency_s is None or not record.output_tokens or record.output_tokens < 2:
        return None
    return (record.latency_s - record.ttft_s) * 1e3 / (record.output_tokens - 1)


def itl_ms(record: RequestRecord) -> list[float]:
    return [(b - a) * 1e3 for a, b in zip(record.chunk_s, record.chunk_s[1:])]


def per_request(record: RequestRecord) -> dict[str, float | None]:
    return {
        "ttft_ms": None if record.ttft_s is None else record.ttft_s * 1e3,
        "tpot_ms": tpot_ms(record),
        "e2el_ms": None if record.latency_s is None else record.latency_s * 1e3,
    }


def meets_slos(record: RequestRecord, slos: dict[str, float | None]) -> bool:
    """Within every SLO that is set (None: not set); a value the request lacks fails a set SLO."""
    values = per_request(record)
    for key, limit in slos.items():
        if limit is None:
            continue
        if values[key] is None or values[key] > limit:
            return False
    return True


def summarize(records: Sequence[RequestRecord], wall_s: float, slos: dict[str, float | None]) -> dict[str, Any]:
    """One run's results: counts, throughputs, latency distributions, goodput, consistency checks."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    rows = [per_request(r) for r in ok]
    slos_set = {k: v for k, v in slos.items() if v is not None}
    good = sum(meets_slos(r, slos) for r in ok) if slos_set else None
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "errors": error_counts(failed),
        "duration_s": wall_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "replicas": sorted({r.replica for r in ok if r.replica is not None}),  # those a data-parallel front chose
        "request_throughput": len(ok) / wall_s if wall_s > 0 else None,
        "input_throughput": input_tokens / wall_s if wall_s > 0 else None,
        "output_throughput": output_tokens / wall_s if wall_s > 0 else None,
        "total_throughput": (input_tokens + output_tokens) / wall_s if wall_s > 0 else None,
        "slos": slos_set,
        "good_requests": good,
        "goodput": None if good is None or wall_s <= 0 else good / wall_s,
        "ttft_ms": distribution([x["ttft_ms"] for x in rows if x["ttft_ms"] is not None]),
        "tpot_ms": distribution([x["tpot_ms"] for x in rows if x["tpot_ms"] is not None]),
        "itl_ms": distribution([gap for r in ok for gap in itl_ms(r)]),
        "e2el_ms": distribution([x["e2el_ms"] for x in rows if x["e2el_ms"] is not None]),
        "client_wait_ms": distribution([(r.sent_s - r.scheduled_s) * 1e3 for r in records if r.sent_s is not None]),
        "checks": consistency(ok),
    }


def error_counts(failed: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Each distinct error text with how many requests got it, most frequent first."""
    counts: dict[str, int] = {}
    for r in failed:
        counts[r.error or "unknown"] = counts.get(r.error or "unknown", 0) + 1
    return [{"error": e, "count": n} for e, n in sorted(counts.items(), key=lambda kv: -kv[1])]


def consistency(ok: Sequence[RequestRecord]) -> dict[str, int]:
    """What the server reported against what was asked: prompt tokens as the dataset built them,
    output tokens as max_tokens (exact with ignore_eos)."""
    return {
        "prompt_tokens_as_expected": sum(r.prompt_tokens == r.expected_prompt_tokens for r in ok),
        "prompt_tokens_unexpected": sum(r.prompt_tokens != r.expected_prompt_tokens for r in ok),
        "output_tokens_as_asked": sum(r.output_tokens == r.max_tokens for r in ok),
        "output_tokens_short": sum((r.output_tokens or 0) < r.max_tokens for r in ok),
        "finish_length": sum(r.finish_reason == "length" for r in ok),
    }


# ---------------------------------------------------------------------------------------------
# the report


COMPARE_UNIT = "tok/s"  # which summary numbers a multirun comparison plots
LATENCY_LABELS = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2el_ms": "E2E latency"}


def rate_label(rate: float | str) -> str:
    return "inf" if rate == "inf" else f"{rate:g}/s"


def report(result: dict[str, Any]) -> Report:
    runs = result["runs"]
    rates = [rate_label(run["request_rate"]) for run in runs]
    plots = [lambda out_dir: latency_cdf(out_dir / "serve_latency_cdf.png", result),
             Bars("serve_throughput.png", "throughput per request rate", "tokens/s", rates,
                  {"output tok/s": [run["metrics"]["output_throughput"] for run in runs],
                   "total tok/s": [run["metrics"]["total_throughput"] for run in runs]}, "request rate")]
    return Report([*_setup(result), _throughput_table(result), _latency_table(result), "\n".join(_notes(result))],
                  plots, summary(result))


def _setup(result: dict[str, Any]) -> list[str]:
    t, o, d = result["target"], result["options"], result["dataset"]
    where = (f"graphexec-serve started by the suite on {t['url']} (overrides: {' '.join(t['overrides']) or 'none'}; "
             f"ready in {t['start_seconds']:.1f} s)" if t["launched"] else f"the server at {t['url']}")
    totals = d["totals"]
    if d["name"] == "random":
        r = d["random"]
        data = (f"random: {totals['requests']} prompts of {r['input_len']} tokens and outputs of {r['output_len']} "
                f"(range ratio {r['range_ratio']:g}; prompt {r['prompt_format']}), to /v1/completions")
    else:
        c = d["chat"]
        data = (f"chat: {totals['requests']} conversations, a shared {c['system_prompt_len']}-token system prompt, "
                f"{c['turns']} earlier turns, outputs of {c['output_len']} (range ratio {c['range_ratio']:g}), "
                "to /v1/chat/completions")
    slos = ", ".join(f"{k} ≤ {v:g}" for k, v in o["slo"].items() if v is not None) or "none set"
    return [
        f"Target: {where}; model `{result['model']}`.",
        f"Dataset (seed {d['seed']}) {data}: {totals['prompt_tokens']} prompt tokens "
        f"({totals['prompt_tokens_range'][0]}–{totals['prompt_tokens_range'][1]}), up to {totals['output_tokens']} "
        f"output tokens. Stream {o['stream']}, ignore_eos {o['ignore_eos']}, temperature {o['temperature']:g}, "
        f"max concurrency {o['max_concurrency'] or 'unlimited'}, burstiness {o['burstiness']:g}. SLOs: {slos}.",
    ]


def _throughput_table(result: dict[str, Any]) -> Table:
    keys = ("duration_s", "request_throughput", "goodput", "input_throughput", "output_throughput", "total_throughput")
    rows = [[rate_label(run["request_rate"]), f"{m['completed']}/{m['requests']}", m["failed"], *(m[k] for k in keys)]
            for run in result["runs"] for m in [run["metrics"]]]
    return Table(["rate", "completed", "failed", "duration s", "req/s", "goodput req/s", "input tok/s", "output tok/s",
                  "total tok/s"], rows)


def _latency_table(result: dict[str, Any]) -> Table:
    rows = [[rate_label(run["request_rate"]), LATENCY_LABELS[key], *(run["metrics"][key][s] for s in STAT_NAMES)]
            for run in result["runs"] for key in LATENCIES]
    return Table(["rate", "metric (ms)", *STAT_NAMES], rows)


def _notes(result: dict[str, Any]) -> list[str]:
    notes = ["- TTFT and E2E latency are from sending each request; TPOT = (E2E − TTFT) / (output tokens − 1); ITL "
             "is the gap between successive streamed chunks with text (one chunk may hold more than one token). "
             "Token counts are the server's usage."]
    for run in result["runs"]:
        m, c = run["metrics"], run["metrics"]["checks"]
        notes.append(
            f"- {rate_label(run['request_rate'])}: prefix cache before the run: {run['flush_cache']}; server usage vs "
            f"request: prompt tokens as built {c['prompt_tokens_as_expected']}/{m['completed']}, output tokens as asked "
            f"{c['output_tokens_as_asked']}/{m['completed']}; prompt tokens served from the server's cache "
            f"{m['cached_tokens']}; client-side wait for a concurrency slot p99 {_f(m['client_wait_ms']['p99'])} ms"
            + (f"; replicas used {', '.join(m['replicas'])}." if m.get("replicas") else "."))
        load = run.get("load_average_1min") or {}
        if load.get("before") is not None:
            notes.append(f"  - machine load (1-min average) before / after: {load['before']:.1f} / {load['after']:.1f} "
                         f"on {load['cpus']} CPUs")
        server = _server_counters(run["server_metrics"])
        if server:
            notes.append(f"  - the server's /metrics over the run: {server}")
        for e in m["errors"]:
            notes.append(f"  - **{e['count']} failed**: {e['error']}")
    return notes


def _server_counters(snapshots: dict[str, Any]) -> str:
    """What graphexec-serve's /metrics counted during the run (its generated tokens cross-check usage)."""
    before, after = snapshots.get("before"), snapshots.get("after")
    if not before or not after:
        return ""
    parts = [f"{after[k] - before[k]} {label}" for k, label in
             (("generated_tokens_total", "tokens generated"), ("retractions_total", "retractions")) if k in before and k in after]
    return ", ".join(parts)


def _records(run: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord(**r) for r in run["records"]]


def latency_values(run: dict[str, Any]) -> dict[str, list[float]]:
    """Per metric, the successful requests' values in ms (ITL: every gap), for the CDF."""
    ok = [r for r in _records(run) if r.success]
    values: dict[str, list[float]] = {key: [] for key in LATENCIES}
    for record in ok:
        for key, value in per_request(record).items():
            if value is not None:
                values[key].append(value)
        values["itl_ms"] += itl_ms(record)
    return values


def latency_cdf(path: Path, result: dict[str, Any]) -> str:
    """One panel per latency metric, one empirical CDF line per request rate."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6.4), dpi=110)
    axes = fig.subplots(2, 2).ravel()
    for ax, key in zip(axes, LATENCIES):
        for run in result["runs"]:
            values = np.sort(latency_values(run)[key])
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        label=f"rate {rate_label(run['request_rate'])}")
        ax.set_title(f"{LATENCY_LABELS[key]} CDF")
        ax.set_xlabel("ms")
        if key == "itl_ms" and ax.has_data():
            ax.set_xscale("log")  # gaps span a decode step to a whole prefill stall
        ax.set_ylabel("share of requests" if key != "itl_ms" else "share of gaps")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path.name


def summary(result: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for run in result["runs"]:
        m, at = run["metrics"], f"@{rate_label(run['request_rate'])}"
        out |= {f"output tok/s {at}": m["output_throughput"], f"req/s {at}": m["request_throughput"],
                f"TTFT median ms {at}": m["ttft_ms"]["median"], f"TPOT median ms {at}": m["tpot_ms"]["median"],
                f"failed {at}": m["failed"], f"cached tokens {at}": m["cached_tokens"]}
        if m.get("replicas"):
            out[f"replicas used {at}"] = len(m["replicas"])
        if m["goodput"] is not None:
            out[f"goodput req/s {at}"] = m["goodput"]
    return out
