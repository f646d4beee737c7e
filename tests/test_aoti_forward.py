"""The forward as AOTInductor packages (`compile.aoti`, capture/aoti_forward.py): built by the
capture process while the engine serves, loaded by a later start through torch's C++ loader
without importing Dynamo or inductor, the weights the live model's own; a damaged, foreign or
stale package is rejected with one warning and rebuilt; a forward that cannot be exported is
compiled by Dynamo instead; while a cold start's package compiles, the regional layer the capture
process builds first serves (`compile.interim_buckets`).  Tiny model; buckets 1, 2 and 4 share one package
whose row count is a Dim."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from capture import aoti_forward
from capture.aoti_forward import AotiForward, source_digest
from capture.artifacts import ArtifactStore
from graphexec import Engine, SamplingParams
from tests.test_capture_artifacts import PROMPTS, _greedy  # the same requests: B=1, 2 and 4 steps

PLAN = ["model=tiny-llama", "capture=auto", "capture.decode.buckets=[1,2,4]", "capture.decode.progress=false",
        "capture.decode.compile.aoti=true", "capture.decode.keep=all", "cache.num_slots=2048",
        "capture.background=true", "capture.idle_delay_s=0",
        "capture.decode.compile.interim_buckets=[1]"]  # one stand-in (a second: one more compile, nothing new)
PACKAGE = "capture.decode.forward.rows"  # every bucket's: its row count a Dim from 1 to 4
STAND_IN = "capture.decode.layer.b1"  # the regional layer for B=1


def _serve_until_captured(engine) -> tuple[list[list[list[int]]], list[str], list[int]]:
    """Greedy tokens while buckets are pending (the capture runs in the idle time between), until
    a capture process was seen stopped while a request was served, and once more as soon as a stand-in
    serves; then idle until the capture is done (serving all along would only stretch the compile:
    the process is stopped while we serve).  Also: the buckets on stand-ins during that request."""
    seen, child_states, on_stand_ins, deadline = [], [], [], time.monotonic() + 600
    while engine.runner.capture_pending() and time.monotonic() < deadline:
        states = engine.runner.backend_stats()["decode"]["buckets"]
        if not on_stand_ins and any(s["state"] == "interim" for s in states.values()):
            seen.append(_greedy(engine))
            on_stand_ins = [b for b, s in engine.runner.backend_stats()["decode"]["buckets"].items()
                            if s["state"] == "interim"]
        elif len(seen) < 2 or ("T" not in child_states and len(seen) < 6):
            seen.append(_greedy(engine))
            child_states += _capture_child_states_while_serving(engine)
            time.sleep(3.0)  # idle: the capture processes run only now
        else:
            time.sleep(0.1)
    assert not engine.runner.capture_pending(), "capture did not finish in 600 s"
    return seen, child_states, on_stand_ins


def _capture_child_states_while_serving(engine) -> list[str]:
    """The capture processes' states (/proc: T stopped, R/S running) once a request is being served."""
    states = []
    for _ in engine.stream([5, 6, 7], SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)):
        if not states:
            states = [state for _, state in _capture_children()]
    return states


def _capture_children() -> list[tuple[int, str]]:
    """(pid, state) of this process's capture_worker children."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"graphexec.engine.capture_worker" in cmdline:
            found.append((int(stat.parent.name), fields[0]))
    return found


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A plan directory whose packages a capture process compiled while the engine served."""
    cache_dir = tmp_path_factory.mktemp("plans")
    with Engine(overrides=[*PLAN, f"capture.cache_dir={cache_dir}"]) as engine:
        seen, child_states, on_stand_ins = _serve_until_captured(engine)
        tokens = _greedy(engine)
        stats = engine.runner.backend_stats()["decode"]
    return SimpleNamespace(cache_dir=cache_dir, stats=stats, tokens=tokens, seen=seen, child_states=child_states,
                           on_stand_ins=on_stand_ins, children_after=_capture_children())


