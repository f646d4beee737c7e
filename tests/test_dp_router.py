"""Data-parallel routing and the front, without models: the router's decisions (least-loaded,
prefix affinity and its slack, the LRU bound, counters), the Prometheus merge, and the front
proxying to fake replica servers (streaming, errors, a client leaving, a dead replica, metrics)."""

import asyncio
import socket
import threading

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from graphexec.config import EngineConfig
from graphexec.errors import ConfigError
from graphexec.parallel.router import NoReplicaError, Router, prefix_key
from graphexec.server.front import REPLICA_HEADER, create_front_app
from graphexec.server.front_metrics import merge_json, merge_prometheus
from tests.helpers import ServerThread, server_config, wait_until

# --- the router ---------------------------------------------------------------------------------


def test_least_loaded_without_affinity():
    router = Router(3)
    assert router.pick(None, [2, 0, 1]) == 1
    assert router.pick(None, [0, 3, 0]) in (0, 2)


def test_ties_spread_over_replicas():
    router = Router(3)
    picks = [router.pick(None, [0, 0, 0]) for _ in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


def test_known_prefix_returns_to_its_replica():
    router = Router(2, affinity_slack=4)
    home = router.pick("system-a", [0, 0])
    other = 1 - home
    loads = [0, 0]
    loads[home] = 3  # busier, but within the slack
    assert router.pick("system-a", loads) == home
    assert router.counters.affinity_hits == 1
    assert router.pick("system-b", loads) == other  # a new prefix goes to the least-loaded


def test_slack_overrides_affinity():
    router = Router(2, affinity_slack=2)
    home = router.pick("p", [0, 0])
    loads = [0, 0]
    loads[home] = 3  # 3 beyond the least-loaded > slack 2
    assert router.pick("p", loads) == 1 - home
    assert router.counters.affinity_overridden == 1
    loads[home] = 2  # back within the slack: the key kept its replica
    assert router.pick("p", loads) == home
    assert router.counters.as_dict() | {"routed_per_replica": None} == {
        "routed": 3, "affinity_hits": 1, "affinity_overridden": 1, "routed_per_replica": None,
    }


def test_affinity_table_is_bounded_lru():
    router = Router(2, max_prefixes=2)
    router.pick("a", [0, 0])
    router.pick("b", [0, 0])
    router.pick("a", [0, 0])  # a is now the most recent
    router.pick("c", [0, 0])  # evicts b
    assert router.known_prefixes() == 2
    hits = router.counters.affinity_hits
    router.pick("b", [0, 0])
    assert router.counters.affinity_hits == hits  # b was forgotten (and now evicted a)
    router.pick("c", [0, 0])
    assert router.counters.affinity_hits == hits + 1
    assert router.known_prefixes() == 2


def test_down_replica_gets_nothing():
    router = Router(2)
    home = router.pick("p", [0, 0])
    router.mark_down(home)
    assert router.pick("p", [0, 0]) == 1 - home  # its prefix finds a new home
    assert all(router.pick(None, [0, 5]) == 1 - home for _ in range(3))
    router.mark_down(1 - home)
    with pytest.raises(NoReplicaError):
        router.pick(None, [0, 0])


def test_prefix_key_shared_system_prompt():
    system = {"role": "system", "content": "You are terse. " * 30}
    a = prefix_key("/v1/chat/completions", {"messages": [system, {"role": "user", "content": "hi"}]})
    b = prefix_key("/v1/chat/completions", {"messages": [system, {"role": "user", "content": "bye"}]})
    c = prefix_key("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert a == b != c
    short = {"role": "system", "content": "Be brief."}  # far shorter than the key's characters
    d = prefix_key("/v1/chat/completions", {"messages": [short, {"role": "user", "content": "hi"}]})
    e = prefix_key("/v1/chat/completions", {"messages": [short, {"role": "user", "content": "bye"}]})
    assert d == e != prefix_key("/v1/chat/completions", {"messages": [{"role": "user", "content": "bye"}]})
    # No system prompt: a continued conversation keeps its first turn's key only up to the cut.
    turn = [{"role": "user", "content": "q" * 300}]
    assert prefix_key("/v1/chat/completions", {"messages": turn}) == prefix_key(
        "/v1/chat/completions", {"messages": [*turn, {"role": "assistant", "content": "a"}]}
    )
    assert prefix_key("/v1/completions", {"prompt": "x" * 300 + "1"}) == prefix_key("/v1/completions", {"prompt": "x" * 300})
    assert prefix_key("/v1/completions", {"prompt": [1, 2, 3]}) != prefix_key("/v1/completions", {"prompt": [1, 2, 4]})
    assert prefix_key("/v1/completions", {}) is None


def test_prefix_key_of_a_responses_body_is_its_chat_conversations():
    chat = prefix_key("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]})
    assert prefix_key("/v1/responses", {"instructions": "Be brief.", "input": "hi"}) == chat
    assert prefix_key("/v1/responses", {"instructions": "Be brief.", "input": [{"role": "user", "content": "bye"}]}) == chat
    turn = {"role": "user", "content": "q" * 300}
    assert prefix_key("/v1/responses", {"input": "q" * 300}) == prefix_key("/v1/chat/completions", {"messages": [turn]})
    assert prefix_key("/v1/responses", {"input": 5}) is None


def test_affinity_slack_config():
    assert EngineConfig.from_overrides(["model=tiny-llama"]).parallel.dp_affinity_slack == 4
    with pytest.raises(ConfigError, match="parallel.dp_affinity_slack"):
        EngineConfig.from_overrides(["model=tiny-llama", "parallel.dp_affinity_slack=-1"])


def test_replica_overrides_replace_the_fronts_own():
    from graphexec.parallel.replicas import replica_overrides

    front = ["model=tiny-llama", "parallel.dp_size=2", "server.port=8000", "+parallel.threads_per_rank=2"]
    own = replica_overrides(front, 4321, 1)
    assert own[:4] == ["model=tiny-llama", "server.port=4321", "parallel.dp_size=1", "parallel.threads_per_rank=1"]
    # Then the server options a replica always takes (tests/test_server_auth.py: keys and TLS stay the front's).
    assert "server.host=127.0.0.1" in own[4:] and all(o.startswith("server.") for o in own[4:])


# --- merged metrics -----------------------------------------------------------------------------

_REPLICA_METRICS = """# HELP graphexec_prompt_tokens_total Prompt tokens
# TYPE graphexec_prompt_tokens_total counter
graphexec_prompt_tokens_total {tokens}
# HELP graphexec_kv_usage_ratio used / total
# TYPE graphexec_kv_usage_ratio gauge
graphexec_kv_usage_ratio {ratio}
# HELP lat_seconds latency
# TYPE lat_seconds histogram
lat_seconds_bucket{{le="1.0"}} {fast}
lat_seconds_bucket{{le="+Inf"}} 2.0
lat_seconds_count 2.0
lat_seconds_sum 3.5
"""


def _samples(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text) for s in f.samples
    }


def test_merge_prometheus_relabels_and_totals():
    texts = [_REPLICA_METRICS.format(tokens=10, ratio=0.2, fast=1), None, _REPLICA_METRICS.format(tokens=5, ratio=0.4, fast=2)]
    samples = _samples(merge_prometheus(texts).decode())
    assert samples[("graphexec_prompt_tokens_total", (("replica", "0"),))] == 10
    assert samples[("graphexec_prompt_tokens_total", (("replica", "2"),))] == 5
    assert samples[("graphexec_prompt_tokens_total", (("replica", "total"),))] == 15
    assert samples[("graphexec_kv_usage_ratio", (("replica", "total"),))] == pytest.approx(0.3)
    assert samples[("lat_seconds_bucket", (("le", "1.0"), ("replica", "total")))] == 3
    assert samples[("lat_seconds_count", (("replica", "total"),))] == 4
    assert not any(labels == (("replica", "1"),) for _, labels in samples)  # did not answer


def test_merge_json_sums_numbers():
    merged = merge_json([{"model": "m", "running": 2, "finished": {"stop": 1}}, None, {"model": "m", "running": 1, "finished": {"stop": 4}}])
    assert merged == {"model": "m", "running": 3, "finished": {"stop": 5}}


# --- the front, before fake replicas ------------------------------------------------------------


class FakeReplica:
    """A replica server answering like graphexec-serve does, with hooks the tests hold."""

    def __init__(self, index: int):
        self.index = index
        self.release = threading.Event()  # the stream's second chunk waits for it
        self.stream_closed = threading.Event()  # the streaming generator ended (or was cancelled)
        self.requests: list[dict] = []
        app = FastAPI()
        app.state.server_config = server_config()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            if "fail" in body:
                return JSONResponse({"error": {"message": f"bad on {index}"}}, status_code=body["fail"])
            if body.get("hold"):  # a long non-streaming answer: watch for the client leaving
                while not self.release.is_set():
                    if await request.is_disconnected():
                        self.stream_closed.set()
                        return Response(status_code=499)
                    await asyncio.sleep(0.05)
            if body.get("stream"):
                return StreamingResponse(self._stream(), media_type="text/event-stream")
            return JSONResponse({"replica": index, "prompt": body.get("prompt")})

        @app.post("/v1/responses")
        async def responses(request: Request) -> Response:
            self.requests.append(await request.json())
            return JSONResponse({"replica": index, "object": "response"})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(_REPLICA_METRICS.format(tokens=10 * (index + 1), ratio=0.5, fast=1), media_type="text/plain")

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        self.server = ServerThread(app)

    async def _stream(self):
        try:
            yield b"data: first\n\n"
            await asyncio.to_thread(self.release.wait, 30)
            yield b"data: second\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            self.stream_closed.set()


@pytest.fixture()
def front():
    replicas = [FakeReplica(0), FakeReplica(1)]
    for r in replicas:
        r.server.__enter__()
    app = create_front_app([r.server.url for r in replicas], Router(2, affinity_slack=4), server_config())
    with ServerThread(app) as server:
        yield server, replicas, app.state.front
    for r in replicas:
        r.release.set()
        r.server.__exit__(None, None, None)


def test_front_streams_chunk_by_chunk(front):
    server, replicas, _ = front
    with httpx.Client(base_url=server.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "p", "stream": True}) as answer:
            replica = replicas[int(answer.headers[REPLICA_HEADER])]
            chunks = answer.iter_raw()
            assert next(chunks) == b"data: first\n\n"  # arrived while the replica still holds the rest
            replica.release.set()
            assert b"".join(chunks) == b"data: second\n\ndata: [DONE]\n\n"


def test_front_keeps_error_status_and_body(front):
    server, _, _ = front
    answer = httpx.post(server.url + "/v1/completions", json={"prompt": "p", "fail": 418}, timeout=10)
    assert answer.status_code == 418
    assert answer.json()["error"]["message"] == f"bad on {answer.headers[REPLICA_HEADER]}"


def test_client_leaving_closes_the_upstream_stream(front):
    server, replicas, state = front
    with httpx.Client(base_url=server.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "p", "stream": True}) as answer:
            replica = replicas[int(answer.headers[REPLICA_HEADER])]
            next(answer.iter_raw())
    wait_until(replica.stream_closed.is_set, timeout=10, what="the replica's stream to be closed")
    wait_until(lambda: state.loads == [0, 0], timeout=10, what="in-flight counts to return to 0")


