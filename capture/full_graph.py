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
tracing and compiling.  Every option, checked, is capture/options.py's `FullGraphOptions`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from capture.aot_layer import AotLayer, layer_structure
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
        self._compiled: Callable | None = None
        self._aots: list[AotLayer] = []  # one per distinct layer structure

    def _bucket_forward(self) -> BucketRunner:
        # `compile.enabled` is a cuda_graph option: the tape records aten calls, which compiled
        # kernels do not make, so it always records the plain forward.
        over_compiled = self.mechanism == "cuda_graph" and self.options.compile.enabled
        compiled = self.mechanism == "compile" or over_compiled
        forward = self._compiled_forward() if compiled else self.env.model
        return lambda fb: forward(fb.input_ids, fb.positions)

    def _compiled_forward(self) -> Callable:
        if self._compiled is None:
            opts = self.options.compile
            options = self._inductor_options()
            compile_kwargs = dict(
                fullgraph=True,
                dynamic=opts.dynamic,
                # A mode is torch.compile's alternative to inductor options (capture/option_parser.py
                # refuses both at once).
                **({"options": options} if options else {"mode": None if opts.mode == "default" else opts.mode}),
            )
            self._compiled = self._regional_forward(compile_kwargs) if opts.regional else self._whole_forward(compile_kwargs)
        return self._compiled

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
        # TODO(issue 22, part 4): the 30 calls cost ~19 % of a B=1 step in Dynamo/AOT
        # wrappers (docs/STATUS.md has the profile; `aot` removes the Dynamo share).
        # nested_compile_region over this call fails (its guards see 30 layer modules); a
        # functional call over stacked per-layer weights would let one subgraph serve every layer
        # inside one whole-forward graph.
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
        compiled_layer = torch.compile(own_code(_call_layer), dynamic=True if dynamic else None, **compile_kwargs)

        def run(layer, positions, x, rotary, layer_id):
            if not dynamic:
                torch._dynamo.mark_static(x, 0)
                torch._dynamo.mark_static(positions, 0)
            return compiled_layer(layer, positions, x, rotary, layer_id)

        if not self._uses_aot():
            return run
        name = f"{self.config_path}.layer" + (f".s{index}" if index else "")
        aot = AotLayer(own_code(_call_layer), compile_kwargs.get("options", {}), self.artifacts, name, self.stats,
                       fallback=run, option=f"{self.config_path}.compile.aot")
        self._aots.append(aot)
        return aot

    def _whole_forward(self, compile_kwargs: dict[str, Any]) -> Callable:
        return torch.compile(own_forward(self.env.model), **compile_kwargs)

    def _uses_aot(self) -> bool:
        # TODO(gpu): the cuda_graph mechanism records over the Dynamo-compiled layer; an artifact
        # would spare a GPU start the trace too, but that path has never run.
        return self.mechanism == "compile" and self.options.compile.aot

    def _make_runner(self, bucket: int, batch: BucketableBatch) -> BucketRunner:
        # A bucket is compiled (or its artifact loaded) on its first call, here.
        with inductor_cache_dir(self.options.compile.cache_dir):
            runner = super()._make_runner(bucket, batch)
        for aot in self._aots:
            aot.trust(bucket)
        return runner


def _call_layer(layer, positions, x, rotary, layer_id):
    return layer(positions, x, rotary, layer_id)
