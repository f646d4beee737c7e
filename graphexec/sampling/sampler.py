"""Turns a batch's last-position logits into next tokens, each row with its own sampling options.

Filters run on the whole batch at once (at most one sort or topk), then one Gumbel-max draw
samples every row: argmax(logits / T + G) with G = -log(-log(U)) picks token i with probability
softmax(logits / T)_i.  Dropped tokens are simply -inf, so nothing needs renormalising, and each
seeded row can draw its U from its own generator.

Speculative verification (a TARGET_VERIFY batch) gives each row the draft token that follows it,
if any.  A greedy row still takes the argmax (the draft is accepted when it equals it).  A sampled
row accepts its draft d with probability p(d), p being the distribution the row would sample from
(temperature and filters applied); otherwise it samples from p with d removed.  For a draft
proposed deterministically (n-gram lookup) that is exact rejection sampling: the token the row
yields is distributed as p, whatever the draft.  Per row the random stream advances by the same
amount (one noise block, one uniform) whether or not the draft is taken.

Penalties, logit_bias and min_tokens (`penalties.py`) run first, on a copy, and everything after
(greedy argmax, temperature, filters) sees the processed logits.  Log-probabilities are "raw":
log_softmax of the model's logits before penalties, temperature and filters, like vLLM's default
logprobs mode, so they describe the model rather than the decoding settings and greedy requests
get meaningful values too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from graphexec.sampling.penalties import LogitsPenalties, TokenHistory
from graphexec.sampling_params import SamplingParams
from graphexec.structured.token_bitmask import RowGrammar, TokenBitmask

# Below this temperature, treat a row as greedy: the scaled logits could overflow float32, and
# the draw is the argmax anyway unless the top two logits are within ~2e-4 of each other (two
# Gumbel draws from float32 uniforms differ by at most ~19.4, i.e. 19.4 * 1e-5 in logit units).
GREEDY_TEMPERATURE = 1e-5

_SMALLEST_NORMAL_FLOAT32 = torch.finfo(torch.float32).tiny
_LARGEST_FLOAT32_BELOW_ONE = 1.0 - 2.0**-24


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator for one seeded request; the caller keeps it for the request's whole life.

    Each sampled step draws exactly one vocabulary-sized block of noise from it, so a seeded
    request's tokens depend only on its seed, logits and params, never on its batch-mates.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


# eq=False: tensors don't support the element-wise == a generated __eq__ would call.
@dataclass(frozen=True, eq=False)
class SamplingBatchInfo:
    """One batch's sampling options as per-row tensors, built once on the host per batch.

    Greedy rows (temperature below GREEDY_TEMPERATURE, or top_k == 1) carry neutral values
    (temperature 1, no filters, no generator): they take the argmax and never consume randomness.
    """

    temperatures: Tensor  # [B] float32
    top_ps: Tensor  # [B] float32, 1 = disabled
    top_ks: Tensor  # [B] int64, vocab_size = disabled
    min_ps: Tensor  # [B] float32, 0 = disabled
    greedy_rows: Tensor  # [B] bool
    generators: tuple[torch.Generator | None, ...]
    all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    max_top_k: int  # largest enabled top_k, 0 when no row uses top-k; sizes a topk call
    # Every sampled row has top-k on, so top-p only ever looks at the max_top_k best tokens.
    top_k_bounds_all: bool
    max_logprobs: int | None  # widest logprobs request in the batch; None when nobody asked
    # None unless some row uses a penalty, logit_bias or an unmet min_tokens (the fast path).
    penalties: LogitsPenalties | None = None
    # Per row, the grammar its next token must fit (None: free); None when no row has one.
    grammars: tuple[RowGrammar | None, ...] | None = None
    # Verification: per row, the draft token the row's sample is tested against (-1: none);
    # None outside a TARGET_VERIFY batch.
    draft_tokens: Tensor | None = None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
        histories: Sequence[TokenHistory | None] | None = None,
        grammars: Sequence[RowGrammar | None] = (),
        draft_tokens: Sequence[int] | None = None,
    ) -> SamplingBatchInfo:
        """vocab_size must be the last dimension of the logits this info will sample.

        `histories` (per row: prompt, output and EOS ids) feed the penalties and min_tokens; a
        row that uses neither may have None.
        """
        if len(generators) != len(params):
            raise ValueError(f"got {len(params)} sampling params but {len(generators)} generators")
        greedy = [p.is_greedy or p.temperature < GREEDY_TEMPERATURE for p in params]
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        top_ks = [
            vocab_size if g or p.top_k == -1 else min(p.top_k, vocab_size)
            for p, g in zip(params, greedy)
        ]
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        requested_logprobs = [p.logprobs for p in params if p.logprobs is not None]

        def floats(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            temperatures=floats(temperatures),
            top_ps=floats(top_ps),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=floats(min_ps),
            greedy_rows=torch.tensor(greedy, dtype=torch.bool, device=device),
            generators=tuple(None if g else gen for g, gen in zip(greedy, generators)),
            all_greedy=all(greedy),
            need_top_p=any(p < 1.0 for p in top_ps),
            need_top_k=any(k < vocab_size for k in top_ks),
            need_min_p=any(p > 0.0 for p in min_ps),
            max_top_k=max((k for k in top_ks if k < vocab_size), default=0),
            top_k_bounds_all=all(g or k < vocab_size for k, g in zip(top_ks, greedy)),
            max_logprobs=max(requested_logprobs, default=None),
            penalties=LogitsPenalties.build(params, histories, vocab_size, device),
            grammars=tuple(grammars) if any(g is not None for g in grammars) else None,
            draft_tokens=None if draft_tokens is None else torch.tensor(draft_tokens, dtype=torch.int64, device=device),
        )


@dataclass(frozen=True, eq=False)
class SamplerOutput:
    """Next tokens, plus raw log-probabilities when any row asked for them.

    top_logprobs/top_ids are [B, info.max_logprobs], best first; a row that asked for fewer
    alternatives takes a prefix.  With max_logprobs == 0 they are [B, 0].
    """

    next_token_ids: Tensor  # [B] int64
    chosen_logprobs: Tensor | None = None  # [B] float32
    top_logprobs: Tensor | None = None  # [B, k] float32
    top_ids: Tensor | None = None  # [B, k] int64


class Sampler:
    """Picks one next token per row of logits [B, V] according to a SamplingBatchInfo."""

    def __init__(self, token_bitmask: TokenBitmask | None = None):
        self.token_bitmask = token_bitmask

    def __call__(self, logits: Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        # float32 even for bf16 models: dividing by small temperatures and summing ~50k
        # probabilities for top-p both lose too much in 8 mantissa bits.
        logits = logits.float()
        # Fast path: without penalties or grammars the model's logits are sampled as they are, no
        # copy made.  Both work on a copy, so log-probabilities stay the model's (raw, as documented).
        scores = logits if info.penalties is None else info.penalties.apply(logits)
        if info.grammars is not None:
            if self.token_bitmask is None:  # a Sampler built by hand: sized by its first batch
                self.token_bitmask = TokenBitmask(logits.shape[-1], logits.shape[0])
            scores = self.token_bitmask.apply(scores.clone() if scores is logits else scores, info.grammars)
        greedy_ids = scores.argmax(dim=-1)
        if info.all_greedy:
            next_ids = greedy_ids
        else:
            next_ids = torch.where(info.greedy_rows, greedy_ids, _sample(scores, info))
        if info.max_logprobs is None:
            return SamplerOutput(next_token_ids=next_ids)
        return _with_logprobs(logits, next_ids, info.max_logprobs)


def _sample(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    scaled = logits / info.temperatures.unsqueeze(1)
    thresholds = _keep_thresholds(scaled, info)
    if thresholds is not None:
        scaled.masked_fill_(scaled < thresholds, -math.inf)
    noise = _gumbel_noise(scaled, info.generators)
    if info.draft_tokens is None:
        return scaled.add_(noise).argmax(dim=-1)
    return _verify_drafts(scaled, noise, info)


def _verify_drafts(kept: Tensor, noise: Tensor, info: SamplingBatchInfo) -> Tensor:
    """Per row: its draft with probability p(draft), else a sample of p without the draft, where
    p = softmax(kept) (scaled logits, filtered tokens at -inf).  Rows without a draft sample p."""
    drafts = info.draft_tokens
    has_draft = drafts >= 0
    index = drafts.clamp(min=0).unsqueeze(1)
    p_draft = (kept.gather(1, index).squeeze(1) - kept.logsumexp(dim=-1)).exp()
    accept = has_draft & (_row_uniforms(kept, info.generators) < p_draft)
    residual = torch.where(has_draft.unsqueeze(1), kept.scatter(1, index, -math.inf), kept)
    return torch.where(accept, drafts, residual.add_(noise).argmax(dim=-1))


def _row_uniforms(scaled: Tensor, generators: tuple[torch.Generator | None, ...]) -> Tensor:
    """One uniform per row, a seeded row's from its own generator (after its noise block)."""
    uniform = torch.rand(scaled.shape[0], device=scaled.device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row : row + 1].uniform_(generator=generator)
    return uniform


