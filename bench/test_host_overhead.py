"""Host-side costs that graph replay cannot hide, as pytest-benchmark micro-suites.

    python -m pytest bench/test_host_overhead.py --benchmark-only

Not part of the default test run (testpaths is tests/).  Sizes are the decode batch sizes the
default plan captures and SmolLM2's vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from capture.padding import PaddingPolicy, StaticInputs
from graphexec import SamplingParams
from graphexec.forward_batch import ForwardBatch
from graphexec.kv_pool import TokenToKVPool
from graphexec.req_to_token_pool import ReqToTokenPool
from graphexec.request import Req
from graphexec.sampler import Sampler, SamplingBatchInfo
from graphexec.schedule_batch import ScheduleBatch

VOCAB = 49152


def _running(batch_size: int, context: int = 64):
    req_pool = ReqToTokenPool(max_requests=64, max_context=2048)
    kv_pool = TokenToKVPool(8192, 1, 1, 8, torch.float32)
    reqs = [Req(f"r{i}", list(range(1, context + 1)), SamplingParams(max_new_tokens=512), (), 2048) for i in range(batch_size)]
    ScheduleBatch.prepare_for_extend(reqs, req_pool, kv_pool)
    for req in reqs:
        req.num_cached_tokens = req.seq_len
        req.output_ids.append(7)
    return reqs, req_pool, kv_pool


@pytest.mark.parametrize("batch_size", [1, 8, 32])
def test_prepare_decode_and_init_forward_batch(benchmark, batch_size):
    """Scheduler side of one decode step: allocate slots, build the device tensors."""
    reqs, req_pool, kv_pool = _running(batch_size)

    def step():
        batch = ScheduleBatch.prepare_for_decode(reqs, req_pool, kv_pool)
        fb = ForwardBatch.init_new(batch, "cpu", VOCAB)
        kv_pool.free(batch.out_cache_loc)  # keep the pool steady across rounds
        return fb

    benchmark(step)


@pytest.mark.parametrize("batch_size,bucket", [(3, 4), (7, 8), (20, 32)])
def test_pad_to_bucket(benchmark, batch_size, bucket):
    reqs, req_pool, kv_pool = _running(batch_size)
    fb = ForwardBatch.init_new(ScheduleBatch.prepare_for_decode(reqs, req_pool, kv_pool), "cpu", VOCAB)
    buffers = StaticInputs(32, torch.device("cpu"))
    benchmark(buffers.load, fb, bucket, PaddingPolicy())


@pytest.mark.parametrize("batch_size", [1, 8, 32])
@pytest.mark.parametrize("kind", ["greedy", "top_p"])
def test_sampler(benchmark, batch_size, kind):
    params = SamplingParams() if kind == "greedy" else SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    info = SamplingBatchInfo.from_params([params] * batch_size, [None] * batch_size, VOCAB, "cpu")
    logits = torch.randn(batch_size, VOCAB, generator=torch.Generator().manual_seed(0))
    benchmark(Sampler(), logits, info)
