"""Full-graph decode: the whole decode forward as one graph per batch-size bucket.

Built on the bucketed core (capture/bucketed.py: pad to the smallest bucket that holds the
batch, run, slice back; the `graph` option picks the mechanism).  What a bucket runs:
  compile     torch.compile(fullgraph=True) with static shapes per bucket (inductor), or with
              `compile.dynamic` one graph for every bucket above 1 (its row count symbolic); the
              attention op stays opaque inside, its metadata prepared outside.  The CPU default.
  cuda_graph  one CUDA graph per bucket: a segmented recording with zero breaks, every bucket in
              the engine's one memory pool, optionally over the compiled forward
              (`compile.enabled`).  The CUDA default.  Attention replays inside the graph against
              fixed-address metadata (`static_metadata_rows`).
  tape        the same recording through the op tape, always of the plain forward (compiled
              kernels issue no aten calls to record): the CUDA path on the CPU.
  eager       debug: the same padding and static buffers, plain module calls inside, so "is it
              the capture or the model?" is one override away.

`compile.regional` compiles the repeated decoder layer once and calls it for every layer, but for
the buckets in `compile.whole_forward_buckets`, which compile the whole forward as one graph: a
compile as many times longer as there are layers, for a step without a call per layer and with
fusion across layers (B=1's, where those calls weigh most).  With `compile.aot` (the `compile`
mechanism only) each bucket's region, layer or whole forward, is compiled ahead of time
(capture/aot_region.py): no Dynamo frame per call, and, given the plan's artifact store
(`preset`), saved beside the plan so a later start with the same key loads it instead of
tracing and compiling.  The whole-forward buckets in `compile.interim_buckets` built apart (by the
capture process) serve meanwhile from the regional layer compiled ahead of time, a stand-in that
process builds first: seconds where the whole forward's package takes a minute or more
(docs/STATUS.md, issue 22: the cold routes measured).  Every option, checked, is
capture/options.py's `FullGraphOptions`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Mapping

import torch

from capture.aot_region import AotRegion, artifact_name, layer_structure, slot_of
from capture.aoti_forward import AotiForward, package_slot
from capture.backend import CaptureEnv
from capture.batch import BucketableBatch, Phase
from capture.bucketed import BucketedBackend, BucketRunner
from capture.inductor_cache import inductor_cache_dir
from capture.options import FullGraphOptions
from capture.own_frame import own_code, own_forward


class FullGraphBackend(BucketedBackend):
    """The ROWS phase with the whole forward as one graph per bucket (a graph with zero breaks)."""

    name = "full_graph"
    phase = Phase.ROWS
    options: FullGraphOptions
    options_type = FullGraphOptions

    def __init__(self, env: CaptureEnv, options: FullGraphOptions | Mapping[str, Any], config_path: str = "capture.decode"):
        super().__init__(env, options, config_path)
        self._regional: Callable | None = None
        self._whole: Callable | None = None
        self._aots: list[AotRegion | AotiForward] = []  # one per distinct layer structure, and the whole forward's
        self._packages: AotiForward | None = None  # the whole forward's, with compile.aoti

    def pending_buckets(self) -> list[int]:
        # A whole forward compiles as many times longer as the model is deep: every regional
        # bucket goes first, so while they are captured in the background a request waits at
        # most one short compile.  A stored one only loads (a fraction of a second): it keeps its
        # place, so a warm start makes B=1 live first.
        pending = super().pending_buckets()
        return sorted(pending, key=lambda bucket: self._is_whole(bucket) and not self._stored(bucket))

    def builds_apart(self, bucket: int) -> bool:
        # Only an ahead-of-time compiled region persists.
        return self._uses_aot() and self.artifacts is not None and not self._stored(bucket)

    def only_loads(self, bucket: int) -> bool:
        return not self.load_needs_compiler(bucket) and self._stored(bucket)

    def load_needs_compiler(self, bucket: int) -> bool:
        # Only a package loads without importing Dynamo and inductor (~2.5 s in the first load
        # of a process, compile.aot's artifacts).
        return not self._packaged(bucket)

    def _packaged(self, bucket: int) -> bool:
        """Whether `bucket` runs an AOTInductor package (capture/aoti_forward.py)."""
        return self._uses_aot() and self.options.compile.aoti and self._is_whole(bucket)

    def compiled_with(self, bucket: int) -> str:
        return self._artifact_of(bucket) if self._uses_aot() else super().compiled_with(bucket)

    def _artifact_of(self, bucket: int) -> str:
        dynamic = self.options.compile.dynamic
        slot = package_slot(bucket, dynamic, max(self.buckets)) if self._packaged(bucket) else slot_of(bucket, dynamic)
        return artifact_name(self._region(self._is_whole(bucket)), slot)

    def _stored(self, bucket: int) -> bool:
        """Whether the bucket's region is in the artifact store.  A regional bucket counts as
        stored once the first layer structure's artifact is there (a file mixing structures
        compiles its others on load)."""
        if not self._uses_aot() or self.artifacts is None:
            return False
        return self.artifacts.path(self._artifact_of(bucket)).exists()

    def _region(self, whole: bool) -> str:
        """The name the whole forward's region, or the regional layer's (its first structure's), is
        stored under: what `builds_apart` looks for is what `_aot` saves."""
        return f"{self.config_path}.{'forward' if whole else 'layer'}"

    def _is_whole(self, bucket: int) -> bool:
        opts = self.options.compile
        if not opts.regional:
            return True
        # Only the compile mechanism pays a Python call per layer; a recorded CUDA graph replays
        # the layers without one.  TODO(gpu): measure whether cross-layer fusion pays there too.
        return self.mechanism == "compile" and bucket in opts.whole_forward_buckets

    def _bucket_forward(self, bucket: int) -> BucketRunner:
        # `compile.enabled` is a cuda_graph option: the tape records aten calls, which compiled
        # kernels do not make, so it always records the plain forward.
        over_compiled = self.mechanism == "cuda_graph" and self.options.compile.enabled
        compiled = self.mechanism == "compile" or over_compiled
        forward = self._compiled_forward(bucket) if compiled else self.env.model
        return lambda fb: forward(fb.input_ids, fb.positions)

    def _interim_possible(self, bucket: int) -> bool:
        return bucket in self.options.compile.interim_buckets and self._is_whole(bucket)

    def _interim_stored(self, bucket: int) -> bool:
        return self.artifacts is not None and self.artifacts.path(self.interim_compiled_with(bucket)).exists()

    def interim_compiled_with(self, bucket: int) -> str:
        return artifact_name(self._region(whole=False), slot_of(bucket, self.options.compile.dynamic))

    def _make_interim_runner(self, bucket: int, batch: BucketableBatch) -> BucketRunner:
        regional = self._compiled_forward(bucket, whole=False)

        def forward(fb: BucketableBatch) -> torch.Tensor:
            return regional(fb.input_ids, fb.positions)

        self._first_run(bucket, lambda: forward(batch))
        return forward

    def _compiled_forward(self, bucket: int, whole: bool | None = None) -> Callable:
        if not (self._is_whole(bucket) if whole is None else whole):
            if self._regional is None:
                self._regional = self._regional_forward(self._compile_kwargs())
            return self._regional
        if self._whole is None:
            self._whole = self._whole_forward(self._compile_kwargs())
        return self._whole

    def _compile_kwargs(self) -> dict[str, Any]:
        opts = self.options.compile
        options = self._inductor_options()
        return dict(
            fullgraph=True,
            dynamic=opts.dynamic,
            # A mode is torch.compile's alternative to inductor options (capture/option_parser.py
            # refuses both at once).
            **({"options": options} if options else {"mode": None if opts.mode == "default" else opts.mode}),
        )

    def _inductor_options(self) -> dict[str, Any]:
        opts = self.options.compile
        options: dict[str, Any] = {"freezing": True} if opts.freezing else {}
        if opts.cpp_wrapper:
            # Inductor's per-call wrapper in C++ instead of Python: the kernels of a graph are
            # launched without a Python frame between them.
            options["cpp_wrapper"] = True
        if opts.skip_module_guards:
            # Weights never change identity or shape after loading, so checking every
            # module attribute on each call (30 times a step when regional) buys nothing.
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        return options

    def _regional_forward(self, compile_kwargs: dict[str, Any]) -> Callable:
        """Compile the repeated decoder layer once and call it for every layer: compile time stops
        scaling with depth.  layer_id must become symbolic for the layers to share a graph, so
        shapes are pinned with mark_static instead of dynamic=False (which would specialize every
        int)."""
        dynamic = compile_kwargs.pop("dynamic")
        model = self.env.model
        # One compiled layer per layer structure: a file may mix weight types between layers (a
        # K-quant file's attn_v and ffn_down in some layers only), and with module guards skipped
        # a graph traced on one structure must never be handed a layer of another.
        by_structure: dict[tuple, Callable] = {}
        runners: dict[int, Callable] = {}  # id(layer) -> its structure's runner: a dict hit a call

        def run_layer(layer, positions, x, rotary, layer_id):
            run = runners.get(id(layer))
            if run is None:
                structure = layer_structure(layer)
                if structure not in by_structure:
                    by_structure[structure] = self._layer_runner(len(by_structure), dynamic, compile_kwargs)
                run = runners[id(layer)] = by_structure[structure]
            return run(layer, positions, x, rotary, layer_id)

        return lambda ids, pos: model(ids, pos, layer_runner=run_layer)

    def _layer_runner(self, index: int, dynamic: bool, compile_kwargs: dict[str, Any]) -> Callable:
        """The compiled layer for the index-th distinct layer structure (its own code object, so
        its own Dynamo cache; its own artifact)."""
        compiled_layer = _torch_compile(own_code(_call_layer), compile_kwargs, dynamic=True if dynamic else None)

        def run(layer, positions, x, rotary, layer_id):
            if not dynamic:
                torch._dynamo.mark_static(x, 0)
                torch._dynamo.mark_static(positions, 0)
            return compiled_layer(layer, positions, x, rotary, layer_id)

        if not self._uses_aot():
            return run
        name = self._region(whole=False) + (f".s{index}" if index else "")
        aot = self._aot(_call_layer, compile_kwargs, name, fallback=run)
        self._aots.append(aot)
        return aot

    def _whole_forward(self, compile_kwargs: dict[str, Any]) -> Callable:
        options = compile_kwargs.get("options", {})
        if options.get("cpp_wrapper"):
            # The wrapper of a whole forward is as long as the model is deep: built with its
            # kernels at -O3 it was most of the compile; built apart it is built at -O1, its
            # kernels still at -O3 (docs/STATUS.md, issue 22: cold compile times).
            compile_kwargs = compile_kwargs | {"options": options | {"cpp_wrapper_build_separate": True}}
        if not self._uses_aot():
            return _torch_compile(own_forward(self.env.model), compile_kwargs)
        compiled: list[Callable] = []  # made on first need: torch.compile imports Dynamo

        def dynamo_forward(model, ids, positions):
            if not compiled:
                compiled.append(_torch_compile(own_forward(model), compile_kwargs))
            return compiled[0](ids, positions)

        if self.options.compile.aoti:
            aot = self._packages = AotiForward(self.artifacts, self._region(whole=True), self.stats, fallback=dynamo_forward,
                              max_rows=max(self.buckets), option=f"{self.config_path}.compile.aoti",
                              shared_rows=self.options.compile.dynamic)
        else:
            aot = self._aot(_call_forward, compile_kwargs, self._region(whole=True), fallback=dynamo_forward,
                            symbolic_ints=False)
        self._aots.append(aot)
        return lambda ids, positions: aot(self.env.model, ids, positions)

    def _aot(self, fn: Callable, compile_kwargs: dict[str, Any], name: str, fallback: Callable,
             symbolic_ints: bool = True) -> AotRegion:
        return AotRegion(own_code(fn), compile_kwargs.get("options", {}), self.artifacts, name, self.stats,
                         fallback=fallback, option=f"{self.config_path}.compile.aot", symbolic_ints=symbolic_ints,
                         shared_rows=self.options.compile.dynamic)

    def _uses_aot(self) -> bool:
        # TODO(gpu): the cuda_graph mechanism records over the Dynamo-compiled layer; an artifact
        # would spare a GPU start the trace too, but that path has never run.
        return self.mechanism == "compile" and self.options.compile.aot

    def _compile_limits(self, bucket: int) -> ContextManager:
        # A package is exported, not traced by Dynamo, and loading one must not import Dynamo
        # (the point of aoti: capture/aoti_forward.py).
        if self._packaged(bucket):
            return contextlib.nullcontext()
        return super()._compile_limits(bucket)

    def _adopt_without_a_run(self, bucket: int) -> bool:
        # A package an earlier bucket loaded and ran serves this one as it is: no guards to check,
        # nothing to compile (a warm start's buckets after the first cost nothing but the swap).
        return self._packages is not None and self._packaged(bucket) and self._packages.adopt(bucket)

    def _make_runner(self, bucket: int, batch: BucketableBatch) -> BucketRunner:
        make = super()._make_runner
        return self._first_run(bucket, lambda: make(bucket, batch))

    def _first_run(self, bucket: int, run: Callable[[], Any]) -> Any:
        """`run()`, whose first call of the bucket's compiled code compiles it (or loads its
        artifact); what it compiled is then saved."""
        with inductor_cache_dir(self.options.compile.cache_dir):
            result = run()
        for aot in self._aots:
            aot.trust(bucket)
        return result


def _torch_compile(fn: Callable, compile_kwargs: dict[str, Any], **more) -> Callable:
    """torch.compile over a copy of the options: it pops guard_filter_fn out of the dict it is
    given, so a shared one would compile every later region without the filter."""
    options = compile_kwargs.get("options")
    kwargs = compile_kwargs if options is None else compile_kwargs | {"options": dict(options)}
    return torch.compile(fn, **(kwargs | more))


def _call_layer(layer, positions, x, rotary, layer_id):
    return layer(positions, x, rotary, layer_id)


def _call_forward(model, input_ids, positions):
    return model(input_ids, positions)