def test_the_capture_process_builds_the_packages_and_the_engine_only_loads_them(built, tiny):
    stats = built.stats
    buckets = stats["buckets"]
    # B=1 first served from the regional layer the capture process built first (keep=all keeps it
    # untimed), then from the package that replaced it; the other buckets have no stand-in.
    assert built.on_stand_ins == [1] and [b for b in (1, 2, 4) if buckets[b]["interim"] is not None] == [1]
    assert buckets[1]["interim_after_s"] < buckets[1]["ready_after_s"]
    # Loaded: the stand-in and the package.
    assert (stats["aot_compiles"], stats["artifacts_saved"], stats["artifacts_loaded"]) == (0, 0, 2)
    assert all(buckets[b]["state"] == "ready" and buckets[b]["origin"] == "artifact" for b in (1, 2, 4))
    assert stats["executions"] > 0
    # One package for every bucket, built on bucket 1's batch (the capture order), traced on two rows.
    assert sorted(p.name for p in built.cache_dir.glob("*/capture.*.aot")) == [f"{PACKAGE}.aot", f"{STAND_IN}.aot"]
    # The weights stay out of a package: the tiny model's alone are ~1.3 MB of fp32.
    assert all(p.stat().st_size < 4 << 20 for p in built.cache_dir.glob("*/capture.*.aot"))
    # Stopped while a request was served; gone once the engine is.
    assert "T" in built.child_states and built.children_after == []
    assert built.seen and built.tokens == _greedy(tiny) and all(tokens == built.tokens for tokens in built.seen)


_FRESH = textwrap.dedent(r"""
    import json, sys
    from graphexec import Engine, SamplingParams
    with Engine(overrides=json.loads(sys.argv[1])) as engine:
        params, prompts = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True), json.loads(sys.argv[2])
        tokens = [engine.generate([p], params)[0].token_ids for p in prompts[:2]]
        tokens += [out.token_ids for n in (2, 4) for out in engine.generate(prompts[:n], params)]
        stats = engine.runner.backend_stats()["decode"]
    compiler = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
    print(json.dumps({"tokens": tokens, "stats": stats, "compiler": compiler}, default=str))
""")


def test_a_fresh_process_loads_the_packages_without_importing_the_compiler(built, tiny):
    overrides = [*PLAN, "capture.background=false", f"capture.cache_dir={built.cache_dir}"]
    result = subprocess.run([sys.executable, "-c", _FRESH, json.dumps(overrides), json.dumps(PROMPTS)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    stats = out["stats"]
    assert (stats["aot_compiles"], stats["artifacts_loaded"], stats["artifacts_rejected"]) == (0, 1, 0)
    assert all(stats["buckets"][b]["origin"] == "artifact" for b in "124") and stats["executions"] > 0
    # Neither Dynamo nor inductor was even imported: the C++ loader needs none of them.
    assert out["compiler"] == []
    assert out["tokens"] == built.tokens == _greedy(tiny)


def test_a_warm_background_start_loads_its_packages_at_once(built, tmp_path, tiny):
    """Packages load in milliseconds: the loop does not wait `idle_delay_s` for them (here an
    hour, so only that can have put them live).  A cold start, which would compile, still waits."""
    overrides = [*PLAN, "capture.idle_delay_s=3600"]
    with Engine(overrides=[*overrides, f"capture.cache_dir={tmp_path}"]) as cold:
        assert cold.runner.capture_pending() and not cold.runner.capture_only_loads()
    with Engine(overrides=[*overrides, f"capture.cache_dir={built.cache_dir}"]) as engine:
        deadline = time.monotonic() + 120
        while engine.runner.capture_pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = engine.runner.backend_stats()["decode"]
        assert not engine.runner.capture_pending() and stats["artifacts_loaded"] == 1
        assert all(stats["buckets"][b]["origin"] == "artifact" for b in (1, 2, 4))
        assert _greedy(engine) == built.tokens == _greedy(tiny)
        # So while capture processes build them, this process need not import the compiler either.
        assert not engine.runner.loads_need_compiler([("capture.decode", b) for b in (1, 2, 4)])


def _header_and_package(store: ArtifactStore) -> tuple[bytes, bytes]:
    return store.load_parts(PACKAGE, reject=lambda name, why: pytest.fail(f"{name} untrusted: {why}"))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "structure", "source", "other format"])
