"""Every capture option: one frozen dataclass per backend, each field documented where it is declared.

The one place to read what a capture backend takes.  A field's docstring says what it does, its
default is the field's own, and its check (capture/option_checks.py) is named beside it.  Config
data (a mode's entry under `capture.*`, as the YAML spells it) becomes one of these through
`capture.option_parser.options_for`, which checks every value once; a backend only reads them.
docs/CAPTURE_OPTIONS.md is rendered from this module (capture/option_docs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import capture.option_checks as check

# The `graph` option: what runs a bucket (capture/bucketed.py).
MECHANISMS = ("auto", "compile", "cuda_graph", "tape", "eager")
KEEP_POLICIES = ("all", "faster")
# What compiles a tc_piecewise piece (capture/tc_piecewise.py).
COMPILERS = ("inductor", "eager", "tensorrt")
INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
PIECEWISE_VARIANTS = ("auto", "breakable", "tc_piecewise")


def _option(default: Any, value_check: check.Check) -> Any:
    return field(default=default, metadata={"check": value_check})


@dataclass(frozen=True)
class CaptureOptions:
    """The options of one capture backend."""

    backend: ClassVar[str] = ""


@dataclass(frozen=True)
class EagerOptions(CaptureOptions):
    """`eager`: plain module calls, any shape, any mode; always available, always correct.  It
    takes no options and ignores any its entry still holds, so `capture.<mode>.backend=eager`
    turns a mode's graphs off without deleting their options."""

    backend: ClassVar[str] = "eager"


@dataclass(frozen=True)
class BucketedOptions(CaptureOptions):
    """What every graph backend takes: its buckets, what runs them, and which graphs it keeps
    (capture/bucketed.py)."""

    buckets: tuple[int, ...] = field(metadata={"check": check.buckets})
    """The sizes captured, ascending without repeats: requests (decode) or tokens (prefill).  A
    batch runs in the smallest bucket that holds it; a larger one runs eager."""
    graph: str = _option("auto", check.choice(MECHANISMS))
    """What runs a bucket: auto (compile on CPU, cuda_graph on CUDA) | compile (the compiled
    forward, called directly) | cuda_graph (CUDA graphs recorded once per bucket, replayed; needs
    device=cuda) | tape (that recording through the op tape, on any device: tests) | eager (the
    plain model on the padded batch: debugging)."""
    lazy: bool = _option(False, check.flag)
    """true: capture a bucket on its first batch instead of ahead of serving."""
    progress: bool = _option(True, check.flag)
    """A progress bar while capturing."""
    max_padding: float = _option(1.0, check.fraction)
    """The largest share of a bucket that may be padding; a batch that would need more runs eager
    (counted as a fallback).  Decode pads whole requests, which cost little next to the weights
    every row reads."""
    keep: str = _option("all", check.choice(KEEP_POLICIES))
    """all: keep every graph (benchmarks, GPUs) | faster: time each bucket's graph against eager on
    its capture batch and keep it only if min_speedup times faster; a dropped bucket runs eager."""
    min_speedup: float = _option(1.05, check.speedup)
    """keep=faster: eager ms / graph ms a graph must measure to be kept (one timing on a small
    shared CPU is a few percent noisy, even interleaved)."""


