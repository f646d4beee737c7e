"""The serve suite (`graphexec-bench bench=serve`): its arrival schedule, datasets and metrics on
their own, then the whole suite against a real graphexec-serve on SmolLM2 (capture=eager, a
handful of short requests), checked against what the server itself reported (usage, /metrics),
and against a URL nobody serves.  No timed assertions: only counts, orderings and identities."""

import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from bench import serve
from bench.report import run_suite
from bench.serve_client import RequestRecord, arrival_times
from bench.serve_datasets import WordVocabulary, build, lengths
from bench.serve_report import LATENCIES, summarize
from bench.serve import free_port
from bench.suites import SuiteContext
from graphexec.config import compose

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SHORT = ["bench=serve", "bench.progress=false", "bench.dataset.num_prompts=4", "bench.dataset.random.input_len=16",
         "bench.dataset.random.output_len=4", "bench.dataset.random.range_ratio=0.5"]


@pytest.fixture(scope="module")
def tokenizer():
    return serve.model_tokenizer(compose(["bench=serve"], config_name="bench"))


@pytest.fixture(scope="module")
def smollm2_server(smollm2_engine):
    """graphexec-serve's app over the shared SmolLM2 engine, in this process."""
    from graphexec.server.app import create_app
    from tests.helpers import ServerThread, server_config

    with ServerThread(create_app(smollm2_engine, server_config())) as server:
        yield server


def _run(tmp_path, *overrides):
    cfg = compose([*SHORT, *overrides], config_name="bench")
    ctx = SuiteContext(out_dir=tmp_path, overrides=(), progress=False)
    payload = run_suite(serve, "serve", lambda: serve.run(cfg, ctx), tmp_path, {}, "test")
    assert payload["status"] == "ok", payload.get("traceback")
    return payload


# --- the parts ---------------------------------------------------------------------------------


def test_arrivals_all_at_once_at_rate_inf_and_poisson_otherwise():
    assert arrival_times(4, math.inf, 1.0, 0) == [0.0] * 4
    times = arrival_times(4000, 8.0, 1.0, seed=3)
    assert times == arrival_times(4000, 8.0, 1.0, seed=3) != arrival_times(4000, 8.0, 1.0, seed=4)
    gaps = np.diff(times)
    assert times[0] == 0 and (gaps >= 0).all()
    assert np.mean(gaps) == pytest.approx(1 / 8, rel=0.1)
    # Exponential gaps have a coefficient of variation of 1; gamma's with shape k, 1/sqrt(k).
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)
    bursty = np.diff(arrival_times(4000, 8.0, 0.25, seed=3))
    assert np.mean(bursty) == pytest.approx(1 / 8, rel=0.15)
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.15)
    with pytest.raises(ValueError, match="bench.burstiness"):
        arrival_times(3, 1.0, 0.0, 0)


def test_lengths_follow_the_range_ratio():
    got = lengths(100, 0.25, 2000, random.Random(0), "random.input_len")
    assert min(got) == 75 and max(got) == 125
    assert lengths(7, 0.0, 5, random.Random(0), "x") == [7] * 5
    with pytest.raises(ValueError, match=r"bench\.dataset\.chat\.range_ratio"):
        lengths(7, 1.0, 5, random.Random(0), "chat.output_len")


def test_text_prompts_have_exactly_the_requested_token_count(tokenizer):
    vocab = WordVocabulary(tokenizer)
    rng = random.Random(1)
    for n in (1, 2, 17, 300, 2000):
        assert len(tokenizer.encode(vocab.text(n, rng))) == n


def test_datasets_are_seeded_and_chat_shares_its_system_prompt(tokenizer):
    opts = compose(["bench=serve", "bench.dataset.num_prompts=6", "bench.dataset.random.range_ratio=0.5"],
                   config_name="bench")
    dataset = serve.options(opts.bench)["dataset"]
    first, again = build(dataset, tokenizer), build(dataset, tokenizer)
    assert first == again and build(dataset | {"seed": 1}, tokenizer) != first
    assert [len(tokenizer.encode(r.prompt)) for r in first] == [r.prompt_tokens for r in first]
    assert len({r.prompt_tokens for r in first}) > 1 and all(64 <= r.prompt_tokens <= 192 for r in first)
    ids = build(dataset | {"random": dataset["random"] | {"prompt_format": "token_ids"}}, tokenizer)
    assert [len(r.prompt) for r in ids] == [r.prompt_tokens for r in ids]
    for fmt in ("text", "token_ids"):  # a shared prefix: every prompt starts with the same 40 tokens
        shared = build(dataset | {"random": dataset["random"] | {"prompt_format": fmt, "shared_prefix_len": 40}}, tokenizer)
        encoded = [tokenizer.encode(r.prompt) if fmt == "text" else r.prompt for r in shared]
        assert [len(e) for e in encoded] == [r.prompt_tokens for r in shared] == [r.prompt_tokens for r in first]
        assert len({tuple(e[:40]) for e in encoded}) == 1 and len({tuple(e[40:]) for e in encoded}) == len(shared)
    with pytest.raises(ValueError, match="shared_prefix_len"):
        build(dataset | {"random": dataset["random"] | {"shared_prefix_len": 200}}, tokenizer)
    chat = build(dataset | {"name": "chat"}, tokenizer)
    systems = {r.messages[0]["content"] for r in chat}
    assert len(systems) == 1 and len(tokenizer.encode(systems.pop())) == dataset["chat"]["system_prompt_len"]
    assert all([m["role"] for m in r.messages] == ["system"] + ["user", "assistant"] * 2 + ["user"] for r in chat)
    assert len({r.messages[-1]["content"] for r in chat}) == len(chat)


