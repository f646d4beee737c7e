"""Typed capture options: each option is checked once and named when wrong, reaches its backend,
and is documented in docs/CAPTURE_OPTIONS.md, which is generated from the same source."""

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from capture import BackendStats, CaptureConfigError, Phase
from capture.full_graph import FullGraphBackend
from capture.inductor_cache import inductor_cache_dir
from capture.option_docs import describe_options
from capture.option_parser import options_for
from capture.options import OPTIONS, CompileOptions, FullGraphOptions, TcPiecewiseOptions
from capture.registry import available_backends, backend_class
from graphexec import Engine, SamplingParams
from tests.helpers import recorded_batches

CPU = torch.device("cpu")
TINY = ["model=tiny-llama", "cache.num_slots=1024"]
ATTENTION = "graphexec::attention"
DOC = Path(__file__).resolve().parent.parent / "docs" / "CAPTURE_OPTIONS.md"


def _options(backend, values, device=CPU):
    return options_for(backend, values, "capture.x", device=device)


def test_the_committed_reference_is_the_generated_one():
    """Regenerate with `python -m capture.option_docs > docs/CAPTURE_OPTIONS.md`."""
    assert DOC.read_text() == describe_options()


def test_every_backend_has_documented_options():
    assert set(available_backends()) == {*OPTIONS, "piecewise"}
    assert all(backend_class(name).options_type is cls for name, cls in OPTIONS.items())
    rows = [line for line in describe_options().splitlines() if line.startswith("| `")]
    assert len(rows) > 30 and not [row for row in rows if row.endswith("|  |")]  # each with its docstring


@pytest.mark.parametrize("backend", ["full_graph", "breakable", "tc_piecewise", "piecewise"])
def test_a_typo_is_refused_naming_it(backend):
    with pytest.raises(CaptureConfigError, match=r"capture\.x\.bukets is not a \w+ option; known: \[.*'buckets'"):
        _options(backend, {"buckets": [1], "bukets": [2]})


def test_a_nested_typo_and_a_bad_value_name_their_full_path():
    with pytest.raises(CaptureConfigError, match=r"capture\.x\.compile\.fast is unknown"):
        _options("full_graph", {"buckets": [1], "compile": {"fast": True}})
    with pytest.raises(CaptureConfigError, match=r"capture\.x\.compile\.regional must be true or false, got 'yes'"):
        _options("full_graph", {"buckets": [1], "compile": {"regional": "yes"}})
    with pytest.raises(CaptureConfigError, match=r"capture\.x\.compile\.mode='max-autotune' cannot be combined with"):
        _options("full_graph", {"buckets": [1], "compile": {"mode": "max-autotune", "cpp_wrapper": True}})
    with pytest.raises(CaptureConfigError, match=r"capture\.x\.buckets must be a non-empty list of sizes, got \[\]"):
        _options("breakable", {})


def test_every_given_value_reaches_the_typed_options():
    compile = {
        "enabled": True, "mode": "default", "dynamic": True, "freezing": True, "cache_dir": "/tmp/ind",
        "regional": True, "skip_module_guards": True, "cpp_wrapper": True, "aot": False,
    }
    common = {
        "buckets": [2, 8], "graph": "eager", "lazy": True, "progress": False, "max_padding": 0.5, "keep": "faster",
        "min_speedup": 1.5,
    }
    decode = _options("full_graph", common | {"compile": compile})
    assert decode == FullGraphOptions(**(common | {"buckets": (2, 8), "compile": CompileOptions(**compile)}))
    extend = _options("piecewise", common | {"variant": "tc_piecewise", "compiler": "eager", "split_ops": [ATTENTION]})
    assert extend == TcPiecewiseOptions(**(common | {"buckets": (2, 8), "compiler": "eager", "split_ops": (ATTENTION,)}))
    # What is not given keeps the documented default (decode pads freely, prefill up to 5 %).
    assert _options("full_graph", {"buckets": [1]}).max_padding == 1.0
    assert _options("piecewise", {"buckets": [1]}).max_padding == 0.05


def test_auto_variant_follows_the_device_and_eager_ignores_graph_options():
    assert _options("piecewise", {"buckets": [16]}).backend == "tc_piecewise"
    assert _options("piecewise", {"buckets": [16], "variant": "auto"}, torch.device("cuda")).backend == "breakable"
    # `capture.<mode>.backend=eager` keeps the mode's graph options without complaint.
    assert _options("eager", {"buckets": [16], "graph": "compile"}).backend == "eager"


@pytest.fixture(scope="module")
def engine():
    return Engine(overrides=TINY + ["capture=eager"])


def _batch(rows):
    return dataclasses.make_dataclass("Batch", ["phase", "batch_size"])(Phase.ROWS, rows)


def test_options_reach_the_backend_and_it_counts_its_own_fallbacks(engine):
    options = _options("full_graph", {"buckets": [2, 8], "graph": "eager", "lazy": True, "max_padding": 0.5})
    backend = FullGraphBackend(engine.runner.capture_env, options)
    assert backend.mechanism == "eager" and backend.pending_buckets() == []  # lazy: nothing captured ahead
    assert [backend.takes(_batch(n)) for n in (1, 2, 3, 5, 9)] == [True, True, False, True, False]
    assert backend.stats.fallbacks == 2 and backend.stats.as_dict()["fallbacks"] == 2  # 3 (62 % padding) and 9
    assert backend.can_run(_batch(9)) is False and backend.stats.fallbacks == 2  # asking is not counting


def test_the_runner_leaves_fallback_counting_to_the_backend():
    served = Engine(overrides=TINY + ["capture=eager", "+capture.decode={backend:full_graph,buckets:[1],graph:eager,progress:false}"])
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 5)]
    with recorded_batches(served) as batches:
        served.generate([[5, 6, 7], [8, 9]], params)
    sizes = [fb.batch_size for fb in batches if fb.forward_mode.is_decode()]
    stats = served.runner.backend_stats()["decode"]
    assert {1, 2} <= set(sizes) and (stats["fallbacks"], stats["executions"]) == (sizes.count(2), sizes.count(1))


def test_inductor_cache_dir_is_set_only_around_a_bucket_compile(engine, tmp_path, monkeypatch):
    """TORCHINDUCTOR_CACHE_DIR, which inductor reads, holds compile.cache_dir while a bucket is made
    and is given back as it was: the process environment is otherwise left alone."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    env, seen = engine.runner.capture_env, []

    def model(input_ids, positions, **kwargs):
        seen.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
        return env.model(input_ids, positions, **kwargs)

    options = {"buckets": [1], "graph": "tape", "progress": False, "compile": {"cache_dir": str(tmp_path)}}
    backend = FullGraphBackend(dataclasses.replace(env, model=model), _options("full_graph", options))
    engine.runner.capture_backend(backend)  # the tape runs the forward while recording it
    assert seen and set(seen) == {str(tmp_path)} and os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"
    with pytest.raises(KeyError), inductor_cache_dir(str(tmp_path)):
        raise KeyError  # restored on the way out of a failure too
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    with inductor_cache_dir("~/ind"):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.expanduser("~/ind")
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_counters_as_reported_keep_their_keys():
    keys = set(BackendStats().as_dict())
    assert {"executions", "fallbacks", "padded_rows", "capture_seconds", "capture_bytes", "buckets", "aot_compiles"} <= keys
