"""tc_piecewise: one Dynamo trace of the whole forward, split at the attention op into pieces.

torch.compile(fullgraph=True, dynamic=False) traces the forward once per token bucket; the
attention custom op is opaque in that trace.  Our Dynamo backend receives the FX graph, cuts it
at every call of a split op (capture/graph_split.py) into [piece0, attn, piece1, ..., pieceN],
compiles each piece with the configured compiler (on Dynamo's fake example inputs, while the
bucket is traced; structurally identical pieces, i.e. every middle layer's, compile once), and
leaves the split ops to run eagerly between the pieces.  With `graph: cuda_graph` (the CUDA
default) each bucket's run of the split module is then recorded (capture/segments.py): every
compiled piece becomes one CUDA graph, all in one shared pool, and the split ops act as break
points, run eagerly between the graphs on replay.

The attention op writes its result into `out`, an `empty_like` made in the piece before it and
read by the piece after it.  The split module hands that very tensor object from the first piece
to the op and then to the next piece, and runs them in the original order, so the write is seen.

Options (under capture.extend / capture.mixed), besides buckets/progress/lazy:
  graph      auto | compile | cuda_graph | tape | eager (capture/bucketed.py); tape records aten calls,
             so it needs compiler=eager (inductor's kernels do not go through the dispatcher)
  compiler   inductor (default) | eager (the same pieces, uncompiled: debugging) | tensorrt
             (needs CUDA and torch_tensorrt; each piece goes to its Dynamo backend)
  split_ops  qualified names of the ops the graph is cut at; default: the caller's
             `CaptureEnv.split_ops` (graphexec: [graphexec::attention])
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from capture.backend import CaptureEnv
from capture.batch import BucketableBatch
from capture.break_points import run_break, run_piece
from capture.errors import CaptureConfigError
from capture.graph_split import SplitGraph, split_at_ops, structure_key
from capture.piecewise import PieceForward, PiecewiseBackend

# The break-point name the split-op pieces answer to while a bucket is recorded.
SPLIT = "tc_piecewise_split"
COMPILERS = ("inductor", "eager", "tensorrt")

CompilePiece = Callable[[torch.fx.GraphModule, Sequence[torch.Tensor]], Callable[..., Any]]


class PieceCache:
    """Compiled pieces by structure and input layout, so identical pieces compile once: the
    middle pieces of a forward (o_proj, MLP, next layer's qkv and rope) differ only in which
    weights they are handed, and weights are inputs, not constants."""

    def __init__(self, compile_piece: CompilePiece):
        self._compile_piece = compile_piece
        self._compiled: dict[tuple, Callable[..., Any]] = {}
        self.compiles = 0  # calls of the compiler, all buckets together

    def get(self, piece: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        key = (structure_key(piece), tuple(_layout(x) for x in example_inputs))
        if key not in self._compiled:
            self._compiled[key] = self._compile_piece(piece, list(example_inputs))
            self.compiles += 1
        return self._compiled[key]


class _PieceSwapper(torch.fx.Interpreter):
    """Runs the split module on fake tensors, replacing each non-split piece, as it is reached,
    by its compiled form for the fake tensors that reach it."""

    def __init__(self, split: SplitGraph, cache: PieceCache):
        super().__init__(split.module)
        self._cache = cache
        self._to_compile = {p.name for p in split.pieces if not p.is_split_op}

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        # Fake outputs for the pieces after this one (a split op runs its fake implementation).
        output = super().call_module(target, args, kwargs)
        if target in self._to_compile:
            compiled = self._cache.get(getattr(self.module, target), args)
            # A plain callable in place of the submodule: the split module's code calls it the same.
            delattr(self.module, target)
            setattr(self.module, target, compiled)
        return output


def compile_pieces(split: SplitGraph, example_inputs: Sequence[Any], cache: PieceCache) -> None:
    """Compile every non-split piece of `split.module` in place.

    Done inside Dynamo's backend call, on its fake example inputs, rather than lazily on the
    first real call: inductor's FX graph cache keys on Dynamo's shape environment, which exists
    only here, so compiling later would bypass the on-disk cache on every start.
    """
    # Dynamo hands parameters over as real tensors and activations as fakes of its own mode.
    fake_mode = torch._guards.detect_fake_mode(example_inputs) or FakeTensorMode()
    fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    with fake_mode:
        _PieceSwapper(split, cache).run(*fakes)


def _layout(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device, x.requires_grad)
    return repr(x)


def compile_with_inductor(piece: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    # Called with the piece's arguments unpacked; returns its outputs as a list.
    return compile_fx(piece, example_inputs)


def compile_with_tensorrt(piece: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
    # TODO(gpu): never run (no device with torch_tensorrt has been lent).  Importing the package
    # registers its Dynamo backend, which takes a piece like any Dynamo backend does; whether it
    # accepts the fake example inputs that compile_pieces hands every compiler is unverified.
    import torch_tensorrt  # noqa: F401

    return torch._dynamo.lookup_backend("torch_tensorrt")(piece, list(example_inputs))


PIECE_COMPILERS: Mapping[str, CompilePiece] = {"inductor": compile_with_inductor, "tensorrt": compile_with_tensorrt}


class _SplitOpBreak:
    """A split-op piece of the split module, as a break point: called plainly, except while a
    bucket is recorded, when it runs eagerly between the recorded pieces."""

    def __init__(self, piece: Callable[..., Any]):
        self.piece = piece

    def __call__(self, *args: Any) -> Any:
        return run_break(SPLIT, self.piece, args, {})


class _GraphedPiece:
    """A compiled piece: called plainly, except while a bucket is recorded, when it is recorded
    as a graph of its own (on CUDA: one CUDA graph per piece per bucket, in the shared pool)."""

    def __init__(self, piece: Callable[..., Any]):
        self.piece = piece

    def __call__(self, *args: Any) -> Any:
        return run_piece(self.piece, args)


class TcPiecewiseBackend(PiecewiseBackend):
    name = "tc_piecewise"
    implicit_segments = False  # the split module hands over its pieces: each recorded alone
    extra_options = PiecewiseBackend.extra_options | {"compiler", "split_ops"}

    def __init__(self, env: CaptureEnv, options: Mapping[str, Any], config_path: str = "capture.extend"):
        self.compiler = _resolve_compiler(options.get("compiler", "inductor"), env.device, config_path)
        super().__init__(env, options, config_path)
        if self.mechanism == "tape" and self.compiler != "eager":
            raise CaptureConfigError(
                f"{config_path}.graph=tape records aten calls, which {self.compiler}'s compiled pieces do not make; "
                f"set {config_path}.compiler=eager"
            )
        self.split_ops = _resolve_split_ops(self.options.get("split_ops", list(env.split_ops)), config_path)
        self.pieces_per_bucket: dict[int, int] = {}  # compiled (non-split) pieces in each bucket's graph
        self.splits_per_bucket: dict[int, int] = {}  # split-op calls in each bucket's graph
        self.piece_cache = PieceCache(PIECE_COMPILERS.get(self.compiler, compile_with_inductor))
        # The bucket being traced: Dynamo calls our backend from inside `_run_pieces`, which sets it.
        self._tracing_bucket: int | None = None

    def _build_forward(self) -> PieceForward:
        model = self.env.model

        # A top frame of our own rather than the model's forward: Dynamo marks a code object it
        # could not trace in one go as skipped for every later compile, whatever the backend
        # (the breakable backend's graph breaks do that to LlamaForCausalLM.forward), and from a
        # skipped top frame Dynamo would hand us each layer's frames separately.  Inlined, the
        # model's forward is traced whatever its mark.
        def whole_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions)

        return torch.compile(whole_forward, backend=self._split_and_compile, fullgraph=True, dynamic=False)

    def _run_pieces(self, fb: BucketableBatch) -> torch.Tensor:
        bucket = self._tracing_bucket = int(fb.input_ids.shape[0])
        try:
            hidden = self._forward(fb.input_ids, fb.positions)
        finally:
            self._tracing_bucket = None
        if not self.splits_per_bucket.get(bucket):
            # Correct but not piecewise: refuse rather than serve it under this backend's name.
            raise RuntimeError(
                f"{self.name}: the {bucket}-token forward did not reach the backend as one graph cut at "
                f"{sorted(self.split_ops)} (check {self.config_path}.split_ops)"
            )
        return hidden

    def _split_and_compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """The Dynamo backend: one call per bucket (static shapes), with the whole forward."""
        split = split_at_ops(gm, self.split_ops)
        if self.compiler != "eager":
            compile_pieces(split, example_inputs, self.piece_cache)
        for piece in split.pieces:
            callable_piece = getattr(split.module, piece.name)
            delattr(split.module, piece.name)  # a submodule slot takes only modules
            wrapper = _SplitOpBreak if piece.is_split_op else _GraphedPiece
            setattr(split.module, piece.name, wrapper(callable_piece))
        if self._tracing_bucket is not None:
            self.pieces_per_bucket[self._tracing_bucket] = split.num_pieces
            self.splits_per_bucket[self._tracing_bucket] = split.num_splits
        return split.module


def _resolve_compiler(compiler: Any, device: torch.device, config_path: str) -> str:
    option = f"{config_path}.compiler"
    if compiler not in COMPILERS:
        raise CaptureConfigError(f"{option}={compiler!r} is unknown; choose one of {list(COMPILERS)}")
    if compiler == "tensorrt" and (device.type != "cuda" or importlib.util.find_spec("torch_tensorrt") is None):
        raise CaptureConfigError(
            f"{option}=tensorrt needs device=cuda and torch_tensorrt installed (the `gpu` extra); "
            f"this engine runs on {device.type}"
        )
    return compiler


def _resolve_split_ops(split_ops: Any, config_path: str) -> frozenset[str]:
    """Qualified names ('namespace::name') of registered ops, or a CaptureConfigError naming the option."""
    option = f"{config_path}.split_ops"
    if isinstance(split_ops, str) or not split_ops or not all(isinstance(op, str) for op in split_ops):
        raise CaptureConfigError(f"{option} must be a non-empty list of op names like [namespace::attention], got {split_ops!r}")
    for op in split_ops:
        namespace, _, name = op.partition("::")
        if not (namespace and name and _is_registered(namespace, name)):
            raise CaptureConfigError(f"{option}: {op!r} is not a registered op ('namespace::name')")
    return frozenset(split_ops)


def _is_registered(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True