@dataclass(frozen=True)
class CompileOptions:
    """`full_graph`'s `compile`: how torch.compile builds the decode forward."""

    enabled: bool = _option(False, check.flag)
    """graph=cuda_graph only: record over the torch.compile'd forward instead of the plain one
    (tape always records the plain forward: compiled kernels make no aten calls to record)."""
    mode: str = _option("default", check.choice(INDUCTOR_MODES))
    """Inductor's mode; anything but default cannot be combined with freezing, skip_module_guards
    or cpp_wrapper."""
    dynamic: bool = _option(False, check.flag)
    """true: one compile with a symbolic batch size for every bucket above 1 instead of one per
    bucket (B=1 keeps its own: Dynamo specializes a size of 1).  With aot, one artifact serves
    them all: one compile on a cold start, one load on a warm one.  With aoti, B=1 shares the
    package too (exported on two rows, its row count a Dim from 1)."""
    freezing: bool = _option(False, check.flag)
    """Inductor freezing: weights as constants, prepacked."""
    cache_dir: str | None = _option(None, check.directory)
    """Inductor's on-disk cache for this backend's compiles and loads; null: inductor's own
    (TORCHINDUCTOR_CACHE_DIR, else a per-user temporary directory)."""
    regional: bool = _option(False, check.flag)
    """Compile the repeated decoder layer once and call it for every layer, so compile time stops
    growing with depth (false: the whole forward as one graph)."""
    whole_forward_buckets: tuple[int, ...] = _option((), check.bucket_subset)
    """With regional and graph=compile (a recorded graph has no call per layer to save): the
    buckets that compile the whole forward as one graph anyway, captured after the others.  Their
    compile takes about as many times longer as the model has layers; their steps make no call per
    layer and fuse across layers (SmolLM2: B=1 ~1.3x, B=8 ~1.1x the regional layer's step,
    bench=decode).  Sizes not in `buckets` are ignored, so narrowing `buckets` needs no second
    override."""
    skip_module_guards: bool = _option(False, check.flag)
    """Drop Dynamo's per-call guards on module attributes: weights never change identity or shape
    after loading (25 -> 6 us a layer call)."""
    cpp_wrapper: bool = _option(False, check.flag)
    """Inductor's per-call wrapper in C++: a graph's kernels launch with no Python between them."""
    aot: bool = _option(False, check.flag)
    """Each bucket's region (the regional layer, or the whole forward) compiled ahead of time (no
    Dynamo frame per call) and, with capture.cache_dir set, saved beside the plan so a later start
    loads it instead of compiling.  Needs mode default and no freezing; graph=compile only."""
    aoti: bool = _option(False, check.flag)
    """With aot (ignored without): each whole-forward bucket exported (torch.export) and compiled by AOTInductor into
    a package, without the weights (the loader is handed the live model's), that torch's C++ loader
    opens in milliseconds without importing Dynamo or inductor: a warm start's graphs are live about
    as soon as the weights are loaded (capture/aoti_forward.py).  The regional layer keeps aot's
    format.  A forward that cannot be exported (collectives inside: tensor parallelism) is compiled
    by Dynamo instead, with one warning."""
    interim_buckets: tuple[int, ...] = _option((), check.bucket_subset)
    """With aot, for the whole-forward buckets a capture process builds apart
    (capture.compile_in_child): that process first builds the regional layer ahead of time for
    these (seconds, where the whole forward takes a minute or more cold), and each serves from it
    meanwhile if it times faster than eager (the `interim` state).  The whole forward replaces it
    once built, timed on its own; only that decision is kept in the plan.  A warm start loads the
    whole forward and never this.  Each stand-in is timed on the engine loop with the capture
    process stopped, so a large bucket's stand-in (a few percent faster, ~2.5 s of timing at
    SmolLM2 B=64) delays the whole forward more than it serves.  Sizes not in `buckets` are ignored."""


@dataclass(frozen=True)
class FullGraphOptions(BucketedOptions):
    """`full_graph` (decode, idle): the whole forward as one graph per batch-size bucket
    (capture/full_graph.py)."""

    backend: ClassVar[str] = "full_graph"
    compile: CompileOptions = field(default_factory=CompileOptions, metadata={"options": CompileOptions})
    """How torch.compile builds the forward: the compile.* options."""


@dataclass(frozen=True)
class PiecewiseOptions(BucketedOptions):
    """What both prefill backends take (extend, mixed): the forward cut into pieces, a bucket
    counting tokens; the per-request layout stays the real one (capture/piecewise.py)."""

    max_padding: float = _option(0.05, check.fraction)
    """The largest share of a bucket that may be padding; a batch that would need more runs eager
    (counted as a fallback).  A prefill's compute grows with its padded tokens, and on the CPU
    pieces measured only 1-7 % faster than eager (bench=prefill)."""


@dataclass(frozen=True)
class BreakableOptions(PiecewiseOptions):
    """`breakable`: the forward cut at its @break_point functions, which run eagerly between the
    compiled or recorded segments (capture/breakable.py)."""

    backend: ClassVar[str] = "breakable"
    breaks: tuple[str, ...] = _option(("attention",), check.break_names)
    """The break points the forward is cut at (names given to @break_point; debug: one break
    around the whole forward, so everything runs eagerly)."""


@dataclass(frozen=True)
class TcPiecewiseOptions(PiecewiseOptions):
    """`tc_piecewise`: one Dynamo trace of the whole forward per bucket, split at the split ops
    into pieces compiled one by one (capture/tc_piecewise.py)."""

    backend: ClassVar[str] = "tc_piecewise"
    compiler: str = _option("inductor", check.choice(COMPILERS))
    """What compiles each piece: inductor | eager (the same pieces uncompiled: debugging, and what
    graph=tape needs, as it records aten calls) | tensorrt (needs CUDA and torch_tensorrt)."""
    split_ops: tuple[str, ...] | None = _option(None, check.op_names)
    """Qualified names ('namespace::name') of the registered ops the trace is cut at; null: the
    caller's break-point ops (graphexec: [graphexec::attention])."""


@dataclass(frozen=True)
class PiecewiseChoice:
    """`piecewise` (extend, mixed): the prefill backend named by its role.  `variant` picks the
    implementation; every other option is the variant's."""

    variant: str = _option("auto", check.choice(PIECEWISE_VARIANTS))
    """auto (breakable on CUDA, where Breakable CUDA Graph needs no compiler; tc_piecewise
    elsewhere, what measured best on the CPU: bench=prefill) | breakable | tc_piecewise."""


# Backend name -> its options, in the order the docs list them.
OPTIONS: Mapping[str, type[CaptureOptions]] = {
    "full_graph": FullGraphOptions,
    "breakable": BreakableOptions,
    "tc_piecewise": TcPiecewiseOptions,
    "eager": EagerOptions,
}
PIECEWISE = "piecewise"
