"""The peer suite (graphexec vs llama.cpp) without llama.cpp: its orchestration with fake workers
(the bench.activations sides, alternation, result shape, ratios, report and plots), the
bench.requantize cache with a fake quantize worker, the llama.cpp side's timing logic on a fake
`Llama`, and the graphexec side for real on the tiny model through `graphexec-bench bench=peer`,
where the peer is recorded as unavailable.  No timed assertions."""

import ctypes
import json
import os
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from bench import peer, peer_worker, workers
from bench.report import run_suite
from bench.suites import SuiteContext
from graphexec.config import compose
from graphexec.text.tokenizer import ByteTokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = [
    "bench=peer", "model=tiny-llama", "capture=eager", "bench.rounds=2", "bench.progress=false",
    "bench.decode.prompt_len=16", "bench.decode.new_tokens=8", "bench.prefill.lengths=[32,64]",
    "bench.batch.sizes=[2,4]", "bench.batch.prompt_len=8", "bench.batch.new_tokens=6",
    "bench.agreement.prompts=2", "bench.agreement.new_tokens=4",
]


def _cfg(*extra):
    return compose([*SMALL, *extra], config_name="bench")


def test_alternation_runs_each_side_once_per_round_in_order():
    calls = []
    raw, sequence = workers.alternate(["graphexec", "llamacpp"], 3, lambda side, r: calls.append((side, r)) or {"r": r})
    assert calls == [("graphexec", 0), ("llamacpp", 0), ("graphexec", 1), ("llamacpp", 1), ("graphexec", 2), ("llamacpp", 2)]
    assert [s["side"] for s in sequence] == ["graphexec", "llamacpp"] * 3
    assert [w["r"] for w in raw["graphexec"]] == [w["r"] for w in raw["llamacpp"]] == [0, 1, 2]


@pytest.mark.parametrize(
    "override, named",
    [("bench.rounds=0", "bench.rounds"), ("bench.threads=-1", "bench.threads"), ("bench.decode.new_tokens=1", "bench.decode.new_tokens"),
     ("bench.prefill.lengths=[]", "bench.prefill.lengths"), ("bench.batch.sizes=[0]", "bench.batch.sizes"),
     ("bench.llamacpp.n_batch=0", "bench.llamacpp.n_batch"), ("bench.requantize=4.5", "bench.requantize"),
     ("bench.requantize='Q4 K'", "bench.requantize")],
)
def test_bad_options_name_the_option(override, named):
    with pytest.raises(ValueError, match=named):
        peer.options(_cfg(override).bench)


def test_peer_unavailable_says_why(monkeypatch):
    opts = peer.options(_cfg().bench)
    tiny = types.SimpleNamespace(name="tiny-llama", source="random")
    assert not peer.peer_status(opts, None, tiny)["available"]
    assert "GGUF" in peer.peer_status(opts, None, tiny)["reason"]
    monkeypatch.setattr(peer, "llamacpp_importable", lambda: False)
    gguf = types.SimpleNamespace(name="smollm2-135m", source="gguf")
    status = peer.peer_status(opts, "/m.gguf", gguf)
    assert not status["available"] and "llama_cpp is not importable" in status["reason"] and "graphexec[peer]" in status["reason"]
    off = peer.options(_cfg("bench.llamacpp.enabled=false").bench)
    assert peer.peer_status(off, "/m.gguf", gguf)["reason"] == "bench.llamacpp.enabled=false"
    monkeypatch.setattr(peer, "llamacpp_importable", lambda: True)
    assert peer.peer_status(opts, "/m.gguf", gguf)["available"]
    with pytest.raises(ValueError, match="bench.llamacpp.n_ctx"):
        peer.peer_status(peer.options(_cfg("bench.llamacpp.n_ctx=40").bench), "/m.gguf", gguf)


def test_prompts_have_exact_lengths_keep_a_leading_bos_and_batch_prompts_share_no_prefix():
    make = peer.prompt_maker([256, 10, 11, 12], bos_token_id=256)
    assert make(7) == [256, 10, 11, 12, 10, 11, 12]
    assert make(3, offset=1) == [256, 11, 12]
    assert peer.prompt_maker([10, 11], bos_token_id=None)(3) == [10, 11, 10]
    spec = peer.build_spec(ByteTokenizer(320), peer.options(_cfg().bench), None)
    assert len(spec["decode"]["prompt"]) == 16
    assert [len(p["prompt"]) for p in spec["prefill"]] == [p["tokens"] for p in spec["prefill"]] == [32, 64]
    firsts = [p[0] for p in spec["batch"]["prompts"]]
    assert len(spec["batch"]["prompts"]) == 4 and len(set(firsts)) == 4


