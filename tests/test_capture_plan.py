"""Graphs that pay for themselves: each bucket timed against eager and kept only if faster, the
decisions stored under a key and honoured by the next start, background capture on the engine
loop that never changes a token (capture/measure.py, capture/plan_store.py,
graphexec/runner/capture_key.py, ModelRunner.capture_next, EngineLoop idle work)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest

from capture import bucketed
from capture.full_graph import FullGraphBackend
from capture.measure import BucketDecision, decide, time_interleaved
from capture.plan_store import PlanStore
from graphexec import Engine, SamplingParams
from graphexec.config import EngineConfig
from graphexec.runner import capture_key as capture_key_module
from graphexec.runner.capture_key import capture_key
from tests.invariants import assert_no_leak

# aot_compile's artifacts: a third of the packages' compile time, and the plan does not depend on
# the format (packages: tests/test_aoti_forward.py).
TINY = ["model=tiny-llama", "capture=auto", "capture.decode.buckets=[1,2]", "capture.decode.progress=false",
        "capture.decode.compile.aoti=false"]
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [7, 7, 7, 7, 7, 7, 7]]


# ---- measuring and deciding ----------------------------------------------------------------------


def test_decide_keeps_only_what_is_faster_by_the_margin():
    assert decide(eager_ms=10.0, graph_ms=5.0, min_speedup=1.05).kept
    assert decide(eager_ms=10.0, graph_ms=9.6, min_speedup=1.05).kept is False
    dropped = decide(eager_ms=10.0, graph_ms=12.0, min_speedup=1.05)
    assert (dropped.reason, round(dropped.speedup, 3)) == ("not faster", 0.833)


def test_time_interleaved_alternates_and_respects_its_budget():
    calls = []
    eager_ms, graph_ms = time_interleaved(lambda: calls.append("e"), lambda: (calls.append("g"), time.sleep(0.002)))
    assert calls[:4] == ["e", "g", "e", "g"]
    assert graph_ms > eager_ms
    calls.clear()
    # A side slower than the budget is still timed MIN_PAIRS times, and no more.
    time_interleaved(lambda: time.sleep(0.05), lambda: calls.append("g"), budget_s=0.01)
    assert len(calls) == 1 + 3


# ---- the plan on disk -------------------------------------------------------------------------------


def _decisions():
    return {"capture.decode": {1: BucketDecision(True, "faster", 10.0, 5.0), 2: BucketDecision(False, "not faster", 5.0, 6.0)}}


def test_plan_round_trip(tmp_path):
    store = PlanStore(tmp_path, {"model": "m", "n": 1})
    assert store.load() is None  # nothing stored yet: no warning either
    store.save(_decisions())
    assert PlanStore(tmp_path, {"n": 1, "model": "m"}).load() == _decisions()  # key order is irrelevant
    assert PlanStore(tmp_path, {"model": "m", "n": 2}).load() is None  # another key, another file


@pytest.mark.parametrize("damage", ["truncate", "tamper", "foreign", "not_json"])
def test_an_untrustworthy_plan_is_ignored_with_one_warning(tmp_path, caplog, damage):
    store = PlanStore(tmp_path, {"model": "m"})
    store.save(_decisions())
    text = store.path.read_text()
    if damage == "truncate":
        store.path.write_text(text[: len(text) // 2])
    elif damage == "not_json":
        store.path.write_bytes(b"\x00\xff" * 100)
    elif damage == "tamper":
        store.path.write_text(text.replace('"kept": false', '"kept": true'))
    else:  # a consistent file of another key, placed under this key's name
        other = PlanStore(tmp_path / "other", {"model": "another"})
        other.save(_decisions())
        store.path.write_text(other.path.read_text())
    with caplog.at_level(logging.WARNING, logger="capture.plan_store"):
        assert store.load() is None
    assert len([r for r in caplog.records if "ignored" in r.getMessage()]) == 1
    store.save(_decisions())  # the rebuild overwrites it
    assert store.load() == _decisions()


def test_each_part_of_the_key_invalidates(tmp_path, monkeypatch):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + b"\x00" * 64)

    def key(*overrides):
        config = EngineConfig.from_overrides(["model=smollm2-135m", f"model.path={model}", *overrides])
        return capture_key(config, 1, 0, "cpu")

    base = key()
    assert key() == base
    assert key("capture.decode.progress=false") == base  # cosmetic
    assert key("capture.decode.min_speedup=1.2") != base
    assert key("capture.decode.buckets=[1,2]") != base
    assert key("model.dtype=bf16") != base
    model.write_bytes(b"GGUF" + b"\x00" * 65)  # another file at the same path
    changed_file = key()
    assert changed_file != base
    monkeypatch.setattr(capture_key_module, "_version", lambda package: "0.0-other")
    assert key() != changed_file


# ---- the engine: measured plans, stored and honoured -------------------------------------------------


@pytest.fixture
def slow_bucket_two(monkeypatch):
    """Bucket 2's graph made slower than eager on purpose (an injected delay).  The delay wraps
    what runs the captured bucket, not the forward it captures: a tape (like a CUDA graph) replays
    the recorded ops only, never the Python around them."""
    real = FullGraphBackend._make_runner

    def slowed(self, bucket, batch):
        runner = real(self, bucket, batch)
        if bucket != 2:
            return runner

        def run(fb):
            time.sleep(0.03)
            return runner(fb)

        return run

    monkeypatch.setattr(FullGraphBackend, "_make_runner", slowed)


def _greedy(engine):
    engine.flush_cache()
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    seeded = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=6, temperature=0.9, seed=11))
    alone = engine.generate(PROMPTS[2:], SamplingParams(max_new_tokens=6, temperature=0.9, seed=5))  # B=1
    return [o.token_ids for o in outs + seeded + alone]


def test_auto_drops_a_slow_graph_keeps_a_fast_one_and_the_next_start_honours_it(tmp_path, slow_bucket_two, monkeypatch):
    # The op tape: the decision and its record are the same whatever the mechanism, and a tape is
    # captured in milliseconds where a compile takes a minute (test_capture_artifacts keeps the compiled side).
    overrides = [*TINY, "capture.background=false", f"capture.cache_dir={tmp_path}", "capture.decode.min_speedup=0.2",
                 "capture.decode.graph=tape"]
    with Engine(overrides=overrides) as engine:
        buckets = engine.runner.backend_stats()["decode"]["buckets"]
        assert buckets[1]["state"] == "ready" and buckets[1]["kept"] and buckets[1]["reason"] == "faster"
        assert buckets[2]["state"] == "dropped" and buckets[2]["reason"] == "not faster"
        assert buckets[2]["graph_ms"] > buckets[2]["eager_ms"]
        _assert_reported_by_the_server(engine)
        first = _greedy(engine)
        assert_no_leak(engine)
    with Engine(overrides=["model=tiny-llama", "capture=eager"]) as eager:
        assert _greedy(eager) == first
    (plan,) = tmp_path.glob("*/plan.json")
    stored = json.loads(plan.read_text())["backends"]["capture.decode"]
    assert (stored["1"]["kept"], stored["2"]["kept"]) == (True, False)

    # The next start measures nothing and never compiles the dropped bucket.
    def no_timing(*args, **kwargs):
        raise AssertionError("a stored decision was measured again")

    monkeypatch.setattr(bucketed, "time_interleaved", no_timing)
    with Engine(overrides=overrides) as again:
        stats = again.runner.backend_stats()["decode"]
        assert set(stats["capture_seconds"]) == {1}
        assert stats["buckets"][2]["state"] == "dropped" and stats["buckets"][1]["state"] == "ready"
        assert _greedy(again) == first
        assert again.runner.backend_stats()["decode"]["executions"] > 0  # B=1 steps ran the graph


def test_a_corrupt_plan_is_rebuilt_with_one_warning_and_the_same_tokens(tmp_path, caplog):
    overrides = [*TINY, "capture.background=false", f"capture.cache_dir={tmp_path}", "capture.decode.keep=all",
                 "capture.decode.graph=tape"]  # the plan's file, whatever the mechanism (as above)
    with Engine(overrides=overrides) as engine:
        first = _greedy(engine)
    (plan,) = tmp_path.glob("*/plan.json")
    plan.write_text(plan.read_text()[:40])
    with caplog.at_level(logging.WARNING, logger="capture.plan_store"), Engine(overrides=overrides) as engine:
        assert _greedy(engine) == first
        assert engine.runner.backend_stats()["decode"]["buckets"][1]["state"] == "ready"
    assert len([r for r in caplog.records if "ignored" in r.getMessage()]) == 1
    assert json.loads(plan.read_text())["backends"]["capture.decode"]["1"]["kept"] is True


# ---- background capture ---------------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", ["compile", "tape"])
def test_background_capture_swaps_graphs_in_between_requests_without_changing_a_token(tmp_path, mechanism):
    common = [*TINY, "capture.decode.keep=all", f"capture.decode.graph={mechanism}", "capture.cache_dir=null",
              "capture.decode.compile.regional=true"]  # one layer compiled, not the whole forward: the swap is the point
    with Engine(overrides=[*common, "capture.background=false"]) as ahead:
        expected = _greedy(ahead)
    with Engine(overrides=[*common, "capture.background=true", "capture.idle_delay_s=0"]) as engine:
        seen = []
        # Requests from the start: the first runs eager while nothing is captured yet; between
        # requests the loop captures a bucket and the next ones replay it.
        deadline = time.monotonic() + 120
        while True:
            seen.append(_greedy(engine))
            assert_no_leak(engine)
            if not engine.runner.capture_pending() or time.monotonic() > deadline:
                break
        seen.append(_greedy(engine))
        stats = engine.runner.backend_stats()["decode"]
        assert {b: s["state"] for b, s in stats["buckets"].items()} == {1: "ready", 2: "ready"}
        assert stats["executions"] > 0
        assert all(tokens == expected for tokens in seen)
        assert len(seen) >= 2


def test_a_request_right_after_start_is_served_before_any_capture(tmp_path):
    with Engine(overrides=[*TINY, "capture.background=true", "capture.idle_delay_s=30", "capture.cache_dir=null"]) as engine:
        t0 = time.perf_counter()
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, temperature=0.0))
        assert engine.runner.capture_pending()  # nothing was captured in its way
        stats = engine.runner.backend_stats()["decode"]
        assert {s["state"] for s in stats["buckets"].values()} == {"pending"}
        assert stats["fallbacks"] > 0  # served eagerly
        assert time.perf_counter() - t0 < 5



_IMPORTS = r"""
import json, sys
from graphexec import Engine, SamplingParams
with Engine(overrides=json.loads(sys.argv[1])) as engine:
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0.0))
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))))
"""


@pytest.mark.parametrize("plan", [["capture=eager"], ["capture=auto", "capture.idle_delay_s=1000", "capture.cache_dir=null"]])
def test_serving_eagerly_never_imports_the_compiler(plan):
    """Importing Dynamo and inductor costs ~3.5 s of a 2-core start: an eager engine, and an auto
    engine before its first background capture, load and serve without them."""
    overrides = ["model=tiny-llama", *plan]
    result = subprocess.run([sys.executable, "-c", _IMPORTS, json.dumps(overrides)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def _assert_reported_by_the_server(engine):
    """Bucket 1 ready, bucket 2 dropped (slower than eager), in /metrics and /metrics/json."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from graphexec.server.app import create_app
    from tests.helpers import ServerThread, server_config

    with ServerThread(create_app(engine, server_config())) as server, httpx.Client(timeout=30) as http:
        text = http.get(f"{server.url}/metrics").text
        as_json = http.get(f"{server.url}/metrics/json").json()
    samples = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]
    state = {(lb["bucket"], lb["state"]): v for name, lb, v in samples if name == "graphexec_capture_bucket_state"}
    assert state[("1", "ready")] == 1 and state[("1", "pending")] == 0
    assert state[("2", "dropped")] == 1 and state[("2", "ready")] == 0
    speedup = {lb["bucket"]: v for name, lb, v in samples if name == "graphexec_capture_bucket_speedup"}
    assert speedup["2"] < 0.2 < speedup["1"]
    decode = as_json["backends"]["decode"]["buckets"]
    assert decode["1"]["state"] == "ready" and decode["2"]["state"] == "dropped" and decode["2"]["reason"] == "not faster"


