"""The benchmark harness's own logic, on the tiny model with tiny sizes (seconds, not minutes)."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from bench.e2e import agreement, percentiles
from bench.report import Report, run_suite
from bench.timing import paired_ms
from bench.workload import WorkloadSpec, make_workload, ordinary_token_range

REPO = Path(__file__).resolve().parents[1]


def test_workload_is_seeded_and_within_the_stated_distributions():
    spec = WorkloadSpec(num_requests=200, prompt_len=(16, 256), output_len=(16, 128), shared_prefix_len=32, shared_fraction=0.5, seed=3)
    items = make_workload(spec, (100, 49152))
    assert items == make_workload(spec, (100, 49152))
    assert items != make_workload(WorkloadSpec(**{**vars(spec), "seed": 4}), (100, 49152))
    assert all(16 <= len(w.prompt_ids) <= 256 and 16 <= w.output_len <= 128 for w in items)
    assert all(100 <= t < 49152 for w in items for t in w.prompt_ids)
    shared = [w for w in items if w.shared_prefix]
    assert 60 <= len(shared) <= 140  # ~half of 200
    prefix = shared[0].prompt_ids[:32]
    assert all(w.prompt_ids[:32] == prefix for w in shared)
    assert all(w.prompt_ids[:32] != prefix for w in items if not w.shared_prefix)
    # both ends of each range are reachable (inclusive bounds)
    assert min(w.output_len for w in items) <= 20 and max(w.output_len for w in items) >= 124


@pytest.mark.parametrize(
    "bad, named",
    [({"prompt_len": (0, 5)}, "prompt_len"), ({"output_len": (9, 3)}, "output_len"), ({"num_requests": 0}, "num_requests"),
     ({"shared_fraction": 1.5}, "shared_fraction"), ({"prompt_len": (4, 20), "shared_prefix_len": 20}, "shared_prefix_len")],
)
def test_workload_spec_names_the_bad_option(bad, named):
    with pytest.raises(ValueError, match=named):
        WorkloadSpec(**bad)


def test_ordinary_token_range_skips_specials_even_in_tiny_vocabularies():
    assert ordinary_token_range(49152) == (100, 49152)
    assert ordinary_token_range(64) == (32, 64)


def test_paired_timing_alternates_sides_and_summarises_each():
    calls = []
    sides = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    out = paired_ms(sides, rounds=3, steps=2)
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3  # warm-up once each, then A B A B ...
    for stats in out.values():
        assert 0 <= stats["min_ms"] <= stats["median_ms"] <= stats["max_ms"]


def test_agreement_and_percentiles():
    ours = [[1, 2, 3, 4], [5, 6], [7]]
    theirs = [[1, 2, 9, 4], [5, 6], [8]]
    got = agreement(ours, theirs)
    assert got["identical_requests"] == 1 and got["compared"] == 3
    assert got["mean_prefix_fraction"] == pytest.approx((2 / 4 + 1 + 0) / 3)
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    p = percentiles(list(range(101)))
    assert (p["p50"], p["p90"], p["p99"]) == (50, 90, 99)


def _suite(report=lambda r: Report(["| x |"], [], {"x": 1.0})):
    return types.SimpleNamespace(report=report)


def test_a_failing_suite_is_reported_not_raised(tmp_path):
    def boom():
        raise RuntimeError("bucket 8 did not capture")

    payload = run_suite(_suite(), "decode", boom, tmp_path, {"k": 1}, "capture=eager")
    assert payload["status"] == "failed"
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["error"] == "RuntimeError: bucket 8 did not capture" and saved["config"] == {"k": 1}
    assert saved["machine"]["torch"] and saved["machine"]["cpu_count"]
    report = (tmp_path / "report.md").read_text()
    assert "FAILED" in report and "bucket 8 did not capture" in report


def test_a_broken_report_keeps_the_measurements(tmp_path):
    def broken(result):
        raise KeyError("speedup")

    payload = run_suite(_suite(report=broken), "decode", lambda: {"rows": [1, 2]}, tmp_path, {}, "defaults")
    saved = json.loads((tmp_path / "results.json").read_text())
    assert payload["status"] == saved["status"] == "failed" and saved["result"] == {"rows": [1, 2]}
    assert "report: KeyError" in saved["error"]


def test_hf_groups_generate_each_requests_own_length_with_timings():
    import torch

    from bench.hf_baseline import generate_grouped, hf_model_from
    from graphexec.config import EngineConfig
    from graphexec.loader.resolve import load_checkpoint

    ckpt = load_checkpoint(EngineConfig.from_overrides(["model=tiny-llama"]).model, torch.float32)
    model = hf_model_from(ckpt.config, ckpt.state_dict)
    prompts = [[40, 41, 42], [50] * 9, [60, 61], [70] * 5, [80]]
    lens = [3, 7, 1, 5, 2]
    grouped, wall = generate_grouped(model, prompts, lens, pad_id=0, group_size=2)
    single, _ = generate_grouped(model, prompts, lens, pad_id=0, group_size=1)
    assert [len(r.token_ids) for r in grouped] == lens
    assert [r.token_ids for r in grouped] == [r.token_ids for r in single]  # left padding changes nothing
    assert grouped[0].ttft == grouped[1].ttft < grouped[2].ttft  # one group shares its prefill
    assert all(r.ttft <= r.latency <= wall for r in grouped)
    assert grouped[2].tpot is None and grouped[1].tpot > 0  # a one-token request has no TPOT


TINY_E2E = [
    "bench=e2e", "model=tiny-llama", "bench.progress=false", "bench.workload.num_requests=10",
    "bench.workload.prompt_len=[4,40]", "bench.workload.output_len=[2,12]", "bench.workload.shared_prefix_len=3",
    "bench.hf.group_size=4", "bench.hf.single_requests=3", "capture.extend.buckets=[32]",
]


def test_e2e_sweep_writes_runs_and_one_comparison_even_when_a_run_fails(tmp_path):
    """`--multirun` over two plans, one of which cannot start: both runs are reported, the sweep ends."""
    cmd = [sys.executable, "-m", "bench.cli", "--multirun", *TINY_E2E, "capture.decode.buckets=[4],[]",
           f"hydra.sweep.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    good, bad = (json.loads((tmp_path / job / "results.json").read_text()) for job in ("0", "1"))

    assert good["status"] == "ok" and good["config"]["model"]["name"] == "tiny-llama"
    sides = good["result"]["sides"]
    assert sides["graphexec"]["requests"] == 10 and sides["hf_single"]["requests"] == 3
    assert sides["graphexec"]["output_tokens"] == sides["hf_grouped"]["output_tokens"] == good["result"]["workload"]["useful_output_tokens"]
    # Same weights, greedy: graphexec's tokens are HF's tokens.
    assert sides["hf_single"]["agreement"]["identical_requests"] == 3
    assert sides["hf_grouped"]["agreement"]["identical_requests"] == 10
    decode = next(b for b in good["result"]["engine_backends"] if "decode" in b["modes"])
    assert decode["backend"] == "full_graph" and decode["modes"] == ["decode", "idle", "target_verify"] and decode["executions"] > 0
    assert good["result"]["ratios"]["graphexec / hf_grouped"] == pytest.approx(
        sides["graphexec"]["tokens_per_s"] / sides["hf_grouped"]["tokens_per_s"])
    for png in good["plots"]:
        assert (tmp_path / "0" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| graphexec | 10 |" in (tmp_path / "0" / "report.md").read_text()

    assert bad["status"] == "failed" and "capture.decode.buckets" in bad["error"]
    comparison = (tmp_path / "comparison.md").read_text()
    assert "capture.decode.buckets=[4] (#0) |" in comparison
    assert "capture.decode.buckets=[] (#1) | FAILED: ConfigError" in comparison
    assert (tmp_path / "comparison_e2e.png").exists()


def test_decode_suite_pairs_buckets_and_splits_a_step_into_model_and_host(tmp_path):
    cmd = [sys.executable, "-m", "bench.cli", "bench=decode", "model=tiny-llama", "bench.progress=false",
           "capture.decode.buckets=[1,2]", "capture.extend.backend=eager", "capture.decode.progress=false",
           "bench.rounds=2", "bench.steps=1", "bench.host_batch=2", "bench.host_steps=6", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())["result"]
    assert [row["bucket"] for row in result["buckets"]] == [1, 2]
    for row in result["buckets"]:
        assert row["speedup"] == pytest.approx(row["eager"]["median_ms"] / row["full_graph"]["median_ms"])
    host = result["host"]
    assert host["batch_size"] == 2 and host["steps"] == 5  # 6 tokens: the first comes from the prefill
    parts = host["forward_ms"] + host["logits_sample_ms"] + host["scheduler_ms"] + host["publish_ms"]
    assert host["step_ms"] == pytest.approx(parts) and 0 < host["host_fraction"] < 1
    assert min(host["forward_ms"], host["logits_sample_ms"], host["scheduler_ms"], host["publish_ms"]) > 0
    assert "host overhead" in (tmp_path / "report.md").read_text()


def test_a_suite_builds_an_engine_from_a_plan_without_background_capture():
    """A suite times an engine that captures nothing in the background; capture=eager's plan has no
    `background` key at all, and setting it must not trip over the struct config (it did)."""
    from bench.suites import build_engine
    from graphexec.config import compose

    cfg = compose(["model=tiny-llama", "capture=eager", "cache.num_slots=512"])
    engine = build_engine(cfg)
    try:
        assert engine.config.capture.background is False and not engine.runner.capture_pending()
    finally:
        engine.shutdown()
    assert "background" not in cfg.capture  # the caller's config untouched


def test_step_timers_leave_the_engine_as_they_found_it(tiny_engine):
    from bench.host_overhead import breakdown, step_timers
    from graphexec import SamplingParams

    with step_timers(tiny_engine) as records:
        tiny_engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [r["mode"] for r in records] == ["extend", "decode", "decode", "decode"]
    assert breakdown(records, "decode")["steps"] == 3 and breakdown(records, "mixed") == {}
    for obj, name in [(tiny_engine.runner, "forward"), (tiny_engine.scheduler, "step"), (tiny_engine.loop, "publish")]:
        assert name not in vars(obj)
