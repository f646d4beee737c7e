"""Typed, frozen engine configuration, composed from the Hydra config groups in `configs/`.

The YAML files are the single source of defaults; this module only composes them, checks every
value once at start-up (errors name the option) and freezes the result.  Nothing mutates a config
after composition.  A config crosses a process boundary as plain data (`EngineConfig.to_plain`,
JSON-able) and is rebuilt on the other side through the same checks (`EngineConfig.from_mapping`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from graphexec.batch.forward_mode import ForwardMode
from graphexec.errors import ConfigError
from graphexec.quant.layers import ACTIVATION_MODES
from graphexec.sampling_params import SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_WEIGHT_MODES = ("native", "dequantize")
_MODEL_SOURCES = ("gguf", "hf", "random")
_ADMISSION_POLICIES = ("optimistic", "reserve")
_DEFAULT_PREFILL_TOKENS = 2048
_DIST_BACKENDS = ("auto", "gloo", "nccl")
_SPEC_METHODS = ("none", "ngram", "draft_model")
_SPEC_POLICIES = ("cost", "always")


def config_dir() -> Path:
    """`configs/` of a source checkout, else the copy installed as package data."""
    repo_configs = Path(__file__).resolve().parent.parent / "configs"
    if (repo_configs / "config.yaml").is_file():
        return repo_configs
    installed = Path(__file__).resolve().parent / "configs"
    if (installed / "config.yaml").is_file():
        return installed
    raise ConfigError(f"graphexec configs not found at {repo_configs} or {installed}; reinstall the package")


def available_options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose like the command-line apps do, turning Hydra's errors into ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    overrides = list(overrides)
    for override in overrides:
        group, _, choice = override.lstrip("+~").partition("=")
        if (config_dir() / group).is_dir() and choice and choice not in available_options(group):
            raise ConfigError(f"{group}={choice!r} is unknown; available: {available_options(group)}")
    try:
        with initialize_config_dir(version_base=None, config_dir=str(config_dir()), job_name="graphexec"):
            return hydra_compose(config_name, overrides=overrides)
    except HydraException as err:
        raise ConfigError(f"invalid config override: {err}") from err


@dataclass(frozen=True)
class ModelSourceConfig:
    name: str
    source: str  # gguf | hf | random
    path: str | None = None  # gguf/hf: file or directory; None for gguf means the packaged SmolLM2
    seed: int = 0  # random only
    architecture: Mapping[str, Any] = field(default_factory=dict)  # random only: ModelConfig fields
    # Weights, activations and (unless cache.dtype says otherwise) the KV cache: float32 | bfloat16
    # | float16 (fp32 | bf16 | fp16 accepted).  Packed quantized weights keep their own encoding.
    dtype: str = "float32"
    # gguf only.  native: Q4_0/Q4_1/Q8_0, Q5_0/Q5_1 and the K-quants Q4_K/Q5_K/Q6_K stay
    # block-quantized and run through graphexec's kernels (graphexec/quant/); dequantize: every
    # tensor becomes a dense `dtype` tensor (the reference).
    weights: str = "native"
    # How native quantized weights meet their activations.  float: as they are (the exact path;
    # only summation order differs from a dense matmul).  q8: each activation row is quantized
    # per 32-element block to 8 bits first and the block dot products are integer, as llama.cpp
    # computes (graphexec/kernels/csrc/qlinear_q8.cpp): faster, and close to llama.cpp's own
    # numerics rather than the fp32 reference's.  Applies to every block-quantized weight (K-quants
    # and Q5_x converted at load to the kernel's layout, graphexec/quant/repack.py).
    activations: str = "float"
    # LongRoPE checkpoints (Phi-3 128k, Phi-4-mini).  false: the original context on the short
    # factors, where transformers uses them too.  true: the declared context, every position on the
    # long factors (llama.cpp's choice past the original context; transformers switches per forward,
    # which a KV cache shared by requests of every length cannot).  Other models: an error.
    rope_long_factors: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass(frozen=True)
class BackendSpec:
    backend: str
    options: Mapping[str, Any]


_EAGER_SPEC = BackendSpec(backend="eager", options=MappingProxyType({}))


@dataclass(frozen=True)
class CapturePlan:
    """Which capture backend runs each ForwardMode, and how its graphs come to be."""

    name: str
    extend: BackendSpec
    decode: BackendSpec
    mixed: BackendSpec
    idle: BackendSpec
    # Speculative verification batches are decode rows; a plan that does not name this mode runs
    # them with decode's spec (and so, sharing its backend, on decode's graphs).
    target_verify: BackendSpec
    # true: the engine serves eagerly from the moment the weights are loaded and captures one
    # bucket at a time on its loop thread while no request is waiting, swapping each in when
    # ready.  false (a plan that does not say): every bucket is captured before the engine serves.
    background: bool = False
    # Background capture starts only after the engine has been idle this long (and resumes after
    # each request the same way): a request that comes right away is never behind a capture.
    idle_delay_s: float = 1.0
    # Background capture: compile the buckets whose compiled code is saved beside the plan
    # (full_graph compile.aot, needs cache_dir) in a child process, stopped while any request is
    # served, and only load them on the loop thread: a request never waits for a compile there.
    # The child loads the weights again: one more copy of them in memory while it runs.  false:
    # compile on the loop thread too (a request arriving mid-compile waits for it).
    compile_in_child: bool = True
    # With compile_in_child: how many such processes may compile at once, each building whole
    # groups of buckets that share one compile (auto: B=1's forward in one, the forward every
    # larger bucket shares in the other).  Each loads the weights again while it runs.
    compile_processes: int = 1
    # Where capture plans (which bucket keeps its graph, measured how) are kept, one file per key
    # (capture/plan_store.py); null: not kept, every start measures again.
    cache_dir: str | None = None

    def for_mode(self, mode: ForwardMode, device_type: str | None = None) -> BackendSpec:
        """The mode's spec; eager on a device its `devices` option does not list."""
        spec: BackendSpec = getattr(self, mode.config_key)
        devices = spec.options.get("devices")
        if devices is None:
            return spec
        if device_type is not None and device_type not in devices:
            return _EAGER_SPEC
        return BackendSpec(spec.backend, MappingProxyType({k: v for k, v in spec.options.items() if k != "devices"}))


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    # New tokens per prefill batch; longer prompts are chunked.  Composed as null it becomes the
    # largest token bucket of the extend backend (so every chunk fits a graph), else 2048.
    max_prefill_tokens: int
    mixed_chunk: bool  # running decodes join a prefill batch as one-token extends (MIXED)
    # optimistic: admit against what the next steps need plus an estimate of future decode
    # tokens, and retract running requests when a decode step cannot get its slots.
    # reserve: admit only when each request's worst case (prompt + max_new_tokens) is promised;
    # nothing is ever retracted, but a few huge requests can hold the pool for everyone.
    admission: str = "optimistic"
    # The estimate of future decode tokens is ratio x each request's remaining max_new_tokens
    # (capped by new_token_estimate_cap): the ratio starts at init_new_token_ratio, decays by
    # new_token_ratio_decay per decode step down to min_new_token_ratio, and is reset to the
    # start on every retraction.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    new_token_estimate_cap: int = 4096


