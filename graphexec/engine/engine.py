"""The Python serving API: `Engine(overrides=[...])`, then `generate` (blocking batch), `stream`
(blocking iterator of deltas), `agenerate` / `astream` (asyncio), `abort` and `shutdown`.

All model work runs on one background thread (`EngineLoop`), started by the first request;
callers only validate, tokenize and wait.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from graphexec.batch.request import Req
from graphexec.config import EngineConfig
from graphexec.engine.background_capture import BackgroundCapture
from graphexec.engine.engine_loop import EngineLoop
from graphexec.engine.engine_metrics import EngineMetrics
from graphexec.engine.rank_setup import RankParts, load_and_capture, load_draft
from graphexec.engine.request_output import RequestDelta, RequestOutput
from graphexec.engine.request_stream import AsyncRequestStream, RequestStream
from graphexec.engine.request_tracker import RequestTracker
from graphexec.engine.threads import call_in_thread
from graphexec.errors import InvalidRequestError, RequestFailedError
from graphexec.parallel.driver import TPDriver
from graphexec.parallel.group import SINGLE
from graphexec.parallel.step_channel import NO_PEERS
from graphexec.sampling_params import SamplingParams
from graphexec.scheduler.scheduler import Scheduler
from graphexec.speculative import Speculator
from graphexec.speculative.draft_model import DraftModelDrafter
from graphexec.structured.spec import StructuredSpec
from graphexec.text.prompt_encoder import Prompt, PromptEncoder

if TYPE_CHECKING:
    from graphexec.loader import LoadedCheckpoint
    from graphexec.structured.grammar_backend import GrammarBackend

__all__ = ["Engine", "Prompt", "RequestDelta", "RequestOutput"]


class Engine:
    """Loads the configured model, builds the runner and scheduler, and serves requests.

    `overrides` are Hydra overrides of `configs/config.yaml`, exactly as on the command line.
    Once a request has been served, the engine loop owns `scheduler` and `runner`: drive them
    directly only on an engine that serves no requests.  Under background capture
    (`capture.background`, the default plan's) the loop owns them from the start: it captures
    while idle, so build such an engine with `capture.background=false` to drive them yourself.
    Other threads read the loop's state only through `metrics()`, a snapshot the loop publishes.
    """

    def __init__(self, overrides: Sequence[str] = (), *, config: EngineConfig | None = None):
        self.config = config if config is not None else EngineConfig.from_overrides(overrides)
        torch.manual_seed(self.config.seed)
        # Tensor parallelism: the other ranks start (or, under torchrun, are joined) first; they
        # load and capture in lockstep with this process, rank 0.
        self._tp = TPDriver(self.config) if self.config.parallel.tp_size > 1 else None
        tp, channel = (SINGLE, NO_PEERS) if self._tp is None else (self._tp.tp, self._tp.channel)
        if self._tp is not None:
            self.config = self._tp.config
        elif self.config.parallel.threads_per_rank is not None:
            torch.set_num_threads(self.config.parallel.threads_per_rank)  # a dp replica's share of the cores
        # Loading and capture run on a thread that then exits, so the engine loop's thread is the
        # only one holding an OpenMP team (graphexec/engine/threads.py: two teams cost ~40 % per step).
        # Background capture (capture.background): serve eagerly at once, capture on the loop
        # thread while idle.  Tensor-parallel ranks capture in lockstep, so they capture first.
        background = self.config.capture.background and self._tp is None
        try:
            rank = call_in_thread(lambda: load_and_capture(self.config, tp, channel, capture=not background))
            speculator = self._speculator(rank.checkpoint, capture=not background)
        except BaseException:
            if self._tp is not None:
                self._tp.close()
            raise
        if self._tp is not None:
            self._tp.start_serving()
        self.runner = rank.runner
        self.kv_cache = rank.kv_cache
        self.model_config = rank.checkpoint.config
        self.tokenizer = rank.checkpoint.tokenizer
        self.scheduler = Scheduler(self.runner, self.kv_cache, self.config.scheduler, speculator)
        self.prompt_encoder = PromptEncoder(self.tokenizer, self.model_config.name, self.model_config.vocab_size, self.max_context)
        self._request_ids = itertools.count()
        self._grammar_backend: GrammarBackend | None = None  # built by the first constrained request
        self._grammar_backend_lock = threading.Lock()
        runners = [self.runner] + ([self.draft.runner] if self.draft is not None else [])
        idle_work = None
        if background and any(r.capture_pending() for r in runners):
            plan = self.config.capture
            idle_work = BackgroundCapture(runners, in_child=plan.compile_in_child, processes=plan.compile_processes)
        self._loop = EngineLoop(
            self.scheduler,
            self.runner,
            idle_work=idle_work,
            idle_delay_s=self.config.capture.idle_delay_s,
        )
        # An engine dropped without shutdown() still stops its thread and its other ranks (the
        # callback holds the loop and the driver, not the engine, so it does not keep it alive).
        self._stop_loop = weakref.finalize(self, _shutdown, self._loop, self._tp)

    def _speculator(self, target: LoadedCheckpoint, capture: bool) -> Speculator | None:
        """The scheduler's speculation partner (None when speculation is off); with a draft model,
        that model's own KV cache and runner too (`self.draft`); under background capture its
        buckets are captured while idle after the target's (`BackgroundCapture`)."""
        self.draft: RankParts | None = None
        spec = self.config.speculative
        if not spec.enabled:
            return None
        if spec.method != "draft_model":
            return Speculator(spec)
        self.draft = call_in_thread(lambda: load_draft(self.config, target, capture=capture))
        return Speculator(spec, DraftModelDrafter(self.draft.runner, self.draft.kv_cache))

    @property
    def loop(self) -> EngineLoop:
        """The loop thread's driver (submissions go through the methods above; benchmarks time
        its iterations)."""
        return self._loop

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    @property
    def max_request_tokens(self) -> int:
        """Most tokens (prompt + generated) one request may hold: the context, or the KV pool if smaller."""
        return min(self.max_context, self.kv_cache.num_slots)

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings, or token-id lists used as given); outputs in order.

        Every prompt is validated before any is queued, so a bad one fails the call cleanly.
        If a request fails, the others of the call are aborted (and released) before it raises.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidRequestError("prompts must be a list of strings or a list of token-id lists", param="prompt")
        params = self._params_per_prompt(len(prompts), sampling_params)
        reqs = [self._make_request(p, sp, chat, f"prompt {i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        if not reqs:
            return []
        streams = self._submit(reqs, self._thread_stream)
        try:
            return [stream.result() for stream in streams]
        except BaseException:
            for stream in streams:
                stream.cancel()
            for stream in streams:
                _drain(stream)
            raise

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *, chat: bool = False) -> RequestStream:
        """Start one request; iterate the result for its deltas (`.result()` waits for the end)."""
        (stream,) = self._submit([self._make_request(prompt, sampling_params, chat, "prompt")], self._thread_stream)
        return stream

    def astream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, *, chat: bool = False
    ) -> AsyncRequestStream:
        """Start one request from a running event loop; `async for` over the result for its deltas.

        Bad input raises here, before anything is queued.
        """
        (stream,) = self._submit([self._make_request(prompt, sampling_params, chat, "prompt")], self._asyncio_stream)
        return stream

    def astream_batch(
        self, prompts: Sequence[Prompt], sampling_params: Sequence[SamplingParams], *, chat: bool = False
    ) -> list[AsyncRequestStream]:
        """Start several requests in one submission (the loop sees them together, so they can
        share their first batch); one stream each, in order.  Bad input raises before any is queued."""
        params = self._params_per_prompt(len(prompts), sampling_params)
        reqs = [self._make_request(p, sp, chat, f"prompt {i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        return self._submit(reqs, self._asyncio_stream) if reqs else []

    async def agenerate(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, *, chat: bool = False
    ) -> RequestOutput:
        """One request, awaited; cancelling the await aborts the request."""
        return await self.astream(prompt, sampling_params, chat=chat).result()

    def abort(self, request_id: str) -> bool:
        """Abort a request; its stream ends with finish_reason "abort" once its KV is released.

        False when the id is unknown or the request already finished.
        """
        return self._loop.abort(request_id)

    def shutdown(self) -> None:
        """Abort unfinished requests and stop the engine loop; the engine takes no new requests."""
        self._stop_loop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    @property
    def is_serving(self) -> bool:
        return self._loop.is_alive

    def num_unfinished(self) -> int:
        """Requests submitted and not yet finished (queued or running)."""
        return self._loop.num_unfinished()

    def metrics(self) -> EngineMetrics:
        return EngineMetrics.collect(self._loop.snapshot(), self._loop.num_unfinished(), self._loop.stats)

    def encode_prompt(self, prompt: Prompt, chat: bool = False, index: int = 0) -> list[int]:
        return self.prompt_encoder.encode(prompt, chat=chat, label=f"prompt {index}")

    def encode_chat(self, messages: Sequence[Mapping[str, str]], tools: Sequence[Mapping] | None = None) -> list[int]:
        """Token ids of a conversation through the model's chat template, ready for the reply;
        `tools` (OpenAI tool objects) go to the template's `tools` variable."""
        return self.prompt_encoder.encode_chat(messages, tools=tools)

    def prepare_grammar(self, spec: StructuredSpec) -> None:
        """Compile a structured-output constraint into the engine's grammar cache now.

        Compiling a JSON schema can take tens of ms: an event loop should call this on a worker
        thread before `astream`, which then finds the grammar cached.  InvalidRequestError (naming
        spec.param) if the schema or regex cannot be compiled.
        """
        self.grammar_backend(spec.param).prepare(spec)

    def grammar_backend(self, param: str = "structured") -> GrammarBackend:
        """The engine's structured-output state, built on first use (llguidance's view of the
        vocabulary: a few hundred ms for 49k tokens); InvalidRequestError naming `param` when this
        engine cannot constrain output."""
        with self._grammar_backend_lock:
            if self._grammar_backend is None:
                if self.tokenizer is None:
                    raise InvalidRequestError(
                        f"{param}: structured output needs a tokenizer; model {self.model_config.name!r} has none", param=param
                    )
                if not self.model_config.eos_token_ids:
                    raise InvalidRequestError(
                        f"{param}: structured output ends on EOS; model {self.model_config.name!r} has none", param=param
                    )
                try:
                    from graphexec.structured.grammar_backend import GrammarBackend
                except ImportError as error:
                    raise InvalidRequestError(
                        f"{param}: structured output needs llguidance, which is not installed ({error}); "
                        "pip install 'graphexec[structured]'",
                        param=param,
                    ) from None
                self._grammar_backend = GrammarBackend(
                    self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids
                )
            return self._grammar_backend

    def kv_slots_free(self) -> int:
        """Free KV slots as the loop last published them (graphexec/engine/engine_metrics.py)."""
        return self._loop.snapshot().kv_slots_free

    def flush_cache(self) -> int:
        """Drop every cached prompt prefix, returning its KV slots to the pool; refused
        (RuntimeError) while requests are in flight.  Returns the slots freed."""
        return self._loop.flush_cache()

    def _params_per_prompt(self, n: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.config.sampling] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise InvalidRequestError(
                f"sampling_params must be one SamplingParams or a list of {n} (one per prompt), got {len(params)}"
            )
        return params

    def _make_request(self, prompt: Prompt, params: SamplingParams | None, chat: bool, label: str) -> Req:
        params = self.config.sampling if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        self._check_logit_bias(params)
        ids = self.prompt_encoder.encode(prompt, chat=chat, label=label)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(f"stop strings need a tokenizer; model {self.model_config.name!r} has none", param="stop")
        spec = params.structured
        req = Req(
            rid=f"req-{next(self._request_ids)}",
            prompt_ids=ids,
            params=params,
            eos_token_ids=self.model_config.eos_token_ids,
            max_context=self.max_context,
            grammar=None if spec is None else self.grammar_backend(spec.param).matcher(spec, params.stop_token_ids),
        )
        if req.max_total_tokens() > self.kv_cache.num_slots:
            raise InvalidRequestError(
                f"{label} needs up to {req.max_total_tokens()} KV slots (prompt + max_new_tokens) "
                f"but the pool has {self.kv_cache.num_slots}; lower max_new_tokens or raise cache.num_slots",
                param="max_tokens",
            )
        return req

    def _check_logit_bias(self, params: SamplingParams) -> None:
        # SamplingParams cannot know the vocabulary; the pairs are sorted, so the last id is the largest.
        vocab_size = self.model_config.vocab_size
        if params.logit_bias and params.logit_bias[-1][0] >= vocab_size:
            raise InvalidRequestError(
                f"logit_bias has token id {params.logit_bias[-1][0]} outside the vocabulary [0, {vocab_size})",
                param="logit_bias",
            )

    def _submit(self, reqs: list[Req], make_stream: Callable[[str], RequestStream | AsyncRequestStream]) -> list:
        now = time.perf_counter()
        streams = [make_stream(req.rid) for req in reqs]
        self._loop.submit(
            [RequestTracker(req, stream.channel.put, self.tokenizer, now) for req, stream in zip(reqs, streams)]
        )
        return streams

    def _thread_stream(self, rid: str) -> RequestStream:
        loop = self._loop
        return RequestStream(rid, loop.abort, lambda: loop.thread_alive)

    def _asyncio_stream(self, rid: str) -> AsyncRequestStream:
        return AsyncRequestStream(rid, self._loop.abort)


def _shutdown(loop: EngineLoop, tp: TPDriver | None) -> None:
    loop.shutdown()
    if tp is not None:
        tp.close()  # after the loop thread is done with the process group


def _drain(stream: RequestStream) -> None:
    """Wait for a cancelled stream's last delta, i.e. until its request released its KV."""
    try:
        for _ in stream:
            pass
    except RequestFailedError:
        pass