def test_batch_throughput_counts_decode_tokens_between_first_and_last():
    # Two requests, same arrival: first tokens at 1.0 s and 1.5 s, 5 tokens each at 0.1 s apart.
    requests = [peer_worker.timed_request(1.0, 0.1, 1.5, [7] * 5), peer_worker.timed_request(1.5, 0.1, 2.0, [7] * 5)]
    got = peer_worker.batch_throughput(requests)
    assert got["decode_tokens"] == 8
    assert got["decode_s"] == pytest.approx(0.9)  # 1.0 → 1.5 + 4 × 0.1
    assert got["decode_tokens_per_s"] == pytest.approx(8 / 0.9)
    assert got["first_token_spread_s"] == pytest.approx(0.5) and got["request_tokens_per_s"] == pytest.approx(10 / 2.0)


def test_model_bytes_counts_tied_tensors_once_and_rope_apart():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight  # tied
    model.register_buffer("cos_table", torch.zeros(8, 2))
    model.register_buffer("codes", torch.zeros(6, dtype=torch.uint8))
    assert peer_worker.model_bytes(model) == (10 * 4 * 4 + 6, 8 * 2 * 4)


def test_worker_failures_are_recorded_and_a_crash_after_the_results_keeps_them(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, env, **kwargs):
        seen.append((cmd, env["OMP_NUM_THREADS"]))
        if "graphexec" in cmd:  # results printed, then a crash in interpreter teardown
            return subprocess.CompletedProcess(cmd, 134, '{"decode": []}\n', "terminate called without an active exception\n")
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nllamacpp worker failed: OSError: bad file\n")

    monkeypatch.setattr(workers.subprocess, "run", fake_run)
    ours = peer.run_worker("graphexec", tmp_path / "s.json", ["model=tiny-llama"], 3, 60)
    theirs = peer.run_worker("llamacpp", tmp_path / "s.json", ["model=tiny-llama"], 3, 60)
    assert ours["error"] is None and ours["decode"] == [] and ours["exit_code"] == 134
    assert ours["exit_error"] == "terminate called without an active exception"
    assert theirs["error"] == "llamacpp worker failed: OSError: bad file" and "decode" not in theirs
    (g_cmd, g_threads), (l_cmd, l_threads) = seen
    assert g_cmd[-1] == "model=tiny-llama" and "model=tiny-llama" not in l_cmd  # engine overrides: graphexec only
    assert g_threads == l_threads == "3"
    assert ours["busy_cores_before"] is None or ours["busy_cores_before"] >= 0  # None off Linux


class _FakeLlama:
    """llama-cpp-python's reset()/generate() contract: generate never stops by itself (no EOS)."""

    def __init__(self):
        self.log = []

    def reset(self):
        self.log.append("reset")

    def generate(self, tokens, **kwargs):
        assert kwargs["temp"] == 0.0 and kwargs["top_k"] == 1 and kwargs["repeat_penalty"] == 1.0
        self.log.append(("generate", len(tokens)))
        token = 0
        while True:
            token += 1
            yield token


def test_llamacpp_side_decodes_exactly_the_asked_tokens_and_resets_before_every_request():
    spec = peer.build_spec(ByteTokenizer(320), peer.options(_cfg("bench.repeats=2").bench), "/m.gguf")
    llama = _FakeLlama()
    out = peer_worker.measure_llamacpp(llama, spec)
    assert [d["tokens"] for d in out["decode"]] == [8, 8] and out["batch"] == {}
    assert out["decode"][0]["token_ids"] == list(range(1, 9))
    assert set(out["prefill"]) == {"32", "64"} and all(len(v) == 2 for v in out["prefill"].values())
    generates = [e for e in llama.log if e != "reset"]
    assert llama.log.count("reset") == len(generates)  # every request starts from an empty context
    assert generates[-2:] == [("generate", 64), ("generate", 64)]