@dataclass(frozen=True)
class CacheConfig:
    num_slots: int
    max_context: int | None  # None: the model's own context length
    prefix_cache: bool = True  # reuse the KV of cached prompt prefixes (graphexec/cache/prefix_cache.py)
    dtype: str | None = None  # KV element type; None follows model.dtype

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return None if self.dtype is None else _DTYPES[self.dtype]


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes serve the model (graphexec/parallel/)."""

    # Tensor-parallel ranks, one process each: attention heads, MLP columns and the vocabulary are
    # split across them and every layer all-reduces.  Rank 0 owns the scheduler (and the HTTP front).
    tp_size: int = 1
    # Data-parallel replicas behind one graphexec-serve: each its own process, scheduler and KV
    # cache (each replica may itself be tp_size ranks).
    dp_size: int = 1
    # dp_size > 1: a request whose prompt prefix (system prompt, first turns) a replica served
    # before goes back to that replica, for its prefix cache, unless that replica has more than
    # this many requests in flight beyond the least-loaded one (then the least-loaded takes it).
    # 0: it goes back only when that replica is as little loaded as any.
    dp_affinity_slack: int = 4
    # torch.distributed backend: auto (nccl on CUDA, gloo on CPU) | gloo | nccl.
    dist_backend: str = "auto"
    # A rank that has not joined a collective (a step, start-up) within this many seconds fails
    # the engine's requests with WorkerFailedError and stops the engine.
    timeout_s: float = 60.0
    # CPU threads each rank (or, at tp_size=1, the engine) uses; null: the machine's cores divided
    # among the ranks (at tp_size=1: torch's default).
    threads_per_rank: int | None = None


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (graphexec/speculative/): drafts verified in one TARGET_VERIFY forward."""

    # none: never speculate.  ngram: prompt lookup, the continuation of the latest earlier
    # occurrence of the request's last tokens in its own prompt + output.  draft_model: a smaller
    # model of the same vocabulary proposes greedily (graphexec/speculative/draft_model.py).
    method: str = "none"
    # Draft tokens per request and step at most (k); a step verifies up to k + 1 tokens of it.
    num_draft_tokens: int = 4
    # ngram: the longest and shortest suffix looked up (the longest that occurs earlier wins).
    ngram_max: int = 4
    ngram_min: int = 2
    # cost: per step, draft only where the expected accepted tokens beat the measured cost of the
    # extra rows (graphexec/speculative/policy.py), so speculation turns itself off where it cannot
    # pay.  always: verify every draft found (tests, benchmarks of the mechanism).
    policy: str = "cost"
    # draft_model: the name of the drafting model's config in configs/model/ (composed and checked
    # like `model=<name>`); its vocabulary must be the target's.
    draft_model: str | None = None
    # draft_model: KV slots of the drafting model's own pool; null: cache.num_slots.  A request
    # that finds the pool full drafts nothing that step (it never waits for the draft model).
    draft_num_slots: int | None = None

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSourceConfig
    capture: CapturePlan
    scheduler: SchedulerConfig
    cache: CacheConfig
    sampling: SamplingParams
    device: str
    attention_backend: str
    seed: int
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.model.torch_dtype

    @classmethod
    def from_overrides(cls, overrides: Sequence[str] = ()) -> "EngineConfig":
        return cls.from_dictconfig(compose(overrides))

    @classmethod
    def from_dictconfig(cls, cfg: DictConfig) -> "EngineConfig":
        raw = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(raw, dict)
        return cls.from_mapping(raw)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> "EngineConfig":
        """A config from plain data shaped like the composed YAML (or `to_plain`'s output)."""
        device = str(raw["device"])
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} needs a GPU and none is available; use device=cpu")
        if not (device == "cpu" or device.startswith("cuda")):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
        return cls(
            model=_model_source(raw["model"]),
            capture=_capture_plan(raw["capture"]),
            scheduler=_scheduler(raw["scheduler"], raw["capture"]),
            cache=_cache(raw["cache"]),
            sampling=SamplingParams(**_known(SamplingParams, raw["sampling"], "sampling")),
            device=device,
            attention_backend=str(raw["attention_backend"]),
            seed=int(raw["seed"]),
            parallel=_parallel(raw.get("parallel") or {}),
            speculative=_speculative(raw.get("speculative") or {}),
        )

    def to_plain(self) -> dict[str, Any]:
        """Dicts, lists, strings, numbers, booleans and None that `from_mapping` rebuilds into an
        equal config: how a config reaches another process without pickle."""
        plain = {f.name: _plain(getattr(self, f.name), f.name) for f in fields(self) if f.name != "capture"}
        return plain | {"capture": _plain_capture(self.capture)}


