"""Host-side costs that graph replay cannot hide, as pytest-benchmark micro-suites.

    graphexec-bench host_overhead

Skipped in the default test run (a benchmark, not a check): `graphexec-bench host_overhead` sets
GRAPHEXEC_BENCH_MICRO and runs them with --benchmark-only.  Sizes are the decode batch sizes the
default plan captures and SmolLM2's vocabulary.
"""

from __future__ import annotations

import os

import pytest
import torch

from capture.padding import StaticInputs
from graphexec import SamplingParams
from graphexec.batch.forward_batch import ForwardBatch
from graphexec.batch.padding import padding_policy
from graphexec.batch.request import Req
from graphexec.batch.schedule_batch import ScheduleBatch
from graphexec.cache.kv_pool import TokenToKVPool
from graphexec.cache.manager import KVCacheManager
from graphexec.cache.req_to_token_pool import ReqToTokenPool
from graphexec.config import SchedulerConfig
from graphexec.runner.model_runner import StepOutput
from graphexec.sampling.sampler import Sampler, SamplerOutput, SamplingBatchInfo
from graphexec.scheduler.scheduler import Scheduler

VOCAB = 49152
pytestmark = pytest.mark.skipif(not os.environ.get("GRAPHEXEC_BENCH_MICRO"), reason="micro-benchmarks: graphexec-bench host_overhead")


def _kv(num_slots: int = 8192, max_requests: int = 64, max_context: int = 2048) -> KVCacheManager:
    pools = TokenToKVPool(num_slots, 1, 1, 8, torch.float32), ReqToTokenPool(max_requests, max_context)
    return KVCacheManager(*pools, prefix_cache=False)


def _running(batch_size: int, context: int = 64):
    kv = _kv()
    reqs = [Req(f"r{i}", list(range(1, context + 1)), SamplingParams(max_new_tokens=512), (), 2048) for i in range(batch_size)]
    for req in reqs:
        kv.admit(req)
    kv.allocate(reqs, [context] * batch_size)
    for req in reqs:
        req.num_computed_tokens = req.seq_len
        req.output_ids.append(7)
    return reqs, kv


def _decode(reqs: list[Req], kv: KVCacheManager) -> ScheduleBatch:
    return ScheduleBatch.decode(reqs, kv.rows(reqs), kv.allocate(reqs, [1] * len(reqs)))


@pytest.mark.parametrize("batch_size", [1, 8, 32])
def test_prepare_decode_and_init_forward_batch(benchmark, batch_size):
    """Scheduler side of one decode step: allocate slots, build the device tensors."""
    reqs, kv = _running(batch_size)

    def rewind():  # keep the pool steady across rounds
        for req in reqs:
            kv.truncate(req, req.num_computed_tokens)

    benchmark.pedantic(lambda: ForwardBatch.init_new(_decode(reqs, kv), "cpu", VOCAB), setup=rewind, rounds=1000, warmup_rounds=20)


@pytest.mark.parametrize("batch_size,bucket", [(3, 4), (7, 8), (20, 32)])
def test_pad_to_bucket(benchmark, batch_size, bucket):
    reqs, kv = _running(batch_size)
    fb = ForwardBatch.init_new(_decode(reqs, kv), "cpu", VOCAB)
    buffers = StaticInputs(32, torch.device("cpu"))
    benchmark(buffers.load, fb, bucket, padding_policy(1))


@pytest.mark.parametrize("batch_size", [1, 8, 32])
@pytest.mark.parametrize("kind", ["greedy", "top_p"])
def test_sampler(benchmark, batch_size, kind):
    params = SamplingParams() if kind == "greedy" else SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    info = SamplingBatchInfo.from_params([params] * batch_size, [None] * batch_size, VOCAB, "cpu")
    logits = torch.randn(batch_size, VOCAB, generator=torch.Generator().manual_seed(0))
    benchmark(Sampler(), logits, info)


class HostOnlyRunner:
    """What Scheduler uses of ModelRunner, with no model: the device, the real
    `init_forward_batch` (host work every step pays) and a `forward_and_sample` that returns a
    fixed non-stop token per row instead of running the model and the sampler."""

    def __init__(self, max_requests: int = 64):
        self.device = torch.device("cpu")
        self.last_batch: ScheduleBatch | None = None
        self._next_ids = torch.full((max_requests,), 7, dtype=torch.int64)
        self._no_logits = torch.empty(0, VOCAB)

    def init_forward_batch(self, batch: ScheduleBatch) -> ForwardBatch:
        self.last_batch = batch
        return ForwardBatch.init_new(batch, self.device, VOCAB)

    def forward_and_sample(self, fb: ForwardBatch) -> StepOutput:
        return StepOutput(sampler=SamplerOutput(next_token_ids=self._next_ids[: fb.batch_size]), logits=self._no_logits)


def _undo_decode_step(runner: HostOnlyRunner, kv: KVCacheManager, reqs: list[Req]) -> None:
    """Put the requests and pools back where they were before the last decode step, so every
    timed tick starts from the same state (same lengths, same number of free slots)."""
    batch = runner.last_batch
    assert batch is not None and batch.batch_size == len(reqs)
    for req in reqs:
        req.output_ids.pop()
        req.num_computed_tokens -= 1
        kv.truncate(req, req.num_computed_tokens)


@pytest.mark.parametrize("batch_size", [1, 8, 32])
def test_scheduler_decode_tick(benchmark, batch_size):
    """One `Scheduler.step` in steady decode: admission check, slot allocation, the plan,
    ForwardBatch.init_new, result processing; everything but the model and the sampler."""
    runner, kv = HostOnlyRunner(), _kv(num_slots=40_000)
    scheduler = Scheduler(runner, kv, SchedulerConfig(max_running_requests=64, max_prefill_tokens=4096, mixed_chunk=False))
    for i in range(batch_size):
        # Never finishes within the timing: no EOS, a large token allowance.
        scheduler.add_request(Req(f"r{i}", list(range(1, 65)), SamplingParams(max_new_tokens=1000), (), 2048))
    while scheduler.waiting:  # the prefill: every request is running from here on
        scheduler.step()
    reqs = list(scheduler.running)
    assert len(reqs) == batch_size and not scheduler.waiting

    def tick():
        assert scheduler.step() == []  # nothing finishes; the batch stays steady

    tick()
    benchmark.pedantic(tick, setup=lambda: _undo_decode_step(runner, kv, reqs), rounds=1000, warmup_rounds=20)
    assert runner.last_batch.forward_mode.is_decode_or_idle() and len(scheduler.running) == batch_size