def _fake_worker(side, scale, error=None):
    if error:
        return {"error": error, "process_seconds": 1.0}
    decode = {"tokens": 8, "ttft_s": 0.01 * scale, "decode_ms_per_token": 2.0 * scale, "latency_s": 0.03,
              "request_ms_per_token": 3.0 * scale, "token_ids": [1, 2, 3, 4, 5, 6, 7, 8 if side == "graphexec" else 9]}
    batch = {"2": [{"decode_tokens_per_s": 900.0, "first_token_spread_s": 0.0, "cached_tokens": 0}]} if side == "graphexec" else {}
    return {
        "side": side, "start_seconds": 1.0 * scale, "error": None, "process_seconds": 2.0,
        "decode": [decode], "prefill": {"32": [{"ttft_s": 0.01, "tokens_per_s": 1000.0 / scale}]}, "batch": batch,
        "memory": {"peak_rss_bytes": 2**20 * 100 * scale, "weight_bytes": 2**20 * 50, "kv_bytes": 2**20 * 8,
                   **({"rope_bytes": 2**20} if side == "graphexec" else {})},
        **({"engine": {"weights": "native", "dtype": "float32", "capture_plan": "eager", "max_prefill_tokens": 2048,
                       "kv_slots": 16384}} if side == "graphexec" else {}),
        # Prompt 1 first differs where both gaps are small (a near tie), prompt 2 where neither is.
        "agreement": [{"token_ids": [1, 2, 3], "gaps": [1.0, 0.2, 1.0]}, {"token_ids": [4, 5, 6], "gaps": [2.0] * 3}]
        if side == "graphexec" else [{"token_ids": [1, 9, 3], "gaps": [1.0, 0.3, 1.0]}, {"token_ids": [4, 5, 7], "gaps": [2.0] * 3}],
    }


def test_suite_with_both_sides_alternates_aggregates_and_reports(tmp_path, monkeypatch):
    cfg = _cfg("bench.prefill.lengths=[32]", "bench.batch.sizes=[2]")
    canned = {"graphexec": [_fake_worker("graphexec", 2), _fake_worker("graphexec", 4)],
              "llamacpp": [_fake_worker("llamacpp", 1), _fake_worker("llamacpp", 1, error="llamacpp worker failed: boom")]}
    payload, calls = _fake_suite(tmp_path, monkeypatch, cfg, canned, ("model=tiny-llama",))

    assert payload["status"] == "ok", payload.get("traceback")
    assert [side for side, _ in calls] == ["graphexec", "llamacpp", "graphexec", "llamacpp"]
    assert calls[0][1] == ["model=tiny-llama", "model.activations=float"]  # tiny-llama is no GGUF: float only
    result = payload["result"]
    assert result["peer"]["available"] and result["errors"] == [{"round": 1, "side": "llamacpp", "error": "llamacpp worker failed: boom"}]
    rows = {r["key"]: r for r in result["rows"]}
    assert rows["decode_ms"]["graphexec"] | {"values": None} == {"min": 4.0, "median": 6.0, "max": 8.0, "rounds": 2, "values": None}
    assert rows["decode_ms"]["llamacpp"]["rounds"] == 1 and rows["decode_ms"]["ratios"] == {"graphexec": pytest.approx(3.0)}
    assert rows["batch_tok_s@2"]["llamacpp"]["median"] == pytest.approx(500.0)  # llama.cpp's B=1 rate beside it
    assert rows["rope_mib"]["llamacpp"] is None and rows["rope_mib"]["graphexec"]["median"] == 1.0
    assert result["greedy_agreement"]["graphexec"]["mean_prefix_fraction"] == pytest.approx(7 / 8)
    assert payload["summary"]["graphexec (float)/llama.cpp decode B=1 tok/s ×"] == pytest.approx((1000 / 4 + 1000 / 8) / 2 / 500)  # median of the rounds' rates

    report = (tmp_path / "report.md").read_text()
    assert "| metric | graphexec (float) | llama.cpp | ratio (float) |" in report
    assert "| B=1 decode ms/token (8 new tokens, prefill excluded) ↓ | 6 (4–8) | 2 | 3.00× |" in report
    assert "llama.cpp round 2 failed**: llamacpp worker failed: boom" in report
    for png in payload["plots"]:
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC


