"""A warm start compiles nothing: full_graph's regions compiled ahead of time per bucket
(`compile.aot`), saved beside the capture plan and loaded by a later start with the same key; a
damaged, foreign or stale artifact is rejected with one warning and rebuilt (capture/artifacts.py,
capture/aot_region.py).  One engine builds the artifacts for the whole module (tiny model, bucket 1
the whole forward, bucket 2 the regional layer) before serving; the round trip runs in a fresh
process.  The capture process that compiles while the engine serves: tests/test_aoti_forward.py
(the default format; the process is the same for both)."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from capture import CaptureEnv, vec_isa
from capture.aot_region import _changed_source
from capture.artifacts import ArtifactStore, UntrustedArtifact
from capture.errors import CaptureConfigError
from capture.full_graph import FullGraphBackend
from capture.plan_store import PlanStore
from graphexec import Engine, SamplingParams
from graphexec.config import EngineConfig
from graphexec.runner.capture_key import capture_key

# Bucket 1 the whole forward; buckets 2 and 4 one regional layer with a symbolic row count (dynamic).
PLAN = ["model=tiny-llama", "capture=auto", "capture.decode.buckets=[1,2,4]", "capture.decode.progress=false",
        "capture.decode.compile.regional=true", "capture.decode.compile.whole_forward_buckets=[1]",
        "capture.background=false", "capture.decode.keep=all", "cache.num_slots=2048",
        "capture.decode.compile.aoti=false"]  # aot_compile's format (AOTInductor packages: test_aoti_forward.py)
ARTIFACT = "capture.decode.forward.b1.aot"  # the one the B=1 steps below run
ARTIFACTS = [ARTIFACT, "capture.decode.layer.rows.aot"]
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [7, 7, 7, 7], [90, 3, 60]]


def _greedy(engine) -> list[list[int]]:
    """Each of two prompts alone (B=1 decode steps), then two together (B=2) and four (B=4)."""
    engine.flush_cache()
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    alone = [engine.generate([p], params)[0].token_ids for p in PROMPTS[:2]]
    return alone + [out.token_ids for n in (2, 4) for out in engine.generate(PROMPTS[:n], params)]


# ---- the store -------------------------------------------------------------------------------------


def test_store_round_trip_and_absence(tmp_path):
    store = ArtifactStore(tmp_path, "k1")
    assert store.load("a") is None  # nothing stored: no warning either
    store.save("a", b"\x00payload\xff")
    assert ArtifactStore(tmp_path, "k1").load("a") == b"\x00payload\xff"


@pytest.mark.parametrize("damage", ["truncate", "flip", "other_key", "other_name", "raw"])
def test_store_distrusts_a_damaged_or_foreign_file(tmp_path, damage):
    store = ArtifactStore(tmp_path, "k1")
    store.save("a", b"x" * 1000)
    raw = store.path("a").read_bytes()
    if damage == "truncate":
        store.path("a").write_bytes(raw[:-10])
    elif damage == "flip":
        store.path("a").write_bytes(raw[:-1] + b"y")
    elif damage == "other_key":  # a consistent file of another key, placed under this key's folder
        other = ArtifactStore(tmp_path / "other", "k2")
        other.save("a", b"x" * 1000)
        store.path("a").write_bytes(other.path("a").read_bytes())
    elif damage == "other_name":  # another bucket's artifact under this one's name
        store.save("b", b"x" * 1000)
        store.path("a").write_bytes(store.path("b").read_bytes())
    else:  # torch's own file format, without our header
        store.path("a").write_bytes(b"\x80\x04" + b"x" * 100)
    with pytest.raises(UntrustedArtifact):
        store.load("a")


@pytest.mark.parametrize("record", ["absent", "other compiler", "no checks", "damaged"])
def test_isa_record_that_does_not_hold_leaves_the_probe_to_inductor(tmp_path, caplog, record):
    """Only a record naming this very compiler file is taken (the fresh-process test below shows one
    taken); these never touch inductor's per-process choice, so inductor probes as it always did."""
    store = ArtifactStore(tmp_path, "k")
    if record == "other compiler":
        store.save(vec_isa.NAME, json.dumps({"isas": ["avx2"], "compiler": ["/usr/bin/cc-7", 1, 2]}).encode())
    elif record == "no checks":  # an older record: the ISAs only, so the extensions' checks would run
        store.save(vec_isa.NAME, json.dumps({"isas": ["avx2"], "compiler": vec_isa._compiler()}).encode())
    elif record == "damaged":
        store.save(vec_isa.NAME, b"{}")
        store.path(vec_isa.NAME).write_bytes(store.path(vec_isa.NAME).read_bytes()[:-1])
    with caplog.at_level(logging.WARNING):
        assert vec_isa.IsaRecord(store)._holds() is False
    assert ("ignored" in caplog.text) == (record == "damaged")


