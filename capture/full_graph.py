"""Full-graph decode: the whole decode forward as one graph per batch-size bucket.

The live batch is padded up to the smallest bucket that holds it (capture/padding.py), run
through that bucket's graph, and sliced back to its real rows.  What "graph" means depends on
the `graph` option:
  compile     torch.compile(fullgraph=True) with static shapes per bucket (inductor); the
              attention op stays opaque inside, its metadata prepared outside.  The CPU default.
  cuda_graph  one torch.cuda.CUDAGraph per bucket, captured largest first into one shared memory
              pool, optionally over the compiled forward.  The CUDA default.
  eager       debug: the same padding and static buffers, plain module calls inside, so "is it
              the capture or the model?" is one override away.
"""

from __future__ import annotations

import os
import types
from typing import Any, Callable, Mapping

import torch

from capture.backend import CaptureBackend, CaptureEnv
from capture.buckets import bucket_for, validate_buckets
from capture.padding import StaticInputs
from capture.errors import CaptureConfigError
from capture.batch import BucketableBatch, Phase

GRAPH_KINDS = ("auto", "compile", "cuda_graph", "eager")
_OPTIONS = {"buckets", "graph", "compile", "lazy", "progress"}
_COMPILE_OPTIONS = {"enabled", "mode", "dynamic", "freezing", "cache_dir", "regional", "skip_module_guards", "cpp_wrapper"}

BucketRunner = Callable[[BucketableBatch], torch.Tensor]


