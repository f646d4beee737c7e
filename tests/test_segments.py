"""Segmented capture (the Breakable CUDA Graph mechanism) on CPU, through the op tape.

Everything the CUDA path does except the CUDA graph itself: graphs recorded between break
points, breaks replayed eagerly on their capture-time argument tensors, fresh break outputs
copied into the boundary buffers the next graph reads, static inputs, padding.  The tape keeps
CUDA-graph semantics (fixed addresses, Python between ops not re-run), so a wiring mistake here
is a wrong token, as it would be on the GPU.
"""

import dataclasses

import pytest
import torch

from capture.break_points import break_point, breaking
from capture.buckets import bucket_for
from capture.op_tape import TapeRecorder
from capture.options import BreakableOptions, TcPiecewiseOptions
from capture.registry import create_backend
from capture.segments import record_segments
from graphexec import ConfigError, Engine, SamplingParams
from graphexec.batch.forward_mode import ForwardMode
from tests.helpers import recorded_batches
from tests.invariants import assert_no_leak

TINY = ["model=tiny-llama", "cache.num_slots=1024"]
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
VARIANTS = {
    "breakable": "backend:breakable,graph:tape",
    "tc_piecewise": "backend:tc_piecewise,graph:tape,compiler:eager",
}
# The same plans with real CUDA graphs (tc_piecewise pieces compiled by inductor, as served).
CUDA_VARIANTS = {
    "breakable": "backend:breakable,graph:cuda_graph",
    "tc_piecewise": "backend:tc_piecewise,graph:cuda_graph",
}


def _plan(variant, buckets="[16,32,64]", prefill_tokens=128, extra="", device="cpu"):
    spec = (CUDA_VARIANTS if device == "cuda" else VARIANTS)[variant]
    return TINY + [
        f"device={device}",
        f"scheduler.max_prefill_tokens={prefill_tokens}",
        "capture=eager",
        f"+capture.extend={{{spec},buckets:{buckets},progress:false,max_padding:1.0{extra}}}",  # pad any batch
        "capture.mixed=${capture.extend}",
    ]