def _fake_suite(tmp_path, monkeypatch, cfg, canned, overrides):
    """peer.run through run_suite with canned workers per side (in call order); returns the payload
    and each call's (side, engine overrides)."""
    calls = []

    def fake_run_worker(side, spec_path, overrides, threads, timeout_s):
        calls.append((side, list(overrides)))
        assert json.loads(spec_path.read_text())["threads"] == threads == 2
        return canned[side][sum(c == side for c, _ in calls) - 1]

    monkeypatch.setattr(peer, "gguf_path", lambda source: tmp_path / "m.gguf")
    monkeypatch.setattr(peer, "llamacpp_importable", lambda: True)
    monkeypatch.setattr(peer, "tokenizer_of", lambda source, gguf: ByteTokenizer(320))
    monkeypatch.setattr(peer, "run_worker", fake_run_worker)
    ctx = SuiteContext(out_dir=tmp_path, overrides=overrides, progress=False)
    return run_suite(peer, "peer", lambda: peer.run(cfg, ctx), tmp_path, {}, "fake"), calls


def _gguf_cfg(*extra):
    """The default model (a GGUF, native weights: both activations modes run) with the small workload."""
    return compose([o for o in SMALL if not o.startswith("model=")] + ["bench.prefill.lengths=[32]", "bench.batch.sizes=[2]", *extra],
                   config_name="bench")


def _source(source="gguf", weights="native", activations="float"):
    return types.SimpleNamespace(name="m", source=source, weights=weights, activations=activations)


def test_activations_default_to_every_runnable_mode_and_name_their_sides():
    assert peer.graphexec_sides(None, _source()) == ["graphexec", "graphexec_q8"]
    assert peer.graphexec_sides(None, _source(weights="dequantize")) == ["graphexec"]
    assert peer.graphexec_sides(None, _source(source="random")) == ["graphexec"]
    assert peer.graphexec_sides(["q8", "float"], _source()) == ["graphexec_q8", "graphexec"]
    assert [peer.label(s) for s in ("graphexec", "graphexec_q8", "llamacpp")] == ["graphexec (float)", "graphexec (q8)", "llama.cpp"]
    assert peer.options(_gguf_cfg("bench.activations=[q8]").bench)["activations"] == ["q8"]


@pytest.mark.parametrize(
    "activations, source, message",
    [([], _source(), r"bench.activations=\[\] must be"), (["int8"], _source(), "bench.activations"),
     (["float", "float"], _source(), "distinct"), ("q8", _source(), "bench.activations='q8'"),
     (["q8"], _source(weights="dequantize"), "model.weights=dequantize"), (["q8"], _source(source="random"), "bench.activations"),
     (None, _source(activations="q8"), r"give bench.activations=\[q8\] instead")],
)
def test_bad_activations_name_the_option(activations, source, message):
    with pytest.raises(ValueError, match=message):
        peer.graphexec_sides(activations, source)


def test_alternation_with_three_sides():
    raw, sequence = workers.alternate(["graphexec", "graphexec_q8", "llamacpp"], 2, lambda side, r: {"r": r})
    assert [(s["round"], s["side"]) for s in sequence] == [
        (0, "graphexec"), (0, "graphexec_q8"), (0, "llamacpp"), (1, "graphexec"), (1, "graphexec_q8"), (1, "llamacpp")]
    assert list(raw) == ["graphexec", "graphexec_q8", "llamacpp"]


def test_q8_reaches_only_the_q8_sides_overrides(tmp_path):
    base = ("capture=eager",)
    assert peer.engine_overrides("graphexec", base, None) == ["capture=eager", "model.activations=float"]
    assert peer.engine_overrides("graphexec_q8", base, None) == ["capture=eager", "model.activations=q8"]
    assert peer.engine_overrides("llamacpp", base, None) == []
    q = tmp_path / "m.Q4_K_M.gguf"
    assert peer.engine_overrides("graphexec_q8", base, q) == ["capture=eager", f"model.path='{q}'", "model.activations=q8"]
    # What the worker composes from them: the side's mode, the re-quantized file.
    composed = compose(["model=smollm2-135m", *peer.engine_overrides("graphexec_q8", base, q)])
    assert composed.model.activations == "q8" and composed.model.path == str(q)


