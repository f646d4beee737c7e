"""The Hydra launch command, run as a user would."""

import subprocess
import sys


def _generate(*overrides):
    return subprocess.run(
        [sys.executable, "-m", "graphexec.entrypoints.generate", *overrides],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_on_tiny_model():
    result = _generate(
        "model=tiny-llama", "chat=false", "prompt=hello", "sampling.max_new_tokens=5", "sampling.ignore_eos=true",
        "capture.decode.buckets=[1,2]", "capture.extend.buckets=[64]",
    )
    assert result.returncode == 0, result.stderr
    assert "> hello" in result.stdout and "[5 tokens, finish_reason=length]" in result.stdout
    assert "tokens/s" in result.stderr


def test_capture_builds_the_plan_a_later_start_uses(tmp_path):
    overrides = ["model=tiny-llama", "capture.decode.buckets=[1]", "capture.decode.keep=all", f"capture.cache_dir={tmp_path}"]
    result = subprocess.run(
        [sys.executable, "-m", "graphexec.entrypoints.capture", *overrides], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    (row,) = [line.split() for line in result.stdout.splitlines() if line.startswith("decode,idle")]
    assert row[1:3] == ["1", "ready"] and row[-1] == "keep=all"
    (plan,) = tmp_path.glob("*/plan.json")
    assert str(plan) in result.stderr
    assert (plan.parent / "capture.decode.forward.b1.aot").exists()  # the compiled forward, shipped with the plan
    # The same overrides find it; graphexec-generate with them loads it (nothing is measured).
    from graphexec.config import EngineConfig
    from graphexec.runner.capture_key import capture_key
    from capture.plan_store import PlanStore

    key = capture_key(EngineConfig.from_overrides(overrides), 1, 0, "cpu")
    assert PlanStore(tmp_path, key).load()["capture.decode"][1].kept


def test_capture_refuses_a_null_cache_dir(capsys):
    import pytest

    from graphexec.config import compose
    from graphexec.entrypoints.capture import _run

    with pytest.raises(SystemExit) as exited:  # in-process: refused before any model loads
        _run(compose(["model=tiny-llama", "capture.cache_dir=null"]))
    assert exited.value.code == 2 and "capture.cache_dir is null" in capsys.readouterr().err


def test_generate_rejects_unknown_model_with_exit_code():
    result = _generate("model=no-such-model")
    assert result.returncode != 0
    assert "no-such-model" in result.stderr


def test_generate_refuses_an_empty_prompt_under_chat_before_loading():
    # chat=true is the default: the chat template would turn "" into a real prompt.
    for overrides in (["prompt="], ["prompts=[hi,'']"]):
        result = _generate("model=tiny-llama", *overrides)
        assert result.returncode == 2, (result.stdout, result.stderr)
        which = "prompt" if overrides == ["prompt="] else "prompts[1]"
        assert f"error: {which} is empty" in result.stderr and result.stdout == ""


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_serve_answers_on_the_configured_port_and_stops_on_sigint():
    import signal
    import time

    import httpx

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "graphexec.entrypoints.serve", "model=tiny-llama", "capture=eager",
         f"server.port={port}", "server.log_level=warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(trust_env=False, timeout=10) as http:
            deadline = time.monotonic() + 120
            while True:
                assert server.poll() is None, server.stderr.read()
                try:
                    if http.get(f"{base}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "graphexec-serve did not come up"
                time.sleep(0.2)
            assert http.get(f"{base}/v1/models").json()["data"][0]["id"] == "tiny-llama"
            body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
            assert http.post(f"{base}/v1/completions", json=body).json()["usage"]["completion_tokens"] == 4
    finally:
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=30)
    assert server.returncode == 0, stderr
    assert f"model=tiny-llama capture=eager on http://127.0.0.1:{port}" in stderr

