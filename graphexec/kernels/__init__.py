"""graphexec's C++ CPU kernels (`csrc/*.cpp`), built once with torch's own tooling and cached.

The sources register implementations for ops whose schemas graphexec defines in Python (so the op
exists, with its fake implementation, even where nothing was built).  `load()` compiles them with
`-march=native` on first use (about a minute on 2 cores; ninja rebuilds only changed sources) into
`GRAPHEXEC_KERNEL_DIR`, default `~/.cache/graphexec/kernels/<torch version>/<checkout>`, and loads
the library into this process.  The checkout part (a hash of where the sources live) keeps two
installs on one machine from rebuilding over each other: ninja's build file names its sources by
path, so a shared directory would rebuild on every switch.  `scripts/setup.sh` builds them at install time, so a first start does not.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

import torch

from graphexec.errors import CheckpointError

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))


def build_dir() -> Path:
    checkout = hashlib.sha1(str(_SOURCES[0].parent.resolve()).encode()).hexdigest()[:12]
    default = Path.home() / ".cache" / "graphexec" / "kernels" / torch.__version__.replace("+", "_") / checkout
    # An empty value is unset: Path("") is the working directory, which would fill with build files.
    return Path(os.environ.get("GRAPHEXEC_KERNEL_DIR") or default)


@functools.cache  # a shared library loads into the process once; cache() also serializes callers
def load() -> Path:
    """Build (if stale) and load the kernel library; raises CheckpointError naming the way out."""
    from torch.utils.cpp_extension import load as load_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "graphexec_kernels.so").exists():
        # Minutes of silence otherwise: a first build looks like a hang (logging is off in the CLIs).
        print(f"graphexec: building the C++ CPU kernels in {directory} (about a minute on 2 cores, once)", file=sys.stderr, flush=True)
    try:
        with _own_ninja():
            load_extension(
                name="graphexec_kernels",
                sources=[str(s) for s in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-DNDEBUG"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError) as error:
        raise CheckpointError(
            f"graphexec's CPU kernels failed to build in {directory} ({error}); quantized weights need them. "
            "Install a C++ compiler and ninja, or load dense weights with model.weights=dequantize"
        ) from error
    return directory


@contextlib.contextmanager
def _own_ninja() -> Iterator[None]:
    """This environment's ninja (the `ninja` dependency) first on PATH while building.  torch runs
    whichever `ninja` PATH finds, and ninja versions record a build's command lines differently
    (1.11 and 1.13 do): with the environment activated or not, a build looked stale to the other
    ninja and was redone from scratch (~90 s on 2 cores) on every switch."""
    scripts = sysconfig.get_path("scripts")
    if not os.path.exists(os.path.join(scripts, "ninja")):
        yield
        return
    previous = os.environ.get("PATH", "")
    os.environ["PATH"] = scripts + os.pathsep + previous
    try:
        yield
    finally:
        os.environ["PATH"] = previous