def test_suite_with_three_sides_reports_each_graphexec_side_against_llamacpp(tmp_path, monkeypatch):
    q8 = _fake_worker("graphexec", 1) | {"decode": [_fake_worker("graphexec", 1)["decode"][0] | {"token_ids": [1, 2, 3, 4, 5, 6, 7, 9]}]}
    canned = {"graphexec": [_fake_worker("graphexec", 2)], "graphexec_q8": [q8], "llamacpp": [_fake_worker("llamacpp", 1)]}
    payload, calls = _fake_suite(tmp_path, monkeypatch, _gguf_cfg("bench.rounds=1"), canned, ("capture=eager",))

    assert payload["status"] == "ok", payload.get("traceback")
    assert [side for side, _ in calls] == ["graphexec", "graphexec_q8", "llamacpp"]
    assert [o for _, overrides in calls for o in overrides if o.startswith("model.activations")] == [
        "model.activations=float", "model.activations=q8"]
    result = payload["result"]
    assert result["sides"] == ["graphexec", "graphexec_q8", "llamacpp"] and result["requantized"] is None
    decode = next(r for r in result["rows"] if r["key"] == "decode_ms")
    assert decode["ratios"] == {"graphexec": pytest.approx(2.0), "graphexec_q8": pytest.approx(1.0)}
    assert result["greedy_agreement"]["graphexec"]["mean_prefix_fraction"] == pytest.approx(7 / 8)
    assert result["greedy_agreement"]["graphexec_q8"]["identical_requests"] == 1
    summary = payload["summary"]
    assert summary["graphexec (q8)/llama.cpp decode B=1 ms/token ×"] == pytest.approx(1.0)
    assert summary["graphexec (float) decode B=1 ms/token"] == pytest.approx(4.0) and "llama.cpp decode B=2 tok/s" not in summary

    report = (tmp_path / "report.md").read_text()
    assert "| metric | graphexec (float) | graphexec (q8) | llama.cpp | ratio (float) | ratio (q8) |" in report
    assert "| B=1 decode ms/token (8 new tokens, prefill excluded) ↓ | 4 | 2 | 2 | 2.00× | 1.00× |" in report
    assert "graphexec (float) differs, 88% agree" in report and "graphexec (q8) identical, 100% agree" in report
    assert "Order run: graphexec (float) → graphexec (q8) → llama.cpp." in report
    assert result["near_tie_agreement"]["graphexec_q8"]["agree"] == 0.5 and summary["graphexec (q8) greedy agreement with llama.cpp"] == 0.5
    assert ("graphexec (q8): 1/2 agree (0 equal, 1 first differ at a near tie, both top-two gaps < 0.5 nats); first "
            "differences at token 1 (gaps 0.20/0.30), 2 (gaps 2.00/2.00)") in report
    assert len(payload["plots"]) == 3


def _fake_quantizer(monkeypatch, returncode=0):
    """workers.subprocess.run standing in for the quantize worker: writes DST, prints its JSON line."""
    seen, real_run = [], subprocess.run

    def fake_run(cmd, *args, **kwargs):
        if "--quantize" not in cmd:  # platform.processor() (the report's machine facts) runs `uname -p`
            return real_run(cmd, *args, **kwargs)
        seen.append(cmd)
        if returncode:
            return subprocess.CompletedProcess(cmd, returncode, "", "quantize worker failed: ValueError: bad type\n")
        dst = cmd[cmd.index("--quantize") + 3]
        Path(dst).write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))  # a valid GGUF: version 3, no tensors, no keys
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"type": cmd[cmd.index("--quantize") + 1], "bytes": 64}) + "\n", "")

    monkeypatch.setattr(workers.subprocess, "run", fake_run)
    monkeypatch.setattr(peer, "llamacpp_importable", lambda: True)
    return seen


