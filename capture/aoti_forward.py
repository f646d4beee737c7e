"""The whole forward as an AOTInductor package per bucket, loaded by torch's C++ loader
(full_graph's `compile.aoti`).

Where capture/aot_region.py's artifacts need Dynamo and inductor imported to load (~2.5 s of every
process's first load), a package is a shared object and its metadata that torch's C++ loader
(`torch._C._aoti.AOTIModelPackageLoader`) opens in milliseconds, importing neither.  A warm start
then puts every kept bucket live about as soon as the weights are loaded.

Building one: `torch.export.export` of the model's forward on the bucket's capture batch (row count
static, or with `shared_rows` one package for every bucket, its row count a `Dim` from 1 to the
largest bucket, stored as `<name>.rows`: one compile on a cold start, not one for B=1 and one for
the rest; B=1 ran within noise of its own package, docs/STATUS.md), then
`torch._inductor.aoti_compile_and_package` with the weights left out of the package
(`package_constants_in_so` false): on load the loader is handed the live model's own parameters
and buffers as user-managed constants, so no second copy of the weights exists, on disk or in
memory.  The attention op stays an opaque call; its metadata is bound per forward outside, as for
every other graph.  A forward with collectives inside (tensor parallelism) is not exported: the
bucket and every later one go to the Dynamo-compiled forward, with one warning.

An export records no guards, so what the package assumes is checked instead: its payload carries
the digest of the model's structure (capture/aot_region.py's `layer_structure`: module types,
tensor shapes, strides and dtypes, plain settings) and of the source of every package the model's
modules are defined in (an edited model file is a rebuild, not a stale graph).  Everything else
that changes the code is in the store's key (versions, device, CPU, options).  A package that does
not check out, does not load or whose first call fails is rejected (one warning), compiled again
and overwritten.

    payload = b"aoti-package " structure-digest b" " source-digest b"\\n" the .pt2 bytes
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from capture.aot_region import SHARED, structure_digest, artifact_name, layer_structure
from capture.artifacts import ArtifactStore
from capture.backend import BackendStats
from capture.vec_isa import IsaRecord

_log = logging.getLogger(__name__)

_HEADER = b"aoti-package "
# How a package is built.  The weights stay out: the loader is handed the live model's (`_open`).
# The wrapper (one C++ function as long as the model is deep, calling the kernels in turn) builds
# faster at -O0 and runs a step as fast as at -O1.  Inductor's precompiled headers are left off:
# they would be built for this one compile (two of them, each taking seconds and ~140 MB under the
# system's temporary directory, outside every cache graphexec names) and save less than they cost.
# Measured with `graphexec-bench startup --plans auto --cold` and bench=decode (docs/STATUS.md,
# seventeenth session).
_INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False,
                     "aot_inductor.compile_wrapper_opt_level": "O0",
                     "aot_inductor.precompile_headers": False}
# Ops a forward reaches other ranks through: a package cannot carry them (yet).
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "_dtensor")


class AotiForward:
    """Runs each bucket's AOTInductor package of the whole forward, loading or compiling it on
    the bucket's first call (its capture); `(model, input_ids, positions) -> hidden rows`, as
    AotRegion's whole forward."""

    def __init__(self, store: ArtifactStore | None, name: str, stats: BackendStats, fallback: Callable,
                 max_rows: int, option: str = "compile.aoti", shared_rows: bool = False):
        self._store = store
        self._isa = IsaRecord(store)
        self._name = name
        self._stats = stats
        self._fallback = fallback  # (model, input_ids, positions): the Dynamo-compiled forward
        self._max_rows = max_rows  # the largest bucket: the shared package's row Dim goes up to it
        self._option = option
        self._shared_rows = shared_rows
        self._ready: dict[int, Callable] = {}  # rows (the bucket) -> what runs a call
        self._loaders: dict[int, Any] = {}  # slot -> its package's loader
        self._origins: dict[int, str] = {}  # slot -> "artifact" | "compiled"
        self._unsaved: dict[int, bytes] = {}  # slot -> its payload, saved once `trust`ed
        self._unavailable = False

    def __call__(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        fn = self._ready.get(input_ids.shape[0])
        if fn is None:
            return self._first_call(input_ids.shape[0], model, input_ids, positions)
        return fn(model, input_ids, positions)

    def adopt(self, bucket: int) -> bool:
        """Make `bucket` ready on its slot's package if that has already run once (the shared one
        serves every bucket): True, and the bucket needs no run of its own."""
        slot = self._slot(bucket)
        if slot not in self._loaders:
            return False
        self._stats.origins[bucket] = self._origins[slot]
        self._ready[bucket] = self._ready_fn(self._loaders[slot])
        return True

    def trust(self, bucket: int) -> None:
        """The bucket's capture forward ran: save the package compiled for it (if it was)."""
        payload = self._unsaved.pop(self._slot(bucket), None)
        if payload is not None:
            self._save(self._artifact(self._slot(bucket)), payload)

    def _slot(self, bucket: int) -> int:
        return package_slot(bucket, self._shared_rows, self._max_rows)

    def _first_call(self, bucket: int, model, input_ids, positions) -> torch.Tensor:
        slot = self._slot(bucket)
        if slot not in self._loaders:
            header = _header(model)
            loader = self._load(self._artifact(slot), model, header)
            if loader is not None:
                try:
                    out = _run(loader, input_ids, positions)
                except Exception as error:  # noqa: BLE001 - any failure of a stored package is a rebuild
                    self._reject(self._artifact(slot), f"its first call failed: {error!r}"[:300])
                else:
                    self._stats.artifacts_loaded += 1
                    self._hold(bucket, slot, loader, "artifact")
                    return out
            compiled = self._compile(bucket, model, input_ids, positions, header)
            if compiled is None:
                self._stats.origins[bucket] = "dynamo"
                self._ready[bucket] = self._fallback
                return self._fallback(model, input_ids, positions)
            loader, payload = compiled
            out = _run(loader, input_ids, positions)
            self._unsaved[slot] = payload
            self._hold(bucket, slot, loader, "compiled")
            return out
        self.adopt(bucket)
        return self._ready[bucket](model, input_ids, positions)

    def _hold(self, bucket: int, slot: int, loader, origin: str) -> None:
        """The loader runs `slot`'s buckets: it has run one of them once."""
        self._loaders[slot] = loader
        self._origins[slot] = origin
        self._stats.origins[bucket] = origin
        self._ready[bucket] = self._ready_fn(loader)

    @staticmethod
    def _ready_fn(loader) -> Callable:
        return lambda model, input_ids, positions: _run(loader, input_ids, positions)

    def _artifact(self, slot: int) -> str:
        return artifact_name(self._name, slot)

    def _load(self, name: str, model, header: bytes):
        parts = None if self._store is None else self._store.load_parts(name, self._reject)
        if parts is None:
            return None
        stored_header, package = parts
        if not stored_header.startswith(_HEADER):
            return self._reject(name, "it is not an AOTInductor package (another format)")
        def structure(line: bytes) -> bytes:
            return line.removeprefix(_HEADER).split(b" ")[0]

        if structure(stored_header) != structure(header):
            return self._reject(name, "the modules it runs differ from those it was compiled on")
        if stored_header != header:
            return self._reject(name, "the model's source changed since it was compiled")
        try:
            return _open(package, model)
        except Exception as error:  # noqa: BLE001 - the loader raises many kinds on a damaged package
            return self._reject(name, f"it does not load: {error!r}"[:300])

    def _reject(self, name: str, why: str) -> None:
        self._stats.artifacts_rejected += 1
        self._store.reject(name, why)

    def _compile(self, bucket: int, model, input_ids, positions, header: bytes):
        """(loader, payload) of the package compiled for `bucket`'s shapes; None once packages
        are unavailable (the Dynamo-compiled forward serves instead)."""
        if self._unavailable:
            return None
        try:
            package = self._package(bucket, model, input_ids, positions)
            loader = _open(package, model)
        except Exception as error:  # noqa: BLE001 - Dynamo's own compile still serves the bucket
            self._give_up(f"{error!r}"[:300])
            return None
        self._isa.remember()
        self._stats.aot_compiles += 1
        return loader, header + b"\n" + package

    def _package(self, bucket: int, model, input_ids, positions) -> bytes:
        """The .pt2 bytes of `model`'s forward exported on these inputs and compiled by AOTInductor."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"the forward is a {type(model).__name__}, not a module torch.export can take")
        dims = row_dims(self._max_rows) if self._slot(bucket) == SHARED else None
        if dims is not None and input_ids.shape[0] == 1:
            # Export fixes a dimension it sees at size 1, so the package B=1 shares is traced on
            # two rows.  Only shapes matter to the trace: the attention op, which reads the batch's
            # metadata, is opaque to it.
            input_ids, positions = input_ids.repeat(2), positions.repeat(2)
        program = torch.export.export(model, (input_ids, positions), dynamic_shapes=dims, strict=False)
        collectives = sorted({str(node.target) for node in program.graph.nodes
                              if node.op == "call_function" and str(node.target).startswith(_COLLECTIVE_NAMESPACES)})
        if collectives:
            raise NotImplementedError(f"the forward calls collectives ({', '.join(collectives[:3])})")
        with tempfile.TemporaryDirectory() as tmp, self._isa.answered():
            path = os.path.join(tmp, "forward.pt2")
            torch._inductor.aoti_compile_and_package(
                program, package_path=path,
                inductor_configs=_INDUCTOR_CONFIGS,
            )
            return Path(path).read_bytes()

    def _give_up(self, why: str) -> None:
        if not self._unavailable:
            _log.warning("%s: %s cannot be compiled into an AOTInductor package (%s); compiling it with Dynamo instead",
                         self._option, self._name, why)
        self._unavailable = True

    def _save(self, name: str, payload: bytes) -> None:
        if self._store is None:
            return
        try:
            self._store.save(name, payload)
        except OSError as error:  # a package not written costs the next start a compile, no more
            _log.warning("could not write compiled artifact %s: %r", self._store.path(name), error)
            return
        self._stats.artifacts_saved += 1


def package_slot(bucket: int, shared_rows: bool, max_rows: int) -> int:
    """Which package runs `bucket`: with `shared_rows` the one every bucket shares (unless the
    only bucket is 1), else its own."""
    return SHARED if shared_rows and max_rows > 1 else bucket


def row_dims(max_rows: int) -> tuple | None:
    """The shared package's dynamic shapes: its row count from 1 to the largest bucket (None, a
    static shape, when that is 1)."""
    if max_rows <= 1:
        return None
    rows = torch.export.Dim("rows", min=1, max=max_rows)
    return ({0: rows}, {0: rows})


def _open(package: bytes, model: torch.nn.Module):
    """A loader for the .pt2 bytes, its constants the model's own tensors (no copy)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "forward.pt2")
        Path(path).write_bytes(package)
        # (path, model name in the package, run single-threaded, runners, device index): the
        # loader unpacks the package into its own directory, so the file may go.
        loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    names = loader.get_constant_fqns()
    missing = [name for name in names if name not in tensors]
    if missing:
        raise KeyError(f"the package needs constants the model does not have: {missing[:3]}")
    # use_inactive false, check_full_update true, user_managed true: the model's storage, not a copy.
    loader.load_constants({name: tensors[name] for name in names}, False, True, True)
    return loader


def _run(loader, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return loader.run([input_ids, positions])[0]


def _header(model: torch.nn.Module) -> bytes:
    """What a package assumes beyond its inputs: the model's structure and its source."""
    return _HEADER + structure_digest(layer_structure(model)).encode() + b" " + source_digest(model).encode()


def source_digest(model: torch.nn.Module) -> str:
    """A digest of every Python file in each package (folder) a module of `model` is defined in,
    torch's own excepted (the key pins torch's version): the functions a forward calls live beside
    the modules that call them."""
    folders = set()
    for module in model.modules():
        name = type(module).__module__
        if name.split(".")[0] == "torch":
            continue
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            folders.add(Path(file).parent)
    digest = hashlib.sha256()
    for file in sorted(f for folder in folders for f in folder.glob("*.py")):
        digest.update(str(file.name).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()
