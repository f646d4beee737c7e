"""The engine loop behind generate / stream / agenerate / astream / abort / shutdown."""

import asyncio
import gc
import threading

import pytest
import torch

from graphexec import Engine, EngineClosedError, InvalidRequestError, RequestFailedError, SamplingParams
from graphexec.batch.forward_mode import ForwardMode
from tests.conftest import TINY_OVERRIDES
from tests.helpers import slowed, wait_until
from tests.invariants import assert_no_leak

LONG = SamplingParams(max_new_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    with Engine(overrides=TINY_OVERRIDES) as engine:
        yield engine


def _ids(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_stream_deltas_add_up_to_generate(engine):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2)
    (expected,) = engine.generate([_ids(9, 1)], params)
    engine.flush_cache()  # the same prompt computed again, not reused: logprobs compare exactly
    deltas = list(engine.stream(_ids(9, 1), params))
    assert all(d.finish_reason is None and d.output is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == "length" and last.output.token_ids == expected.token_ids
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text == engine.tokenizer.decode(expected.token_ids)
    assert [e for d in deltas for e in d.logprobs] == expected.logprobs
    assert all(len(e["top"]) == 2 for e in expected.logprobs)
    assert_no_leak(engine)


def test_per_request_stats(engine):
    outs = engine.generate([_ids(5, 2), _ids(30, 3)], SamplingParams(max_new_tokens=12, ignore_eos=True))
    for out, prompt_len in zip(outs, (5, 30)):
        assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (prompt_len, 12, 0)
        assert 0 < out.ttft < out.latency
        assert 0 < out.tpot and out.ttft + 11 * out.tpot == pytest.approx(out.latency, abs=0.05)
    (none,) = engine.generate([[5]], SamplingParams(max_new_tokens=0))
    assert none.token_ids == [] and none.ttft is None and none.tpot is None and none.finish_reason == "length"


def test_abort_via_python_api_frees_slots(engine):
    with slowed(engine):
        stream = engine.stream(_ids(10, 4), LONG)
        first = [next(stream) for _ in range(3)]
        assert engine.kv_cache.num_free < engine.kv_cache.num_slots
        assert engine.abort(stream.request_id)
        rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    out = rest[-1].output
    assert 3 <= out.completion_tokens < 400 and out.token_ids[:3] == [t for d in first for t in d.token_ids]
    assert_no_leak(engine)
    assert not engine.abort(stream.request_id)  # finished: nothing to abort
    assert not engine.abort("no-such-request")


def test_abort_of_a_queued_request_and_a_dropped_stream():
    engine = Engine(overrides=TINY_OVERRIDES + ["scheduler.max_running_requests=2"])
    with slowed(engine):
        kept, dropped, queued = (engine.stream(_ids(4, s), LONG) for s in range(3))
        wait_until(lambda: engine.metrics().running == 2, what="two running")
        assert engine.metrics().waiting == 1  # beyond max_running_requests: queued, not failed
        assert engine.abort(queued.request_id)
        assert queued.result().finish_reason == "abort" and queued.result().token_ids == []
        del dropped  # a dropped stream aborts its request
        gc.collect()
        wait_until(lambda: engine.metrics().finished["abort"] == 2, what="the dropped stream's abort")
        assert not kept.finished and engine.metrics().running == 1
        kept.close()
        assert kept.result().finish_reason == "abort"
    assert_no_leak(engine)


def test_async_calls_interleave_in_one_event_loop(engine):
    prompts = [_ids(n, 10 + n) for n in (3, 8, 13, 21)]
    lengths = [5, 40, 17, 40]
    expected = [o.text for o in engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths])]
    arrivals = []

    async def consume(i):
        stream = engine.astream(prompts[i], SamplingParams(max_new_tokens=lengths[i], ignore_eos=True))
        text = ""
        async for delta in stream:
            arrivals.append(i)
            text += delta.text
        return text

    async def main():
        generated = [engine.agenerate(prompts[i], SamplingParams(max_new_tokens=lengths[i], ignore_eos=True)) for i in (0, 2)]
        results = await asyncio.gather(generated[0], consume(1), generated[1], consume(3))
        with slowed(engine):  # still running when cancelled, however fast the steps are
            cancelled = asyncio.ensure_future(engine.agenerate(prompts[1], LONG))
            await asyncio.sleep(0.2)
            cancelled.cancel()  # cancelling the await aborts the request
            with pytest.raises(asyncio.CancelledError):
                await cancelled
        return results

    results = asyncio.run(main())
    assert [results[0].text, results[1], results[2].text, results[3]] == expected
    # The two astream consumers received their deltas interleaved, not one after the other.
    both = [i for i in arrivals if i in (1, 3)]
    assert both.index(3) < len(both) - 1 - both[::-1].index(1)
    wait_until(lambda: engine.num_unfinished() == 0)
    assert_no_leak(engine)


def test_stop_strings_cut_text_and_release_kv(smollm2_engine):
    engine = smollm2_engine
    prompt = "List the days of the week, one per line."
    (free,) = engine.generate([prompt], SamplingParams(max_new_tokens=20), chat=True)
    stop = free.text[free.text.index("\n") - 3 :][:5]  # spans a line break: several tokens
    assert stop in free.text
    cut = free.text.index(stop)
    params = SamplingParams(max_new_tokens=20, stop=("no such text", stop))
    (out,) = engine.generate([prompt], params, chat=True)
    assert out.text == free.text[:cut] and out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: len(out.token_ids)] and len(out.token_ids) < len(free.token_ids)
    streamed = list(engine.stream(prompt, params, chat=True))
    assert "".join(d.text for d in streamed) == free.text[:cut]  # no piece of the stop string leaked
    assert streamed[-1].finish_reason == "stop"
    assert_no_leak(engine)


