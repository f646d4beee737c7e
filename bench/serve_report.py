"""The serve suite's numbers (bench/README.md, serve): one request rate's counts, throughputs, goodput
and TTFT / TPOT / ITL / E2E distributions from its per-request records (`summarize`), and the report:
tables, a latency CDF, a throughput plot, headline numbers.  No I/O."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from bench.report import Bars, Report, Table
from bench.serve_client import RequestRecord
from bench.stats import distribution
from bench.tables import sig3

STAT_NAMES = ("mean", "median", "p90", "p99")
LATENCY_LABELS = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2el_ms": "E2E latency"}
LATENCIES = tuple(LATENCY_LABELS)
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")  # bench.slo.*: a request meets them all or is not good
THROUGHPUTS = ("duration_s", "request_throughput", "goodput", "input_throughput", "output_throughput",
               "total_throughput")


def per_request(r: RequestRecord) -> dict[str, float | None]:
    """TTFT, TPOT ((E2E − TTFT) / (output tokens − 1)) and E2E latency in ms; None where unknown."""
    tpot = (None if r.ttft_s is None or r.latency_s is None or not r.output_tokens or r.output_tokens < 2
            else (r.latency_s - r.ttft_s) * 1e3 / (r.output_tokens - 1))
    return {"ttft_ms": None if r.ttft_s is None else r.ttft_s * 1e3, "tpot_ms": tpot,
            "e2el_ms": None if r.latency_s is None else r.latency_s * 1e3}


def latency_values(ok: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Per metric, the requests' values in ms; ITL pools every gap between chunks with text."""
    values: dict[str, list[float]] = {key: [] for key in LATENCIES}
    for record in ok:
        for key, value in per_request(record).items():
            if value is not None:
                values[key].append(value)
        values["itl_ms"] += [(b - a) * 1e3 for a, b in zip(record.chunk_s, record.chunk_s[1:])]
    return values


