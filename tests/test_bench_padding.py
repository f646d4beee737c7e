"""The padding suite of graphexec-bench: which bucket each set picks, the rows it wastes, and the
files a run writes, on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench.padding import _pinned, plan_set, set_label

SETS = [[1, 2, 4], [4]]
SIZES = [1, 3, 4, 6]


def test_plan_set_pads_to_the_smallest_bucket_that_holds_the_batch():
    rows = plan_set([1, 2, 4], SIZES)
    chosen = [(r["batch_size"], r["bucket"], r["wasted_rows"]) for r in rows]
    assert chosen == [(1, 1, 0), (3, 4, 1), (4, 4, 0), (6, None, 0)]
    assert [r["runs"] for r in rows] == ["graph", "graph", "graph", "eager"]
    assert rows[1]["wasted_fraction"] == pytest.approx(0.25)


def test_plan_set_with_one_bucket_wastes_everything_below_it():
    rows = plan_set([8], [1, 5, 8, 9])
    assert [r["wasted_rows"] for r in rows] == [7, 3, 0, 0]
    assert [r["wasted_fraction"] for r in rows] == pytest.approx([7 / 8, 3 / 8, 0.0, 0.0])
    assert rows[-1]["bucket"] is None and rows[-1]["runs"] == "eager"
    assert set_label([1, 8, 32]) == "[1,8,32]"


def test_pinned_view_pads_through_execute_and_matches_eager(tiny_engine):
    """The suite times a bucket by offering the backend only that bucket: its own prepare() must
    pad to it (counted on the view, not the shared backend) and give eager's hidden rows."""
    from bench.decode import decode_batch
    from capture import create_backend

    runner = tiny_engine.runner
    backend = create_backend("full_graph", runner.capture_env, {"buckets": [1, 2, 4], "graph": "eager", "progress": False})
    runner.capture_backend(backend)
    with torch.inference_mode():
        fb, release = decode_batch(tiny_engine, 3, 16)
        view = _pinned(backend, 4)
        padded, exact = runner.execute(view, fb), runner.execute(runner.eager, fb)
    release()
    assert view.buckets == (4,) and backend.buckets == (1, 2, 4)
    assert view.stats.padded_rows == 1 and view.stats.executions == 1 and backend.stats.executions == 0
    assert padded.shape == exact.shape == (3, exact.shape[1])
    torch.testing.assert_close(padded, exact)


@pytest.fixture(scope="module")
def padding_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("padding")
    result = subprocess.run(
        [sys.executable, "-m", "bench.cli", "bench=padding", "model=tiny-llama", "capture=eager",
         "bench.graph=eager", f"bench.bucket_sets={SETS}".replace(" ", ""), f"bench.batch_sizes={SIZES}".replace(" ", ""),
         "bench.rounds=1", "bench.steps=1", "bench.context_len=8", "bench.progress=false", f"hydra.run.dir={out}"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return out, json.loads((out / "results.json").read_text())


def test_run_records_each_sets_bucket_waste_and_eager_fallback(padding_run):
    _, payload = padding_run
    assert payload["status"] == "ok", payload.get("error")
    result = payload["result"]
    assert result["captured_buckets"] == [1, 2, 4] and result["batch_sizes"] == SIZES
    measured = {m["batch_size"]: m for m in result["measured"]}
    for buckets, s in zip(SETS, result["sets"]):
        assert s["buckets"] == buckets and [r["batch_size"] for r in s["rows"]] == SIZES
        for row in s["rows"]:
            size, m = row["batch_size"], measured[row["batch_size"]]
            fitting = [b for b in buckets if b >= size]
            if fitting:
                assert row["bucket"] == min(fitting) and row["runs"] == "graph"
                assert row["wasted_rows"] == row["bucket"] - size
                timed = next(t for t in m["buckets"] if t["bucket"] == row["bucket"])
                assert row["ms"] == timed["median_ms"] and row["pad_us"] > 0
            else:
                assert row["bucket"] is None and row["runs"] == "eager" and row["wasted_rows"] == 0
                assert row["ms"] == m["eager"]["median_ms"]
        assert s["eager_at"] == [6]
    # Each live batch size is timed once per distinct bucket any set picks for it.
    assert {size: [t["bucket"] for t in m["buckets"]] for size, m in measured.items()} == {1: [1, 4], 3: [4], 4: [4], 6: []}
    fine, coarse = result["sets"]
    assert fine["mean_wasted_fraction"] == pytest.approx((0 + 1 / 4 + 0 + 0) / 4)
    assert coarse["mean_wasted_fraction"] == pytest.approx((3 / 4 + 1 / 4 + 0 + 0) / 4)
    assert fine["finest"] == coarse["finest"] == "[1,2,4]" and fine["vs_finest"] == pytest.approx(1.0)
    assert payload["summary"]["[4] mean wasted fraction"] == pytest.approx(coarse["mean_wasted_fraction"])


def test_run_writes_report_and_plots(padding_run):
    out, payload = padding_run
    report = (out / "report.md").read_text()
    assert "### bucket set [1,2,4]" in report and "### bucket set [4]" in report and "### across sets" in report
    assert "| 6 | eager | 0 |" in report and "| 1 | 4 | 3 |" in report
    assert payload["plots"] == ["padding_latency.png", "padding_waste.png"]
    for name in payload["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batch_above_the_request_limit_is_refused(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.cli", "bench=padding", "model=tiny-llama", "capture=eager", "bench.graph=eager",
         "scheduler.max_running_requests=4", "bench.batch_sizes=[2,8]", "bench.bucket_sets=[[8]]",
         "bench.progress=false", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    payload = json.loads((tmp_path / "results.json").read_text())
    assert result.returncode == 1 and payload["status"] == "failed"
    assert "scheduler.max_running_requests is 4" in payload["error"]