def _prompts():
    """15, 16, 17 and 64 tokens (below, on, above a bucket; the largest) and 70 (eager fallback)."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (15, 16, 17, 64, 70)]


@pytest.fixture(scope="module")
def eager_tokens():
    engine = Engine(overrides=TINY + ["capture=eager"])
    return [engine.generate([p], PARAMS)[0].token_ids for p in _prompts()]


def _logits_against_eager(engine) -> dict[int, float]:
    """Generate the prompts; every batch the piecewise backend runs is run again by the eager
    runner, and the largest logit difference is kept per token bucket."""
    engine.flush_cache()  # prompts it has seen would hit the prefix cache and skip buckets
    runner = engine.runner
    backend = runner.backends[ForwardMode.EXTEND]
    worst: dict[int, float] = {}

    execute = runner.execute

    def checked(used, fb):
        hidden = execute(used, fb)
        if used is backend:
            graphed = runner.model.compute_logits(hidden)
            eager = runner.model.compute_logits(execute(runner.eager, fb))
            bucket = bucket_for(fb.num_tokens, backend.buckets)
            worst[bucket] = max(worst.get(bucket, 0.0), float((graphed - eager).abs().max()))
        return hidden

    runner.execute = checked
    try:
        for prompt in _prompts():
            engine.generate([prompt], PARAMS)
    finally:
        del runner.execute
    return worst


# -- the mechanism, on small functions ---------------------------------------------------------


@break_point("double")
def _double(x):
    return x * 2


def test_replay_reads_the_inputs_of_now_and_rewrites_the_outputs_of_capture():
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def forward():
        h = torch.nn.functional.linear(x, w).relu()
        h = _double(h.reshape(8, 4).t().contiguous())  # a copying reshape and contiguous
        return (h + 1).sum(dim=0)

    with breaking({"double"}):
        graph = record_segments(TapeRecorder(), forward)
        out = graph.output
        assert graph.num_segments == 2 and [b.name for b in graph.breaks] == ["double"]
        for _ in range(3):
            x.copy_(torch.randn(4, 8))
            assert graph.replay() is out
            torch.testing.assert_close(out, forward())


def test_a_break_whose_output_is_not_copied_back_leaves_the_next_segment_stale():
    """The boundary buffer is what the next segment reads: without the copy, replay is wrong."""
    x = torch.randn(4)
    with breaking({"double"}):
        graph = record_segments(TapeRecorder(), lambda: _double(x + 1) - 1)
        x.copy_(torch.randn(4))
        first, brk, last = graph.steps
        first.replay()
        brk.fn(*brk.args)  # the break run, its fresh result dropped instead of copied back
        last.replay()
        assert not torch.equal(graph.output, x * 2 + 1)
        torch.testing.assert_close(graph.replay(), x * 2 + 1)


def test_breaks_nested_in_a_break_run_eagerly_inside_it():
    x = torch.randn(4)

    @break_point("outer")
    def outer(t):
        return _double(t) + 1

    with breaking({"outer", "double"}):
        graph = record_segments(TapeRecorder(), lambda: outer(x) * 3)
        assert [b.name for b in graph.breaks] == ["outer"] and graph.num_segments == 2
        x.copy_(torch.randn(4))
        torch.testing.assert_close(graph.replay(), (x * 2 + 1) * 3)


def test_the_break_switch_is_traced_through_and_guarded():
    """Dynamo reads which breaks are active while it traces, without a graph break (a whole forward
    traces straight through an inactive break), and guards on it: code traced with the break off
    is not reused with it on, where the break runs eagerly between graphs.  Once both ways are
    compiled, flipping the switch compiles nothing more."""
    x = torch.randn(4)
    graphs = []  # the ops of each graph Dynamo hands over

    def backend(gm, example_inputs):
        graphs.append({n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    torch.compile(lambda t: _double(t + 1) - 1, backend=backend, fullgraph=True)(x)
    assert graphs == [{"add", "mul", "sub"}]
    compiled = torch.compile(lambda t: _double(t + 1) - 1, backend=backend)

    def run(*active):
        with breaking(active):
            torch.testing.assert_close(compiled(x), x * 2 + 1)

    run()
    assert graphs[1:] == [{"add", "mul", "sub"}]
    run("double")
    assert graphs[2:] and all("mul" not in ops for ops in graphs[2:])  # x * 2 ran eagerly
    run(), run("double"), run()
    settled = len(graphs)
    run("double"), run()
    assert len(graphs) == settled


def test_a_break_active_in_one_thread_never_cuts_a_forward_in_another():
    """Two engines in one process run their loops on two threads: a `breaking()` (and a
    recording's handler) entered by one must leave the other's forwards whole, compiled or not."""
    import threading

    x = torch.randn(4)
    inside, release = threading.Event(), threading.Event()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    compiled = torch.compile(lambda t: _double(t + 3) - 3, backend=backend)

    class Refuse:
        def on_break(self, name, fn, args, kwargs):
            raise AssertionError(f"the other thread's handler ran break {name!r}")

    def hold_the_switch():
        from capture.break_points import intercepting

        with breaking({"double"}), intercepting(Refuse()):
            inside.set()
            release.wait(30)

    holder = threading.Thread(target=hold_the_switch)
    holder.start()
    try:
        assert inside.wait(30)
        torch.testing.assert_close(compiled(x), x * 2 + 3)
        assert graphs == [{"add", "mul", "sub"}]  # traced whole: the break is off in this thread
    finally:
        release.set()
        holder.join()


def test_a_host_read_inside_a_segment_is_refused_as_cuda_capture_would():
    x = torch.randn(4)
    with pytest.raises(RuntimeError, match="reads a device value on the host inside a recorded segment"):
        record_segments(TapeRecorder(), lambda: x * float(x.sum()))


# -- both piecewise variants on the tiny model --------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tokens_equal_eager_around_bucket_edges(variant, eager_tokens):
    engine = Engine(overrides=_plan(variant))
    backend = engine.runner.backends[ForwardMode.EXTEND]
    assert backend.name == variant and backend.mechanism == "tape"
    assert [engine.generate([p], PARAMS)[0].token_ids for p in _prompts()] == eager_tokens
    assert (backend.stats.executions, backend.stats.fallbacks) == (4, 1)
    assert backend.stats.padded_rows == (16 - 15) + (32 - 17)
    layers = engine.model_config.num_layers
    for bucket in (16, 32, 64):
        recorded = backend.segments_of(bucket)
        assert recorded.num_segments == layers + 1
        assert [b.name for b in recorded.breaks] == ["attention" if variant == "breakable" else "tc_piecewise_split"] * layers
    assert_no_leak(engine)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chunked_and_mixed_batches_replay_recorded_graphs(variant, eager_tokens):
    engine = Engine(overrides=_plan(variant, buckets="[32]", prefill_tokens="null") + ["scheduler.mixed_chunk=true"])
    with recorded_batches(engine) as batches:
        outputs = engine.generate(_prompts(), PARAMS)
    assert [o.token_ids for o in outputs] == eager_tokens
    assert ForwardMode.MIXED in [fb.forward_mode for fb in batches]
    backend = engine.runner.backends[ForwardMode.EXTEND]
    assert backend.stats.fallbacks == 0 and backend.stats.executions == sum(fb.forward_mode.is_extend() for fb in batches)
    assert_no_leak(engine)


def test_padded_tokens_write_only_the_dummy_slot():
    engine = Engine(overrides=_plan("breakable"))
    kv = engine.kv_cache.token_pool
    for buf in kv.k_buffers + kv.v_buffers:
        buf[1:] = float("nan")
    prompt = _prompts()[2]  # 17 tokens in bucket 32
    engine.generate([prompt], SamplingParams(max_new_tokens=1))
    for buf in kv.k_buffers + kv.v_buffers:
        assert int((~torch.isnan(buf[1:]).flatten(1).all(dim=1)).sum()) == len(prompt)
    assert_no_leak(engine)


def test_debug_and_user_marked_breaks_through_the_recorded_path(eager_tokens):
    debug = Engine(overrides=_plan("breakable", buckets="[32,64]", extra=",breaks:[debug]"))
    assert [debug.generate([p], PARAMS)[0].token_ids for p in _prompts()] == eager_tokens
    assert [b.name for b in debug.runner.backends[ForwardMode.EXTEND].segments_of(32).breaks] == ["debug"]

    engine = Engine(overrides=_plan("breakable", buckets="[32,64]", extra=",breaks:[attention,mlp]"))
    for layer in engine.runner.model.layers:
        layer.mlp.forward = break_point("mlp")(layer.mlp.forward)
    backend = engine.runner.backends[ForwardMode.EXTEND]
    engine.runner.capture_backend(backend)  # record again with the new break marked
    assert [engine.generate([p], PARAMS)[0].token_ids for p in _prompts()] == eager_tokens
    layers = engine.model_config.num_layers
    assert backend.segments_of(32).num_segments == 2 * layers + 1


@pytest.mark.parametrize(
    "extra,message",
    [
        ("backend:breakable,graph:cuda_graph", "capture.extend.graph=cuda_graph needs device=cuda; this engine runs on cpu"),
        ("backend:breakable,graph:film", "capture.extend.graph='film' is unknown"),
        ("backend:tc_piecewise,graph:tape", "capture.extend.graph=tape records aten calls"),
    ],
)
def test_config_errors_name_the_option(extra, message):
    with pytest.raises(ConfigError) as err:
        Engine(overrides=TINY + ["capture=eager", f"+capture.extend={{{extra},buckets:[16]}}"])
    assert message in str(err.value)


def test_auto_variant_is_breakable_on_cuda_and_tc_piecewise_on_cpu(tiny_engine, monkeypatch):
    import capture.registry as registry

    made = []
    monkeypatch.setattr(registry, "backend_class", lambda name: lambda env, options, path: made.append((name, options)))
    cpu_env = tiny_engine.runner.eager.env
    cuda_env = dataclasses.replace(cpu_env, device=torch.device("cuda"))
    create_backend("piecewise", cpu_env, {"buckets": [16]}, "capture.extend")
    create_backend("piecewise", cuda_env, {"buckets": [16], "variant": "auto"}, "capture.extend")
    assert made == [("tc_piecewise", TcPiecewiseOptions(buckets=(16,))), ("breakable", BreakableOptions(buckets=(16,)))]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_equal_eager_per_bucket(variant):
    worst = _logits_against_eager(Engine(overrides=_plan(variant)))
    assert sorted(worst) == [16, 32, 64] and max(worst.values()) < 1e-4, worst


# -- the same checks with real CUDA graphs (the lent device; scripts/gpu_check.sh) --------------


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(CUDA_VARIANTS))
def test_cuda_graph_segments_equal_eager(variant):
    eager = Engine(overrides=TINY + ["device=cuda", "capture=eager"])
    expected = [eager.generate([p], PARAMS)[0].token_ids for p in _prompts()]
    engine = Engine(overrides=_plan(variant, device="cuda"))
    backend = engine.runner.backends[ForwardMode.EXTEND]
    assert backend.mechanism == "cuda_graph"
    assert [engine.generate([p], PARAMS)[0].token_ids for p in _prompts()] == expected
    assert backend.segments_of(16).num_segments == engine.model_config.num_layers + 1
    worst = _logits_against_eager(engine)
    assert sorted(worst) == [16, 32, 64] and max(worst.values()) < 1e-3, worst
    assert_no_leak(engine)


def test_smollm2_breakable_recorded_path_equals_eager(smollm2_engine):
    """The real model (30 layers, GQA 9/3 heads, tied embeddings) through the recorded path the
    CUDA backend takes: 31 segments around 30 eager attention breaks."""
    engine = Engine(
        overrides=[
            "model=smollm2-135m",
            "cache.num_slots=4096",
            "capture=eager",
            "+capture.extend={backend:breakable,graph:tape,buckets:[64],progress:false,max_padding:1.0}",
            "capture.mixed=${capture.extend}",
        ]
    )
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in ("Hi!", "What is 2+2?")]
    params = SamplingParams(max_new_tokens=6)
    got = [engine.generate([p], params)[0].token_ids for p in prompts]
    smollm2_engine.flush_cache()
    assert got == [smollm2_engine.generate([p], params)[0].token_ids for p in prompts]
    backend = engine.runner.backends[ForwardMode.EXTEND]
    assert backend.stats.executions == 2 and backend.segments_of(64).num_segments == 31