class FullGraphBackend(CaptureBackend):
    name = "full_graph"

    def __init__(self, env: CaptureEnv, options: Mapping[str, Any], config_path: str = "capture.decode"):
        super().__init__(env, options, config_path)
        unknown = sorted(set(self.options) - _OPTIONS)
        if unknown:
            raise CaptureConfigError(f"{config_path}.{unknown[0]} is not a full_graph option; known: {sorted(_OPTIONS)}")
        self.buckets = validate_buckets(self.options.get("buckets"), f"{config_path}.buckets")
        self.graph_kind = _resolve_graph_kind(self.options.get("graph", "auto"), env.device, config_path)
        self.compile_options = dict(self.options.get("compile") or {})
        unknown = sorted(set(self.compile_options) - _COMPILE_OPTIONS)
        if unknown:
            raise CaptureConfigError(f"{config_path}.compile.{unknown[0]} is unknown; known: {sorted(_COMPILE_OPTIONS)}")
        self.lazy = bool(self.options.get("lazy", False))
        self.buffers = StaticInputs(self.buckets[-1], env.device)
        self._runners: dict[int, BucketRunner] = {}
        self._compiled: Callable | None = None
        self._cuda_pool = None

    # -- capture -------------------------------------------------------------------------------

    def capture(self) -> None:
        if self.graph_kind == "cuda_graph":
            self.env.enable_static_metadata(self.buckets[-1])
        if not self.lazy:
            self._capture_each(self.buckets, f"{self.name} ({self.graph_kind})", self._capture_timed)

    def _capture_timed(self, bucket: int) -> BucketRunner:
        # Each bucket is a legitimate compile of the same code (two with regional compilation: the
        # first specializes layer_id), so lift Dynamo's recompile limit while capturing.
        limit = 2 * len(self.buckets) + 8
        with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=max(256, limit)):
            runner = self._measured(bucket, lambda: self._capture_bucket(bucket))
        self._runners[bucket] = runner
        return runner

    def _capture_bucket(self, bucket: int) -> BucketRunner:
        dummy = self.buffers.dummy_batch(bucket, self.env.padding, Phase.ROWS, self.env.empty_batch(Phase.ROWS))
        if self.graph_kind == "eager":
            return self._run_model
        if self.graph_kind == "compile":
            forward = self._compiled_forward()
            with self.env.forward_scope(dummy):
                forward(dummy.input_ids, dummy.positions)  # compiles this bucket's static shape
            return lambda fb: forward(fb.input_ids, fb.positions)
        return self._capture_cuda_graph(dummy)

    def _compiled_forward(self) -> Callable:
        if self._compiled is None:
            opts = self.compile_options
            if opts.get("cache_dir"):
                # Inductor reads its on-disk cache location from the environment.
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(opts["cache_dir"])
            options: dict[str, Any] = {"freezing": True} if opts.get("freezing") else {}
            if opts.get("cpp_wrapper"):
                # Inductor's per-call wrapper in C++ instead of Python: the kernels of a graph are
                # launched without a Python frame between them.
                options["cpp_wrapper"] = True
            if opts.get("skip_module_guards"):
                # Weights never change identity or shape after loading, so checking every
                # module attribute on each call (30 times a step when regional) buys nothing.
                options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
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
            if opts.get("regional"):
                # Compile the repeated decoder layer once and call it for every layer: compile
                # time stops scaling with depth.  layer_id must become symbolic for the layers to
                # share a graph, so shapes are pinned with mark_static instead of dynamic=False
                # (which would specialize every int).
                dynamic = compile_kwargs.pop("dynamic")
                compiled_layer = torch.compile(_own_code(_call_layer), dynamic=True if dynamic else None, **compile_kwargs)
                model = self.env.model

                def run_layer(layer, positions, x, rotary, layer_id):
                    if not dynamic:
                        torch._dynamo.mark_static(x, 0)
                        torch._dynamo.mark_static(positions, 0)
                    return compiled_layer(layer, positions, x, rotary, layer_id)

                self._compiled = lambda ids, pos: model(ids, pos, layer_runner=run_layer)
            else:
                model = self.env.model

                # Our own top frame, not the model's forward: Dynamo may have marked that code
                # object as skipped after another backend's graph breaks (breakable), and a
                # skipped top frame would be compiled layer by layer instead of whole.
                def whole_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
                    return model(input_ids, positions)

                self._compiled = torch.compile(_own_code(whole_forward), **compile_kwargs)
        return self._compiled

    def _capture_cuda_graph(self, dummy: BucketableBatch) -> BucketRunner:
        use_compile = bool(self.compile_options.get("enabled", False))
        forward = self._compiled_forward() if use_compile else self.env.model
        with self.env.forward_scope(dummy):
            for _ in range(2):  # warm-up: lazy inits, allocator, compilation happen outside capture
                forward(dummy.input_ids, dummy.positions)
            torch.cuda.synchronize(self.env.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._cuda_pool):
                static_out = forward(dummy.input_ids, dummy.positions)
        self._cuda_pool = graph.pool()

        def replay(fb: BucketableBatch) -> torch.Tensor:
            graph.replay()
            return static_out

        return replay

    def _run_model(self, fb: BucketableBatch) -> torch.Tensor:
        return self.env.model(fb.input_ids, fb.positions)

    # -- serving -------------------------------------------------------------------------------

    def can_run(self, fb: BucketableBatch) -> bool:
        if not fb.forward_mode.is_decode_or_idle():
            return False
        bucket = bucket_for(fb.batch_size, self.buckets)
        return bucket is not None and (self.lazy or bucket in self._runners)

    def execute(self, fb: BucketableBatch) -> torch.Tensor:
        bucket = bucket_for(fb.batch_size, self.buckets)
        runner = self._runners.get(bucket) or self._capture_timed(bucket)
        padded = self.buffers.load(fb, bucket, self.env.padding)
        with self.env.forward_scope(padded):
            hidden = runner(padded)
        self.stats.executions += 1
        self.stats.padded_rows += bucket - fb.batch_size
        return hidden[: fb.num_token_non_padded]


def _call_layer(layer, positions, x, rotary, layer_id):
    return layer(positions, x, rotary, layer_id)


def _own_code(fn: Callable) -> Callable:
    """`fn` over a code object of its own.  Dynamo caches compiled graphs on the code object, so
    without this every backend in the process would share one cache, and with module guards
    skipped (`skip_module_guards`) one engine's graph could run another engine's different
    modules (seen: a dequantized model replaying a quantized model's layer graph)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _resolve_graph_kind(kind: str, device: torch.device, config_path: str) -> str:
    if kind not in GRAPH_KINDS:
        raise CaptureConfigError(f"{config_path}.graph={kind!r} is unknown; choose one of {list(GRAPH_KINDS)}")
    if kind == "auto":
        return "cuda_graph" if device.type == "cuda" else "compile"
    if kind == "cuda_graph" and device.type != "cuda":
        raise CaptureConfigError(f"{config_path}.graph=cuda_graph needs device=cuda; this engine runs on {device.type}")
    return kind