def summarize(records: Sequence[RequestRecord], wall_s: float, slos: dict[str, float | None]) -> dict[str, Any]:
    """One run's results: counts, throughputs, latency distributions, goodput, consistency checks."""
    ok, failed = [r for r in records if r.success], [r for r in records if not r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    slos_set = {k: v for k, v in slos.items() if v is not None}
    # A good request is within every SLO set; a value it lacks fails a set SLO.
    good = sum(all(values[k] is not None and values[k] <= limit for k, limit in slos_set.items())
               for values in map(per_request, ok)) if slos_set else None

    def per_s(count: float | None) -> float | None:  # over the run's wall time, first dispatch to last answer
        return None if count is None or wall_s <= 0 else count / wall_s

    return {
        "requests": len(records), "completed": len(ok), "failed": len(failed),
        "errors": [{"error": e, "count": n} for e, n in Counter(r.error or "unknown" for r in failed).most_common()],
        "duration_s": wall_s, "input_tokens": input_tokens, "output_tokens": output_tokens,
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "replicas": sorted({r.replica for r in ok if r.replica is not None}),  # those a data-parallel front chose
        "request_throughput": per_s(len(ok)), "input_throughput": per_s(input_tokens),
        "output_throughput": per_s(output_tokens), "total_throughput": per_s(input_tokens + output_tokens),
        "slos": slos_set, "good_requests": good, "goodput": per_s(good),
        **{key: distribution(values) for key, values in latency_values(ok).items()},
        "client_wait_ms": distribution([(r.sent_s - r.scheduled_s) * 1e3 for r in records if r.sent_s is not None]),
        # What the server reported against what was asked: prompt tokens as the dataset built them,
        # output tokens as max_tokens (exact with ignore_eos).
        "checks": {"prompt_tokens_as_expected": sum(r.prompt_tokens == r.expected_prompt_tokens for r in ok),
                   "prompt_tokens_unexpected": sum(r.prompt_tokens != r.expected_prompt_tokens for r in ok),
                   "output_tokens_as_asked": sum(r.output_tokens == r.max_tokens for r in ok),
                   "output_tokens_short": sum((r.output_tokens or 0) < r.max_tokens for r in ok),
                   "finish_length": sum(r.finish_reason == "length" for r in ok)},
    }


def rate_label(rate: float | str) -> str:
    return "inf" if rate == "inf" else f"{rate:g}/s"


def report(result: dict[str, Any]) -> Report:
    runs = result["runs"]
    rates = [rate_label(run["request_rate"]) for run in runs]
    throughput = Table(["rate", "completed", "failed", "duration s", "req/s", "goodput req/s", "input tok/s",
                        "output tok/s", "total tok/s"],
                       [[rate, f"{m['completed']}/{m['requests']}", m["failed"], *(m[k] for k in THROUGHPUTS)]
                        for rate, run in zip(rates, runs) for m in [run["metrics"]]])
    latency = Table(["rate", "metric (ms)", *STAT_NAMES],
                    [[rate, LATENCY_LABELS[key], *(run["metrics"][key][s] for s in STAT_NAMES)]
                     for rate, run in zip(rates, runs) for key in LATENCIES])
    plots = [lambda out_dir: latency_cdf(out_dir / "serve_latency_cdf.png", result),
             Bars("serve_throughput.png", "throughput per request rate", "tokens/s", rates,
                  {f"{w} tok/s": [run["metrics"][f"{w}_throughput"] for run in runs] for w in ("output", "total")},
                  "request rate")]
    return Report([*_setup(result), throughput, latency, "\n".join(_notes(result))], plots, summary(result))


def _setup(result: dict[str, Any]) -> list[str]:
    t, o, d = result["target"], result["options"], result["dataset"]
    where = (f"graphexec-serve started by the suite on {t['url']} (overrides: {' '.join(t['overrides']) or 'none'}; "
             f"ready in {t['start_seconds']:.1f} s)" if t["launched"] else f"the server at {t['url']}")
    totals, r, c = d["totals"], d["random"], d["chat"]
    data = (f"random: {totals['requests']} prompts of {r['input_len']} tokens and outputs of {r['output_len']} "
            f"(range ratio {r['range_ratio']:g}; prompt {r['prompt_format']}), to /v1/completions"
            if d["name"] == "random" else
            f"chat: {totals['requests']} conversations, a shared {c['system_prompt_len']}-token system prompt, "
            f"{c['turns']} earlier turns, outputs of {c['output_len']} (range ratio {c['range_ratio']:g}), "
            "to /v1/chat/completions")
    slos = ", ".join(f"{k} ≤ {v:g}" for k, v in o["slo"].items() if v is not None) or "none set"
    low, high = totals["prompt_tokens_range"]
    return [f"Target: {where}; model `{result['model']}`.",
            f"Dataset (seed {d['seed']}) {data}: {totals['prompt_tokens']} prompt tokens ({low}–{high}), up to "
            f"{totals['output_tokens']} output tokens. Stream {o['stream']}, ignore_eos {o['ignore_eos']}, temperature "
            f"{o['temperature']:g}, max concurrency {o['max_concurrency'] or 'unlimited'}, burstiness "
            f"{o['burstiness']:g}. SLOs: {slos}."]


def _notes(result: dict[str, Any]) -> list[str]:
    notes = ["- TTFT and E2E latency are from sending each request; TPOT = (E2E − TTFT) / (output tokens − 1); ITL "
             "is the gap between successive streamed chunks with text (one chunk may hold more than one token). "
             "Token counts are the server's usage."]
    for run in result["runs"]:
        m, c = run["metrics"], run["metrics"]["checks"]
        notes.append(f"- {rate_label(run['request_rate'])}: prefix cache before the run: {run['flush_cache']}; server "
                     f"usage vs request: prompt tokens as built {c['prompt_tokens_as_expected']}/{m['completed']}, "
                     f"output tokens as asked {c['output_tokens_as_asked']}/{m['completed']}; prompt tokens served "
                     f"from the server's cache {m['cached_tokens']}; client-side wait for a concurrency slot p99 "
                     f"{sig3(m['client_wait_ms']['p99'])} ms"
                     + (f"; replicas used {', '.join(m['replicas'])}." if m.get("replicas") else "."))
        load = run.get("load_average_1min") or {}
        if load.get("before") is not None:
            notes.append(f"  - machine load (1-min average) before / after: {load['before']:.1f} / {load['after']:.1f} "
                         f"on {load['cpus']} CPUs")
        # What graphexec-serve's /metrics counted during the run (its generated tokens cross-check usage).
        before, after = (run["server_metrics"].get(when) or {} for when in ("before", "after"))
        if counted := [f"{after[k] - before[k]} {what}" for k, what in (("generated_tokens_total", "tokens generated"),
                       ("retractions_total", "retractions")) if k in before and k in after]:
            notes.append(f"  - the server's /metrics over the run: {', '.join(counted)}")
        notes += [f"  - **{e['count']} failed**: {e['error']}" for e in m["errors"]]
    return notes


def latency_cdf(path: Path, result: dict[str, Any]) -> str:
    """One panel per latency metric, one empirical CDF line per request rate."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6.4), dpi=110)
    per_run = [latency_values([RequestRecord(**r) for r in run["records"] if r["success"]]) for run in result["runs"]]
    for ax, key in zip(fig.subplots(2, 2).ravel(), LATENCIES):
        for run, values in zip(result["runs"], per_run):
            if n := len(values[key]):
                ax.step(sorted(values[key]), [i / n for i in range(1, n + 1)], where="post",
                        label=f"rate {rate_label(run['request_rate'])}")
        ax.set(title=f"{LATENCY_LABELS[key]} CDF", xlabel="ms",
               ylabel="share of requests" if key != "itl_ms" else "share of gaps")
        if key == "itl_ms" and ax.has_data():
            ax.set_xscale("log")  # gaps span a decode step to a whole prefill stall
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
        out |= {f"replicas used {at}": len(m["replicas"])} if m.get("replicas") else {}
        out |= {f"goodput req/s {at}": m["goodput"]} if m["goodput"] is not None else {}
    return out
