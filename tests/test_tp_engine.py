"""Tensor parallelism through the Engine: rank 0 schedules and samples, the other ranks (real
processes over gloo) run every forward with it.  Tokens must equal tp_size=1's; a rank that dies
or hangs must fail the requests with WorkerFailedError within parallel.timeout_s and leave no
process behind.  Model-level sharding equality is tests/test_tp_model.py's."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from graphexec.cache.req_to_token_pool import ReqToTokenPool
from graphexec.engine.engine import Engine
from graphexec.errors import EngineClosedError, RequestFailedError, WorkerFailedError
from graphexec.sampling_params import SamplingParams

TINY = ["model=tiny-llama", "cache.num_slots=2048", "parallel.threads_per_rank=1"]
PROMPTS = ["hello world", "abc", "the quick brown fox jumps", "x" * 40, "tensor parallel"]


def _tokens(engine: Engine, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def reference_tokens():
    with Engine([*TINY, "capture=eager"]) as engine:
        greedy = _tokens(engine, SamplingParams(max_new_tokens=10, temperature=0.0))
        seeded = _tokens(engine, SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=11))
    return greedy, seeded


@pytest.mark.parametrize("capture", ["eager", "graph_first"])
def test_tp2_tokens_equal_tp1(reference_tokens, capture):
    greedy, seeded = reference_tokens
    # The five requests decode padded to the 8 bucket (three padded rows on every rank); prefill
    # runs in chunks of 16 tokens, the extend bucket, whose pieces run on both ranks with the
    # all-reduces between them.
    plan = [f"capture={capture}"]
    if capture == "graph_first":
        plan += ["capture.decode.buckets=[8]", "capture.extend.buckets=[16]", "scheduler.max_prefill_tokens=16"]
    with Engine([*TINY, *plan, "parallel.tp_size=2"]) as engine:
        assert _tokens(engine, SamplingParams(max_new_tokens=10, temperature=0.0)) == greedy
        assert _tokens(engine, SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=11)) == seeded
        if capture == "graph_first":
            stats = engine.metrics().backends
            assert stats["extend"]["executions"] > 0 and stats["decode"]["executions"] > 0, stats
        workers = engine._tp.workers.procs
    assert all(p.poll() is not None for p in workers)
    assert _children() == []


def test_tp2_verifies_drafts_with_the_tokens_of_tp1(reference_tokens):
    """Speculation under tensor parallelism: TARGET_VERIFY batches travel to the other rank like
    decode batches, and greedy tokens stay those of one process without speculation."""
    greedy, _ = reference_tokens
    spec = ["speculative=ngram", "speculative.policy=always", "speculative.ngram_min=1"]
    with Engine([*TINY, "capture=eager", "parallel.tp_size=2", *spec]) as engine:
        assert _tokens(engine, SamplingParams(max_new_tokens=10, temperature=0.0)) == greedy
        assert engine.metrics().speculation["verify_steps"] > 0
    assert _children() == []


def test_idle_engine_keeps_its_ranks(reference_tokens):
    """Idle longer than the timeout: keep-alives stop the workers from taking rank 0 for hung."""
    greedy, _ = reference_tokens
    with Engine([*TINY, "capture=eager", "parallel.tp_size=2", "parallel.timeout_s=2"]) as engine:
        time.sleep(5)
        assert _tokens(engine, SamplingParams(max_new_tokens=10, temperature=0.0)) == greedy
    assert _children() == []


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_failed_rank_fails_requests_within_timeout(how):
    timeout_s = 3.0
    engine = Engine([*TINY, "capture=eager", "parallel.tp_size=2", f"parallel.timeout_s={timeout_s}"])
    (worker,) = engine._tp.workers.procs
    stream = engine.stream("a long generation", SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True))
    first = next(iter(stream))  # generating
    assert first.token_ids
    os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match="parallel.timeout_s"):
        stream.result()
    elapsed = time.monotonic() - start
    assert elapsed < timeout_s + 5, elapsed
    # The engine stopped: it takes nothing more, and says why.
    assert not engine.is_serving
    with pytest.raises(EngineClosedError, match="tensor parallelism"):
        engine.generate(["again"], SamplingParams(max_new_tokens=2))
    engine.shutdown()
    assert worker.poll() is not None
    assert _children() == []


def test_worker_failure_is_a_request_failure():
    """Callers that catch RequestFailedError keep working."""
    assert issubclass(WorkerFailedError, RequestFailedError)


@pytest.mark.slow
def test_torchrun_two_ranks_matches_one_process(tmp_path):
    args = ["model=tiny-llama", "capture=eager", "chat=false", "prompt=hello tensor parallel", "sampling.max_new_tokens=12"]
    one = subprocess.run([sys.executable, "-m", "graphexec.entrypoints.generate", *args], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = subprocess.run(
        [*torchrun, "-m", "graphexec.entrypoints.generate", *args, "parallel.tp_size=2", "parallel.threads_per_rank=1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    text = lambda out: out.split("\n[")[0]  # noqa: E731 -- the prompt and its generation
    assert text(two.stdout) == text(one.stdout)
    assert "> hello tensor parallel" in two.stdout


def test_torchrun_world_must_match_tp_size(monkeypatch):
    from graphexec.config import EngineConfig
    from graphexec.engine.tp_worker import run_if_worker
    from graphexec.errors import ConfigError

    for key, value in dict(RANK="1", WORLD_SIZE="3", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="parallel.tp_size"):
        run_if_worker(EngineConfig.from_overrides([*TINY, "parallel.tp_size=2"]))


def test_table_journal_replays_to_an_equal_table():
    """Rank 0's request -> token table changes, replayed by a worker, give the same table."""
    rng = random.Random(0)
    driver, mirror = ReqToTokenPool(6, 32, journal=True), ReqToTokenPool(6, 32)
    held: dict[int, int] = {}
    for step in range(200):
        op = rng.random()
        if op < 0.3 and driver.num_free:
            row = driver.alloc()
            n = rng.randint(1, 8)
            driver.write(row, 0, torch.randint(1, 100, (n,)))
            held[row] = n
        elif op < 0.7 and held:
            rows = rng.sample(sorted(held), k=rng.randint(1, len(held)))
            rows = [r for r in rows if held[r] < 32]
            driver.write_points(rows, [held[r] for r in rows], torch.randint(1, 100, (len(rows),)))
            for r in rows:
                held[r] += 1
        elif held:
            row = rng.choice(sorted(held))
            driver.free(row)
            del held[row]
        if step % 7 == 0:
            mirror.replay(driver.take_journal())
            assert torch.equal(mirror.req_to_token, driver.req_to_token)
    mirror.replay(driver.take_journal())
    assert torch.equal(mirror.req_to_token, driver.req_to_token)
    assert driver.take_journal() == []


