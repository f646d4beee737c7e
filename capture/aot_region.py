"""A compiled region ahead of time, one callable per bucket, persisted as an artifact
(full_graph's `compile.aot`).  The region is the regional decoder layer, called once per layer,
or the whole forward (`compile.whole_forward_buckets`), called once a step; either way its first
argument is the module it runs and its second its rows (the bucket).

`torch.compile(...).aot_compile` traces the region once for a bucket's static shapes (its tensor
inputs marked static; the layer's layer_id stays symbolic, so one graph serves every layer) and
returns a callable with no Dynamo frame in front of it: no cache lookup on each call.  With
`shared_rows` (full_graph's `compile.dynamic`) the buckets above 1 share one region traced with
its row count symbolic, compiled (or loaded) on the first of them, stored as `<name>.rows`.  Its guards
are checked on every call of the bucket's capture forward, then no more (`trust`).  With an
ArtifactStore (capture/artifacts.py) the callable is then saved under `<name>.b<bucket>`, and a
later start loads it instead: no Dynamo trace, no inductor compile.  Inductor's own cache still
holds the kernels' shared objects; an emptied one costs a C++ rebuild on load, not a wrong result.

A stored artifact is used only if it checks out (the store's checksum), the sources it inlined
are the ones this process runs (an edited model file is a rebuild, not a stale graph), its
guards hold on the bucket's capture inputs and its first call succeeds; otherwise it is rejected
(one warning), compiled again and overwritten.  Should the region not compile ahead of time at
all (a graph torch cannot serialize), or one graph not serve every layer (under tensor
parallelism the first layer's input is a collective's tensor subclass, the others' plain
tensors), that bucket and every later one fall back to the Dynamo-compiled region, with one
warning, and nothing is saved.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from capture.artifacts import ArtifactStore
from capture.backend import BackendStats
from capture.vec_isa import IsaRecord

_log = logging.getLogger(__name__)

# An artifact's payload: this, the module's structure `structure_digest`, a newline, torch's compiled function.
_STRUCTURE = b"module-structure "
# (module, rows, ...) -> output rows: (layer, positions, x, rotary, layer_id) for the regional
# layer, (model, input_ids, positions) for the whole forward.
RegionFn = Callable[..., torch.Tensor]


class AotRegion:
    """Runs each bucket's ahead-of-time compiled region (as LlamaForCausalLM's `layer_runner`, or
    as the whole forward), loading or compiling it on the bucket's first call (its capture)."""

    def __init__(
        self,
        fn: RegionFn,
        options: Mapping[str, Any],
        store: ArtifactStore | None,
        name: str,
        stats: BackendStats,
        fallback: RegionFn,
        option: str = "compile.aot",
        symbolic_ints: bool = True,
        shared_rows: bool = False,
    ):
        # The guards an artifact carries are `_serializable_guards`' alone.  A caller's filter
        # (skip_module_guards) would also drop the key-order guard of the module dict a whole
        # forward iterates, which loading needs (without it: "'_Missing' object has no attribute
        # '_modules'"); what it would drop beyond that, the module argument's guards, goes anyway.
        options = {k: v for k, v in options.items() if k != "guard_filter_fn"}
        options["guard_filter_fn"] = _serializable_guards(fn.__code__.co_varnames[0])
        # symbolic_ints (dynamic=True) keeps the layer's layer_id symbolic (without it the graph
        # guards `layer_id == 0`); the shapes are pinned per bucket with mark_static before
        # tracing.  The whole forward has no int to keep, and with dynamic=True its float
        # constants would be made tensors, a restart aot_compile cannot take.
        self._compiler = torch.compile(fn, fullgraph=True, dynamic=symbolic_ints, options=options)
        # Every bucket above 1 runs one region whose row count is symbolic (Dynamo specializes a
        # dimension of size 1, so B=1 keeps its own): one compile, one artifact, one load.
        self._shared_rows = shared_rows
        self._globals = fn.__globals__
        self._store = store
        self._isa = IsaRecord(store)
        self._name = name
        self._stats = stats
        self._fallback = fallback
        self._option = option  # the config option that asked for this, for messages
        self._ready: dict[int, RegionFn] = {}  # rows (the bucket) -> what runs a call
        # Per slot (`slot_of`: the bucket, or SHARED for the buckets that share one region):
        self._aot: dict[int, Any] = {}  # its ahead-of-time compiled region (not Dynamo's)
        self._origins: dict[int, str] = {}  # where that came from: "artifact" | "compiled"
        self._structures: dict[int, str] = {}  # `structure_digest` of the module's structure it runs
        self._unsaved: set[int] = set()  # compiled here, saved once `trust`ed
        self._unavailable = False

    def __call__(self, module, rows: torch.Tensor, *rest) -> torch.Tensor:
        fn = self._ready.get(rows.shape[0])
        if fn is None:
            return self._first_call(rows.shape[0], (module, rows, *rest))
        return fn(module, rows, *rest)

    def trust(self, bucket: int) -> None:
        """The bucket's capture forward has passed the guards at every call: save what was
        compiled for it, and stop checking.  Its later batches are the same static buffers (shapes,
        dtypes, device) through the same modules, so checking again on every call (a regional
        layer: 30 a step, ~7 us each through inspect's argument binding) buys nothing."""
        slot = slot_of(bucket, self._shared_rows)
        fn = self._aot.get(slot)
        if fn is None:  # Dynamo's
            return
        # A shared region's explicit `guard_check` still checks a later bucket's first calls.
        fn.disable_guard_check()
        self._ready[bucket] = fn
        if slot in self._unsaved:
            self._unsaved.discard(slot)
            self._save(self._artifact(slot), fn, self._structures[slot])

    def _first_call(self, bucket: int, args: tuple) -> torch.Tensor:
        slot = slot_of(bucket, self._shared_rows)
        structure = layer_structure(args[0])  # what the artifact must have been compiled on, and checks
        if slot in self._aot:  # a shared region another bucket loaded or compiled
            self._stats.origins[bucket] = self._origins[slot]
            self._use(bucket, slot, structure)
            return self._ready[bucket](*args)
        name, digest = self._artifact(slot), structure_digest(structure)
        fn = self._load(name, args, digest)
        if fn is not None:
            try:
                out = fn(*args)
            except Exception as error:  # noqa: BLE001 - any failure of a stored artifact is a rebuild
                self._reject(name, f"its first call failed: {error!r}")
            else:
                self._isa.remember()
                self._stats.artifacts_loaded += 1
                self._hold(slot, fn, "artifact", digest)
                self._stats.origins[bucket] = "artifact"
                self._use(bucket, slot, structure)
                return out
        fn = self._compile(bucket, args)
        if fn is None:
            self._ready[bucket] = self._fallback
            return self._fallback(*args)
        self._unsaved.add(slot)
        self._hold(slot, fn, "compiled", digest)
        self._use(bucket, slot, structure)
        return self._ready[bucket](*args)

    def _hold(self, slot: int, fn, origin: str, structure: str) -> None:
        """fn runs `slot`'s buckets: where it came from, and the `structure_digest` of the modules it was
        compiled on (what its artifact records)."""
        self._aot[slot] = fn
        self._origins[slot] = origin
        self._structures[slot] = structure

    def _use(self, bucket: int, slot: int, structure: tuple) -> None:
        """fn for `bucket`, its guards checked on every call until `trust`: a call whose input
        they reject (a tensor subclass out of a tensor-parallel all-reduce, where Dynamo would
        compile a second graph), or whose modules differ from those it was compiled on (the
        module guards are filtered out of an artifact; a K-quant file mixes weight types between
        layers), hands this bucket and every later one to Dynamo."""
        fn = self._aot[slot]

        def checked(*args):
            if layer_structure(args[0]) != structure:
                why = f"{_call_name(args)}'s modules differ from those it was compiled on"
            elif not fn.guard_check(*args):
                why = f"its guards reject {_call_name(args)}'s inputs"
            else:
                return fn(*args)
            self._give_up(why)
            self._aot.pop(slot, None)
            self._unsaved.discard(slot)
            self._stats.origins[bucket] = "dynamo"
            self._ready[bucket] = self._fallback
            return self._fallback(*args)

        self._ready[bucket] = checked

    def _artifact(self, slot: int) -> str:
        return artifact_name(self._name, slot)

    def _load(self, name: str, args: tuple, structure: str) -> RegionFn | None:
        parts = None if self._store is None else self._store.load_parts(name, self._reject)
        if parts is None:
            return None
        header, payload = parts
        if not header.startswith(_STRUCTURE):
            return self._reject(name, "it does not record the modules it was compiled on (an older format)")
        if header != _STRUCTURE + structure.encode():
            # Its guards say nothing of the module (`_serializable_guards`): this is the check.
            return self._reject(name, "the modules it runs differ from those it was compiled on")
        try:
            with self._isa.answered():
                fn = torch.compiler.load_compiled_function(io.BytesIO(payload), f_globals=self._globals)
            changed = _changed_source(fn)
            if changed is not None:
                return self._reject(name, f"{changed} changed since it was compiled")
            if not fn.guard_check(*args):
                return self._reject(name, "its guards do not hold for this bucket")
        except Exception as error:  # noqa: BLE001 - torch raises many kinds on a foreign or damaged artifact
            return self._reject(name, f"it does not load: {error!r}"[:300])
        return fn

    def _reject(self, name: str, why: str) -> None:
        self._stats.artifacts_rejected += 1
        self._store.reject(name, why)

    def _compile(self, bucket: int, args: tuple):
        """The region compiled ahead of time for `bucket`'s shapes; None once that is unavailable."""
        if self._unavailable:
            self._stats.origins[bucket] = "dynamo"
            return None
        shared = slot_of(bucket, self._shared_rows) == SHARED
        for arg in args:
            if isinstance(arg, torch.Tensor):
                if shared and arg.shape[0] == bucket:  # a row dimension (the rotary tables are longer)
                    torch._dynamo.mark_dynamic(arg, 0)
                else:
                    torch._dynamo.mark_static(arg, 0)
        try:
            with self._isa.answered():
                fn = self._compiler.aot_compile((args, {}))
        except Exception as error:  # noqa: BLE001 - Dynamo's own compile still serves the bucket
            self._give_up(f"{error!r}"[:300])
            return self._compile(bucket, args)
        self._isa.remember()
        self._stats.aot_compiles += 1
        self._stats.origins[bucket] = "compiled"
        return fn

    def _give_up(self, why: str) -> None:
        if not self._unavailable:
            _log.warning("%s: %s cannot be compiled ahead of time (%s); compiling it with Dynamo instead",
                         self._option, self._name, why)
        self._unavailable = True

    def _save(self, name: str, fn, structure: str) -> None:
        if self._store is None:
            return
        try:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "region")
                fn.save_compiled_function(path)
                payload = _STRUCTURE + structure.encode() + b"\n" + Path(path).read_bytes()
            self._store.save(name, payload)
        except Exception as error:  # noqa: BLE001 - an artifact not written costs the next start a compile, no more
            _log.warning("could not write compiled artifact %s: %r", self._store.path(name), error)
            return
        self._stats.artifacts_saved += 1


