"""Full-graph decode: the whole decode forward as one graph per batch-size bucket.

Built on the bucketed core (capture/bucketed.py: pad to the smallest bucket that holds the
batch, run, slice back; the `graph` option picks the mechanism).  What a bucket runs:
  compile     torch.compile(fullgraph=True) with static shapes per bucket (inductor); the
              attention op stays opaque inside, its metadata prepared outside.  The CPU default.
  cuda_graph  one CUDA graph per bucket: a segmented recording with zero breaks, every bucket in
              the engine's one memory pool, optionally over the compiled forward
              (`compile.enabled`).  The CUDA default.  Attention replays inside the graph against
              fixed-address metadata (`static_metadata_rows`).
  tape        the same recording through the op tape, always of the plain forward (compiled
              kernels issue no aten calls to record): the CUDA path on the CPU.
  eager       debug: the same padding and static buffers, plain module calls inside, so "is it
              the capture or the model?" is one override away.

`compile.regional` compiles the repeated decoder layer once and calls it for every layer.  With
`compile.aot` (the `compile` mechanism only) that layer is compiled ahead of time per bucket
(capture/aot_layer.py): no Dynamo frame per call, and, given the plan's artifact store
(`preset`), saved beside the plan so a later start with the same key loads it instead of
tracing and compiling.
"""

from __future__ import annotations

import os
import types
from typing import Any, Callable, Mapping

import torch

from capture.aot_layer import AotLayer
from capture.backend import CaptureEnv
from capture.batch import BucketableBatch, Phase
from capture.bucketed import BucketedBackend, BucketRunner
from capture.errors import CaptureConfigError

_COMPILE_OPTIONS = {"enabled", "mode", "dynamic", "freezing", "cache_dir", "regional", "skip_module_guards", "cpp_wrapper", "aot"}