def test_requantize_runs_the_worker_once_then_reuses_its_cached_file(tmp_path, monkeypatch):
    src = tmp_path / "model.Q4_1.gguf"
    src.write_bytes(b"GGUF" + bytes(100))
    opts = peer.options(_gguf_cfg("bench.requantize=Q4_K_M", f"bench.requantize_dir={tmp_path / 'cache'}").bench)
    seen = _fake_quantizer(monkeypatch)

    first = peer.requantize(opts, src)
    (cmd,) = seen
    tmp_file = cmd[cmd.index("--quantize") + 3]
    assert cmd[1:] == ["-m", "bench.cli", "peer_worker", "--quantize", "Q4_K_M", str(src), tmp_file, "--threads", "2"]
    final = tmp_path / "cache" / Path(first["file"]).name
    assert Path(first["file"]) == final and final.name.startswith("model.Q4_1.") and final.name.endswith(".Q4_K_M.gguf")
    assert not first["reused"] and first["type"] == "Q4_K_M" and not Path(tmp_file).exists() and Path(tmp_file).parent == final.parent
    assert first["tensor_types"] == {}

    again = peer.requantize(opts, src)
    assert again["reused"] and again["file"] == first["file"] and len(seen) == 1  # no second quantize

    # A changed source (size, mtime) is another key: re-quantized, not served stale.
    src.write_bytes(b"GGUF" + bytes(200))
    os.utime(src, ns=(1, 1))
    changed = peer.requantize(opts, src)
    assert changed["file"] != first["file"] and not changed["reused"] and len(seen) == 2


def test_requantize_errors_name_the_option_and_leave_no_file(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    opts = peer.options(_gguf_cfg("bench.requantize=Q4_K_X", f"bench.requantize_dir={tmp_path / 'cache'}").bench)
    _fake_quantizer(monkeypatch, returncode=1)
    with pytest.raises(RuntimeError, match="bench.requantize=Q4_K_X: quantize worker failed: ValueError: bad type"):
        peer.requantize(opts, src)
    assert list((tmp_path / "cache").iterdir()) == []
    with pytest.raises(ValueError, match="bench.requantize=Q4_K_X needs a GGUF"):
        peer.requantize(opts, None)
    monkeypatch.setattr(peer, "llamacpp_importable", lambda: False)
    with pytest.raises(ValueError, match="bench.requantize=Q4_K_X needs llama_cpp"):
        peer.requantize(opts, src)


def test_requantized_file_reaches_both_sides_and_the_setup_line(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(100))
    _fake_quantizer(monkeypatch)
    monkeypatch.setattr(peer, "tensor_types", lambda path: {"Q5_0": 3, "Q4_K": 1})
    cfg = _gguf_cfg("bench.rounds=1", "bench.activations=[float]", "bench.requantize=Q4_K_M", f"bench.requantize_dir={tmp_path / 'c'}")
    canned = {"graphexec": [_fake_worker("graphexec", 2)], "llamacpp": [_fake_worker("llamacpp", 1)]}
    payload, calls = _fake_suite(tmp_path, monkeypatch, cfg, canned, ())
    assert payload["status"] == "ok", payload.get("traceback")
    result = payload["result"]
    file = result["requantized"]["file"]
    assert result["model"]["gguf"] == file and json.loads((tmp_path / peer.SPEC_FILE).read_text())["llamacpp"]["gguf"] == file
    assert calls[0][1] == [f"model.path='{file}'", "model.activations=float"]
    assert f"Model `{Path(file).name}` (Q4_K_M, 0.0 MiB, tensors Q5_0 ×3, Q4_K ×1: `m.gguf` re-quantized by llama.cpp, written to" in (tmp_path / "report.md").read_text()


def test_quantize_worker_sets_llamacpps_params_and_lists_the_types(monkeypatch, tmp_path):
    class Params(ctypes.Structure):  # the fields of llama_model_quantize_params the worker sets
        _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int), ("allow_requantize", ctypes.c_bool)]

    calls = []
    params = Params()
    fake = types.SimpleNamespace(
        LLAMA_FTYPE_MOSTLY_Q4_K_M=15, LLAMA_FTYPE_MOSTLY_Q8_0=7, llama_model_quantize_default_params=lambda: params,
        llama_model_quantize=lambda src, dst, p: calls.append((src, dst)) or open(dst, "wb").write(b"GGUF") and 0)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    dst = tmp_path / "out.gguf"
    assert peer_worker.quantize("Q4_K_M", "/src.gguf", str(dst), 3) == {"type": "Q4_K_M", "bytes": 4}
    assert (params.ftype, params.allow_requantize, params.nthread) == (15, True, 3) and calls == [(b"/src.gguf", str(dst).encode())]
    with pytest.raises(ValueError, match=r"bench.requantize=Q4_X is not a llama.cpp file type; choose one of \['Q4_K_M', 'Q8_0'\]"):
        peer_worker.quantize("Q4_X", "/src.gguf", str(dst), 3)