def _record(index, ttft, latency, chunks, out, prompt=10, error=None):
    return RequestRecord(index, 10, out, sent_s=0.0, ttft_s=ttft, latency_s=latency, chunk_s=chunks, prompt_tokens=prompt,
                         output_tokens=out, success=error is None, error=error)


def test_metrics_by_hand():
    records = [
        _record(0, 0.1, 0.5, [0.1, 0.2, 0.35, 0.5], 5),
        _record(1, 0.3, 1.3, [0.3, 0.8, 1.3], 3, prompt=11),
        _record(2, None, 0.01, [], None, error="HTTP 400: bad"),
        _record(3, None, 0.01, [], None, error="HTTP 400: bad"),
    ]
    m = summarize(records, 2.0, {"ttft_ms": 200.0, "tpot_ms": None, "e2el_ms": None})
    assert (m["requests"], m["completed"], m["failed"]) == (4, 2, 2)
    assert m["errors"] == [{"error": "HTTP 400: bad", "count": 2}]
    assert (m["request_throughput"], m["output_throughput"], m["input_throughput"], m["total_throughput"]) == (1.0, 4.0, 10.5, 14.5)
    assert m["ttft_ms"]["median"] == pytest.approx(200) and m["ttft_ms"]["p90"] == pytest.approx(280)
    assert sorted([m["tpot_ms"]["min"], m["tpot_ms"]["max"]]) == pytest.approx([100, 500])  # 400/4 and 1000/2 ms
    assert m["itl_ms"]["count"] == 5 and m["itl_ms"]["mean"] == pytest.approx((100 + 150 + 150 + 500 + 500) / 5)
    assert (m["good_requests"], m["goodput"]) == (1, 0.5)
    assert m["checks"]["prompt_tokens_as_expected"] == 1 and m["checks"]["prompt_tokens_unexpected"] == 1
    assert summarize(records, 2.0, {"ttft_ms": None})["goodput"] is None  # no SLO set: no goodput


@pytest.mark.parametrize("override, named", [
    ("bench.request_rates=[]", "bench.request_rates"), ("bench.max_concurrency=0", "bench.max_concurrency"),
    ("+bench.slo.ttl_ms=3", "bench.slo.ttl_ms"), ("bench.burstiness=0", "bench.burstiness"),
    ("bench.request_rates=[1,fast]", "bench.request_rates"),
])
def test_bad_options_name_the_option(override, named):
    with pytest.raises(ValueError, match=named):
        serve.options(compose(["bench=serve", override], config_name="bench").bench)


# --- against servers ---------------------------------------------------------------------------


def _check_run(run, dataset_totals, num_prompts):
    m = run["metrics"]
    assert (m["requests"], m["completed"], m["failed"]) == (num_prompts, num_prompts, 0), m["errors"]
    assert sorted(r["index"] for r in run["records"]) == list(range(num_prompts))
    # Every count is the server's usage, and equals what the dataset asked for.
    assert m["checks"]["prompt_tokens_as_expected"] == m["checks"]["output_tokens_as_asked"] == num_prompts
    assert m["input_tokens"] == dataset_totals["prompt_tokens"] and m["output_tokens"] == dataset_totals["output_tokens"]
    assert m["output_throughput"] * m["duration_s"] == pytest.approx(m["output_tokens"])
    # The server's own counter of generated tokens moved by exactly what usage reported.
    before, after = run["server_metrics"]["before"], run["server_metrics"]["after"]
    assert after["generated_tokens_total"] - before["generated_tokens_total"] == m["output_tokens"]
    for key in LATENCIES:
        d = m[key]
        assert d["min"] <= d["median"] <= d["p90"] <= d["p99"] <= d["max"] and d["min"] <= d["mean"] <= d["max"]
    assert m["itl_ms"]["count"] == sum(len(r["chunk_s"]) - 1 for r in run["records"])
    for r in run["records"]:
        assert 0 < r["ttft_s"] <= r["chunk_s"][-1] <= r["latency_s"] and r["finish_reason"] == "length"
        assert r["sent_s"] >= r["scheduled_s"]


