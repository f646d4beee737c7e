"""The Python serving API: `Engine(overrides=[...]).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from graphexec.config import EngineConfig
from graphexec.errors import InvalidRequestError
from graphexec.model_runner import ModelRunner
from graphexec.models.checkpoint import load_checkpoint
from graphexec.request import Req
from graphexec.sampling_params import SamplingParams
from graphexec.scheduler import Scheduler

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # generated ids only; a stop token that ended the request is not included
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[dict] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class Engine:
    """Loads the configured model, builds the runner and scheduler, and serves generate calls.

    `overrides` are Hydra overrides of `configs/config.yaml`, exactly as on the command line.
    """

    def __init__(self, overrides: Sequence[str] = (), *, config: EngineConfig | None = None):
        self.config = config if config is not None else EngineConfig.from_overrides(overrides)
        torch.manual_seed(self.config.seed)
        checkpoint = load_checkpoint(self.config.model, self.config.torch_dtype)
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.runner = ModelRunner(self.config, checkpoint)
        self.runner.capture()
        self.scheduler = Scheduler(self.runner, self.config.scheduler)
        self._request_ids = itertools.count()

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings, or token-id lists used as given); outputs in order.

        Every prompt is validated before any is queued, so a bad one fails the call cleanly.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidRequestError("prompts must be a list of strings or a list of token-id lists")
        params = self._params_per_prompt(len(prompts), sampling_params)
        reqs = [self._make_request(i, p, sp, chat) for i, (p, sp) in enumerate(zip(prompts, params))]
        for req in reqs:
            self.scheduler.add_request(req)
        try:
            while any(not req.finished for req in reqs):
                self.scheduler.step()
        except BaseException:
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        return [self._output(req) for req in reqs]

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

    def encode_prompt(self, prompt: Prompt, chat: bool = False, index: int = 0) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(f"prompt {index}: model {self.model_config.name!r} has no tokenizer; pass token ids")
            if chat:
                prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidRequestError(f"prompt {index} must be a string or a list of token ids, got {type(prompt).__name__}")
        vocab = self.model_config.vocab_size
        if not ids:
            raise InvalidRequestError(f"prompt {index} is empty: at least one token is needed")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt {index} has token id {bad[0]} outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_context:
            raise InvalidRequestError(
                f"prompt {index} has {len(ids)} tokens; the context limit is {self.max_context} "
                f"(prompt must be at most {self.max_context - 1} to generate)"
            )
        return ids

    def _make_request(self, index: int, prompt: Prompt, params: SamplingParams, chat: bool) -> Req:
        ids = self.encode_prompt(prompt, chat, index)
        req = Req(
            rid=f"req-{next(self._request_ids)}",
            prompt_ids=ids,
            params=params,
            eos_token_ids=self.model_config.eos_token_ids,
            max_context=self.max_context,
        )
        if req.max_total_tokens() > self.scheduler.kv_capacity:
            raise InvalidRequestError(
                f"prompt {index} needs up to {req.max_total_tokens()} KV slots (prompt + max_new_tokens) "
                f"but the pool has {self.scheduler.kv_capacity}; lower max_new_tokens or raise cache.num_slots"
            )
        return req

    def _output(self, req: Req) -> RequestOutput:
        text = self.tokenizer.decode(req.output_ids) if self.tokenizer is not None else ""
        return RequestOutput(
            request_id=req.rid,
            prompt_token_ids=list(req.prompt_ids),
            text=text,
            token_ids=list(req.output_ids),
            finish_reason=req.finish_reason.value,
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
        )

    def kv_slots_free(self) -> int:
        return self.runner.kv_pool.num_free