def _exchange(rank: int, port: int, sizes: list[int], out) -> None:
    import torch.distributed as dist

    from graphexec.parallel.step_sync import StepKind, StepMessage, StepSender, receive

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    sender = StepSender(dist.group.WORLD, 2, keep_alive_s=60.0)
    for n in sizes:
        changes = (("span", 1, 0, torch.arange(n)),)
        if rank == 0:
            sender._send(StepMessage(StepKind.KEEP_ALIVE, table_changes=changes))
        else:
            message = receive(dist.group.WORLD)
            out.put((message.kind.value, torch.equal(message.table_changes[0][3], changes[0][3])))
    dist.destroy_process_group()


def test_step_messages_of_any_length_arrive_whole():
    """A message past the one-broadcast buffer (a long prompt chunk) follows in a second broadcast."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    sizes = [1, 8_000, 20_000, 100_000]  # int64 slots: 8 B .. 800 KB
    procs = [ctx.Process(target=_exchange, args=(rank, port, sizes, out)) for rank in range(2)]
    for p in procs:
        p.start()
    received = [out.get(timeout=120) for _ in sizes]
    for p in procs:
        p.join(60)
    assert received == [("keep_alive", True)] * len(sizes)
    assert [p.exitcode for p in procs] == [0, 0]


@pytest.mark.gpu
def test_gpu_tp2_nccl_with_the_all_reduce_inside_cuda_graphs():
    """NCCL for the model's collectives, CUDA graphs (decode) and piecewise pieces capturing them."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"tensor parallelism over NCCL needs 2 GPUs (one rank each); this machine has {torch.cuda.device_count()}")
    cuda = ["model=tiny-llama", "device=cuda", "cache.num_slots=2048", "attention_backend=torch_native",
            "capture.decode.buckets=[1,2,4]", "capture.extend.buckets=[16,64]"]
    with Engine([*cuda, "capture=eager"]) as engine:
        expected = _tokens(engine, SamplingParams(max_new_tokens=10, temperature=0.0))
    with Engine([*cuda, "capture=graph_first", "parallel.tp_size=2"]) as engine:
        assert _tokens(engine, SamplingParams(max_new_tokens=10, temperature=0.0)) == expected
        stats = engine.metrics().backends
    assert len(stats["decode"]["capture_seconds"]) == 3 and stats["decode"]["executions"] > 0
