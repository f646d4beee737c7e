"""The serve suite's numbers, from the per-request records of one run (one request rate).

Boundary: pure arithmetic over `RequestRecord`s; no I/O.  Definitions (as vLLM's `bench serve`):
- TTFT: sent → first chunk with text.  E2E latency: sent → end of the answer.
- TPOT, per request: (E2E − TTFT) / (output tokens − 1), output tokens from usage.
- ITL: the gaps between successive chunks with text, pooled over requests (a chunk may carry more
  than one token: graphexec-serve sends whole characters only).
- Throughputs divide the successful requests' token counts (from usage) by the run's wall time,
  first dispatch to last answer.  Goodput counts only requests within every SLO that is set.
"""

from __future__ import annotations

from typing import Any, Sequence

from bench.serve_client import RequestRecord
from bench.stats import distribution

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