def test_changed_source_names_the_edited_module():
    def fake(checksum):
        source = SimpleNamespace(module="capture.full_graph", firstlineno=1, lastlineno=3, checksum=checksum)
        return SimpleNamespace(source_info=lambda: SimpleNamespace(inlined_sources=[source]))

    import hashlib
    import inspect

    import capture.full_graph as module

    current = hashlib.sha256("".join(inspect.getsourcelines(module)[0][0:2]).encode()).hexdigest()
    assert _changed_source(fake(current)) is None
    assert _changed_source(fake("0" * 64)) == "capture.full_graph (lines 1-3)"


@pytest.mark.parametrize("option", ["freezing=true", "mode=max-autotune"])
def test_aot_refuses_what_it_cannot_persist(option):
    env = CaptureEnv(model=lambda *a, **k: None, device=torch.device("cpu"), padding=None, empty_batches={})
    name, value = option.split("=")
    value = {"true": True, "false": False}.get(value, value)
    compile_options = {"regional": True, "aot": True, name: value}
    with pytest.raises(CaptureConfigError, match=f"capture.decode.compile.aot=true needs capture.decode.compile.{name}="):
        FullGraphBackend(env, {"buckets": [1], "compile": compile_options})


def test_whole_forward_buckets_are_captured_after_the_regional_ones(tmp_path):
    env = CaptureEnv(model=lambda *a, **k: None, device=torch.device("cpu"), padding=None, empty_batches={})
    compile_options = {"regional": True, "whole_forward_buckets": [1, 8]}  # 8 is not a bucket here: ignored
    backend = FullGraphBackend(env, {"buckets": [1, 2, 4], "compile": compile_options | {"aot": True}})
    # A request waits for the bucket being compiled; the long one comes when the short ones are done.
    assert backend.pending_buckets() == [2, 4, 1]
    # Stored, it only loads: B=1 first again (a warm start).
    store = ArtifactStore(tmp_path, "k")
    store.save("capture.decode.forward.b1", b"compiled")
    backend.preset({}, store)
    assert backend.pending_buckets() == [1, 2, 4]
    recorded = FullGraphBackend(env, {"buckets": [1, 2, 4], "graph": "tape", "compile": compile_options})
    assert recorded.pending_buckets() == [1, 2, 4]  # a recording replays without per-layer calls
    with pytest.raises(CaptureConfigError, match=r"capture.decode.compile.whole_forward_buckets must hold integers"):
        FullGraphBackend(env, {"buckets": [1, 2, 4], "compile": compile_options | {"whole_forward_buckets": [0]}})


# ---- the engine -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A plan directory whose kept buckets' regions an engine compiled and saved before serving, and
    that engine's tokens."""
    cache_dir = tmp_path_factory.mktemp("plans")
    with Engine(overrides=[*PLAN, f"capture.cache_dir={cache_dir}"]) as engine:
        tokens = _greedy(engine)
        stats = engine.runner.backend_stats()["decode"]
    return SimpleNamespace(cache_dir=cache_dir, stats=stats, tokens=tokens)


def test_the_engine_compiles_and_saves_each_region_once(built, tiny):
    stats = built.stats
    assert (stats["aot_compiles"], stats["artifacts_saved"]) == (2, 2)
    assert all(stats["buckets"][b]["origin"] == "compiled" for b in (1, 2, 4)) and stats["executions"] > 0
    assert sorted(p.name for p in built.cache_dir.glob("*/capture.*.aot")) == ARTIFACTS
    # What inductor's ISA probe answered in that process, recorded for the next one (capture/vec_isa.py).
    (record,) = built.cache_dir.glob(f"*/{vec_isa.NAME}.aot")
    assert json.loads(ArtifactStore(record.parent, record.parent.name).load(vec_isa.NAME))["isas"]
    assert "checks" in json.loads(ArtifactStore(record.parent, record.parent.name).load(vec_isa.NAME))
    assert built.tokens == _greedy(tiny)


