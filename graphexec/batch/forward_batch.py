"""ForwardBatch: the device-side contract of one forward, built from a ScheduleBatch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from capture import Phase
from graphexec.batch.forward_mode import ForwardMode
from graphexec.batch.prompt_logprobs import PromptLogprobPlan
from graphexec.sampling.sampler import SamplingBatchInfo
from graphexec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from graphexec.batch.schedule_batch import ScheduleBatch


_NO_SAMPLING = SamplingParams(temperature=0.0)

# Decode (and idle) batches carry no per-request extend layout.
_NO_EXTEND_FIELDS = dict(
    extend_prefix_lens=None,
    extend_seq_lens=None,
    extend_start_loc=None,
    extend_prefix_lens_cpu=None,
    extend_seq_lens_cpu=None,
    extend_num_tokens=None,
)


@dataclass(frozen=True)
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, position of each token in its own sequence
    req_pool_indices: torch.Tensor  # [batch_size] int64
    seq_lens: torch.Tensor  # [batch_size] int64, KV length after this forward
    seq_lens_cpu: tuple[int, ...]  # host copy so metadata builders never sync on the device
    seq_lens_sum: int
    out_cache_loc: torch.Tensor  # [num_tokens] int64, slot each new K/V is written to
    # Extend-only fields (None in decode): per-request prefix and new-token counts, and where
    # each request's run of new tokens starts in input_ids.
    extend_prefix_lens: torch.Tensor | None
    extend_seq_lens: torch.Tensor | None
    extend_start_loc: torch.Tensor | None
    extend_prefix_lens_cpu: tuple[int, ...] | None
    extend_seq_lens_cpu: tuple[int, ...] | None
    extend_num_tokens: int | None
    # Real token rows; a backend that pads to a bucket adds rows after these and no consumer
    # reads past them.
    num_token_non_padded: int
    sampling_info: SamplingBatchInfo | None
    # On a padded batch (capture/padding.py), num_token_non_padded on the device, in a fixed
    # buffer: what code inside a replayed graph reads.  None on an unpadded batch.
    num_token_non_padded_device: torch.Tensor | None = None
    # Extend rows whose logits give prompt logprobs (None: no request in the batch asked).
    prompt_logprobs: PromptLogprobPlan | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def phase(self) -> Phase:
        return Phase.TOKENS if self.forward_mode.is_extend() else Phase.ROWS

    @classmethod
    def init_new(cls, batch: "ScheduleBatch", device: torch.device | str, vocab_size: int) -> "ForwardBatch":
        """Build the device tensors of one forward.  Never mutates `batch`."""
        mode = batch.forward_mode

        def on_device(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        seq_lens_cpu = tuple(batch.seq_lens)
        prefix_cpu = tuple(batch.prefix_lens)
        extend_cpu = tuple(batch.extend_lens)
        if not mode.is_extend():
            # The token of each row sits at the old length L = seq_lens - 1 (decode; a verify
            # row i of a request sits at L + i, its length L + i + 1).
            positions = [max(s - 1, 0) for s in seq_lens_cpu]
        else:
            positions = [p for pre, ext in zip(prefix_cpu, extend_cpu) for p in range(pre, pre + ext)]

        extend_fields = dict(_NO_EXTEND_FIELDS)
        prompt_logprobs = None
        if mode.is_extend():
            prompt_logprobs = PromptLogprobPlan.build(batch.reqs, prefix_cpu, extend_cpu, device)
            start_loc, total = [], 0
            for n in extend_cpu:
                start_loc.append(total)
                total += n
            extend_fields = dict(
                extend_prefix_lens=on_device(list(prefix_cpu)),
                extend_seq_lens=on_device(list(extend_cpu)),
                extend_start_loc=on_device(start_loc),
                extend_prefix_lens_cpu=prefix_cpu,
                extend_seq_lens_cpu=extend_cpu,
                extend_num_tokens=total,
            )

        sampling_info = None
        if batch.reqs:
            # A prompt chunk's row is computed but not sampled: greedy and generator-free, so it
            # never advances a seeded request's random stream; with no history it is never penalised.
            samples = batch.row_samples()  # a verify batch samples every row, each for its request
            sampled = [r if s else None for r, s in zip(batch.row_owners(), samples)]
            sampling_info = SamplingBatchInfo.from_params(
                [_NO_SAMPLING if r is None else r.params for r in sampled],
                [None if r is None else r.generator for r in sampled],
                vocab_size,
                device,
                histories=[h if s else None for h, s in zip(batch.row_histories(), samples)],
                grammars=[g if s else None for g, s in zip(batch.row_grammars(), samples)],
                draft_tokens=None if batch.drafts is None else [t for d in batch.drafts for t in (*d, -1)],
            )
        return cls(
            forward_mode=mode,
            batch_size=batch.batch_size,
            input_ids=on_device(batch.input_ids),
            positions=on_device(positions),
            req_pool_indices=on_device(batch.req_pool_indices),
            seq_lens=on_device(list(seq_lens_cpu)),
            seq_lens_cpu=seq_lens_cpu,
            seq_lens_sum=sum(seq_lens_cpu),
            out_cache_loc=batch.out_cache_loc.to(device, non_blocking=True),
            num_token_non_padded=len(batch.input_ids),
            sampling_info=sampling_info,
            prompt_logprobs=prompt_logprobs,
            **extend_fields,
        )

    @classmethod
    def empty(cls, mode: ForwardMode, device: torch.device | str) -> "ForwardBatch":
        """A batch with no rows: what padding turns into an all-dummy batch for capture."""
        none = torch.zeros(0, dtype=torch.int64, device=device)
        extend = _NO_EXTEND_FIELDS
        if mode.is_extend():
            extend = dict(
                extend_prefix_lens=none,
                extend_seq_lens=none,
                extend_start_loc=none,
                extend_prefix_lens_cpu=(),
                extend_seq_lens_cpu=(),
                extend_num_tokens=0,
            )
        return cls(
            forward_mode=mode,
            batch_size=0,
            input_ids=none,
            positions=none,
            req_pool_indices=none,
            seq_lens=none,
            seq_lens_cpu=(),
            seq_lens_sum=0,
            out_cache_loc=none,
            num_token_non_padded=0,
            sampling_info=None,
            **extend,
        )

    @classmethod
    def empty_for(cls, phase: Phase, device: torch.device | str) -> "ForwardBatch":
        """The empty batch a capture backend of this phase pads into its capture batches."""
        return cls.empty(ForwardMode.DECODE if phase is Phase.ROWS else ForwardMode.EXTEND, device)

    def to(self, device: torch.device | str) -> "ForwardBatch":
        """This batch with every tensor (the prompt-logprob plan's too) on `device` (a worker rank
        receives batches decoded on the CPU)."""
        moved = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                moved[f.name] = value.to(device)
        plan = self.prompt_logprobs
        if plan is not None:
            moved["prompt_logprobs"] = dataclasses.replace(plan, rows=plan.rows.to(device), targets=plan.targets.to(device))
        return dataclasses.replace(self, **moved)

    def sample_row_indices(self) -> torch.Tensor:
        """Hidden rows that produce a next token: each request's last new token (every row of a
        decode or verify batch)."""
        if self.forward_mode.is_extend():
            return self.extend_start_loc + self.extend_seq_lens - 1
        return torch.arange(self.batch_size, device=self.input_ids.device)
