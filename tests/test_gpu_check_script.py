"""scripts/gpu_check.sh and what it carries, checked where there is no GPU: the wheel list covers
what the GPU path imports beyond the image's packages, the script's step caps fit one device call,
at most 8 files come back, the goal verdicts read the parts right, and (opt-in, GRAPHEXEC_GPU_REHEARSAL=1:
no device has been lent for a while and it costs ~50 s of the suite) the parts and the whole script
run end to end as a CPU rehearsal."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"
CALL_LIMIT_S = 480  # the timeout_s docs/GPU.md gives the device call
MAX_FILES_BACK = 8  # the device tool returns at most this many files from $OUT
# What the GPU path runs: the runtime, the capture library and the bench modules gpu_check uses.
GPU_PATH = ["graphexec", "capture", "bench/gpu_check.py", "bench/decode.py", "bench/prefill.py", "bench/timing.py",
            "bench/workers.py", "bench/stats.py", "bench/tables.py", "bench/cli.py"]
LOCAL = {"graphexec", "capture", "bench", "tests"}
# Imported only by features the check does not run, and neither in the image nor carried.
NOT_CARRIED = {
    "torch_tensorrt": "capture.extend.compiler=tensorrt only",
    "llguidance": "structured output, imported on the first constrained request",
}
# Imported when present by packages that run fine without them (not graphexec's imports).
OPTIONAL_ELSEWHERE = {"dill", "jaraco-context", "jaraco-functools", "jaraco-text", "backports-tarfile", "more-itertools"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _listed(path: Path) -> dict[str, str | None]:
    """Distribution -> pinned version (None when unpinned) of a package list file."""
    found = {}
    for line in path.read_text().splitlines():
        spec = line.split("#")[0].strip()
        if spec:
            name, _, version = spec.partition("==")
            found[_norm(name)] = version or None
    return found


WHEELS = _listed(REPO / "scripts" / "gpu_wheels.txt")
IMAGE = _listed(REPO / "scripts" / "gpu_image_packages.txt")


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def _uncovered(distributions) -> list[str]:
    return sorted(d for d in map(_norm, distributions)
                  if d not in WHEELS and d not in IMAGE and d not in OPTIONAL_ELSEWHERE and d != "graphexec")


def test_the_wheel_list_covers_every_import_of_the_gpu_path_the_image_lacks():
    files = [p for entry in GPU_PATH for p in ([REPO / entry] if entry.endswith(".py") else (REPO / entry).rglob("*.py"))]
    modules = set().union(*map(_top_level_imports, files)) - set(sys.stdlib_module_names) - LOCAL
    by_module = importlib.metadata.packages_distributions()
    unknown = sorted(m for m in modules if m not in by_module and m not in NOT_CARRIED)
    assert not unknown, f"imported but not installed here, so not checkable: {unknown}"
    distributions = {d for m in modules - set(NOT_CARRIED) for d in by_module[m]}
    assert not _uncovered(distributions), "add these to scripts/gpu_wheels.txt"
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime"} <= set(WHEELS)  # what every Engine composes with


def test_wheels_are_pinned_once_each_and_not_in_the_image():
    # One version per name: two stop the whole --no-index install.
    names = [_norm(line.split("==")[0]) for line in (REPO / "scripts" / "gpu_wheels.txt").read_text().splitlines()
             if line.split("#")[0].strip()]
    assert len(names) == len(set(names))
    unpinned = [name for name, version in WHEELS.items() if version is None]
    assert not unpinned, "pin these in scripts/gpu_wheels.txt (the versions .venv resolves)"
    # Carrying a package the image has only overrides it; the one deliberate case is documented.
    assert set(WHEELS) & set(IMAGE) == {"typing-extensions"}


def test_step_caps_sum_to_the_budget_and_fit_one_call():
    caps = {name: v for name, v in re.findall(r"^(\w+)=(\d+)", SCRIPT.read_text(), re.M) if name.startswith("CAP_")}
    budget = int(re.search(r"^BUDGET_S=(\d+)", SCRIPT.read_text(), re.M)[1])
    assert sum(map(int, caps.values())) <= budget < CALL_LIMIT_S
    # Every step runs under one of them.
    steps = re.findall(r'^step "\$(\w+)"', SCRIPT.read_text(), re.M)
    assert set(steps) - {"pytest_cap"} <= set(caps) and len(steps) == 7
    # The capture part runs one process per variant inside its cap.
    assert sum(gpu_check.GPU.variant_timeout_s.values()) < int(caps["CAP_CAPTURE"])


def test_at_most_eight_files_come_back():
    names = set(re.findall(r'\$out/([\w.-]+)', SCRIPT.read_text()))
    assert names == {"device.txt", "pytest.txt", "gpu_check.json", "summary.txt", "gpu_check.log"}
    assert len(names) <= MAX_FILES_BACK


# -- the verdicts -------------------------------------------------------------------------------


def _result(speedup_b1=6.0, breakable=(1.0, 2.0), tc=(4.0, 8.0), parity_ok=True) -> dict:
    timings = {"median_ms": 1.0}
    row = {"dtype": "float32", "phase": "decode", "bucket": 1, "rel_diff": 1e-6, "tolerance": 2e-3,
           "argmax_agree": 1.0, "ok": parity_ok}
    return {
        "rehearsal": False,
        "environment": {"device": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "python": "3.12.3"},
        "parity": {"rows": [row], "ok": parity_ok, "seconds": 1.0},
        "decode_graph": {"buckets": [{"bucket": 1, "speedup": speedup_b1, "eager": timings,
                                      "full_graph": {"median_ms": 1.0 / speedup_b1}}], "seconds": 1.0},
        "capture": {"variants": {
            "breakable": {"capture_seconds": {"64": breakable[0], "256": breakable[1]}},
            "tc_piecewise": {"capture_seconds": {"64": tc[0], "256": tc[1]}},
        }, "seconds": 1.0},
    }


def test_verdicts_pass_and_fail_on_the_goals():
    passing = gpu_check.verdicts(_result())
    assert [line.split(": ")[1].split(" ")[0] for line in passing] == ["PASS", "PASS", "PASS"]
    assert "(4.00x;" in passing[1]  # (4 + 8) / (1 + 2)
    failing = gpu_check.verdicts(_result(speedup_b1=4.9, tc=(2.0, 6.0), parity_ok=False))
    assert [line.split(": ")[1].split(" ")[0] for line in failing] == ["FAIL", "FAIL", "FAIL"]


def test_a_missing_part_is_not_measured_and_named_in_the_summary(tmp_path):
    result = _result()
    result["capture"] = {"error": "no output: killed by its timeout or crashed (see gpu_check.log)"}
    result["capture"]["variants"] = {}
    del result["decode_graph"]["buckets"][0]
    text = gpu_check.summary_text(result, tmp_path / "absent.txt")
    assert "decode graph >= 5x eager at B=1: NOT MEASURED" in text
    assert "breakable capture >= 3x faster than tc_piecewise: NOT MEASURED (no output" in text
    assert "capture: ERROR no output" in text and "pytest -m gpu: no output" in text


def test_merge_reports_a_part_that_never_wrote(tmp_path):
    (tmp_path / "parity.json").write_text(json.dumps({"rows": [], "ok": True, "seconds": 1.0}))
    merged = gpu_check.merge(tmp_path, rehearse=True)
    assert merged["parity"]["ok"] is True
    assert "no output" in merged["decode_graph"]["error"] and "no output" in merged["capture"]["error"]


# -- rehearsals on the CPU ----------------------------------------------------------------------


def _rehearsal_env() -> dict[str, str]:
    return os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("GRAPHEXEC_GPU_REHEARSAL"),
    reason="the whole script on the CPU (~50 s): set GRAPHEXEC_GPU_REHEARSAL=1 before a device call "
    "or after changing scripts/gpu_check.sh or bench/gpu_check.py (docs/GPU.md)",
)
def test_the_script_rehearses_every_part_within_its_budget(tmp_path):
    """The whole script on the CPU, without wheels to install (this venv has everything): every
    part runs, and imports only packages the image has or the wheels carry."""
    out = tmp_path / "out"
    env = _rehearsal_env() | {"OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_REHEARSE": "1",
                              "GPU_WHEELS_DIR": str(tmp_path / "none"), "GPU_CHECK_SITE": str(tmp_path / "site")}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == ["device.txt", "gpu_check.json", "gpu_check.log", "pytest.txt", "summary.txt"]
    summary = (out / "summary.txt").read_text()
    assert "decode graph >= 5x eager at B=1:" in summary and "NOT MEASURED" not in summary
    assert re.search(r"pytest -m gpu: \d+ skipped", summary)
    total = int(re.search(r"total (\d+) s of a 450 s budget", summary)[1])
    assert total < 450
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["rehearsal"] is True
    for part in gpu_check.PARTS:
        assert "error" not in result[part], result[part]
    parity = result["parity"]
    assert {(r["phase"], r["bucket"]) for r in parity["rows"]} == {
        *(("decode", b) for b in gpu_check.REHEARSAL.decode_buckets),
        *(("extend", b) for b in gpu_check.REHEARSAL.extend_buckets),
    }
    assert parity["ok"] and all(0 < r["rel_diff"] for r in parity["rows"])  # two backends, not one twice
    decode = result["decode_graph"]
    assert decode["mechanism"] == "tape" and [r["bucket"] for r in decode["buckets"]] == [1, 2]
    assert all(r["max_abs_hidden_diff"] == 0 for r in decode["buckets"])  # the tape replays the same ops
    for variant in gpu_check.VARIANTS:
        captured = result["capture"]["variants"][variant]
        assert "error" not in captured, captured
        assert set(captured["capture_seconds"]) == {"8", "16"} and captured["max_abs_hidden_diff_vs_eager"] == 0
        assert captured["environment"]["imported_distributions"]["triton"]  # triton attention, interpreted
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("REHEARSAL") and "NOT MEASURED" not in summary
    imported = {d for part in gpu_check.PARTS for d in result[part]["environment"]["imported_distributions"]}
    imported |= {d for v in result["capture"]["variants"].values() for d in v["environment"]["imported_distributions"]}
    assert {"hydra-core", "omegaconf"} <= {_norm(d) for d in imported}
    assert not _uncovered(imported), "add these to scripts/gpu_wheels.txt"


