"""What rank 0's per-step message costs the host: pickle (the protocol before issue 28) against
graphexec/parallel/step_codec.py, encode + decode, for decode batches and a prefill chunk.

    graphexec-bench step_message [--seconds 1.0]

Boundary: measurement only, one thread, in this process.  Each case is the StepMessage a
StepSender sends: the ForwardBatch without sampling state plus the table journal that step
writes (a decode step maps one position per request, a prefill chunk one per token; built by
the real ReqToTokenPool).  Times are medians of calls timed one by one; the broadcast itself
(the same bytes either way, give or take the size) is not included.
"""

from __future__ import annotations

import argparse
import pickle

import torch

from bench.tables import header, machine_line, row
from bench.timing import median_us_per_call
from graphexec.batch.forward_batch import ForwardBatch
from graphexec.batch.forward_mode import ForwardMode
from graphexec.batch.prompt_logprobs import PromptLogprobPlan, PromptLogprobSpan
from graphexec.cache.req_to_token_pool import ReqToTokenPool
from graphexec.parallel.step_codec import decode, encode
from graphexec.parallel.step_schema import StepKind, StepMessage

CONTEXT = 200  # tokens each decoding request already holds


def _ints(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def forward_batch(mode: ForwardMode, runs: list[tuple[int, int]], rows, slots: torch.Tensor, first_id: int = 0,
                  **extra) -> ForwardBatch:
    """A ForwardBatch by hand (no public batch API yet; attention_kernels builds its batches here):
    `runs` is (cached prefix, new tokens) per request, `rows` their table rows, `slots` where the
    new K/V go, the token ids counting up from `first_id`."""
    prefix, new, seq = tuple(p for p, _ in runs), tuple(n for _, n in runs), tuple(p + n for p, n in runs)
    extend = dict(extend_prefix_lens=_ints(prefix), extend_seq_lens=_ints(new),
                  extend_start_loc=_ints(sum(new[:r]) for r in range(len(runs))), extend_prefix_lens_cpu=prefix,
                  extend_seq_lens_cpu=new, extend_num_tokens=sum(new))
    return ForwardBatch(
        forward_mode=mode, batch_size=len(runs), input_ids=_ints(range(first_id, first_id + sum(new))),
        positions=_ints(p + i for p, n in runs for i in range(n)), req_pool_indices=_ints(rows), seq_lens=_ints(seq),
        seq_lens_cpu=seq, seq_lens_sum=sum(seq), out_cache_loc=slots, num_token_non_padded=sum(new),
        sampling_info=None, **(extend if mode.is_extend() else dict.fromkeys(extend)), **extra,
    )  # fmt: skip


def message(mode: ForwardMode, runs: list[tuple[int, int]], first_slot: int, first_id: int, plan=None) -> StepMessage:
    """One forward's StepMessage: its batch and the journal of a fresh table mapping each new
    token's position to its slot (slots counting up from `first_slot`)."""
    table = ReqToTokenPool(len(runs), 4096, journal=True)
    rows = [table.alloc() for _ in runs]
    slots = _ints(range(first_slot, first_slot + sum(n for _, n in runs)))
    table.write_points([r for r, (_, n) in zip(rows, runs) for _ in range(n)],
                       [p + i for p, n in runs for i in range(n)], slots)
    fb = forward_batch(mode, runs, rows, slots, first_id, prompt_logprobs=plan)
    return StepMessage(StepKind.FORWARD, fb, tuple(table.take_journal()))


def measure(msg: StepMessage, seconds: float) -> dict[str, tuple[int, float, float]]:
    """Per side: bytes, encode µs, decode µs."""
    pickled, encoded = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), encode(msg)
    sides = {"pickle": (pickled, lambda: pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), lambda: pickle.loads(pickled)),
             "codec": (encoded, lambda: encode(msg), lambda: decode(encoded))}
    return {side: (len(data), *(median_us_per_call(fn, seconds, min_calls=20) for fn in calls))
            for side, (data, *calls) in sides.items()}


def cases(prefill: int = 512) -> dict[str, StepMessage]:
    # prompt logprobs: every row but the last predicts a prompt token
    plan = PromptLogprobPlan((PromptLogprobSpan(0, 0, prefill - 1, 1, 5),), _ints(range(prefill - 1)),
                             _ints(range(2, prefill + 1)), 5)
    return {**{f"decode B={b}": message(ForwardMode.DECODE, [(CONTEXT, 1)] * b, 1000, 7) for b in (1, 8)},
            f"prefill {prefill}": message(ForwardMode.EXTEND, [(0, prefill)], 1, 1),
            f"prefill {prefill} + prompt logprobs": message(ForwardMode.EXTEND, [(0, prefill)], 1, 1, plan),
            "keep-alive": StepMessage(StepKind.KEEP_ALIVE)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per measurement")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(machine_line())
    print(header(["message", "bytes pickle / codec", "pickle enc + dec µs", "codec enc + dec µs", "pickle total µs",
                  "codec total µs"]))
    for name, msg in cases().items():
        (pickle_bytes, pe, pd), (codec_bytes, ce, cd) = measure(msg, args.seconds).values()
        print(row([name, f"{pickle_bytes:,} / {codec_bytes:,}", f"{pe:.1f} + {pd:.1f}", f"{ce:.1f} + {cd:.1f}",
                   f"{pe + pd:.1f}", f"{ce + cd:.1f}"]), flush=True)
