"""Per-request decoding options, validated once when the request arrives."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from graphexec.errors import InvalidRequestError
from graphexec.structured.spec import StructuredSpec

# OpenAI's API caps top_logprobs at 20; larger values would only cost a wider top-k per step.
MAX_LOGPROBS = 20

# Stop strings are searched in the decoded text after every token; a handful is all any API offers.
MAX_STOP_STRINGS = 8

# torch.Generator.manual_seed accepts at most a 64-bit unsigned value.
_SEED_LIMIT = 2**64

# OpenAI's ranges: penalties in [-2, 2], logit biases in [-100, 100] (enough to ban or force a token).
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a token count or id is almost certainly a bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token of one request.

    temperature 0 means greedy.  top_k -1 disables top-k.  logprobs None turns
    log-probabilities off, 0 returns only the chosen token's, k > 0 also the
    k most likely alternatives.  Float fields accept ints and store floats.
    `stop` strings end the request when they appear in the decoded text; the
    match and anything after it are left out of the output text.

    Logits processing, as OpenAI and vLLM define it, runs before temperature
    and the filters (and before the greedy argmax), in vLLM's order:
    `logit_bias` (token id -> bias, stored as (id, bias) pairs sorted by id)
    is added, and until `min_tokens` tokens are generated EOS (unless
    `ignore_eos`) and `stop_token_ids` are banned (logit -inf; stop strings
    are not matched before then either); then `repetition_penalty` (1 = off)
    divides positive and multiplies negative logits of every token seen in
    the prompt or the output; then each token in the output loses
    `presence_penalty` once and `frequency_penalty` per occurrence.
    Returned logprobs are of the raw model logits, before any of this (vLLM's
    default): they describe the model, not the decoding settings.

    `structured` holds the output to a grammar (graphexec/structured/): only tokens it
    allows are sampled, and EOS only where it is complete.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # Log-probabilities of the prompt's own tokens (vLLM's prompt_logprobs): None off, 0 each
    # prompt token's, k > 0 also the k most likely alternatives at each position.  The first
    # prompt token has none.  A request that asks recomputes a cached prefix instead of reusing it.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    structured: StructuredSpec | None = None

    def __post_init__(self) -> None:
        self._check_max_new_tokens()
        self._set_float("temperature", lambda v: v >= 0, ">= 0 (0 means greedy)")
        self._set_float("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
        self._check_top_k()
        self._set_float("min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
        self._check_seed()
        self._set_stop_token_ids()
        self._set_stop()
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {_describe(self.ignore_eos)}")
        self._check_logprob_count("logprobs")
        self._check_logprob_count("prompt_logprobs")
        penalty_range = f"in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}]"
        self._set_float("presence_penalty", lambda v: abs(v) <= MAX_PENALTY, penalty_range)
        self._set_float("frequency_penalty", lambda v: abs(v) <= MAX_PENALTY, penalty_range)
        self._set_float("repetition_penalty", lambda v: v > 0, "> 0 (1 means off)")
        self._set_logit_bias()
        self._check_min_tokens()
        self._check_structured()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether any penalty, bias or min_tokens can change this request's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def replace(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed; the copy is validated like a new instance."""
        return dataclasses.replace(self, **changes)

    def _check_max_new_tokens(self) -> None:
        value = self.max_new_tokens
        if not _is_int(value):
            raise InvalidRequestError(f"max_new_tokens must be an int >= 0, got {_describe(value)}")
        if value < 0:
            raise InvalidRequestError(f"max_new_tokens must be >= 0, got {value}")

    def _set_float(self, name: str, in_range: Callable[[float], bool], range_text: str) -> None:
        value = getattr(self, name)
        if not _is_number(value):
            raise InvalidRequestError(f"{name} must be a number {range_text}, got {_describe(value)}")
        # NaN fails every comparison, so in_range rejects it; inf is rejected explicitly
        # because a division by an infinite temperature silently turns into uniform sampling.
        if not (math.isfinite(value) and in_range(value)):
            raise InvalidRequestError(f"{name} must be {range_text}, got {value!r}")
        object.__setattr__(self, name, float(value))

    def _check_top_k(self) -> None:
        value = self.top_k
        if not _is_int(value):
            raise InvalidRequestError(
                f"top_k must be an int, -1 (disabled) or >= 1, got {_describe(value)}"
            )
        if value != -1 and value < 1:
            raise InvalidRequestError(f"top_k must be -1 (disabled) or >= 1, got {value}")

    def _check_seed(self) -> None:
        value = self.seed
        if value is None:
            return
        if not _is_int(value) or not 0 <= value < _SEED_LIMIT:
            raise InvalidRequestError(
                f"seed must be None or an int in [0, 2**64), got {_describe(value)}"
            )

    def _set_stop_token_ids(self) -> None:
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)):
            raise InvalidRequestError(
                f"stop_token_ids must be a tuple or list of ints >= 0, got {_describe(ids)}"
            )
        for position, token_id in enumerate(ids):
            if not _is_int(token_id) or token_id < 0:
                raise InvalidRequestError(
                    f"stop_token_ids[{position}] must be an int >= 0, got {_describe(token_id)}"
                )
        # A tuple keeps the params hashable and immune to the caller mutating its list later.
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    def _set_stop(self) -> None:
        strings = self.stop
        if isinstance(strings, str):
            # Taken as a sequence, a bare string would stop on each of its characters.
            raise InvalidRequestError(f"stop must be a tuple or list of strings (wrap a single one: ({strings!r},)), got {_describe(strings)}")
        if not isinstance(strings, (tuple, list)):
            raise InvalidRequestError(f"stop must be a tuple or list of strings, got {_describe(strings)}")
        if len(strings) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(strings)}")
        for position, text in enumerate(strings):
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"stop[{position}] must be a non-empty string, got {_describe(text)}")
        object.__setattr__(self, "stop", tuple(strings))

    def _check_logprob_count(self, name: str) -> None:
        """logprobs / prompt_logprobs: None (off) or how many alternatives besides the token's own."""
        value = getattr(self, name)
        if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
            raise InvalidRequestError(
                f"{name} must be None (off) or an int in [0, {MAX_LOGPROBS}], got {_describe(value)}"
            )

    def _set_logit_bias(self) -> None:
        value = self.logit_bias
        if value is None:  # as OpenAI's null: no bias
            value = ()
        if isinstance(value, Mapping):
            pairs = list(value.items())
        elif isinstance(value, (tuple, list)):
            pairs = list(value)
        else:
            raise InvalidRequestError(
                f"logit_bias must be a mapping of token id -> bias, got {_describe(value)}"
            )
        checked = []
        for entry in pairs:
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise InvalidRequestError(f"logit_bias entries must be (token id, bias) pairs, got {_describe(entry)}")
            token_id, bias = entry
            if not _is_int(token_id) or token_id < 0:
                raise InvalidRequestError(f"logit_bias token ids must be ints >= 0, got {_describe(token_id)}")
            if not (_is_number(bias) and math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise InvalidRequestError(
                    f"logit_bias[{token_id}] must be a number in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {_describe(bias)}"
                )
            checked.append((token_id, float(bias)))
        checked.sort()
        duplicates = [a for (a, _), (b, _) in zip(checked, checked[1:]) if a == b]
        if duplicates:
            raise InvalidRequestError(f"logit_bias names token id {duplicates[0]} more than once")
        # Sorted pairs: hashable, frozen, and equal for equal mappings whatever their order.
        object.__setattr__(self, "logit_bias", tuple(checked))

    def _check_min_tokens(self) -> None:
        value = self.min_tokens
        if not _is_int(value) or value < 0:
            raise InvalidRequestError(f"min_tokens must be an int >= 0, got {_describe(value)}")
        if value > self.max_new_tokens:
            raise InvalidRequestError(
                f"min_tokens must be <= max_new_tokens (max_tokens over HTTP), got {value} > {self.max_new_tokens}"
            )
    def _check_structured(self) -> None:
        value = self.structured
        if value is None:
            return
        if not isinstance(value, StructuredSpec):
            raise InvalidRequestError(f"structured must be None or a StructuredSpec, got {_describe(value)}", param="structured")
        if self.ignore_eos:
            # The grammar decides where the output ends: EOS is what it allows there.
            raise InvalidRequestError(f"{value.param}: cannot be combined with ignore_eos", param=value.param)
