"""The capture suite end to end through `graphexec-bench`, on the tiny model: cold and warm probe
processes, results.json, report.md and plots.  Extend captures lazily here (nothing at start-up)
to keep the cold compile short; decode captures one bucket, in aot_compile's format."""

import json
import subprocess
import sys

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench_capture(out_dir, *overrides):
    result = subprocess.run(
        [sys.executable, "-m", "bench.cli", "bench=capture", "model=tiny-llama", *overrides, f"hydra.run.dir={out_dir}"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return json.loads((out_dir / "results.json").read_text()), (out_dir / "report.md").read_text()


def test_cold_and_warm_capture_per_backend_and_bucket(tmp_path):
    payload, report = _bench_capture(
        tmp_path, "capture.decode.buckets=[1]", "+capture.extend.lazy=true",
        "capture.decode.compile.aoti=false",  # aot_compile's artifact: a third of a package's compile time
    )
    assert payload["status"] == "ok", payload.get("error")
    result = payload["result"]
    assert list(result["phases"]) == ["cold", "warm"] and result["cold_is_cold"]
    for phase in result["phases"].values():
        assert phase["error"] is None
        assert phase["start_seconds"] > 0 and phase["peak_rss_bytes"] > 0

    # Shared specs are one backend each: extend with mixed, decode with idle.
    backends = {b["name"]: b for b in result["backends"]}
    assert set(backends) == {"extend", "decode"}
    assert backends["extend"]["modes"] == ["extend", "mixed"] and backends["extend"]["buckets"] == []
    decode = backends["decode"]
    assert decode["modes"] == ["decode", "idle", "target_verify"] and decode["backend"] == "full_graph"
    assert [row["bucket"] for row in decode["buckets"]] == [1]
    for row in decode["buckets"]:
        assert row["cold_seconds"] >= 0 and row["cold_mib"] >= 0
    # The warm process found the cold one's compiled artifacts (or, for a dropped bucket, did not compile).
    cold_total = payload["summary"]["decode cold s total"]
    assert payload["summary"].get("decode warm s total", 0.0) < cold_total

    assert payload["plots"] == ["capture_decode.png"]
    assert (tmp_path / "capture_decode.png").read_bytes()[:8] == PNG_MAGIC
    assert "### decode: full_graph (shared by idle, target_verify)" in report
    assert "| bucket | eager ms | graph ms | speedup | decision | cold s | warm s | cold MiB | warm MiB |" in report
    # The default plan measured the bucket cold; warm loaded that decision (same key, same plan dir).
    (row,) = decode["buckets"]
    assert row["eager_ms"] > 0 and row["graph_ms"] > 0 and row["reason"] in ("faster", "not faster")
    assert row["warm_state"] == ("ready" if row["reason"] == "faster" else "dropped")
    if row["warm_state"] == "dropped":
        assert row["warm_seconds"] is None  # never compiled again
    else:
        assert (row["cold_origin"], row["warm_origin"]) == ("compiled", "artifact")  # compile.aot
    assert "| warm |" in report and "![capture_decode.png](capture_decode.png)" in report


def test_failing_probe_is_recorded_per_phase_and_explicit_cache_dir_flagged(tmp_path):
    cache = tmp_path / "inductor-cache"
    payload, report = _bench_capture(
        tmp_path / "run", "capture.decode.buckets=[]", f"capture.decode.compile.cache_dir={cache}"
    )
    assert payload["status"] == "ok"
    result = payload["result"]
    expected = "ConfigError: capture.decode.buckets must be a non-empty list of sizes, got []"
    for phase in ("cold", "warm"):
        assert expected in result["phases"][phase]["error"]
        assert result["phases"][phase]["exit_code"] != 0
    assert result["backends"] == [] and payload["plots"] == [] and payload["summary"] == {}
    assert result["explicit_cache_dirs"] == [str(cache)] and not result["cold_is_cold"]
    assert expected in report and "Cold is not cold" in report
