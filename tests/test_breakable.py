"""Breakable prefill on CPU: inductor-compiled segments with the break points run eagerly between."""

import itertools

import pytest
import torch

from capture.break_points import break_point
from graphexec import ConfigError, Engine, SamplingParams
from graphexec.batch.forward_mode import ForwardMode
from tests.helpers import recorded_batches
from tests.invariants import assert_no_leak

TINY = ["model=tiny-llama", "cache.num_slots=1024"]


def _plan(breaks="[attention]", buckets="[16,32,64]", prefill_tokens=128):
    # A budget above the largest bucket, so an oversized prompt reaches the backend unchunked.
    return TINY + [
        f"scheduler.max_prefill_tokens={prefill_tokens}",
        "capture=eager",
        f"+capture.extend={{backend:breakable,buckets:{buckets},breaks:{breaks},progress:false,max_padding:1.0}}",  # pad any batch
        "capture.mixed=${capture.extend}",
    ]


def _prompts():
    """Prefill batches of 15, 16, 17 and 64 tokens (below, on, above a bucket; the largest), and
    one of 70 (above every bucket: eager fallback)."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (15, 16, 17, 64, 70)]


PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def eager_tokens():
    engine = Engine(overrides=TINY + ["capture=eager"])
    return [engine.generate([p], PARAMS)[0].token_ids for p in _prompts()]


@pytest.fixture(scope="module")
def breakable():
    return Engine(overrides=_plan())


def test_tokens_equal_eager_around_bucket_edges(breakable, eager_tokens):
    backend = breakable.runner.backends[ForwardMode.EXTEND]
    assert backend.name == "breakable" and breakable.runner.backends[ForwardMode.MIXED] is backend
    before = backend.stats.executions, backend.stats.fallbacks, backend.stats.padded_rows
    got = [breakable.generate([p], PARAMS)[0].token_ids for p in _prompts()]
    assert got == eager_tokens
    assert backend.stats.executions - before[0] == 4
    assert backend.stats.fallbacks - before[1] == 1  # the 70-token prompt
    assert backend.stats.padded_rows - before[2] == (16 - 15) + (32 - 17)
    assert_no_leak(breakable)


def test_segments_are_breaks_plus_one(breakable):
    """Within one forward, compiled code runs in exactly len(layers) + 1 stretches, separated by
    the eager attention calls: no attention runs inside a compiled graph."""
    backend = breakable.runner.backends[ForwardMode.EXTEND]
    attn = breakable.runner.attn_backend
    trace: list[str] = []
    real_forward = attn.forward

    def traced(*args):
        trace.append("break")
        return real_forward(*args)

    attn.forward, backend.trace = traced, trace
    try:
        breakable.generate([_prompts()[0]], SamplingParams(max_new_tokens=1))
    finally:
        del attn.forward
        backend.trace = None
    runs = [kind for kind, _ in itertools.groupby(trace)]
    layers = breakable.model_config.num_layers
    assert runs.count("break") == layers and trace.count("break") == layers
    assert runs.count("segment") == layers + 1 and runs[0] == runs[-1] == "segment"
    assert_no_leak(breakable)


def test_debug_break_runs_everything_eagerly(eager_tokens):
    engine = Engine(overrides=_plan(breaks="[debug]"))
    backend = engine.runner.backends[ForwardMode.EXTEND]
    assert [engine.generate([p], PARAMS)[0].token_ids for p in _prompts()] == eager_tokens
    assert backend.stats.compiles == 0 and backend.stats.executions == 4


def test_user_marked_break_keeps_tokens(eager_tokens):
    # One bucket (32: the 15-, 16- and 17-token prompts run its recompiled segments, the others
    # eager): a second one only compiled the same segments at another size, in each of the three
    # captures below.
    engine = Engine(overrides=_plan(breaks="[attention,mlp]", buckets="[32]"))
    for layer in engine.runner.model.layers:
        layer.mlp.forward = break_point("mlp")(layer.mlp.forward)
    backend = engine.runner.backends[ForwardMode.EXTEND]
    engine.runner.capture_backend(backend)  # recompile with the new break marked
    assert [engine.generate([p], PARAMS)[0].token_ids for p in _prompts()] == eager_tokens
    assert backend.stats.executions == 3  # the recompiled bucket ran, not only eager fallbacks
    attention_only = Engine(overrides=_plan(buckets="[32]")).runner.backends[ForwardMode.EXTEND]
    assert backend.stats.compiles > attention_only.stats.compiles


def test_padded_tokens_write_only_the_dummy_slot(breakable):
    kv = breakable.kv_cache.token_pool
    breakable.flush_cache()  # cached KV would be poisoned below
    assert kv.num_free == kv.num_slots
    for buf in kv.k_buffers + kv.v_buffers:
        buf[1:] = float("nan")
    prompt = _prompts()[2]  # 17 tokens → bucket 32: 15 padded tokens
    breakable.generate([prompt], SamplingParams(max_new_tokens=1))
    for buf in kv.k_buffers + kv.v_buffers:
        written = ~torch.isnan(buf[1:]).flatten(1).all(dim=1)
        assert int(written.sum()) == len(prompt)
        buf.nan_to_num_(0.0)
    assert_no_leak(breakable)


@pytest.mark.parametrize(
    "override,message",
    [
        ("+capture.extend={backend:breakable,buckets:[]}", "capture.extend.buckets must be a non-empty list"),
        ("+capture.extend={backend:breakable,buckets:[64,16]}", "capture.extend.buckets must be sorted"),
        ("+capture.extend={backend:breakable,buckets:[16],breaks:[]}", "capture.extend.breaks must be a non-empty list"),
        ("+capture.extend={backend:breakable,buckets:[16],turbo:1}", "capture.extend.turbo is not a breakable option"),
    ],
)
def test_config_errors(override, message):
    with pytest.raises(ConfigError) as err:
        Engine(overrides=TINY + ["capture=eager", override])
    assert message in str(err.value)


def test_chunked_and_mixed_batches_through_breakable(eager_tokens):
    """Chunks of a long prompt and MIXED batches (decodes riding along as one-token extends) all
    go through the piecewise backend, and tokens stay equal to eager."""
    engine = Engine(overrides=_plan(buckets="[32]", prefill_tokens="null") + ["scheduler.mixed_chunk=true"])
    assert engine.config.scheduler.max_prefill_tokens == 32  # defaults to the largest bucket
    with recorded_batches(engine) as batches:
        outputs = engine.generate(_prompts(), PARAMS)
    modes = [fb.forward_mode for fb in batches]
    assert [o.token_ids for o in outputs] == eager_tokens
    assert ForwardMode.MIXED in modes
    backend = engine.runner.backends[ForwardMode.EXTEND]
    assert backend.stats.fallbacks == 0 and backend.stats.executions == sum(m.is_extend() for m in modes)
    assert_no_leak(engine)


def test_breakable_leaves_whole_forward_compiles_intact(breakable):
    """Dynamo marks frames left by graph breaks as skipped for the whole process; the breakable
    backend compiles a frame of its own so a later whole-forward compile is still one graph."""
    breakable.generate([_prompts()[0]], SamplingParams(max_new_tokens=2))
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    Engine(
        overrides=TINY
        + [
            "capture=graph_first",
            "capture.decode.buckets=[1]",
            "capture.decode.compile.regional=false",
            "capture.decode.progress=false",
            "capture.extend.backend=eager",
        ]
    )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