def test_stop_string_split_over_byte_tokens(engine):
    prompt = _ids(6, 7)
    (free,) = engine.generate([prompt], SamplingParams(max_new_tokens=60, ignore_eos=True))
    start = next(i for i in range(2, 50) if "\ufffd" not in free.text[i - 1 : i + 3] and len(free.text[i : i + 3].encode()) >= 3)
    stop = free.text[start : start + 3]
    cut = free.text.index(stop)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True, stop=(stop,))
    deltas = list(engine.stream(prompt, params))
    assert "".join(d.text for d in deltas) == deltas[-1].output.text == free.text[:cut]
    assert deltas[-1].finish_reason == "stop"
    assert_no_leak(engine)


def test_failed_step_fails_only_its_batch(engine):
    running = engine.stream(_ids(8, 8), SamplingParams(max_new_tokens=60, ignore_eos=True))
    next(running)
    real = engine.runner.forward_and_sample
    failures = []

    def fail_next_prefill(fb):
        if fb.forward_mode == ForwardMode.EXTEND and not failures:
            failures.append(fb.batch_size)
            raise RuntimeError("injected prefill failure")
        return real(fb)

    engine.runner.forward_and_sample = fail_next_prefill
    try:
        with pytest.raises(RequestFailedError, match="injected prefill failure"):
            engine.stream(_ids(5, 9), SamplingParams(max_new_tokens=5)).result()
        assert running.result().completion_tokens == 60  # decoding alongside, untouched
    finally:
        del engine.runner.forward_and_sample
    assert failures == [1] and engine.metrics().finished["error"] >= 1
    assert_no_leak(engine)
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].completion_tokens == 3


def test_bad_input_raises_before_queueing(engine):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.stream([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="sampling_params must be a SamplingParams"):
        engine.stream([1], {"max_new_tokens": 3})

    async def bad_async():
        engine.astream([1, 99999])

    with pytest.raises(InvalidRequestError, match="token id 99999 outside the vocabulary"):
        asyncio.run(bad_async())
    assert engine.num_unfinished() == 0
    assert_no_leak(engine)


# Compiled graphs replayed from the loop thread: tests/test_full_graph.py (generate runs there too).
GRAPH_FIRST_DEBUG = [
    "capture=graph_first",
    "capture.decode.buckets=[1,2]",
    "capture.decode.graph=eager",
    "capture.decode.progress=false",
    "capture.extend.buckets=[64]",
    "capture.extend.progress=false",
]


@pytest.mark.parametrize("plan", [["capture=eager"], GRAPH_FIRST_DEBUG])
def test_shutdown_aborts_in_flight_and_closes(plan):
    engine = Engine(overrides=["model=tiny-llama", "cache.num_slots=1024", *plan])
    expected = engine.generate([[7, 8, 9]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    assert [t for d in engine.stream([7, 8, 9], SamplingParams(max_new_tokens=6, ignore_eos=True)) for t in d.token_ids] == expected
    with slowed(engine):
        stream = engine.stream([1, 2, 3], LONG)
        next(stream)
        engine.shutdown()
    assert stream.result().finish_reason == "abort"
    assert not engine.is_serving
    assert_no_leak(engine)
    with pytest.raises(EngineClosedError):
        engine.generate([[1]], SamplingParams(max_new_tokens=1))


def test_dropped_engine_stops_its_thread():
    def loop_threads():
        return sum(t.name == "graphexec-engine-loop" for t in threading.enumerate())

    before = loop_threads()
    engine = Engine(overrides=TINY_OVERRIDES)
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert loop_threads() == before + 1
    del engine
    gc.collect()
    wait_until(lambda: loop_threads() == before)


def test_a_finished_request_is_counted_before_its_caller_hears_of_it(engine, monkeypatch):
    """The engine loop forgets a request (unfinished set, finish counters) before it delivers the
    last delta, so metrics read as soon as an answer arrives already count it (the delivery used
    to come first, and a client polling /metrics could still see its request running)."""
    from graphexec.engine import request_tracker

    seen_at_delivery = []
    init = request_tracker.RequestTracker.__init__

    def recording_init(self, req, sink, *args, **kwargs):
        def sink_and_look(delta):
            if getattr(delta, "finished", False):
                seen_at_delivery.append((engine.num_unfinished(), sum(engine.metrics().finished.values())))
            return sink(delta)

        init(self, req, sink_and_look, *args, **kwargs)

    monkeypatch.setattr(request_tracker.RequestTracker, "__init__", recording_init)
    before = sum(engine.metrics().finished.values())
    engine.generate(["ab", "cd"], SamplingParams(max_new_tokens=2))
    # Each answer arrives with its own request already counted (the other may still be running):
    # the k-th delivery sees at least k finished, and every request is either finished or unfinished.
    assert len(seen_at_delivery) == 2
    for k, (unfinished, finished) in enumerate(sorted(seen_at_delivery, key=lambda seen: seen[1]), start=1):
        assert finished - before >= k and unfinished + finished - before == 2


def test_loop_thread_pins_the_cuda_device_the_engine_was_built_on(monkeypatch):
    # torch.cuda.set_device refuses `cuda` without an index (the GPU run of the fifteenth session
    # found every device=cuda engine's loop dead on it); the building thread's current device is meant.
    from graphexec.engine.engine_loop import cuda_index

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert cuda_index(torch.device("cuda")) == 3
    assert cuda_index(torch.device("cuda:1")) == 1
    assert cuda_index(torch.device("cpu")) is None