def test_a_damaged_foreign_or_stale_package_is_rebuilt_with_one_warning(built, tmp_path, caplog, monkeypatch, damage):
    shutil.copytree(built.cache_dir, tmp_path, dirs_exist_ok=True)
    (artifact,) = tmp_path.glob(f"*/{PACKAGE}.aot")
    store = ArtifactStore(artifact.parent, artifact.parent.name)
    header, package = _header_and_package(store)
    prefix, structure, sources = header.split(b" ")
    if damage == "truncate":
        artifact.write_bytes(artifact.read_bytes()[:-5000])
    elif damage == "garbage":  # a well-formed file of this key whose package the loader cannot open
        store.save(PACKAGE, header + b"\nnot a package")
    elif damage == "structure":  # compiled on other modules (an export records no guard to see it)
        store.save(PACKAGE, b" ".join([prefix, b"0" * 64, sources]) + b"\n" + package)
    elif damage == "source":  # compiled from model code that has since been edited
        store.save(PACKAGE, b" ".join([prefix, structure, b"0" * 64]) + b"\n" + package)
    else:  # aot_compile's format under this name
        store.save(PACKAGE, b"module-structure " + structure + b"\n" + package)
    # The rebuild's compile, without paying for one: it yields the package the capture process built.
    compiles = []
    monkeypatch.setattr(AotiForward, "_package", lambda self, *args: compiles.append(args[0]) or package)
    overrides = [*PLAN, "capture.background=false", f"capture.cache_dir={tmp_path}"]
    with caplog.at_level(logging.WARNING, logger="capture.artifacts"), Engine(overrides=overrides) as engine:
        assert _greedy(engine) == built.tokens
        stats = engine.runner.backend_stats()["decode"]
    assert compiles == [4]  # captured before serving: the largest bucket first
    assert (stats["artifacts_rejected"], stats["aot_compiles"], stats["artifacts_saved"], stats["artifacts_loaded"]) == (1, 1, 1, 0)
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 1 and f"{PACKAGE}.aot" in warnings[0]
    expected = {"truncate": "truncated", "garbage": "does not load", "structure": "modules it runs differ",
                "source": "source changed", "other format": "not an AOTInductor package"}[damage]
    assert expected in warnings[0]
    assert _header_and_package(store) == (header, package)  # rewritten as built


def test_a_forward_that_cannot_be_exported_is_compiled_by_dynamo(tmp_path, caplog, monkeypatch, tiny):
    def refuse(*args, **kwargs):
        raise NotImplementedError("cannot export this")

    monkeypatch.setattr(torch.export, "export", refuse)
    overrides = [*PLAN, "capture.decode.buckets=[1]", "capture.background=false", f"capture.cache_dir={tmp_path}"]
    with caplog.at_level(logging.WARNING, logger="capture.aoti_forward"), Engine(overrides=overrides) as engine:
        assert _greedy(engine) == _greedy(tiny)
        stats = engine.runner.backend_stats()["decode"]
    assert stats["buckets"][1]["origin"] == "dynamo" and (stats["aot_compiles"], stats["artifacts_saved"]) == (0, 0)
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "capture.aoti_forward"]
    assert "capture.decode.compile.aoti" in warning and "cannot export this" in warning
    assert not list(tmp_path.glob("*/capture.*.aot"))


@pytest.mark.parametrize("max_rows", [2, 3, 64])
def test_the_shared_package_spans_every_bucket(max_rows):
    """Exported on two rows (what AotiForward traces when the batch at hand has one: export fixes
    a dimension it sees at 1), the shared package takes every bucket from 1 up."""
    model = torch.nn.Linear(4, 4)
    dims = aoti_forward.row_dims(max_rows)
    x = torch.randn(max_rows, 4)
    program = torch.export.export(model, (x[:2],), dynamic_shapes=(dims[0],), strict=False)
    for rows in range(1, max_rows + 1):
        torch.testing.assert_close(program.module()(x[:rows]), model(x[:rows]))
    assert aoti_forward.row_dims(1) is None and aoti_forward.package_slot(1, True, 1) == 1  # bucket 1 alone: static


def test_the_source_digest_covers_every_file_beside_the_models_modules(tmp_path, monkeypatch):
    package = tmp_path / "fakemodels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "net.py").write_text("import torch\nclass Net(torch.nn.Module):\n    pass\n")
    (package / "helpers.py").write_text("def scale(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from fakemodels.net import Net

    model = torch.nn.Sequential(Net(), torch.nn.Linear(2, 2))
    before = source_digest(model)
    assert source_digest(model) == before
    (package / "helpers.py").write_text("def scale(x):\n    return x * 3\n")  # a helper the module calls
    assert source_digest(model) != before
    assert aoti_forward.source_digest(torch.nn.Linear(2, 2)) == aoti_forward.source_digest(torch.nn.ReLU())  # torch's own: none