def _keep_thresholds(scaled: Tensor, info: SamplingBatchInfo) -> Tensor | None:
    """Per row [B, 1], the smallest scaled logit that survives every filter; None if no filter.

    Each filter keeps the tokens at or above some logit value, so a token equal to the last
    one kept is kept too (as in Hugging Face's warpers).  Thresholds rather than sorted
    positions make the result independent of how a sort orders ties, and need no scatter back.
    """
    thresholds = []
    if info.need_top_p:
        thresholds.append(_top_k_top_p_threshold(scaled, info))
    elif info.need_top_k:
        thresholds.append(_top_k_threshold(scaled, info))
    if info.need_min_p:
        # prob_i < min_p * max_prob  <=>  logit_i < max_logit + log(min_p), so no softmax is
        # needed, and earlier filters don't matter since none drops the most likely token.
        # log(0) = -inf keeps every token on rows with min-p off.
        thresholds.append(scaled.amax(dim=-1, keepdim=True) + info.min_ps.log().unsqueeze(1))
    if not thresholds:
        return None
    return thresholds[0] if len(thresholds) == 1 else torch.maximum(*thresholds)


def _top_k_threshold(scaled: Tensor, info: SamplingBatchInfo) -> Tensor:
    # topk of the widest k in the batch is far cheaper than a full sort when k is small.
    largest = scaled.topk(info.max_top_k, dim=-1).values
    kth_largest = largest.gather(-1, info.top_ks.clamp(max=info.max_top_k).unsqueeze(1) - 1)
    enabled = (info.top_ks < scaled.shape[-1]).unsqueeze(1)
    return torch.where(enabled, kth_largest, -math.inf)


