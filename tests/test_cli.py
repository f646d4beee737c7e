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
        "capture.decode.buckets=[1,2]",
    )
    assert result.returncode == 0, result.stderr
    assert "> hello" in result.stdout and "[5 tokens, finish_reason=length]" in result.stdout
    assert "tokens/s" in result.stderr


def test_generate_rejects_unknown_model_with_exit_code():
    result = _generate("model=no-such-model")
    assert result.returncode != 0
    assert "no-such-model" in result.stderr