# ---- stand-ins (compile.interim_buckets) ------------------------------------------------------------


class _StandIns(FullGraphBackend):
    """full_graph whose graphs another process builds (`graph_stored` says when one is there) and
    whose stand-ins are stored: bucket 1's as fast as eager, bucket 2's slowed on purpose, bucket
    4's failing to load.  Graph and stand-ins run the eager forward (the core under test decides,
    the code that runs is not the point), so the keep threshold is far below 1: timing the same
    forward against itself under three test workers on two cores measured under 0.5."""

    graph_stored = False

    def builds_apart(self, bucket):
        return not self.graph_stored

    def _interim_possible(self, bucket):
        return True

    def _interim_stored(self, bucket):
        return True

    def _make_interim_runner(self, bucket, batch):
        if bucket == 4:
            raise RuntimeError("no such artifact")

        def run(fb):
            if bucket == 2:
                time.sleep(0.2)  # ~100x the tiny model's forward: slower beyond any noise
            return self._run_model(fb)

        return run

    def _make_runner(self, bucket, batch):
        return self._run_model


def test_a_stand_in_serves_only_if_faster_and_the_graph_replaces_it_and_alone_is_decided(caplog):
    with Engine(overrides=["model=tiny-llama", "capture=eager"]) as engine:
        runner = engine.runner
        backend = _StandIns(runner.capture_env, {"buckets": [1, 2, 4], "graph": "compile", "keep": "faster",
                                                 "min_speedup": 0.05, "progress": False})

        def capture(bucket):
            batch = backend.dummy_batch(bucket)
            with runner._forward_scope(batch):
                backend.capture_bucket(bucket, batch)

        assert backend.interims_to_build() == []  # every stand-in stored already: counted as built
        assert all(backend.interim_waiting(b) for b in (1, 2, 4))
        with caplog.at_level(logging.WARNING, logger="capture.bucketed"):
            for bucket in (1, 2, 4):
                capture(bucket)
        states = backend.stats.states
        assert states == {1: "interim", 2: "pending", 4: "pending"}
        assert backend.stats.interim_decisions[1].kept and not backend.stats.interim_decisions[2].kept
        assert 4 not in backend.stats.interim_decisions
        assert [r.getMessage() for r in caplog.records] == [
            "capture.decode bucket 4: its stand-in failed (RuntimeError('no such artifact')); "
            "it runs eager until its graph is built"]
        # Still pending (their graphs are owed), each stand-in tried once, none decided for the plan.
        assert backend.pending_buckets() == [1, 2, 4] and not any(backend.interim_waiting(b) for b in (1, 2, 4))
        assert backend.stats.decisions == {}
        fb = backend.dummy_batch(1)
        assert backend.can_run(fb) and not backend.can_run(backend.dummy_batch(2))
        # The graphs arrive: each bucket is captured again, timed on its own and decided.
        backend.graph_stored = True
        for bucket in (1, 2, 4):
            capture(bucket)
        assert backend.pending_buckets() == [] and set(states.values()) == {"ready"}
        assert set(backend.stats.decisions) == {1, 2, 4} and all(d.kept for d in backend.stats.decisions.values())
        assert backend.stats.interim_after_seconds[1] < backend.stats.ready_after_seconds[1]