def test_client_leaving_before_the_answer_cancels_it(front):
    server, replicas, state = front
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "p", "hold": True}, timeout=httpx.Timeout(10, read=0.5))
    wait_until(lambda: any(r.stream_closed.is_set() for r in replicas), timeout=10, what="the replica to see the client leave")
    wait_until(lambda: state.loads == [0, 0], timeout=10, what="in-flight counts to return to 0")


def test_affinity_through_the_front(front):
    server, _, state = front
    prompt = "shared system prompt " * 20
    seen = {httpx.post(server.url + "/v1/completions", json={"prompt": prompt + str(i)}, timeout=10).headers[REPLICA_HEADER] for i in range(4)}
    assert len(seen) == 1
    assert state.router.counters.affinity_hits == 3


def test_front_routes_responses_by_their_instructions(front):
    server, replicas, state = front
    bodies = [{"instructions": "Shared rules.", "input": f"question {i}"} for i in range(3)]
    answers = [httpx.post(server.url + "/v1/responses", json=body, timeout=10) for body in bodies]
    assert {a.json()["object"] for a in answers} == {"response"}
    assert len({a.headers[REPLICA_HEADER] for a in answers}) == 1 and state.router.counters.affinity_hits == 2
    assert sum((r.requests for r in replicas), []) == bodies