def test_graphexec_side_runs_for_real_and_the_peer_is_recorded_unavailable(tmp_path):
    """The tiny model is no GGUF: llama.cpp cannot be its peer, whether llama_cpp is installed or not."""
    cmd = [sys.executable, "-m", "bench.cli", *SMALL, "bench.rounds=1", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["status"] == "ok", payload.get("error")
    result = payload["result"]
    assert not result["peer"]["available"] and "GGUF" in result["peer"]["reason"]
    assert result["errors"] == [] and result["sequence"] == [{"round": 0, "side": "graphexec"}]
    assert result["engine_overrides"] == ["model=tiny-llama", "capture=eager"]
    (worker,) = result["raw"]["graphexec"]
    (decode,) = worker["decode"]
    assert decode["tokens"] == 8 and decode["cached_tokens"] == 0  # EOS ignored; the cache was flushed
    assert all(r[0]["cached_tokens"] == 0 for r in worker["prefill"].values())
    assert {b: r[0]["requests"] for b, r in worker["batch"].items()} == {"2": 2, "4": 4}
    # The agreement prompts, greedy, each step's top-two gap beside its token (tiny-llama: no chat template).
    assert [len(a["token_ids"]) for a in worker["agreement"]] == [4, 4]
    assert all(len(a["gaps"]) == 4 and min(a["gaps"]) >= 0 for a in worker["agreement"])
    assert worker["memory"]["weight_bytes"] > 0 and worker["memory"]["rope_bytes"] > 0 and worker["torch_threads"] == 2
    rows = {r["key"]: r for r in result["rows"]}
    assert rows["pp_tok_s@64"]["graphexec"]["median"] > 0 and rows["pp_tok_s@64"]["llamacpp"] is None
    report = (tmp_path / "report.md").read_text()
    assert "**llama.cpp unavailable**" in report and "| decode tok/s, graphexec B=4 vs llama.cpp B=1 ↑ |" in report
    assert sorted(payload["plots"]) == ["peer_latency.png", "peer_memory.png", "peer_throughput.png"]
    for png in payload["plots"]:
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC


def test_near_tie_verdict_counts_equal_prompts_and_first_differences_where_both_gaps_are_small():
    from bench.peer import verdict

    ours = [{"token_ids": [1, 2], "gaps": [0.1, 3.0]}, {"token_ids": [1, 2], "gaps": [0.1, 3.0]},
            {"token_ids": [5, 6], "gaps": [0.4, 0.1]}, {"token_ids": [5, 6], "gaps": [0.1, 0.1]}]
    theirs = [{"token_ids": [1, 2], "gaps": [9.0, 9.0]}, {"token_ids": [1, 3], "gaps": [0.1, 0.2]},
              {"token_ids": [7, 6], "gaps": [0.45, 0.1]}, {"token_ids": [8, 6], "gaps": [0.6, 0.1]}]
    v = verdict(ours, theirs, near_tie_nats=0.5)
    assert [r["first_difference"] for r in v["per_prompt"]] == [None, 1, 0, 0]
    # Prompt 2 differs where ours is sure (3.0), prompt 4 where llama.cpp is (0.6): not near ties.
    assert [r["near_tie"] for r in v["per_prompt"]] == [False, False, True, False]
    assert (v["equal"], v["after_near_tie"], v["agree"], v["new_tokens"]) == (1, 1, 0.5, 2)


class _LogitLlama:
    """llama-cpp-python's reset()/eval() with logits that follow the last token fed."""

    def __init__(self):
        self.fed = []

    def reset(self):
        self.fed.clear()

    def eval(self, tokens):
        self.fed.extend(tokens)

    def logits(self):
        row = [0.0] * 6
        row[(self.fed[-1] + 1) % 6] = 2.0  # the next id, by 2 nats over the rest
        if self.fed[-1] == 3:
            row[1] = row[5] = 3.0  # a tie: argmax takes the lowest id
        return row


def test_llamacpp_agreement_decodes_greedily_by_hand_with_each_steps_gap():
    llama = _LogitLlama()
    out = peer_worker.greedy_with_gaps(llama, llama.logits, [7, 0], 4)
    assert out == {"token_ids": [1, 2, 3, 1], "gaps": [2.0, 2.0, 2.0, 0.0]}
    assert llama.fed == [7, 0, 1, 2, 3]  # the prompt, then every token but the last
