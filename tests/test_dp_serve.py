"""`graphexec-serve parallel.dp_size=2` as a real subprocess: requests complete with the same
greedy text as one in-process engine, a shared prompt prefix stays on one replica and is served
from its prefix cache, /metrics reports each replica and the total, and no replica outlives the
front (SIGTERM: the front stops them; SIGKILL: Linux's parent-death signal does)."""

import contextlib
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from graphexec.parallel.ports import free_port
from graphexec.sampling_params import SamplingParams
from tests.conftest import TINY_OVERRIDES

REPO = Path(__file__).resolve().parent.parent
REPLICA_HEADER = "x-graphexec-replica"


@contextlib.contextmanager
def dp_server(overrides: list[str], timeout_s: float = 240.0):
    """graphexec-serve with parallel.dp_size=2; yields (url, front process)."""
    port = free_port()
    command = [sys.executable, "-m", "graphexec.entrypoints.serve", *overrides, "parallel.dp_size=2",
               f"server.port={port}", "server.log_level=warning"]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, f"graphexec-serve exited: {proc.stderr.read().decode(errors='replace')[-3000:]}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, "graphexec-serve dp_size=2 did not start"
            time.sleep(0.3)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            proc.kill()
        proc.wait()
        proc.stderr.close()


def _replicas_of(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def _all_gone(processes: list[psutil.Process], timeout_s: float = 30.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return alive


def _complete(url: str, prompt: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def tiny_dp():
    with dp_server(TINY_OVERRIDES) as server:
        yield server


def test_concurrent_completions_all_complete_like_one_engine(tiny_dp, tiny):
    url, _ = tiny_dp
    prompts = [f"request {i}: the quick brown fox" for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _complete(url, p), prompts))
    assert [a.status_code for a in answers] == [200] * len(prompts)
    assert {a.headers[REPLICA_HEADER] for a in answers} == {"0", "1"}  # both replicas served
    expected = tiny.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0))
    for answer, reference in zip(answers, expected):
        body = answer.json()
        assert body["usage"]["completion_tokens"] == 8
        assert body["choices"][0]["text"] == reference.text


def test_shared_prefix_stays_on_one_replica_and_hits_its_cache(tiny_dp):
    url, _ = tiny_dp
    system = "You are a careful assistant who answers briefly. " * 8  # past the router's key length
    answers = [_complete(url, system + f"question {i}?", max_tokens=2) for i in range(4)]
    assert len({a.headers[REPLICA_HEADER] for a in answers}) == 1
    cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert all(c >= len(system) - 16 for c in cached[1:]), cached  # byte tokens: the prefix, less a page's worth
    front = httpx.get(url + "/metrics/json", timeout=30).json()["front"]
    assert front["affinity_hits"] >= 3


def test_metrics_per_replica_and_total(tiny_dp):
    url, _ = tiny_dp
    text = httpx.get(url + "/metrics", timeout=30).text
    lines = [line for line in text.splitlines() if line.startswith("graphexec_generation_tokens_total{")]
    values = {line.split('replica="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
    assert set(values) == {"0", "1", "total"}
    assert values["total"] == values["0"] + values["1"] > 0
    body = httpx.get(url + "/metrics/json", timeout=30).json()
    assert len(body["replicas"]) == 2
    assert body["total"]["generated_tokens_total"] == sum(r["generated_tokens_total"] for r in body["replicas"])


def test_replicas_answer_only_the_fronts_token_from_their_environment(tiny_dp):
    """The front's per-run token is each replica's only key; it is in the replica's environment,
    never on its command line (`ps` shows that to every local user)."""
    url, proc = tiny_dp
    replicas = [p for p in _replicas_of(proc) if "graphexec.entrypoints.serve" in p.cmdline()]
    assert len(replicas) == 2
    tokens = {p.environ()["GRAPHEXEC_ADMIN_API_KEY"] for p in replicas}
    assert len(tokens) == 1 and len(token := tokens.pop()) >= 32
    for replica in replicas:
        assert not any(token in arg for arg in replica.cmdline())
        port = next(a.split("=", 1)[1] for a in replica.cmdline() if a.startswith("server.port="))
        models = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(models, timeout=30).status_code == 401  # the loopback port is no way around the front
        assert httpx.get(models, headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code == 200
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 200  # the front itself has no key set


def test_sigterm_to_the_front_stops_every_replica(tiny_dp):
    _, proc = tiny_dp
    replicas = _replicas_of(proc)
    assert len(replicas) >= 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM once shut down
    assert _all_gone(replicas) == []


def test_replica_failing_at_start_up_is_reported_with_its_stderr():
    from graphexec.parallel.replicas import ReplicaSet, ReplicaStartError

    with pytest.raises(ReplicaStartError, match=r"(?s)replica 0 exited with code 2.*cache\.num_slots"):
        ReplicaSet.start(["model=tiny-llama", "cache.num_slots=0"], dp_size=1, threads=1, startup_timeout_s=120)


@pytest.mark.slow
def test_chat_system_prompt_affinity_and_sigkill_leaves_no_replica():
    """SmolLM2 (it has a chat template): a shared system prompt on several chats goes to one
    replica and is served from its prefix cache; SIGKILL on the front takes the replicas along."""
    overrides = ["model=smollm2-135m", "capture=eager", "cache.num_slots=4096"]
    with dp_server(overrides) as (url, proc):
        system = {"role": "system", "content": "You are a helpful assistant who always answers in one line. " * 5}
        answers = []
        for question in ("What is 2+2?", "Name a colour.", "Say hello."):
            body = {"model": "smollm2-135m", "max_tokens": 4, "messages": [system, {"role": "user", "content": question}]}
            answers.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=120))
        assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
        assert len({a.headers[REPLICA_HEADER] for a in answers}) == 1
        cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
        assert cached[0] == 0 and all(c > 50 for c in cached[1:]), cached
        replicas = _replicas_of(proc)
        assert len(replicas) >= 2
        proc.kill()
        proc.wait()
        assert _all_gone(replicas) == []