def test_random_text_prompts_against_graphexec_serve(smollm2_server, tmp_path):
    payload = _run(tmp_path, f"bench.url={smollm2_server.url}", "bench.request_rates=[inf,50]",
                   "bench.max_concurrency=3", "bench.slo.ttft_ms=1e9")
    result = payload["result"]
    assert result["model"] == "smollm2-135m" and result["model_source"] == "/v1/models"
    assert not result["target"]["launched"] and [w["success"] for w in result["warmup"]] == [True]
    for run in result["runs"]:
        _check_run(run, result["dataset"]["totals"], 4)
        assert run["flush_cache"] == "flushed" and run["metrics"]["good_requests"] == 4
        in_flight = sorted([(r["sent_s"], 1) for r in run["records"]] + [(r["sent_s"] + r["latency_s"], -1) for r in run["records"]])
        assert max(np.cumsum([step for _, step in in_flight])) <= 3  # bench.max_concurrency
    assert payload["summary"]["output tok/s @inf"] > 0 and "goodput req/s @50/s" in payload["summary"]
    report = (tmp_path / "report.md").read_text()
    assert "| inf | 4/4 | 0 |" in report and "| 50/s | 4/4 | 0 |" in report
    for png in payload["plots"]:
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC


def test_chat_against_graphexec_serve_counts_the_template_and_reuses_the_system_prompt(smollm2_server, tmp_path):
    payload = _run(tmp_path, f"bench.url={smollm2_server.url}", "bench.dataset.name=chat", "bench.dataset.num_prompts=4",
                   "bench.dataset.chat.system_prompt_len=40", "bench.dataset.chat.turns=1", "bench.dataset.chat.user_len=8",
                   "bench.dataset.chat.assistant_len=8", "bench.dataset.chat.output_len=4", "bench.max_concurrency=1")
    run = payload["result"]["runs"][0]
    _check_run(run, payload["result"]["dataset"]["totals"], 4)
    # One at a time after a flush: every conversation but the first finds the shared system prompt cached.
    cached = sorted(r["cached_tokens"] for r in run["records"])
    assert cached[0] == 0 and all(c >= 40 for c in cached[1:])


def test_a_url_nobody_serves_is_recorded_as_failures(tmp_path):
    payload = _run(tmp_path, f"bench.url=http://127.0.0.1:{free_port()}", "bench.dataset.num_prompts=3")
    result = payload["result"]
    assert result["model_source"].startswith("model.name (/v1/models failed: ConnectError")
    m = result["runs"][0]["metrics"]
    assert (m["completed"], m["failed"]) == (0, 3) and m["errors"][0]["count"] == 3
    assert m["errors"][0]["error"].startswith("ConnectError") and m["ttft_ms"]["count"] == 0
    assert "**3 failed**: ConnectError" in (tmp_path / "report.md").read_text()
    assert result["options"]["request_rates"] == ["inf"] and "Infinity" not in json.dumps(result)  # strict JSON


@pytest.mark.slow  # a fresh graphexec-serve process: imports, model load, then the requests
def test_graphexec_bench_starts_graphexec_serve_passes_overrides_and_stops_it(tmp_path):
    cmd = [sys.executable, "-m", "bench.cli", *SHORT, "capture=eager", "bench.dataset.random.prompt_format=token_ids",
           "bench.server_overrides=['server.max_queued_requests=7']", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((tmp_path / "results.json").read_text())
    target, run = payload["result"]["target"], payload["result"]["runs"][0]
    assert target["launched"] and target["overrides"] == ["capture=eager", "server.max_queued_requests=7"]
    _check_run(run, payload["result"]["dataset"]["totals"], 4)
    metrics = run["server_metrics"]["after"]
    assert metrics["max_queued_requests"] == 7 and metrics["backends"]["decode"]["backend"] == "eager"
    with pytest.raises(ProcessLookupError):  # stopped (and reaped) before the suite returned
        os.kill(target["pid"], 0)
    assert (tmp_path / "server.log").is_file()


@pytest.mark.slow  # graphexec-serve's data-parallel front and two replicas on the tiny model
def test_serve_suite_at_dp_2_spreads_a_shared_prefix_over_both_replicas(tmp_path):
    """What `graphexec-bench dp` measured: one shared system prompt, 16 requests, 8 in flight."""
    cmd = [sys.executable, "-m", "bench.cli", "bench=serve", "model=tiny-llama", "capture=eager", "parallel.dp_size=2",
           "bench.progress=false", "bench.dataset.num_prompts=16", "bench.dataset.random.input_len=96",
           "bench.dataset.random.output_len=4", "bench.dataset.random.prompt_format=token_ids",
           "bench.dataset.random.shared_prefix_len=64", "bench.max_concurrency=8", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((tmp_path / "results.json").read_text())
    m = payload["result"]["runs"][0]["metrics"]
    assert (m["completed"], m["failed"]) == (16, 0), m["errors"]
    # Replica 0 or 1 holds the shared prefix, the other takes what exceeds the affinity slack (4).
    assert m["replicas"] == ["0", "1"] and m["cached_tokens"] > 0
    assert payload["summary"]["replicas used @inf"] == 2 and "replicas used 0, 1" in (tmp_path / "report.md").read_text()
    # bench.* options, `+` or not, are the suite's: the server gets the engine overrides only.
    assert payload["result"]["target"]["overrides"] == ["model=tiny-llama", "capture=eager", "parallel.dp_size=2"]
