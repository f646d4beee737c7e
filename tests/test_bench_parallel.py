"""`graphexec-bench bench=parallel` (the peer suite with one graphexec side per tensor-parallel size,
configs/bench/parallel.yaml) for real on the tiny model: tp=1 and tp=2 (a worker rank each round)
in fresh processes, their greedy tokens equal, and a report with every row.  No timed assertions."""

import json
import subprocess
import sys

import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_parallel_suite_runs_tp1_and_tp2(tmp_path):
    cmd = [
        sys.executable, "-m", "bench.cli", "bench=parallel", "model=tiny-llama", "capture=eager", "bench.tp_sizes=[1,2]",
        "bench.rounds=1", "bench.progress=false", "bench.decode.prompt_len=16", "bench.decode.new_tokens=8",
        "bench.batch.sizes=[3]", "bench.batch.prompt_len=16", "bench.batch.new_tokens=8", "bench.prefill.lengths=[32]",
        "parallel.threads_per_rank=1", f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["status"] == "ok", payload.get("error")
    result = payload["result"]
    assert result["sides"] == ["graphexec_tp1", "graphexec_tp2"] and result["errors"] == []
    assert result["greedy_tokens_equal"] is True and not result["peer"]["available"]
    rows = {r["key"]: r for r in result["rows"]}
    for side in result["sides"]:
        assert rows["batch_tok_s@3"][side]["median"] > 0 and rows["decode_ms"][side]["median"] > 0
    report = (tmp_path / "report.md").read_text()
    assert "| B=1 decode ms/token (8 new tokens, prefill excluded) ↓ |" in report and "graphexec (tp2)" in report
    for png in payload["plots"]:
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC


def test_parallel_suite_options_name_the_bad_option():
    from bench.peer import graphexec_sides, options
    from graphexec.config import compose

    with pytest.raises(ValueError, match="bench.tp_sizes"):
        options(compose(["bench=parallel", "bench.tp_sizes=[]"], config_name="bench").bench)
    with pytest.raises(ValueError, match="bench.tp_sizes and bench.activations"):
        graphexec_sides(["float"], None, [1, 2])
