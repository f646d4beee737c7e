"""The spec suite end to end through `graphexec-bench`, on the tiny model: a `none` and a
speculation worker process, results.json, report.md, the ratio plot and the greedy identity check."""

import json
import subprocess
import sys

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Short prompts: the tiny model's tokenizer is byte-level and its context 512.
PROMPTS = ("bench.prompts={copy:['Repeat: the cat sat on the mat. the cat sat on the mat.','Copy: a b c d a b c d a b'],"
           "open:['Tell me a story.','Why is the sky blue?']}")


def test_spec_suite_runs_both_sides_and_greedy_outputs_agree(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.cli", "bench=spec", "model=tiny-llama", "capture=eager", "bench.rounds=1",
         "bench.max_tokens=16", PROMPTS, "bench.batch_sizes=[1,2]", "bench.progress=false",
         "bench.chat=false",  # the tiny model has no chat template
         "speculative.policy=always", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["status"] == "ok", payload.get("error")
    res = payload["result"]
    assert res["errors"] == []
    assert res["sides"]["none"][-1] == "speculative=none"
    assert res["sides"]["spec"][-2:] == ["speculative=ngram", "speculative.policy=always"]
    assert {(r["class"], r["batch"]) for r in res["rows"]} == {
        ("copy", 1), ("open", 1), ("copy", 2), ("open", 2), ("mixed", 2)}
    for r in res["rows"]:
        assert r["tok_s_none"] > 0 and r["tok_s_spec"] > 0 and r["ratio"] > 0
    assert sum(r["drafted_tokens"] or 0 for r in res["rows"]) > 0  # the spec side really speculated
    # 2 prompts each B=1 class, 2 requests each B=2 class: 10 outputs of the spec run checked
    assert res["identity"] == {"compared": 10, "mismatches": []}
    report = (tmp_path / "report.md").read_text()
    assert "Greedy identity: all 10 outputs" in report and "MISMATCH" not in report
    assert "| class | tok/s none | tok/s spec | ratio | decode ratio | acceptance rate | mean accepted length |" in report
    assert payload["plots"] == ["spec_ratio.png"]
    assert (tmp_path / "spec_ratio.png").read_bytes()[:8] == PNG_MAGIC
    ratios = {"copy B=1 ratio", "open B=1 ratio", "copy B=1 decode ratio", "open B=1 decode ratio"}
    assert set(payload["summary"]) == ratios | {"greedy mismatches"}
