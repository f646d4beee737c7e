"""Prompt logprobs: the log-probability the model gives each prompt token, read off the prefill's
own hidden rows (the rows the logits processor otherwise drops before the LM head).

Row j of a request's extend run sits at position p = prefix + j and predicts the token at p + 1.
When p + 1 is inside the prompt, that row yields the entry of prompt position p + 1.  Position 0
has no entry: nothing predicts the first token.  Chunked prefill simply fills the positions of
each chunk.  A cached prefix has no hidden rows, so the scheduler never maps one for a request
whose entries are incomplete (it recomputes the prefix instead of returning fewer entries).

Only requests that ask pay anything: the plan is None for a batch where nobody asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:
    from graphexec.batch.request import Req

# Rows pushed through the LM head at a time: bounds the [rows, vocab] fp32 logits a long prompt
# would otherwise materialise at once (256 x 49,152 x 4 B = 48 MiB).
_ROWS_PER_CHUNK = 256


@dataclass(frozen=True)
class PromptLogprobSpan:
    """One request's rows in this forward: `num_rows` hidden rows from `first_row`, giving the
    entries of prompt positions `first_position` onwards."""

    batch_index: int
    first_row: int
    num_rows: int
    first_position: int
    top_k: int


@dataclass(frozen=True)
class PromptLogprobs:
    """Per planned row, in plan order: the prompt token's logprob and the top-k alternatives."""

    chosen: torch.Tensor  # [N] float32
    top_logprobs: torch.Tensor  # [N, k] float32, best first
    top_ids: torch.Tensor  # [N, k] int64


@dataclass(frozen=True)
class PromptLogprobPlan:
    spans: tuple[PromptLogprobSpan, ...]
    rows: torch.Tensor  # [N] hidden rows, every span's in order
    targets: torch.Tensor  # [N] the prompt token each row predicts
    max_top_k: int

    @classmethod
    def build(
        cls, reqs: Sequence["Req"], prefix_lens: Sequence[int], extend_lens: Sequence[int], device: torch.device | str
    ) -> "PromptLogprobPlan | None":
        """The rows of an extend batch that give prompt logprobs; None if no request asked."""
        spans, rows, targets = [], [], []
        start = 0
        for i, (req, prefix, extend) in enumerate(zip(reqs, prefix_lens, extend_lens)):
            top_k = req.params.prompt_logprobs
            # Rows at positions prefix .. prefix + n - 1 predict prompt positions prefix + 1 .. prefix + n.
            n = min(extend, len(req.prompt_ids) - 1 - prefix)
            if top_k is not None and n > 0:
                spans.append(PromptLogprobSpan(i, start, n, prefix + 1, top_k))
                rows.extend(range(start, start + n))
                targets.extend(req.prompt_ids[prefix + 1 : prefix + 1 + n])
            start += extend
        if not spans:
            return None
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)  # noqa: E731
        return cls(tuple(spans), as_tensor(rows), as_tensor(targets), max(s.top_k for s in spans))

    def compute(self, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> PromptLogprobs:
        """Log-softmax of the LM head over the planned rows of `hidden` (real rows only), a chunk
        of rows at a time.  The chosen and the top logprobs come from one tensor, so a prompt
        token that is the argmax has exactly its top-1 value (clients compare them for greed)."""
        chosen, top_values, top_ids = [], [], []
        for start in range(0, self.rows.numel(), _ROWS_PER_CHUNK):
            rows = self.rows[start : start + _ROWS_PER_CHUNK]
            logprobs = compute_logits(hidden[rows]).float().log_softmax(dim=-1)
            chosen.append(logprobs.gather(1, self.targets[start : start + _ROWS_PER_CHUNK, None]).squeeze(1))
            values, ids = logprobs.topk(min(self.max_top_k, logprobs.shape[-1]), dim=-1)
            top_values.append(values)
            top_ids.append(ids)
        return PromptLogprobs(torch.cat(chosen), torch.cat(top_values), torch.cat(top_ids))

    def entries(self, result: PromptLogprobs) -> list[tuple[int, int, list[dict]]]:
        """(batch index, first prompt position, entries) per span, entries shaped like output
        logprobs: {"token_id", "logprob", "top": [(id, logprob), ...] when top_k > 0}."""
        chosen, top_values, top_ids = result.chosen.tolist(), result.top_logprobs.tolist(), result.top_ids.tolist()
        targets = self.targets.tolist()
        out, start = [], 0  # start: the span's first row in the plan
        for span in self.spans:
            entries = []
            for k in range(start, start + span.num_rows):
                entry = {"token_id": targets[k], "logprob": chosen[k]}
                if span.top_k:
                    entry["top"] = list(zip(top_ids[k][: span.top_k], top_values[k][: span.top_k]))
                entries.append(entry)
            start += span.num_rows
            out.append((span.batch_index, span.first_position, entries))
        return out
