"""The package installs non-editably with its Hydra configs, and nothing is left out of it."""

import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest

from graphexec.parallel.ports import free_port
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for top in ("graphexec", "capture"):
        for init in (ROOT / top).rglob("__init__.py"):
            package = ".".join(init.parent.relative_to(ROOT).parts)
            assert package in listed, f"{package} missing from [tool.setuptools] packages"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """graphexec's wheel, built once for the tests below."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
    )
    (built,) = out.glob("graphexec-*.whl")
    return built


def test_wheel_ships_configs_and_composes_from_site_packages(tmp_path, wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for yaml in (ROOT / "configs").rglob("*.yaml"):
        assert f"graphexec/configs/{yaml.relative_to(ROOT / 'configs')}" in names
    assert "capture/backend.py" in names
    assert "graphexec/kernels/csrc/qlinear.cpp" in names  # built on the user's machine at first use

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # Run from a directory outside the repo so the checkout's configs/ cannot be found.
    probe = (
        "import graphexec.config as c; from graphexec.config import EngineConfig;"
        "print(c.config_dir()); print(EngineConfig.from_overrides(['model=tiny-llama']).model.name)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(site)}, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    config_dir, model = result.stdout.split()
    assert config_dir.startswith(str(site)) and model == "tiny-llama"


def test_an_empty_kernel_dir_variable_means_the_default(monkeypatch):
    """GRAPHEXEC_KERNEL_DIR= (set, empty) must not build into the working directory."""
    from pathlib import Path

    from graphexec.kernels import build_dir

    monkeypatch.delenv("GRAPHEXEC_KERNEL_DIR", raising=False)
    default = build_dir()
    monkeypatch.setenv("GRAPHEXEC_KERNEL_DIR", "")
    assert build_dir() == default != Path("")
    monkeypatch.setenv("GRAPHEXEC_KERNEL_DIR", "/tmp/elsewhere")
    assert build_dir() == Path("/tmp/elsewhere")



def test_kernels_build_with_this_environments_ninja_activated_or_not(monkeypatch):
    """Whatever PATH says (an activated venv or not), the build runs the environment's own ninja:
    two ninja versions disagree on a build's recorded command lines and rebuilt it on every switch."""
    import shutil
    import sysconfig

    from graphexec.kernels import _own_ninja

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    own = os.path.join(sysconfig.get_path("scripts"), "ninja")
    with _own_ninja():
        assert shutil.which("ninja") == own
    assert os.environ["PATH"] == "/usr/bin:/bin"

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.mark.slow
def test_a_fresh_structured_install_is_consistent_and_serves_json_schema(tmp_path, wheel):
    """What a package user does: `pip install 'graphexec[structured]'` into a new environment.
    `pip check` must be clean and a json_schema request must be served (no "not installed" 400).
    Wheels come from pip's cache; torch is pinned first, as scripts/setup.sh does."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # --no-compile: nothing here needs torch's thousands of modules byte-compiled ahead.
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, f"graphexec[structured] @ {wheel.as_uri()}"], check=True)
    check = subprocess.run([str(venv / "bin" / "pip"), "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    port = free_port()
    # torch_native attention: the C++ kernels would build from scratch for this new install
    # (minutes); they are tested everywhere else.
    serve = [str(venv / "bin" / "graphexec-serve"), "model=tiny-llama", "capture=eager", "attention_backend=torch_native"]
    server = subprocess.Popen(
        [*serve, f"server.port={port}"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(trust_env=False, timeout=60) as http:
            wait_until(lambda: _healthy(http, url, server), timeout=120, what="the installed server to start")
            body = {"model": "tiny-llama", "prompt": "n=", "max_tokens": 24, "temperature": 0,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}
            out = http.post(f"{url}/v1/completions", json=body)
        assert out.status_code == 200, out.text
        text = out.json()["choices"][0]["text"]
        if out.json()["choices"][0]["finish_reason"] == "stop":  # random weights may run out of tokens first
            value = json.loads(text)
            assert list(value) == ["n"] and isinstance(value["n"], int)
        else:
            assert text.startswith('{"n": ')
    finally:
        server.terminate()
        server.wait(30)


def _healthy(http: httpx.Client, url: str, server: subprocess.Popen) -> bool:
    if server.poll() is not None:
        raise AssertionError(f"graphexec-serve exited ({server.returncode}): {server.stderr.read()[-2000:]}")
    try:
        return http.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False
