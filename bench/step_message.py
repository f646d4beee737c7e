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


def decode_message(batch: int) -> StepMessage:
    table = ReqToTokenPool(max(batch, 1), 4096, journal=True)
    rows = [table.alloc() for _ in range(batch)]
    table.take_journal()
    slots = _ints(range(1000, 1000 + batch))
    table.write_points(rows, [CONTEXT] * batch, slots)
    seq = (CONTEXT + 1,) * batch
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=batch, input_ids=_ints(range(7, 7 + batch)),
        positions=_ints([CONTEXT] * batch), req_pool_indices=_ints(rows), seq_lens=_ints(seq), seq_lens_cpu=seq,
        seq_lens_sum=sum(seq), out_cache_loc=slots, extend_prefix_lens=None, extend_seq_lens=None,
        extend_start_loc=None, extend_prefix_lens_cpu=None, extend_seq_lens_cpu=None, extend_num_tokens=None,
        num_token_non_padded=batch, sampling_info=None,
    )  # fmt: skip
    return StepMessage(StepKind.FORWARD, fb, tuple(table.take_journal()))


def prefill_message(tokens: int, prompt_logprobs: bool) -> StepMessage:
    table = ReqToTokenPool(1, 4096, journal=True)
    row = table.alloc()
    slots = _ints(range(1, tokens + 1))
    table.write_points([row] * tokens, list(range(tokens)), slots)
    plan = None
    if prompt_logprobs:  # every row but the last predicts a prompt token
        plan = PromptLogprobPlan((PromptLogprobSpan(0, 0, tokens - 1, 1, 5),), _ints(range(tokens - 1)),
                                 _ints(range(2, tokens + 1)), 5)  # fmt: skip
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=_ints(range(1, tokens + 1)),
        positions=_ints(range(tokens)), req_pool_indices=_ints([row]), seq_lens=_ints([tokens]),
        seq_lens_cpu=(tokens,), seq_lens_sum=tokens, out_cache_loc=slots, extend_prefix_lens=_ints([0]),
        extend_seq_lens=_ints([tokens]), extend_start_loc=_ints([0]), extend_prefix_lens_cpu=(0,),
        extend_seq_lens_cpu=(tokens,), extend_num_tokens=tokens, num_token_non_padded=tokens,
        sampling_info=None, prompt_logprobs=plan,
    )  # fmt: skip
    return StepMessage(StepKind.FORWARD, fb, tuple(table.take_journal()))


def measure(message: StepMessage, seconds: float) -> dict[str, float]:
    pickled = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    encoded = encode(message)
    return {
        "pickle_bytes": len(pickled),
        "codec_bytes": len(encoded),
        "pickle_encode_us": median_us_per_call(lambda: pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), seconds, min_calls=20),
        "pickle_decode_us": median_us_per_call(lambda: pickle.loads(pickled), seconds, min_calls=20),
        "codec_encode_us": median_us_per_call(lambda: encode(message), seconds, min_calls=20),
        "codec_decode_us": median_us_per_call(lambda: decode(encoded), seconds, min_calls=20),
    }


def cases() -> dict[str, StepMessage]:
    return {
        "decode B=1": decode_message(1),
        "decode B=8": decode_message(8),
        "prefill 512": prefill_message(512, prompt_logprobs=False),
        "prefill 512 + prompt logprobs": prefill_message(512, prompt_logprobs=True),
        "keep-alive": StepMessage(StepKind.KEEP_ALIVE),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per measurement")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(machine_line())
    print(header(["message", "bytes pickle / codec", "pickle enc + dec µs", "codec enc + dec µs", "pickle total µs",
                  "codec total µs"]))
    for name, message in cases().items():
        r = measure(message, args.seconds)
        pickle_us, codec_us = (r[f"{side}_encode_us"] + r[f"{side}_decode_us"] for side in ("pickle", "codec"))
        print(row([name, f"{r['pickle_bytes']:,} / {r['codec_bytes']:,}",
                   f"{r['pickle_encode_us']:.1f} + {r['pickle_decode_us']:.1f}",
                   f"{r['codec_encode_us']:.1f} + {r['codec_decode_us']:.1f}", f"{pickle_us:.1f}", f"{codec_us:.1f}"]),
              flush=True)