def _top_k_top_p_threshold(scaled: Tensor, info: SamplingBatchInfo) -> Tensor:
    # One ascending sort serves both filters.  This mirrors Hugging Face's TopPLogitsWarper:
    # drop the least likely tokens while their cumulative mass stays <= 1 - top_p, which
    # leaves the smallest set of most likely tokens whose mass reaches top_p.
    if info.need_top_k and info.top_k_bounds_all:
        # Top-k bounds every sampled row, so only the max_top_k best logits can carry top-p
        # mass: a topk of those replaces the full-vocabulary sort (~50x less work at k=50).
        # Greedy rows (top_k == vocab) clamp to the smallest candidate; their draw is unused.
        ascending = scaled.topk(info.max_top_k, dim=-1).values.flip(-1)
    else:
        ascending = scaled.sort(dim=-1).values
    vocab = ascending.shape[-1]
    # top_k == vocab (disabled) points at the smallest logit, so it drops nothing.
    k_threshold = ascending.gather(-1, vocab - info.top_ks.clamp(max=vocab).unsqueeze(1))
    # top-p applies to the distribution top-k left behind, renormalised.
    probs = ascending.masked_fill(ascending < k_threshold, -math.inf).softmax(dim=-1)
    tail_mass = probs.cumsum(dim=-1)
    num_dropped = (tail_mass <= (1.0 - info.top_ps).unsqueeze(1)).sum(dim=-1, keepdim=True)
    # Rounding can push the total mass under 1 - top_p for tiny top_p; the top token stays.
    p_threshold = ascending.gather(-1, num_dropped.clamp_(max=vocab - 1))
    # Rows with top_p == 1 are exempt, so even tokens whose probability underflows to 0 stay:
    # a row must be filtered identically whether or not a batch-mate turned top-p on.
    enabled = (info.top_ps < 1.0).unsqueeze(1)
    return torch.maximum(k_threshold, torch.where(enabled, p_threshold, -math.inf))


def _gumbel_noise(scaled: Tensor, generators: tuple[torch.Generator | None, ...]) -> Tensor:
    """Standard Gumbel noise -log(-log(U)); argmax(logits + noise) samples softmax(logits)."""
    # Unseeded rows share one draw from the global generator; seeded rows overwrite theirs
    # with exactly one vocabulary-sized draw from their own generator.
    uniform = torch.rand_like(scaled)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row].uniform_(generator=generator)
    # U == 1 would give +inf noise, beating every logit; U == 0 would give -inf, which on a row
    # with a single surviving token leaves nothing but -inf and argmax would return token 0.
    uniform.clamp_(min=_SMALLEST_NORMAL_FLOAT32, max=_LARGEST_FLOAT32_BELOW_ONE)
    return uniform.log_().neg_().log_().neg_()


def _with_logprobs(logits: Tensor, next_ids: Tensor, max_logprobs: int) -> SamplerOutput:
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(dim=-1, index=next_ids.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(min(max_logprobs, logprobs.shape[-1]), dim=-1)
    return SamplerOutput(
        next_token_ids=next_ids,
        chosen_logprobs=chosen,
        top_logprobs=top_logprobs,
        top_ids=top_ids,
    )