# The slot of the region every bucket above 1 shares (`shared_rows`); no bucket is 0.
SHARED = 0


def slot_of(bucket: int, shared_rows: bool) -> int:
    """Which compiled region runs `bucket`: its own, or with `shared_rows` (above 1) the shared one."""
    return SHARED if shared_rows and bucket > 1 else bucket


def artifact_name(region: str, slot: int) -> str:
    """What the region `region` (e.g. capture.decode.layer) compiled for `slot` (`slot_of`) is stored as."""
    return f"{region}.rows" if slot == SHARED else f"{region}.b{slot}"


def layer_structure(layer: torch.nn.Module) -> tuple:
    """What one compiled graph assumes of a layer beyond its inputs' guards: every submodule's
    type, its tensors' names, shapes and dtypes, and its plain settings (an op choice such as
    `activations`, a row count)."""
    def settings(module):
        return tuple(sorted((k, v) for k, v in vars(module).items()
                            if not k.startswith("_") and isinstance(v, (bool, int, float, str))))

    return tuple(
        (name, type(module).__qualname__, settings(module),
         tuple((k, tuple(t.shape), t.stride(), t.dtype, str(t.device))
               for k, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]))
        for name, module in layer.named_modules()
    )


def structure_digest(structure: tuple) -> str:
    """`layer_structure` as a short string an artifact carries (the dtypes' and types' reprs are
    stable across processes of one torch version, which the key pins)."""
    return hashlib.sha256(repr(structure).encode()).hexdigest()