class FullGraphBackend(BucketedBackend):
    """The ROWS phase with the whole forward as one graph per bucket (a graph with zero breaks)."""

    name = "full_graph"
    phase = Phase.ROWS
    extra_options = frozenset({"compile"})

    def __init__(self, env: CaptureEnv, options: Mapping[str, Any], config_path: str = "capture.decode"):
        super().__init__(env, options, config_path)
        self.compile_options = dict(self.options.get("compile") or {})
        unknown = sorted(set(self.compile_options) - _COMPILE_OPTIONS)
        if unknown:
            raise CaptureConfigError(f"{config_path}.compile.{unknown[0]} is unknown; known: {sorted(_COMPILE_OPTIONS)}")
        _check_aot(self.compile_options, f"{config_path}.compile")
        self._compiled: Callable | None = None
        self._aot: AotLayer | None = None

    def _bucket_forward(self) -> BucketRunner:
        # `compile.enabled` is a cuda_graph option: the tape records aten calls, which compiled
        # kernels do not make, so it always records the plain forward.
        over_compiled = self.mechanism == "cuda_graph" and bool(self.compile_options.get("enabled", False))
        compiled = self.mechanism == "compile" or over_compiled
        forward = self._compiled_forward() if compiled else self.env.model
        return lambda fb: forward(fb.input_ids, fb.positions)

    def _compiled_forward(self) -> Callable:
        if self._compiled is None:
            opts = self.compile_options
            if opts.get("cache_dir"):
                # Inductor reads its on-disk cache location from the environment.
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(opts["cache_dir"])
            options = self._inductor_options()
            mode = opts.get("mode", "default")
            if mode != "default" and options:
                raise CaptureConfigError(
                    f"{self.config_path}.compile.mode={mode!r} cannot be combined with freezing, skip_module_guards or cpp_wrapper"
                )
            compile_kwargs = dict(
                fullgraph=True,
                dynamic=bool(opts.get("dynamic", False)),
                **({"options": options} if options else {"mode": None if mode == "default" else mode}),
            )
            self._compiled = self._regional_forward(compile_kwargs) if opts.get("regional") else self._whole_forward(compile_kwargs)
        return self._compiled

    def _inductor_options(self) -> dict[str, Any]:
        opts = self.compile_options
        options: dict[str, Any] = {"freezing": True} if opts.get("freezing") else {}
        if opts.get("cpp_wrapper"):
            # Inductor's per-call wrapper in C++ instead of Python: the kernels of a graph are
            # launched without a Python frame between them.
            options["cpp_wrapper"] = True
        if opts.get("skip_module_guards"):
            # Weights never change identity or shape after loading, so checking every
            # module attribute on each call (30 times a step when regional) buys nothing.
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        return options

    def _regional_forward(self, compile_kwargs: dict[str, Any]) -> Callable:
        """Compile the repeated decoder layer once and call it for every layer: compile time stops
        scaling with depth.  layer_id must become symbolic for the layers to share a graph, so
        shapes are pinned with mark_static instead of dynamic=False (which would specialize every
        int)."""
        # TODO(issue 22, part 4): the 30 calls cost ~19 % of a B=1 step in Dynamo/AOT
        # wrappers (docs/STATUS.md has the profile; `aot` removes the Dynamo share).
        # nested_compile_region over this call fails (its guards see 30 layer modules); a
        # functional call over stacked per-layer weights would let one subgraph serve every layer
        # inside one whole-forward graph.
        dynamic = compile_kwargs.pop("dynamic")
        compiled_layer = torch.compile(_own_code(_call_layer), dynamic=True if dynamic else None, **compile_kwargs)
        model = self.env.model

        def run_layer(layer, positions, x, rotary, layer_id):
            if not dynamic:
                torch._dynamo.mark_static(x, 0)
                torch._dynamo.mark_static(positions, 0)
            return compiled_layer(layer, positions, x, rotary, layer_id)

        if self._uses_aot():
            self._aot = AotLayer(
                _own_code(_call_layer), compile_kwargs.get("options", {}), self.artifacts,
                f"{self.config_path}.layer", self.stats, fallback=run_layer, option=f"{self.config_path}.compile.aot",
            )
            run_layer = self._aot
        return lambda ids, pos: model(ids, pos, layer_runner=run_layer)

    def _whole_forward(self, compile_kwargs: dict[str, Any]) -> Callable:
        model = self.env.model

        # Our own top frame, not the model's forward: Dynamo may have marked that code
        # object as skipped after another backend's graph breaks (breakable), and a
        # skipped top frame would be compiled layer by layer instead of whole.
        def whole_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions)

        return torch.compile(_own_code(whole_forward), **compile_kwargs)

    def _uses_aot(self) -> bool:
        # TODO(gpu): the cuda_graph mechanism records over the Dynamo-compiled layer; an artifact
        # would spare a GPU start the trace too, but that path has never run.
        return self.mechanism == "compile" and bool(self.compile_options.get("aot", False))

    def _make_runner(self, bucket: int, batch: BucketableBatch) -> BucketRunner:
        runner = super()._make_runner(bucket, batch)
        if self._aot is not None:
            self._aot.trust(bucket)
        return runner


def _check_aot(opts: Mapping[str, Any], path: str) -> None:
    """`aot` persists the regional layer; torch 2.13 cannot serialize a frozen graph, a batch size
    left symbolic would specialize on its first bucket where Dynamo would recompile, and an
    inductor mode cannot be combined with the guard filter an artifact needs."""
    if not opts.get("aot"):
        return
    if opts.get("mode", "default") != "default":
        raise CaptureConfigError(f"{path}.aot=true needs {path}.mode=default (or set {path}.aot=false)")
    for option, wrong in (("regional", False), ("freezing", True), ("dynamic", True)):
        if bool(opts.get(option, False)) is wrong:
            raise CaptureConfigError(f"{path}.aot=true needs {path}.{option}={str(not wrong).lower()} (or set {path}.aot=false)")


def _call_layer(layer, positions, x, rotary, layer_id):
    return layer(positions, x, rotary, layer_id)


def _own_code(fn: Callable) -> Callable:
    """`fn` over a code object of its own.  Dynamo caches compiled graphs on the code object, so
    without this every backend in the process would share one cache, and with module guards
    skipped (`skip_module_guards`) one engine's graph could run another engine's different
    modules (seen: a dequantized model replaying a quantized model's layer graph)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
