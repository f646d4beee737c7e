"""Full-graph decode: same tokens as eager at every batch size, padding inert, fallbacks counted."""

import pytest
import torch

from graphexec import ConfigError, Engine, SamplingParams
from graphexec.batch.forward_mode import ForwardMode
from tests.helpers import recorded_batches, wait_until
from tests.invariants import assert_no_leak

TINY = ["model=tiny-llama", "cache.num_slots=1024"]
GRAPH = TINY + [
    "capture=graph_first",
    "capture.decode.buckets=[1,2,4]",
    "capture.decode.progress=false",
    "capture.extend.backend=eager",  # this file is about decode; prefill has its own tests
]


def _workload(vocab=320):
    """Five staggered requests: the running batch shrinks 5 → 1, crossing every bucket boundary."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (3, 11, 17, 6, 29)]
    params = [SamplingParams(max_new_tokens=4 + 5 * i, ignore_eos=True) for i in range(5)]
    return prompts, params


@pytest.fixture(scope="module")
def eager_tokens():
    prompts, params = _workload()
    return [o.token_ids for o in Engine(overrides=TINY + ["capture=eager"]).generate(prompts, params)]


@pytest.fixture(scope="module")
def graph_engine():
    return Engine(overrides=GRAPH)


def _decode_sizes(batches):
    return [fb.batch_size for fb in batches if fb.forward_mode.is_decode()]


def test_graph_first_equals_eager_across_buckets(graph_engine, eager_tokens):
    prompts, params = _workload()
    stats = graph_engine.runner.backends[ForwardMode.DECODE].stats
    before = stats.executions, stats.fallbacks, stats.padded_rows
    with recorded_batches(graph_engine) as batches:
        outputs = graph_engine.generate(prompts, params)
    sizes = _decode_sizes(batches)
    assert [o.token_ids for o in outputs] == eager_tokens
    assert set(sizes) == {1, 2, 3, 4, 5}  # every bucket, a padded size (3) and an oversize batch (5)
    assert stats.fallbacks - before[1] == sizes.count(5)  # 5 > largest bucket: eager, counted
    assert stats.executions - before[0] == len(sizes) - sizes.count(5)
    assert stats.padded_rows - before[2] == sizes.count(3)  # 3 pads to 4
    assert_no_leak(graph_engine)


def test_idle_shares_the_decode_graphs(graph_engine):
    runner = graph_engine.runner
    assert runner.backends[ForwardMode.IDLE] is runner.backends[ForwardMode.DECODE]
    assert runner.backends[ForwardMode.EXTEND].name == "eager"
    assert set(runner.backends[ForwardMode.DECODE].stats.capture_seconds) == {1, 2, 4}


def test_padding_is_inert_and_alone_equals_padded(graph_engine):
    """A request alone (bucket 1) and inside a padded bucket (3 rows → 4) gives the same tokens,
    and padded rows write no real KV slot."""
    prompts, _ = _workload()
    new_tokens = 12
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    alone = graph_engine.generate([prompts[1]], params)[0].token_ids

    kv = graph_engine.kv_cache.token_pool
    graph_engine.flush_cache()  # cached KV would be poisoned below, and prompts[1] must not hit
    assert kv.num_free == kv.num_slots
    for buf in kv.k_buffers + kv.v_buffers:
        buf[1:] = float("nan")  # every real slot poisoned; the dummy slot 0 is not
    with recorded_batches(graph_engine) as batches:
        together = graph_engine.generate(prompts[:3], params)
    sizes = _decode_sizes(batches)
    assert 3 in sizes and together[1].token_ids == alone
    # Exactly the requests' own KV was written: each holds its prompt plus all but its last token.
    expected_written = sum(len(p) + new_tokens - 1 for p in prompts[:3])
    for buf in kv.k_buffers + kv.v_buffers:
        written = ~torch.isnan(buf[1:]).flatten(1).all(dim=1)
        assert int(written.sum()) == expected_written
        buf.nan_to_num_(0.0)
    assert_no_leak(graph_engine)


@pytest.mark.parametrize("graph", ["eager"])
def test_debug_switch_runs_padding_with_eager_inside(graph, eager_tokens):
    engine = Engine(overrides=GRAPH + [f"capture.decode.graph={graph}"])
    prompts, params = _workload()
    assert [o.token_ids for o in engine.generate(prompts, params)] == eager_tokens
    assert engine.runner.backends[ForwardMode.DECODE].stats.padded_rows > 0


def test_static_metadata_matches_dynamic(eager_tokens):
    """The CUDA-graph metadata path (fixed shapes and addresses), exercised on the CPU."""
    engine = Engine(overrides=GRAPH + ["capture.decode.graph=eager"])
    engine.runner.attn_backend.enable_static_decode_metadata(4, engine.max_context, engine.runner.device)
    prompts, params = _workload()
    assert [o.token_ids for o in engine.generate(prompts, params)] == eager_tokens


@pytest.mark.parametrize("attention", ["torch_native", "cpu"])
def test_decode_recorded_on_the_tape_equals_eager(eager_tokens, attention):
    """The cuda_graph path on the CPU: each bucket one recording with zero breaks (the op tape),
    attention replayed inside it against static metadata, every bucket on the engine's one
    recorder."""
    engine = Engine(overrides=GRAPH + ["capture.decode.graph=tape", f"attention_backend={attention}"])
    runner = engine.runner
    backend = runner.backends[ForwardMode.DECODE]
    assert backend.static_metadata_rows == 4 and runner._static_metadata_rows == 4
    for bucket in backend.buckets:
        recorded = backend.segments_of(bucket)
        assert recorded.num_segments == 1 and recorded.breaks == ()
    assert runner.capture_env.recorders.get("tape", runner.device, "unused") is backend.recorder
    prompts, params = _workload()
    with recorded_batches(engine) as batches:
        outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == eager_tokens
    sizes = _decode_sizes(batches)
    assert backend.stats.executions == len(sizes) - sizes.count(5)
    assert_no_leak(engine)


def test_a_replayed_decode_graph_reads_the_real_row_count_at_run_time():
    """Padded rows are zeroed after attention by comparing row ids with the count on the device:
    a replay of the bucket-4 recording zeroes exactly the rows this batch pads (3 real rows, then
    2), not those of the batch it was recorded on."""
    engine = Engine(
        overrides=GRAPH
        + ["capture.decode.graph=tape", "capture.decode.buckets=[4]", "capture.decode.lazy=true"]
        + ["attention_backend=torch_native"]
    )
    runner, attn = engine.runner, engine.runner.attn_backend
    forward, recorded_out, live_rows = attn.forward, [], []

    def spy(q, k, v, out, layer_id, ctx):  # runs while the bucket is recorded, not on replay
        forward(q, k, v, out, layer_id, ctx)
        if int(layer_id) == 0 and ctx.forward_batch.forward_mode.is_decode():
            recorded_out[:] = [out]  # the last one seen is the recorded graph's own buffer

    execute = runner.execute

    def execute_and_look(backend, fb):
        hidden = execute(backend, fb)
        if fb.forward_mode.is_decode():
            live_rows.append((recorded_out[0] != 0).any(dim=1).tolist())
        return hidden

    attn.forward, runner.execute = spy, execute_and_look
    prompts, _ = _workload()
    engine.generate(prompts[:3], SamplingParams(max_new_tokens=3, ignore_eos=True))
    engine.generate(prompts[3:], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert live_rows == [[True, True, True, False]] * 2 + [[True, True, False, False]] * 2


def test_every_backend_of_an_engine_records_through_one_recorder(graph_engine):
    """One recorder per kind per engine: on CUDA, one memory pool for decode and prefill graphs."""
    from capture import create_backend

    env = graph_engine.runner.capture_env
    decode = create_backend("full_graph", env, {"buckets": [4], "graph": "tape", "lazy": True})
    for variant in ("breakable", "tc_piecewise"):
        options = {"buckets": [16], "graph": "tape", "lazy": True, "variant": variant}
        options |= {"compiler": "eager"} if variant == "tc_piecewise" else {}
        assert create_backend("piecewise", env, options).recorder is decode.recorder
    assert decode.mechanism == "tape" and decode.static_metadata_rows == 4


@pytest.mark.parametrize(
    "override,message",
    [
        ("capture.decode.buckets=[]", "capture.decode.buckets must be a non-empty list"),
        ("capture.decode.buckets=[8,4]", "capture.decode.buckets must be sorted ascending"),
        ("capture.decode.graph=cuda_graph", "capture.decode.graph=cuda_graph needs device=cuda"),
        ("capture.decode.graph=warp", "capture.decode.graph='warp' is unknown"),
        ("capture.decode.backend=hyperdrive", "capture.decode.backend='hyperdrive' is unknown"),
        ("+capture.decode.turbo=1", "capture.decode.turbo is not a full_graph option"),
        ("+capture.decode.compile.fast=1", "capture.decode.compile.fast is unknown"),
    ],
)
def test_config_errors_name_the_option(override, message):
    if torch.cuda.is_available() and "cuda_graph" in override:
        pytest.skip("cuda_graph is valid on this machine")
    with pytest.raises(ConfigError) as err:
        Engine(overrides=GRAPH + [override])
    assert message in str(err.value)


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_logits_per_bucket():
    engine = Engine(overrides=GRAPH + ["device=cuda"])
    eager = Engine(overrides=TINY + ["capture=eager", "device=cuda"])
    prompts, params = _workload()
    assert [o.token_ids for o in engine.generate(prompts, params)] == [
        o.token_ids for o in eager.generate(prompts, params)
    ]


@pytest.mark.gpu
def test_the_default_plan_on_cuda_serves_while_it_captures_and_equals_eager(tmp_path):
    """What `device=cuda` alone gets: capture=auto, graphs captured in the background (CUDA graphs
    for decode, prefill pieces) while requests are served; the tokens never change."""
    eager = Engine(overrides=TINY + ["capture=eager", "device=cuda"])
    prompts, params = _workload()
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    plan = ["device=cuda", f"capture.cache_dir={tmp_path}", "capture.idle_delay_s=0",
            "capture.decode.buckets=[1,2,4]", "capture.extend.buckets=[64]"]
    with Engine(overrides=TINY + plan) as engine:
        seen = [[o.token_ids for o in engine.generate(prompts, params)]]
        wait_until(lambda: not engine.runner.capture_pending(), timeout=300, what="background capture")
        seen.append([o.token_ids for o in engine.generate(prompts, params)])
        stats = engine.runner.backend_stats()
        assert_no_leak(engine)
    assert seen == [expected, expected]
    assert {s["state"] for s in stats["decode"]["buckets"].values()} <= {"ready", "dropped"}
    assert stats["decode"]["executions"] > 0  # CUDA graphs measured ~30x eager here (gpu_check.sh): kept

def test_smollm2_graph_first_equals_eager(smollm2_engine):
    """The real model: five staggered requests, batch sizes 5 (eager fallback), 4, 3 and 2 (padded
    to 4), 1.  Two buckets, not three: each is a compile of SmolLM2's layer, and the tiny model's
    tests above cross every bucket boundary."""
    graph = Engine(
        overrides=[
            "model=smollm2-135m",
            "cache.num_slots=4096",
            "capture=graph_first",
            "capture.decode.buckets=[1,4]",
            "capture.decode.progress=false",
            "capture.extend.backend=eager",
        ]
    )
    tok = graph.tokenizer
    texts = ["Hi!", "Name a color.", "What is 2+2?", "Write one word about the sea.", "Count to five."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    params = [SamplingParams(max_new_tokens=6 + 4 * i, ignore_eos=True) for i in range(len(texts))]
    with recorded_batches(graph) as batches:
        got = [o.token_ids for o in graph.generate(prompts, params)]
    sizes = _decode_sizes(batches)
    assert got == [o.token_ids for o in smollm2_engine.generate(prompts, params)]
    assert {1, 2, 3, 4, 5} <= set(sizes)
    stats = graph.runner.backends[ForwardMode.DECODE].stats
    assert stats.fallbacks == sizes.count(5) and stats.padded_rows == sizes.count(3) + 2 * sizes.count(2)
    assert stats.executions == len(sizes) - sizes.count(5)
    assert_no_leak(graph)