_FRESH = r"""
import json, sys
from torch._dynamo.utils import counters
from torch._inductor import cpu_vec_isa
isa_probes = []
check_build = cpu_vec_isa.VecISA.check_build
def counted(self, code):
    isa_probes.append(str(self))
    return check_build(self, code)
cpu_vec_isa.VecISA.check_build = counted
from capture.plan_store import PlanStore
from graphexec import Engine, SamplingParams
from graphexec.config import EngineConfig
from graphexec.runner.capture_key import capture_key
with Engine(overrides=json.loads(sys.argv[1])) as engine:
    params, prompts = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True), json.loads(sys.argv[2])
    tokens = [engine.generate([p], params)[0].token_ids for p in prompts[:2]]
    tokens += [out.token_ids for n in (2, 4) for out in engine.generate(prompts[:n], params)]
    stats = engine.runner.backend_stats()["decode"]
print(json.dumps({"tokens": tokens, "stats": stats, "dynamo": dict(counters["stats"]),
                  "aot_autograd": dict(counters["aot_autograd"]), "isa_probes": isa_probes}, default=str))
"""


def test_a_fresh_process_loads_the_artifact_and_compiles_nothing(built, tiny):
    overrides = [*PLAN, f"capture.cache_dir={built.cache_dir}"]
    result = subprocess.run(
        [sys.executable, "-c", _FRESH, json.dumps(overrides), json.dumps(PROMPTS)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    stats = out["stats"]
    # Buckets 2 and 4 share one artifact: two loads in all.
    assert (stats["aot_compiles"], stats["artifacts_loaded"], stats["artifacts_rejected"]) == (0, 2, 0)
    assert all(stats["buckets"][b]["origin"] == "artifact" for b in "124") and stats["executions"] > 0
    # Neither Dynamo nor AOTAutograd/inductor compiled a graph in that process.
    assert out["dynamo"].get("unique_graphs", 0) == 0 and out["aot_autograd"].get("total", 0) == 0
    assert out["tokens"] == built.tokens == _greedy(tiny)
    # The ISA record held (same CPU, same compiler file): inductor's per-ISA build-and-dlopen probe
    # never ran, nor did an extension's check (AVX-512 BF16, VNNI, AMX where the CPU has them).
    assert out["isa_probes"] == []


def _copy_plans(built, tmp_path):
    shutil.copytree(built.cache_dir, tmp_path, dirs_exist_ok=True)
    (artifact,) = tmp_path.glob(f"*/{ARTIFACT}")
    return artifact


@pytest.mark.parametrize("damage", ["truncate", "garbage", "structure", "foreign"])
def test_a_damaged_or_foreign_artifact_is_rebuilt_with_one_warning(built, tmp_path, caplog, damage):
    artifact = _copy_plans(built, tmp_path)
    overrides = [*PLAN, f"capture.cache_dir={tmp_path}"]
    store, name = ArtifactStore(artifact.parent, artifact.parent.name), ARTIFACT.removesuffix(".aot")
    structure, _, compiled = store.load(name).partition(b"\n")  # the modules compiled on, torch's bytes
    if damage == "truncate":
        artifact.write_bytes(artifact.read_bytes()[:-5000])
    elif damage == "garbage":  # a well-formed file of this key whose compiled function torch cannot load
        store.save(name, structure + b"\nnot a compiled function")
    elif damage == "structure":  # intact compiled code, recorded as compiled on other modules (no guard sees them)
        store.save(name, b"module-structure " + b"0" * 64 + b"\n" + compiled)
    else:  # the key changed (another option): the old key's artifact, copied into the new key's folder
        overrides.append("capture.decode.min_speedup=1.5")
        new_folder = PlanStore(tmp_path, capture_key(EngineConfig.from_overrides(overrides), 1, 0, "cpu")).path.parent
        assert new_folder != artifact.parent
        new_folder.mkdir()
        shutil.copy(artifact, new_folder / ARTIFACT)
    with caplog.at_level(logging.WARNING, logger="capture.artifacts"), Engine(overrides=overrides) as engine:
        assert _greedy(engine) == built.tokens
        stats = engine.runner.backend_stats()["decode"]
    # A foreign folder holds only the copied artifact: buckets 2 and 4's layer is compiled there too.
    compiled = 2 if damage == "foreign" else 1
    assert (stats["artifacts_rejected"], stats["aot_compiles"], stats["artifacts_saved"]) == (1, compiled, compiled)
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 1 and ARTIFACT in warnings[0]
    assert damage != "structure" or "modules it runs differ" in warnings[0]
    rebuilt = engine.runner.plan_path.parent / ARTIFACT
    assert ArtifactStore(rebuilt.parent, rebuilt.parent.name).load(ARTIFACT.removesuffix(".aot"))  # rewritten, trusted


def test_a_region_that_cannot_be_compiled_ahead_of_time_falls_back_to_dynamo(tmp_path, caplog, monkeypatch, built):
    """Guards torch cannot serialize (what an unserializable graph looks like to aot_compile): every
    bucket is compiled by Dynamo instead, with one warning per region, and serves the same tokens."""
    from capture import aot_region

    monkeypatch.setattr(aot_region, "_serializable_guards", lambda module_arg: lambda entries: [True] * len(entries))
    with caplog.at_level(logging.WARNING, logger="capture.aot_region"), Engine(overrides=[*PLAN, f"capture.cache_dir={tmp_path}"]) as engine:
        assert _greedy(engine) == built.tokens
        stats = engine.runner.backend_stats()["decode"]
    assert all(stats["buckets"][b]["origin"] == "dynamo" for b in (1, 2, 4))
    assert (stats["aot_compiles"], stats["artifacts_saved"]) == (0, 0)
    warned = [r.getMessage() for r in caplog.records if "cannot be compiled ahead of time" in r.getMessage()]
    assert len(warned) == 2 and any(".forward" in m for m in warned) and any(".layer" in m for m in warned)
    assert not list(tmp_path.glob("*/*.aot"))


def test_an_artifact_carries_no_guard_on_the_module_it_runs():
    """Rebuilding a whole forward's ~4,700 module guards was most of its load: the artifact keeps
    the guards on its other inputs, the key order of a module dict it iterates (loading rebuilds
    that source), and what torch can serialize; the module is checked by its stored structure."""
    from capture import aot_region

    def entry(name, guard_type="TENSOR_MATCH", is_global=False):
        return SimpleNamespace(name=name, guard_type=guard_type, is_global=is_global)

    entries = [entry("layer"), entry("layer._modules['mlp']._buffers['codes']"), entry("layer.tp", "TYPE_MATCH"),
               entry("layer._modules['layers']._modules", "DICT_KEYS_MATCH"), entry("x"), entry("layer_id", "TYPE_MATCH"),
               entry("rotary._buffers['cos_table']"), entry("", "GRAD_MODE", is_global=True)]
    keep = aot_region._serializable_guards("layer")(entries)
    assert [e.name for e, k in zip(entries, keep) if k] == [
        "layer._modules['layers']._modules", "x", "layer_id", "rotary._buffers['cos_table']"]


def test_a_layer_whose_guards_reject_a_later_layer_hands_the_bucket_to_dynamo(tmp_path, caplog, monkeypatch):
    """Under tensor parallelism layer 0's input is a collective's tensor subclass and the others'
    plain tensors: one ahead-of-time graph cannot serve both, so Dynamo takes over, nothing is saved."""
    from capture import aot_region
    from capture.backend import BackendStats

    class Compiled:  # what aot_compile returns, its guards holding for layer 0 only
        def guard_check(self, *args):
            return args[-1] == 0

        def __call__(self, *args):
            return "aot"

    monkeypatch.setattr(aot_region.AotRegion, "_compile", lambda self, bucket, args: Compiled())
    stats = BackendStats()
    layer = aot_region.AotRegion(lambda *a: None, {}, ArtifactStore(tmp_path, "k"), "capture.decode.layer", stats,
                                 fallback=lambda *args: "dynamo")
    x = torch.zeros(1, 4)
    same = torch.nn.Identity()
    with caplog.at_level(logging.WARNING, logger="capture.aot_region"):
        assert [layer(same, x, x, None, i) for i in (0, 1, 2)] == ["aot", "dynamo", "dynamo"]
        layer.trust(1)
    assert stats.origins[1] == "dynamo" and not list(tmp_path.iterdir())
    assert len([r for r in caplog.records if "guards reject layer 1" in r.getMessage()]) == 1


def test_buckets_above_one_share_one_region_with_a_symbolic_row_count(tmp_path, monkeypatch):
    """compile.dynamic: every bucket above 1 runs one compiled region (compiled on the first of
    them, its rows marked dynamic, saved once as `<region>.rows`); B=1 has its own."""
    from capture import aot_region
    from capture.backend import BackendStats

    class Compiled:  # what aot_compile returns: remembers the row count it was compiled on
        def __init__(self, rows):
            self.rows = rows

        def guard_check(self, *args):
            return True

        def disable_guard_check(self):
            pass

        def __call__(self, module, rows, *rest):
            return (self.rows, rows.shape[0])

        def save_compiled_function(self, path):
            Path(path).write_bytes(b"compiled for %d rows" % self.rows)

    marked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: SimpleNamespace(aot_compile=lambda a: Compiled(a[0][1].shape[0])))
    monkeypatch.setattr(torch._dynamo, "mark_dynamic", lambda t, dim: marked.append(("dynamic", tuple(t.shape))))
    monkeypatch.setattr(torch._dynamo, "mark_static", lambda t, dim: marked.append(("static", tuple(t.shape))))
    stats = BackendStats()
    region = aot_region.AotRegion(lambda *a: None, {}, ArtifactStore(tmp_path, "k"), "capture.decode.forward", stats,
                                  fallback=lambda *args: "dynamo", shared_rows=True)
    region._isa = SimpleNamespace(answered=contextlib.nullcontext, remember=lambda: None)  # no inductor here
    model, rope = torch.nn.Identity(), torch.zeros(100, 4)
    outs = []
    for bucket in (2, 4, 1, 2, 4):
        outs.append(region(model, torch.zeros(bucket, dtype=torch.long), rope))
        region.trust(bucket)
    # Two compiles (the shared region on bucket 2, B=1's own); bucket 4 runs bucket 2's.
    assert outs == [(2, 2), (2, 4), (1, 1), (2, 2), (2, 4)] and stats.aot_compiles == 2
    assert stats.origins == {1: "compiled", 2: "compiled", 4: "compiled"}
    # The shared region's rows are dynamic; the rotary table (not a row count long) and B=1's stay static.
    assert marked == [("dynamic", (2,)), ("static", (100, 4)), ("static", (1,)), ("static", (100, 4))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["capture.decode.forward.b1.aot", "capture.decode.forward.rows.aot"]
    assert stats.artifacts_saved == 2


def test_a_later_layer_built_differently_hands_the_bucket_to_dynamo(tmp_path, caplog, monkeypatch):
    """An artifact carries no module guards: a layer whose modules differ from the one it was
    compiled on (another weight type, another op choice) must not run it, even with its guards holding."""
    from capture import aot_region
    from capture.backend import BackendStats

    class Compiled:
        def guard_check(self, *args):
            return True

        def __call__(self, *args):
            return "aot"

    monkeypatch.setattr(aot_region.AotRegion, "_compile", lambda self, bucket, args: Compiled())
    layer = aot_region.AotRegion(lambda *a: None, {}, ArtifactStore(tmp_path, "k"), "capture.decode.layer", BackendStats(),
                                 fallback=lambda *args: "dynamo")
    x = torch.zeros(1, 4)
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)]
    with caplog.at_level(logging.WARNING, logger="capture.aot_region"):
        assert [layer(m, x, x, None, i) for i, m in enumerate(layers)] == ["aot", "aot", "dynamo"]
    assert len([r for r in caplog.records if "layer 2's modules differ" in r.getMessage()]) == 1
