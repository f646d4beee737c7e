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

Options (under capture.extend / capture.mixed): capture/options.py's `TcPiecewiseOptions`: the
bucketed ones, `compiler` (inductor | eager | tensorrt) and `split_ops` (default: the caller's
`CaptureEnv.split_ops`; graphexec: [graphexec::attention]).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from capture.backend import CaptureEnv
from capture.batch import BucketableBatch
from capture.break_points import run_break, run_piece
from capture.graph_split import SplitGraph, split_at_ops, structure_key
from capture.options import TcPiecewiseOptions
from capture.own_frame import own_forward
from capture.piecewise import PieceForward, PiecewiseBackend

# The break-point name the split-op pieces answer to while a bucket is recorded.
SPLIT = "tc_piecewise_split"

CompilePiece = Callable[[torch.fx.GraphModule, Sequence[torch.Tensor]], Callable[..., Any]]


class PieceCache:
    """Compiled pieces by structure and input layout, so identical pieces compile once: the
    middle pieces of a forward (o_proj, MLP, next layer's qkv and rope) differ only in which
    weights they are handed, and weights are inputs, not constants."""

    def __init__(self, compile_piece: CompilePiece):
        self._compile_piece = compile_piece
        self._compiled: dict[tuple, Callable[..., Any]] = {}

    def get(self, piece: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        key = (structure_key(piece), tuple(_layout(x) for x in example_inputs))
        if key not in self._compiled:
            self._compiled[key] = self._compile_piece(piece, list(example_inputs))
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
    options: TcPiecewiseOptions
    options_type = TcPiecewiseOptions
    implicit_segments = False  # the split module hands over its pieces: each recorded alone

    def __init__(self, env: CaptureEnv, options: TcPiecewiseOptions | Mapping[str, Any], config_path: str = "capture.extend"):
        super().__init__(env, options, config_path)
        self.split_ops = frozenset(self.options.split_ops or env.split_ops)
        self.piece_cache = PieceCache(self._compile_piece)
        # The bucket being traced: Dynamo calls our backend from inside `_run_pieces`, which sets it.
        self._tracing_bucket: int | None = None

    def _compile_piece(self, piece: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
        self.stats.compiles += 1
        return PIECE_COMPILERS[self.options.compiler](piece, example_inputs)

    def _build_forward(self) -> PieceForward:
        return torch.compile(own_forward(self.env.model), backend=self._split_and_compile, fullgraph=True, dynamic=False)

    def _run_pieces(self, fb: BucketableBatch) -> torch.Tensor:
        bucket = self._tracing_bucket = int(fb.input_ids.shape[0])
        try:
            hidden = self._forward(fb.input_ids, fb.positions)
        finally:
            self._tracing_bucket = None
        if not self.stats.splits.get(bucket):
            # Correct but not piecewise: refuse rather than serve it under this backend's name.
            raise RuntimeError(
                f"{self.name}: the {bucket}-token forward did not reach the backend as one graph cut at "
                f"{sorted(self.split_ops)} (check {self.config_path}.split_ops)"
            )
        return hidden

    def _split_and_compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """The Dynamo backend: one call per bucket (static shapes), with the whole forward."""
        split = split_at_ops(gm, self.split_ops)
        if self.options.compiler != "eager":
            compile_pieces(split, example_inputs, self.piece_cache)
        for piece in split.pieces:
            callable_piece = getattr(split.module, piece.name)
            delattr(split.module, piece.name)  # a submodule slot takes only modules
            wrapper = _SplitOpBreak if piece.is_split_op else _GraphedPiece
            setattr(split.module, piece.name, wrapper(callable_piece))
        if self._tracing_bucket is not None:
            self.stats.pieces[self._tracing_bucket] = split.num_pieces
            self.stats.splits[self._tracing_bucket] = split.num_splits
        return split.module