def test_dead_replica_answers_503_and_is_routed_around(front):
    server, replicas, state = front
    dead = int(httpx.post(server.url + "/v1/completions", json={"prompt": "q" * 300}, timeout=10).headers[REPLICA_HEADER])
    replicas[dead].server.__exit__(None, None, None)
    answer = httpx.post(server.url + "/v1/completions", json={"prompt": "q" * 300}, timeout=10)
    assert answer.status_code == 503
    assert f"replica {dead}" in answer.json()["error"]["message"]
    assert state.router.is_down(dead)
    again = httpx.post(server.url + "/v1/completions", json={"prompt": "q" * 300}, timeout=10)
    assert again.status_code == 200 and again.headers[REPLICA_HEADER] == str(1 - dead)
    health = httpx.get(server.url + "/health", timeout=15)
    assert health.status_code == 200 and health.json()["status"] == "degraded"


def test_connection_closed_under_a_request_is_retried_once():
    """A replica that closes a connection without answering (as on keep-alive expiry) costs a
    retry on a new connection, not a 503 and a replica marked down."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        first, _ = listener.accept()
        first.recv(65536)
        first.close()  # read, then closed without a response
        second, _ = listener.accept()
        second.recv(65536)
        second.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        second.close()

    threading.Thread(target=serve, daemon=True).start()
    app = create_front_app([f"http://127.0.0.1:{port}"], Router(1), server_config())
    with ServerThread(app) as server:
        answer = httpx.post(server.url + "/v1/completions", json={"prompt": "p"}, timeout=10)
    listener.close()
    assert answer.status_code == 200 and answer.json() == {}
    assert not app.state.front.router.is_down(0)


def test_front_metrics_relabel_and_total(front):
    server, _, _ = front
    samples = _samples(httpx.get(server.url + "/metrics", timeout=10).text)
    tokens = {dict(labels)["replica"]: v for (name, labels), v in samples.items() if name == "graphexec_prompt_tokens_total"}
    assert tokens == {"0": 10, "1": 20, "total": 30}
    front_json = httpx.get(server.url + "/metrics/json", timeout=10).json()["front"]
    assert front_json["in_flight"] == [0, 0] and front_json["down"] == []
