"""graphexec's C++ CPU kernels (`csrc/*.cpp`), built once with torch's own tooling and cached.

The sources register implementations for ops whose schemas graphexec defines in Python (so the op
exists, with its fake implementation, even where nothing was built).  `load()` compiles them on
first use (about a minute on 2 cores; ninja rebuilds only changed sources) and loads the library
into this process.

What a build may use is chosen by the CPU the process runs on, never by the machine that built
it: `isa()` reads torch's own detection (`torch.backends.cpu.get_cpu_capability()`, which
`ATEN_CPU_CAPABILITY` can lower, and `torch.cpu.get_capabilities()` for VNNI) and picks one of
the fixed instruction-set variants of `ISA_FLAGS`;
`GRAPHEXEC_KERNEL_ISA` picks a lower one by hand.  Each variant builds into its own folder,
`GRAPHEXEC_KERNEL_DIR` (default `~/.cache/graphexec/kernels/<torch version>/<checkout>`) /
`<variant>`, so a cache shared by two different CPUs (a cluster home directory, an image built
elsewhere) holds one build per variant and each process loads the one its CPU runs.  The
checkout part (a hash of where the sources live) keeps two installs on one machine from
rebuilding over each other: ninja's build file names its sources by path.  `scripts/setup.sh`
builds the variant of the installing machine at install time, so a first start there does not.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterator

import torch

from graphexec.errors import CheckpointError

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))


# Compiler flags per variant, best first.  "avx512" is what torch's own AVX512 kernels require
# (F, BW, VL, DQ, with AVX2/FMA); the float sources need F only, the 8-bit activation path
# (qlinear_q8.cpp) BW and VL.  The VNNI variants add the byte dot-product instruction
# (vpdpbusd) on 512 bits (AVX512-VNNI: Ice Lake server and later, Zen 4) or 256 bits (AVX-VNNI:
# Alder Lake and later clients, which lack AVX-512).  "portable" is the compiler's baseline for
# the target (SSE2 on x86-64): the scalar loops, auto-vectorized.
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
ISA_FLAGS = {
    "avx512vnni": [*_AVX512, "-mavx512vnni"],
    "avx512": _AVX512,
    "avxvnni": [*_AVX2, "-mavxvnni"],
    "avx2": _AVX2,
    "portable": [],
}
# What each variant needs of the running CPU: torch's capability level (which ATEN_CPU_CAPABILITY
# can lower) and the features torch.cpu.get_capabilities() reports.
_NEEDS = {
    "avx512vnni": ("AVX512", "avx512_vnni"),
    "avx512": ("AVX512", None),
    "avxvnni": ("AVX2", "avx_vnni"),
    "avx2": ("AVX2", None),
    "portable": (None, None),
}
_LEVELS = {"AVX512": ("AVX512",), "AVX2": ("AVX512", "AVX2")}  # a level and those above it


def runnable() -> list[str]:
    """The variants this process's CPU runs, best first."""
    level = torch.backends.cpu.get_cpu_capability()
    features = torch.cpu.get_capabilities()
    return [
        variant for variant, (needs_level, feature) in _NEEDS.items()
        if (needs_level is None or level in _LEVELS[needs_level]) and (feature is None or features.get(feature, False))
    ]


def isa() -> str:
    """The variant this process builds and loads: the best its CPU runs, or GRAPHEXEC_KERNEL_ISA."""
    variants = runnable()
    chosen = os.environ.get("GRAPHEXEC_KERNEL_ISA") or variants[0]
    if chosen not in ISA_FLAGS:
        raise CheckpointError(f"GRAPHEXEC_KERNEL_ISA={chosen!r} is not a kernel variant; choose one of {list(ISA_FLAGS)}")
    if chosen not in variants:
        raise CheckpointError(
            f"GRAPHEXEC_KERNEL_ISA={chosen!r} needs instructions this CPU lacks (it runs {variants[0]!r}); "
            f"choose one of {variants}"
        )
    return chosen


def build_dir() -> Path:
    checkout = hashlib.sha1(str(_SOURCES[0].parent.resolve()).encode()).hexdigest()[:12]
    default = Path.home() / ".cache" / "graphexec" / "kernels" / torch.__version__.replace("+", "_") / checkout
    # An empty value is unset: Path("") is the working directory, which would fill with build files.
    return Path(os.environ.get("GRAPHEXEC_KERNEL_DIR") or default)


@functools.cache  # a shared library loads into the process once; cache() also serializes callers
def load() -> Path:
    """Build (if stale) and load the kernel library; raises CheckpointError naming the way out."""
    from torch.utils.cpp_extension import load as load_extension

    variant = isa()
    directory = build_dir() / variant
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "graphexec_kernels.so").exists():
        # Minutes of silence otherwise: a first build looks like a hang (logging is off in the CLIs).
        print(f"graphexec: building the C++ CPU kernels ({variant}) in {directory} (about a minute on 2 cores, once)", file=sys.stderr, flush=True)
    _clear_stale_lock(directory)
    try:
        with _own_ninja():
            load_extension(
                name="graphexec_kernels",
                sources=[str(s) for s in _SOURCES],
                extra_cflags=["-O3", *ISA_FLAGS[variant], "-fopenmp", "-DNDEBUG"],
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


# A build takes minutes on 2 cores; a lock this old outlived the process that built.
STALE_LOCK_S = 30 * 60
# torch takes the lock for an up-to-date library's no-op ninja run too (tensor-parallel ranks start
# at once): a lock younger than this is not worth a word.
_QUIET_LOCK_S = 10


def _clear_stale_lock(directory: Path) -> None:
    """torch's build lock (`lock` in the build directory) is a file that a killed build leaves
    behind, and every later start then waits on it forever, in silence.  Say that it waits, and
    remove a lock older than any build."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        print(f"graphexec: removing {lock}, left {age / 60:.0f} minutes ago by a kernel build that did not finish",
              file=sys.stderr, flush=True)
        lock.unlink(missing_ok=True)
    elif age > _QUIET_LOCK_S:
        print(f"graphexec: waiting for another process to finish building the C++ CPU kernels in {directory} "
              f"(if none is running, remove {lock})", file=sys.stderr, flush=True)


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
