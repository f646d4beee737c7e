"""ModelRunner: owns the weights, the attention backend and one capture backend per ForwardMode,
and turns a ForwardBatch into sampled tokens.  It reads and writes the KV pools of the KV cache
manager it is given; it never allocates or frees a slot.  With `capture.cache_dir` set it keys a
stored capture plan (runner/capture_key.py) and hands each bucketed backend the plan's decisions
and the key's compiled-code artifacts (capture/plan_store.py, capture/artifacts.py).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterator

import torch

from capture import CaptureBackend, CaptureConfigError, CaptureEnv, Phase, create_backend
from capture.bucketed import BucketedBackend
from capture.eager import EagerRunner
from capture.plan_store import PlanStore
from graphexec.attention.backend import ForwardContext, create_attention_backend, resolve_attention_backend
from graphexec.attention.forward_context import forward_context
from graphexec.attention.op import ATTENTION_OP, PYTHON_ROUTED_OPS
from graphexec.batch.forward_batch import ForwardBatch
from graphexec.batch.forward_mode import ForwardMode
from graphexec.batch.padding import padding_policy
from graphexec.batch.prompt_logprobs import PromptLogprobs
from graphexec.cache.manager import KVCacheManager
from graphexec.config import EngineConfig
from graphexec.errors import ConfigError
from graphexec.loader import LoadedCheckpoint
from graphexec.models.config import ModelConfig
from graphexec.models.llama import LlamaForCausalLM
from graphexec.models.moe import PackedExperts
from graphexec.models.sharding import shard_state_dict
from graphexec.models.tp_layout import TPLayout
from graphexec.parallel.group import SINGLE, TPGroup
from graphexec.parallel.step_channel import NO_PEERS, StepChannel
from graphexec.quant import PACKED_MODULES, ensure_kernels
from graphexec.runner.capture_key import capture_key
from graphexec.runner.logits_processor import LogitsProcessor
from graphexec.sampling.sampler import Sampler, SamplerOutput
from graphexec.structured.token_bitmask import TokenBitmask

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    sampler: SamplerOutput
    logits: torch.Tensor  # [batch_size, vocab] fp32, the rows that sampled
    # Prompt logprobs computed by this forward: (batch index, first prompt position, entries)
    # per request that asked (graphexec/batch/prompt_logprobs.py).
    prompt_logprobs: list[tuple[int, int, list[dict]]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        checkpoint: LoadedCheckpoint,
        kv_cache: KVCacheManager,
        tp: TPGroup = SINGLE,
        channel: StepChannel = NO_PEERS,
    ):
        self.config = config
        self.tp = tp
        # Announces each forward to the other tensor-parallel ranks (rank 0 of several; else silent).
        self.channel = channel
        self.model_config: ModelConfig = checkpoint.config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.kv_cache = kv_cache
        self.max_context = kv_cache.max_context

        # Built on the meta device and given the checkpoint's tensors: no second copy of the weights.
        # RoPE tables stay fp32 like the reference; the model casts per use.
        with torch.device("meta"):
            model = LlamaForCausalLM(self.model_config, tp)
        model.load_weights(_rank_state_dict(checkpoint, model.layout), self.dtype, config.model.activations)
        if self.device.type == "cpu" and any(isinstance(m, (*PACKED_MODULES, PackedExperts)) for m in model.modules()):
            ensure_kernels()
        self.model = model.to(device=self.device).eval()

        # This rank's heads (all of them with one rank); the vocabulary stays whole.
        local = model.layout.local_config()
        self.attn_backend = create_attention_backend(
            config.attention_backend, local.num_heads, local.num_kv_heads, local.head_dim, self.device,
            sliding_window=self.model_config.layer_windows, scale=self.model_config.attention_scale,
            logit_softcap=self.model_config.attn_logit_softcap,
        )
        self.logits_processor = LogitsProcessor(self.model.compute_logits)
        self.sampler = Sampler(TokenBitmask(self.model_config.vocab_size, config.scheduler.max_running_requests))

        self.capture_env = env = CaptureEnv(
            model=self.model,
            device=self.device,
            padding=padding_policy(self.attn_backend.padded_seq_len),
            empty_batches={phase: ForwardBatch.empty_for(phase, self.device) for phase in Phase},
            split_ops=(ATTENTION_OP,),
            traced_ops=PYTHON_ROUTED_OPS,
        )
        self._static_metadata_rows = 0
        self.eager = EagerRunner(env, {}, "capture.eager")
        # One instance per distinct spec, so modes that share a spec share its graphs.
        instances: dict[str, CaptureBackend] = {repr(("eager", {})): self.eager}
        self.backends: dict[ForwardMode, CaptureBackend] = {}
        for mode in ForwardMode:
            spec = config.capture.for_mode(mode, self.device.type)
            key = repr((spec.backend, dict(spec.options)))
            if key not in instances:
                with _config_errors():
                    instances[key] = create_backend(spec.backend, env, spec.options, f"capture.{mode.config_key}")
            self.backends[mode] = instances[key]
        self._plan_store = None
        if config.capture.cache_dir is not None:
            attention = resolve_attention_backend(config.attention_backend, self.device)
            self._plan_store = PlanStore(config.capture.cache_dir, capture_key(config, tp.size, tp.rank, attention))
            stored = self._plan_store.load() or {}
            artifacts = self._plan_store.artifacts()
            for backend in self._bucketed():
                backend.preset(stored.get(backend.config_path, {}), artifacts)

    def _bucketed(self) -> list[BucketedBackend]:
        """The distinct bucketed backends, decode's first (its B=1 graph is the most used)."""
        distinct = {id(b): b for b in self.backends.values() if isinstance(b, BucketedBackend)}.values()
        return sorted(distinct, key=lambda b: b.phase is not Phase.ROWS)

    @torch.inference_mode()
    def capture(self) -> None:
        """Build every backend's graphs once, before serving (in the inference mode they replay in)."""
        for backend in {id(b): b for b in self.backends.values()}.values():
            self.capture_backend(backend)

    @torch.inference_mode()
    def capture_next(self, skip: Collection[tuple[str, int]] = ()) -> bool:
        """Capture one pending bucket (decode's smallest first) but those in `skip` ((config path,
        bucket): another process is compiling them) and swap it in if it is kept; what the engine
        loop runs while no request waits (`capture.background`).  True if it captured one.  A
        bucket whose capture fails is dropped (logged), and the engine keeps serving it eagerly."""
        for backend in self._bucketed():
            pending = self._capturable(backend, skip)
            if not pending:
                continue
            bucket = pending[0]
            self._use_static_metadata(backend.static_metadata_rows)
            batch = backend.dummy_batch(bucket)
            try:
                with _config_errors(), self._forward_scope(batch):
                    backend.capture_bucket(bucket, batch)
            except Exception as error:  # noqa: BLE001 - one bad bucket must not stop serving
                _log.exception("capture of %s bucket %d failed; it runs eager", backend.config_path, bucket)
                backend.drop(bucket, f"capture failed: {error!r}"[:200])
            self._save_plan()
            return True
        return False

    def buckets_to_build_apart(self) -> list[list[tuple[str, int]]]:
        """(config path, bucket) of every pending bucket that another process with this runner's
        config could compile and save for this one to load (`build_apart` there), in capture
        order, grouped: the buckets of a group share one compile (`compiled_with`), so one process
        builds all of them; groups are in the order of their first bucket."""
        return self._grouped(lambda backend: [b for b in backend.pending_buckets() if backend.builds_apart(b)],
                             lambda backend, bucket: backend.compiled_with(bucket))

    def interims_to_build_apart(self) -> list[list[tuple[str, int]]]:
        """(config path, bucket) of every bucket built apart whose stand-in another process should
        build first (`BucketedBackend.interim_built` there), grouped as `buckets_to_build_apart`."""
        return self._grouped(lambda backend: backend.interims_to_build(),
                             lambda backend, bucket: backend.interim_compiled_with(bucket))

    def _grouped(self, buckets_of: Callable[[BucketedBackend], list[int]],
                 compiled_with: Callable[[BucketedBackend, int], str]) -> list[list[tuple[str, int]]]:
        """(config path, bucket) of each backend's `buckets_of`, grouped by what compiling them
        produces, groups in the order of their first bucket."""
        groups: dict[tuple[str, str], list[tuple[str, int]]] = {}
        for backend in self._bucketed():
            for bucket in buckets_of(backend):
                key = (backend.config_path, compiled_with(backend, bucket))
                groups.setdefault(key, []).append((backend.config_path, bucket))
        return list(groups.values())

    def interim_built_apart(self, config_path: str, bucket: int) -> None:
        """Another process has stored the stand-in of `bucket` of the backend at `config_path`."""
        self._bucketed_at(config_path).interim_built(bucket)

    def loads_need_compiler(self, buckets: list[tuple[str, int]]) -> bool:
        """Whether loading any of `buckets` ((config path, bucket)), once built, imports Dynamo and inductor."""
        return any(self._bucketed_at(path).load_needs_compiler(bucket) for path, bucket in buckets)

    def compiling_apart(self, config_path: str, bucket: int) -> None:
        """Another process is compiling `bucket` of the backend at `config_path` (its state shows it)."""
        self._bucketed_at(config_path).compiling_elsewhere(bucket)

    @torch.inference_mode()
    def build_apart(self, config_path: str, bucket: int, interim: bool = False) -> None:
        """In a process that builds for a serving one (graphexec/engine/capture_worker.py): compile
        the bucket (with `interim`, its stand-in) and save its artifact, nothing timed, nothing
        swapped in, no plan written."""
        backend = self._bucketed_at(config_path)
        self._use_static_metadata(backend.static_metadata_rows)
        batch = backend.dummy_batch(bucket)
        with _config_errors(), self._forward_scope(batch):
            backend.build(bucket, batch, interim)

    def _bucketed_at(self, config_path: str) -> BucketedBackend:
        for backend in self._bucketed():
            if backend.config_path == config_path:
                return backend
        raise KeyError(f"no bucketed capture backend at {config_path!r}")

    @property
    def artifact_key(self) -> str | None:
        """The hash of the key this runner's plan and artifacts are stored under (None without
        capture.cache_dir): a process that builds for this one must have the same."""
        return None if self._plan_store is None else self._plan_store.artifacts().key_hash

    @property
    def plan_path(self):
        """The stored capture plan's file (None when capture.cache_dir is null)."""
        return None if self._plan_store is None else self._plan_store.path

    def capture_pending(self, skip: Collection[tuple[str, int]] = ()) -> bool:
        """Whether any bucket, but those in `skip` ((config path, bucket)), is still to be captured
        (background capture)."""
        return any(self._capturable(backend, skip) for backend in self._bucketed())

    @staticmethod
    def _capturable(backend: BucketedBackend, skip: Collection[tuple[str, int]]) -> list[int]:
        """`backend`'s pending buckets but those in `skip` (another process builds their graph),
        unless their stand-in waits to be loaded."""
        return [b for b in backend.pending_buckets()
                if (backend.config_path, b) not in skip or backend.interim_waiting(b)]

    def capture_only_loads(self) -> bool:
        """Whether every bucket still to be captured only loads stored code (milliseconds each)."""
        return all(b.pending_only_load() for b in self._bucketed())

    def _save_plan(self) -> None:
        """Keep what has been decided so far, so a later start neither measures nor compiles a
        dropped bucket.  A failed capture is not kept: the next start tries again."""
        if self._plan_store is None:
            return
        decisions = {
            b.config_path: {k: d for k, d in b.stats.decisions.items() if not d.reason.startswith("capture failed")}
            for b in self._bucketed()
        }
        try:
            self._plan_store.save(decisions)
        except OSError as error:
            _log.warning("could not write the capture plan %s: %s", self._plan_store.path, error)

    @torch.inference_mode()
    def capture_backend(self, backend: CaptureBackend) -> None:
        """Capture one backend built on this runner's `capture_env` (the engine's, or one a
        benchmark made): each bucket inside a forward scope for its capture batch."""
        self._use_static_metadata(backend.static_metadata_rows)
        with _config_errors():
            for bucket, batch in backend.capture_plan():
                with self._forward_scope(batch):
                    backend.capture_bucket(bucket, batch)
                if backend in self._bucketed():
                    self._save_plan()

    def _use_static_metadata(self, rows: int) -> None:
        """Decode metadata in fixed-address buffers for batches of up to `rows` rows, for graphs
        that replay attention inside them."""
        if rows <= self._static_metadata_rows:
            return
        if self._static_metadata_rows:
            # New buffers would leave the graphs recorded so far reading freed ones.
            raise RuntimeError(
                f"static decode metadata is sized for {self._static_metadata_rows} rows; a backend needing "
                f"{rows} must be captured first"
            )
        self.attn_backend.enable_static_decode_metadata(rows, self.max_context, self.device)
        self._static_metadata_rows = rows

    @contextlib.contextmanager
    def _forward_scope(self, fb: ForwardBatch) -> Iterator[None]:
        """The forward context and the attention backend's metadata for fb (prepared once per
        forward, outside any graph), for as long as fb's forward runs."""
        kv = self.kv_cache
        with forward_context(ForwardContext(fb, self.attn_backend, kv.token_pool, kv.req_to_token_pool)):
            self.attn_backend.init_forward_metadata(fb, kv.req_to_token_pool.req_to_token)
            try:
                yield
            finally:
                self.attn_backend.end_forward()

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden rows of fb's real tokens, from the mode's backend or, if it cannot run fb, eager."""
        backend = self.backends[fb.forward_mode]
        if not backend.takes(fb):  # a batch it cannot run: the backend counts the fallback
            backend = self.eager
        return self.execute(backend, fb)

    @torch.inference_mode()
    def execute(self, backend: CaptureBackend, fb: ForwardBatch) -> torch.Tensor:
        """fb through `backend` (which must be able to run it): padded by the backend, run in a
        forward scope for the padded batch, real rows back."""
        prepared = backend.prepare(fb)
        with self._forward_scope(prepared.batch):
            return prepared.run()

    @torch.inference_mode()
    def forward_and_sample(self, fb: ForwardBatch) -> StepOutput:
        # The other ranks run the same forward and LM-head rows; sampling is rank 0's alone.
        with self.channel.step(fb, self.kv_cache.take_table_changes()):
            logits, prompt_logprobs = self.forward_logits(fb)
        entries = [] if prompt_logprobs is None else fb.prompt_logprobs.entries(prompt_logprobs)
        return StepOutput(self.sampler(logits, fb.sampling_info), logits, entries)

    @property
    def keep_alive_s(self) -> float | None:
        """How often an idle engine must call `keep_alive` (None: never, no other ranks wait)."""
        return self.channel.keep_alive_s

    def keep_alive(self) -> None:
        """Idle: let the other ranks know this one is alive (no-op without a channel to them)."""
        self.channel.keep_alive(self.kv_cache.take_table_changes())

    @torch.inference_mode()
    def forward_logits(self, fb: ForwardBatch) -> tuple[torch.Tensor, PromptLogprobs | None]:
        """The sampled rows' logits and, if the batch asked, its prompt logprobs: everything of a
        step that runs on every tensor-parallel rank."""
        hidden = self.forward(fb)
        logits = self.logits_processor(hidden, fb)
        plan = fb.prompt_logprobs
        return logits, None if plan is None else plan.compute(hidden, self.model.compute_logits)

    def backend_stats(self) -> dict[str, dict]:
        """Per-mode counters: capture cost, executions, fallbacks, padded rows.  Modes that share
        a backend show the same counters; `modes` lists them, so a sum can count each once."""
        sharing: dict[int, list[str]] = {}
        distinct: dict[int, CaptureBackend] = {}
        for mode, backend in self.backends.items():
            sharing.setdefault(id(backend), []).append(mode.config_key)
            distinct.setdefault(id(backend), backend)
        # One conversion per backend, its modes sharing the dict: the loop publishes these every
        # step, and decode, idle and verify share one backend.
        once = {key: b.stats.as_dict() | {"backend": b.name, "modes": sharing[key]} for key, b in distinct.items()}
        return {mode.config_key: once[id(backend)] for mode, backend in self.backends.items()}

    def weight_nbytes(self) -> int:
        """Bytes of resident weights: parameters and packed quantized arrays, not derived RoPE tables."""
        derived = {id(t) for t in self.model.rope_tables()}
        tensors = [t for t in [*self.model.parameters(), *self.model.buffers()] if id(t) not in derived]
        return sum(t.numel() * t.element_size() for t in tensors)

    def init_forward_batch(self, schedule_batch) -> ForwardBatch:
        return ForwardBatch.init_new(schedule_batch, self.device, self.model_config.vocab_size)


def _rank_state_dict(checkpoint: LoadedCheckpoint, layout: TPLayout) -> dict:
    """The checkpoint's weights for layout's rank: as loaded when the loader already cut them
    for it (every loader does, through rank_setup), else cut here from a whole one (tests, benchmarks)."""
    if checkpoint.tp_shard == (layout.size, layout.rank):
        return checkpoint.state_dict
    if checkpoint.tp_shard != (1, 0):
        raise ValueError(
            f"checkpoint was cut for tp rank {checkpoint.tp_shard[1]} of {checkpoint.tp_shard[0]}, "
            f"not rank {layout.rank} of {layout.size}"
        )
    return shard_state_dict(checkpoint.state_dict, layout)


@contextlib.contextmanager
def _config_errors() -> Iterator[None]:
    """capture/ is a library with its own error type; to engine users a bad capture option is a
    ConfigError like any other (its message already names the option)."""
    try:
        yield
    except CaptureConfigError as error:
        raise ConfigError(str(error)) from error