def _plain(value: Any, option: str) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {key: _plain(item, f"{option}.{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{option}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, (ModelSourceConfig, SchedulerConfig, CacheConfig, ParallelConfig, SpeculativeConfig, SamplingParams)):
        return {f.name: _plain(getattr(value, f.name), f"{option}.{f.name}") for f in fields(value)}
    raise ConfigError(f"{option} holds a {type(value).__name__}, which cannot travel to another process as plain data")


def _plain_capture(plan: CapturePlan) -> dict[str, Any]:
    """The plan as the YAML spells it: each mode's backend beside its options."""
    plain = {}
    for f in fields(plan):
        value = getattr(plan, f.name)
        if isinstance(value, BackendSpec):
            plain[f.name] = {"backend": value.backend, **_plain(value.options, f"capture.{f.name}")}
        else:
            plain[f.name] = _plain(value, f"capture.{f.name}")
    return plain


def _known(dc: type, values: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    names = {f.name for f in fields(dc)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]} is not an option; known: {sorted(names)}")
    return dict(values)


def _scheduler(values: Mapping[str, Any], capture: Mapping[str, Any]) -> SchedulerConfig:
    values = _known(SchedulerConfig, values, "scheduler")
    if values.get("max_prefill_tokens") is None:
        buckets = (capture.get("extend") or {}).get("buckets")
        values["max_prefill_tokens"] = max(buckets) if buckets else _DEFAULT_PREFILL_TOKENS
    for key in ("max_running_requests", "max_prefill_tokens"):
        _check_positive_int(values.get(key), f"scheduler.{key}")
    if not isinstance(values.get("mixed_chunk"), bool):
        raise ConfigError(f"scheduler.mixed_chunk must be true or false, got {values.get('mixed_chunk')!r}")
    if values.get("admission", "optimistic") not in _ADMISSION_POLICIES:
        raise ConfigError(f"scheduler.admission must be one of {list(_ADMISSION_POLICIES)}, got {values['admission']!r}")
    for key in ("init_new_token_ratio", "min_new_token_ratio", "new_token_ratio_decay"):
        value = values.get(key, getattr(SchedulerConfig, key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ConfigError(f"scheduler.{key} must be a number in [0, 1], got {value!r}")
        values[key] = float(value)
    if values.get("min_new_token_ratio", 0.1) > values.get("init_new_token_ratio", 0.7):
        raise ConfigError(
            f"scheduler.min_new_token_ratio ({values['min_new_token_ratio']}) must not exceed "
            f"scheduler.init_new_token_ratio ({values['init_new_token_ratio']})"
        )
    _check_positive_int(values.get("new_token_estimate_cap", 4096), "scheduler.new_token_estimate_cap")
    return SchedulerConfig(**values)


def _check_positive_int(value: Any, option: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{option} must be an integer >= 1, got {value!r}")


def _cache(values: Mapping[str, Any]) -> CacheConfig:
    values = _known(CacheConfig, values, "cache")
    _check_positive_int(values["num_slots"], "cache.num_slots")
    if values["max_context"] is not None and (not isinstance(values["max_context"], int) or values["max_context"] < 2):
        raise ConfigError(f"cache.max_context must be null or an integer >= 2, got {values['max_context']!r}")
    if not isinstance(values.get("prefix_cache", True), bool):
        raise ConfigError(f"cache.prefix_cache must be true or false, got {values['prefix_cache']!r}")
    dtype = values.get("dtype")
    if dtype is not None:
        dtype = _DTYPE_ALIASES.get(dtype, dtype)
        if dtype not in _DTYPES:
            raise ConfigError(f"cache.dtype must be null or one of {sorted(_DTYPES)}, got {values['dtype']!r}")
    return CacheConfig(**(values | {"dtype": dtype}))


def _parallel(values: Mapping[str, Any]) -> ParallelConfig:
    values = _known(ParallelConfig, values, "parallel")
    for key in ("tp_size", "dp_size"):
        _check_positive_int(values.get(key, 1), f"parallel.{key}")
    slack = values.get("dp_affinity_slack", ParallelConfig.dp_affinity_slack)
    if not isinstance(slack, int) or isinstance(slack, bool) or slack < 0:
        raise ConfigError(f"parallel.dp_affinity_slack must be an integer >= 0, got {slack!r}")
    if values.get("dist_backend", "auto") not in _DIST_BACKENDS:
        raise ConfigError(f"parallel.dist_backend must be one of {list(_DIST_BACKENDS)}, got {values['dist_backend']!r}")
    timeout = values.get("timeout_s", ParallelConfig.timeout_s)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"parallel.timeout_s must be a number of seconds > 0, got {timeout!r}")
    values["timeout_s"] = float(timeout)
    if values.get("threads_per_rank") is not None:
        _check_positive_int(values["threads_per_rank"], "parallel.threads_per_rank")
    return ParallelConfig(**values)


def _speculative(values: Mapping[str, Any]) -> SpeculativeConfig:
    values = _known(SpeculativeConfig, values, "speculative")
    if values.get("method", "none") not in _SPEC_METHODS:
        raise ConfigError(f"speculative.method must be one of {list(_SPEC_METHODS)}, got {values['method']!r}")
    if values.get("policy", "cost") not in _SPEC_POLICIES:
        raise ConfigError(f"speculative.policy must be one of {list(_SPEC_POLICIES)}, got {values['policy']!r}")
    for key in ("num_draft_tokens", "ngram_max", "ngram_min"):
        _check_positive_int(values.get(key, getattr(SpeculativeConfig, key)), f"speculative.{key}")
    if values.get("ngram_min", SpeculativeConfig.ngram_min) > values.get("ngram_max", SpeculativeConfig.ngram_max):
        raise ConfigError(
            f"speculative.ngram_min ({values['ngram_min']}) must not exceed speculative.ngram_max "
            f"({values.get('ngram_max', SpeculativeConfig.ngram_max)})"
        )
    if values.get("draft_num_slots") is not None:
        _check_positive_int(values["draft_num_slots"], "speculative.draft_num_slots")
    draft = values.get("draft_model")
    if draft is not None and draft not in available_options("model"):
        raise ConfigError(f"speculative.draft_model={draft!r} is unknown; available: {available_options('model')}")
    if values.get("method") == "draft_model" and draft is None:
        raise ConfigError(
            "speculative.method=draft_model needs speculative.draft_model, the name of a model config "
            f"(one of {available_options('model')})"
        )
    return SpeculativeConfig(**values)


def draft_model_source(config: SpeculativeConfig) -> ModelSourceConfig:
    """The drafting model's source, composed from configs/model/<speculative.draft_model>.yaml
    through the same checks as `model=<name>`."""
    raw = OmegaConf.to_container(compose([f"model={config.draft_model}"]).model, resolve=True)
    assert isinstance(raw, dict)
    return _model_source(raw)


def _model_source(values: Mapping[str, Any]) -> ModelSourceConfig:
    values = _known(ModelSourceConfig, values, "model")
    if values.get("source") not in _MODEL_SOURCES:
        raise ConfigError(f"model.source must be one of {list(_MODEL_SOURCES)}, got {values.get('source')!r}")
    if values["source"] == "hf" and not values.get("path"):
        raise ConfigError("model.path is required when model.source=hf (a Hugging Face model directory)")
    dtype = _DTYPE_ALIASES.get(values.get("dtype"), values.get("dtype"))
    if dtype not in _DTYPES:
        raise ConfigError(f"model.dtype must be one of {sorted(_DTYPES) + sorted(_DTYPE_ALIASES)}, got {dtype!r}")
    if values.get("weights") not in _WEIGHT_MODES:
        raise ConfigError(f"model.weights must be one of {list(_WEIGHT_MODES)}, got {values.get('weights')!r}")
    activations = values.get("activations", "float")
    if activations not in ACTIVATION_MODES:
        raise ConfigError(f"model.activations must be one of {list(ACTIVATION_MODES)}, got {activations!r}")
    if activations == "q8" and (values["source"] != "gguf" or values.get("weights") != "native"):
        raise ConfigError(
            "model.activations=q8 applies to block-quantized weights: it needs model.source=gguf with "
            f"model.weights=native (got model.source={values['source']}, model.weights={values.get('weights')})"
        )
    architecture = MappingProxyType(dict(values.pop("architecture", None) or {}))
    return ModelSourceConfig(architecture=architecture, **(values | {"dtype": dtype}))


def _capture_plan(values: Mapping[str, Any]) -> CapturePlan:
    from capture.registry import available_backends

    specs = {}
    for mode in ForwardMode:
        key = mode.config_key
        if mode.is_target_verify() and values.get(key) is None:
            key = ForwardMode.DECODE.config_key
        entry = dict(values.get(key) or {})
        backend = entry.pop("backend", None)
        if backend not in available_backends():
            raise ConfigError(f"capture.{key}.backend={backend!r} is unknown; available: {available_backends()}")
        devices = entry.get("devices")
        if devices is not None and (
            not isinstance(devices, (list, tuple)) or not devices or not set(devices) <= {"cpu", "cuda"}
        ):
            raise ConfigError(f"capture.{key}.devices must be a non-empty list of 'cpu' and 'cuda' (elsewhere: eager), got {devices!r}")
        specs[mode.config_key] = BackendSpec(backend=backend, options=MappingProxyType(entry))
    plan_keys = {"name", "background", "cache_dir", "idle_delay_s", "compile_in_child", "compile_processes"}
    extra = sorted(set(values) - {m.config_key for m in ForwardMode} - plan_keys)
    if extra:
        raise ConfigError(
            f"capture.{extra[0]} is neither a ForwardMode nor a plan option; plans map "
            f"{[m.config_key for m in ForwardMode]} and take {sorted(plan_keys)}"
        )
    # A plan captures in the background only if it says so (auto does): a hand-made plan, or
    # eager with one mode overridden, captures before serving as before.
    background = values.get("background", False)
    if not isinstance(background, bool):
        raise ConfigError(f"capture.background must be true or false, got {background!r}")
    cache_dir = values.get("cache_dir")
    if cache_dir is not None and not isinstance(cache_dir, str):
        raise ConfigError(f"capture.cache_dir must be a directory path or null, got {cache_dir!r}")
    compile_in_child = values.get("compile_in_child", True)
    if not isinstance(compile_in_child, bool):
        raise ConfigError(f"capture.compile_in_child must be true or false, got {compile_in_child!r}")
    compile_processes = values.get("compile_processes", 1)
    _check_positive_int(compile_processes, "capture.compile_processes")
    idle_delay_s = values.get("idle_delay_s", 1.0)
    if isinstance(idle_delay_s, bool) or not isinstance(idle_delay_s, (int, float)) or idle_delay_s < 0:
        raise ConfigError(f"capture.idle_delay_s must be a number of seconds >= 0, got {idle_delay_s!r}")
    return CapturePlan(
        name=str(values.get("name", "custom")),
        background=background,
        cache_dir=cache_dir,
        idle_delay_s=float(idle_delay_s),
        compile_in_child=compile_in_child,
        compile_processes=compile_processes,
        **specs,
    )
