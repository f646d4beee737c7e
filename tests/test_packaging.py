"""The package installs non-editably with its Hydra configs, and nothing is left out of it."""

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for top in ("graphexec", "capture"):
        for init in (ROOT / top).rglob("__init__.py"):
            package = ".".join(init.parent.relative_to(ROOT).parts)
            assert package in listed, f"{package} missing from [tool.setuptools] packages"


def test_wheel_ships_configs_and_composes_from_site_packages(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("graphexec-*.whl")
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
