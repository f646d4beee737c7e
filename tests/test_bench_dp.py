"""bench/dp.py: the cache-hit count it reads from either server's /metrics, and a real run on
the tiny model at dp 1 and 2 (slow; no timed assertions)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.dp import _cache_hits

REPO = Path(__file__).resolve().parent.parent


def test_cache_hits_reads_one_server_or_the_replicas_total():
    one = "graphexec_prefix_cache_hit_tokens_total 12.0\ngraphexec_prefix_cache_hit_tokens_created 1.7e9\n"
    front = (
        'graphexec_prefix_cache_hit_tokens_total{replica="0"} 5.0\n'
        'graphexec_prefix_cache_hit_tokens_total{replica="1"} 7.0\n'
        'graphexec_prefix_cache_hit_tokens_total{replica="total"} 12.0\n'
    )
    assert _cache_hits(one) == _cache_hits(front) == 12


@pytest.mark.slow
def test_dp_bench_runs_tiny_at_dp_1_and_2(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "bench.cli", "dp", "--models", "tiny", "--dp", "1", "2", "--requests", "16",
           "--concurrency", "8", "--max-tokens", "4", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["dp"] for r in rows] == [1, 2]
    assert all(r["errors"] == [] and r["req_per_s"] > 0 and r["cached_tokens"] > 0 for r in rows)
    # One shared system prompt: replica 0 or 1 holds it, the other takes what exceeds the slack (4).
    assert rows[1]["replicas_used"] == ["0", "1"]
    assert "| tiny | 2 |" in proc.stdout