def _serializable_guards(module_arg: str) -> Callable:
    """The guards an artifact carries: none on the module argument `module_arg` (the region's
    first), then torch's own rule for aot_compile (no global state, none of the kinds it cannot
    serialize), which a filter of our own would otherwise replace.

    Dynamo guards every module, attribute and weight a region reads when the module comes in as an
    argument (skip_module_guards does not see it as one): a whole forward carried ~4,700 guards, and
    rebuilding them was most of an artifact's load.  What they check of the module, its
    `layer_structure`, is checked instead: stored with the artifact and compared on load, and on
    every call until `trust`."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES

    def keep(entries):
        return [not (e.is_global or e.guard_type in unsupported or _on_module(e, module_arg)) for e in entries]

    return keep


def _on_module(entry, module_arg: str) -> bool:
    """Whether a guard checks the module argument or something reached through it.  The guard on
    the key order of a module dict the region iterates (the whole forward's layers) stays: loading
    rebuilds that dict's source whatever the filter, and it finds the module only if a guard kept
    it in the artifact."""
    root = re.split(r"[.\[]", entry.name, maxsplit=1)[0]  # `layer` of "layer._modules['mlp']"
    return root == module_arg and entry.guard_type != "DICT_KEYS_MATCH"


def _call_name(args: tuple) -> str:
    """Which call a message is about: a regional layer's last argument is its layer_id."""
    return f"layer {args[-1]}" if isinstance(args[-1], int) else "the forward"


def _changed_source(fn) -> str | None:
    """The first source the artifact inlined (module and lines) whose text differs now."""
    for source in fn.source_info().inlined_sources:
        module = importlib.import_module(source.module)
        lines = inspect.getsourcelines(module)[0][source.firstlineno - 1 : source.lastlineno - 1]
        if hashlib.sha256("".join(lines).encode()).hexdigest() != source.checksum:
            return f"{source.module} (lines {source.firstlineno}-{source.lastlineno})"
    return None
