"""tc_piecewise prefill: one Dynamo trace split at the attention op, pieces compiled by inductor."""

import dataclasses

import pytest
import torch
from torch import fx

from capture import Phase
from capture.buckets import bucket_for
from capture.graph_split import split_at_ops, structure_key
from capture.options import TcPiecewiseOptions
from capture.tc_piecewise import TcPiecewiseBackend
from graphexec import ConfigError, Engine, SamplingParams
from graphexec.batch.forward_mode import ForwardMode
from tests.invariants import assert_no_leak

TINY = ["model=tiny-llama", "cache.num_slots=1024"]
# An explicit prefill budget above the largest bucket: by default it is the largest bucket, so
# long prompts would be chunked to fit and no batch would ever fall back to eager.
BUDGET = ["scheduler.max_prefill_tokens=256"]
ATTENTION = "graphexec::attention"


def _pad_all(extra):
    """These tests pad any batch unless they set max_padding themselves (the default is 0.05)."""
    return "" if "max_padding" in extra else ",max_padding:1.0"


def _plan(extra="", buckets="[16,32,64]", budget=BUDGET):
    return TINY + budget + [
        "capture=eager",
        f"+capture.extend={{backend:tc_piecewise,buckets:{buckets},progress:false{_pad_all(extra)}{extra}}}",
        "capture.mixed=${capture.extend}",
    ]


def _batches():
    """Prefill batches (one generate call each) of 15, 16, 17, 31, 32, 33, 63, 64 tokens (below, on,
    above each bucket) and 65, 100 (above the largest: eager fallback); some hold several prompts."""
    gen = torch.Generator().manual_seed(5)
    sizes = [(15,), (16,), (10, 7), (31,), (20, 12), (33,), (40, 23), (64,), (65,), (50, 30, 20)]
    return [[torch.randint(3, 320, (n,), generator=gen).tolist() for n in batch] for batch in sizes]


PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def eager_engine():
    return Engine(overrides=TINY + BUDGET + ["capture=eager"])


@pytest.fixture(scope="module")
def tc_engine():
    return Engine(overrides=_plan())


def _spy(engine):
    """Record every ForwardBatch and its StepOutput; undo with `del engine.runner.forward_and_sample`."""
    calls = []
    real = engine.runner.forward_and_sample

    def spy(fb):
        out = real(fb)
        calls.append((fb, out))
        return out

    engine.runner.forward_and_sample = spy
    return calls


def _generate(engine, batches, params=PARAMS):
    return [[o.token_ids for o in engine.generate(batch, params)] for batch in batches]


# -- the split, on hand-made graphs ------------------------------------------------------------


def _layered_graph(layers=2, attention=torch.ops.graphexec.attention):
    """x -> [mul, empty_like, attention(out), add] per layer: the shape of the model's forward."""
    g = fx.Graph()
    x = g.placeholder("x")
    for layer in range(layers):
        h = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
        out = g.call_function(torch.ops.aten.empty_like.default, (h,))
        g.call_function(attention, (h, h, h, out, layer))
        x = g.call_function(torch.ops.aten.add.Tensor, (x, out))
    g.output((x,))
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("attention", [torch.ops.graphexec.attention, torch.ops.graphexec.attention.default])
def test_split_gives_pieces_between_split_ops(attention):
    """Dynamo records the op as its packet, AOT graphs as the overload: both are split at."""
    split = split_at_ops(_layered_graph(2, attention), {ATTENTION})
    assert [p.is_split_op for p in split.pieces] == [False, True, False, True, False]
    assert split.num_splits == 2 and split.num_pieces == 3
    middle = getattr(split.module, split.pieces[2].name)
    ops = [n.target for n in middle.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.empty_like.default]
    assert len(split_at_ops(_layered_graph(2, attention), {"aten::sin"}).pieces) == 1  # nothing to cut at


def test_split_keeps_a_mutation_visible_to_the_next_piece():
    """copy_ into an empty_like, like attention into `out`: no data edge links the write to the
    reader, only the original order does."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    h = g.call_function(torch.ops.aten.mul.Tensor, (x, 3.0))
    out = g.call_function(torch.ops.aten.empty_like.default, (h,))
    g.call_function(torch.ops.aten.copy_.default, (out, h))
    g.output((g.call_function(torch.ops.aten.add.Tensor, (out, y)),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    split = split_at_ops(gm, {"aten::copy_"})
    assert [p.is_split_op for p in split.pieces] == [False, True, False]
    x_val, y_val = torch.randn(5), torch.randn(5)
    assert torch.equal(split.module(x_val, y_val)[0], x_val * 3 + y_val)
    assert torch.equal(gm(x_val, y_val)[0], x_val * 3 + y_val)  # the original is untouched


def test_split_makes_no_empty_pieces():
    g = fx.Graph()
    x = g.placeholder("x")
    g.call_function(torch.ops.aten.relu_.default, (x,))  # first node: no piece before it
    g.call_function(torch.ops.aten.relu_.default, (x,))  # back to back: none between
    g.output((g.call_function(torch.ops.aten.neg.default, (x,)),))
    split = split_at_ops(fx.GraphModule(torch.nn.Module(), g), {"aten::relu_"})
    assert [p.is_split_op for p in split.pieces] == [True, True, False]
    assert torch.equal(split.module(torch.tensor([-1.0, 2.0]))[0], torch.tensor([0.0, -2.0]))


def test_structure_key_ignores_names_not_ops():
    split = split_at_ops(_layered_graph(3), {ATTENTION})
    first, middle1, middle2, last = (getattr(split.module, p.name) for p in split.pieces if not p.is_split_op)
    names = [[n.name for n in piece.graph.nodes if n.op == "call_function"] for piece in (middle1, middle2)]
    assert names[0] != names[1]  # add/mul_1/empty_like_1 vs add_1/mul_2/empty_like_2
    assert structure_key(middle1) == structure_key(middle2)
    assert len({structure_key(first), structure_key(middle1), structure_key(last)}) == 3



def _split_module_without_tuple_return(m, root_m, split_callback, qualname_map=None, keep_original_order=False,
                                       keep_original_node_name=False):
    """torch 2.11's split_module (the GPU image's): no tuple_return, one-output pieces return bare."""
    from torch.fx.passes.split_module import split_module

    return split_module(m, root_m, split_callback, qualname_map, keep_original_order=keep_original_order,
                        keep_original_node_name=keep_original_node_name)


def test_split_without_tuple_return_runs_the_same(monkeypatch):
    import capture.graph_split as graph_split

    def graph():
        g = fx.Graph()
        x = g.placeholder("x")
        h = g.call_function(torch.ops.aten.mul.Tensor, (x, 3.0))
        s = g.call_function(torch.ops.aten.sin.default, (h,))
        g.output((g.call_function(torch.ops.aten.add.Tensor, (s, h)),))
        return fx.GraphModule(torch.nn.Module(), g)

    x = torch.randn(5)
    tupled = split_at_ops(graph(), {"aten::sin"})
    monkeypatch.setattr(graph_split, "split_module", _split_module_without_tuple_return)
    bare = split_at_ops(graph(), {"aten::sin"})
    first = [getattr(split.module, split.pieces[0].name) for split in (tupled, bare)]
    # The piece before sin has one output: a tuple only with tuple_return.
    assert [isinstance(piece(x), tuple) for piece in first] == [True, False]
    for split in (tupled, bare):
        assert [p.is_split_op for p in split.pieces] == [False, True, False]
        torch.testing.assert_close(split.module(x)[0], torch.sin(x * 3) + x * 3)


@pytest.mark.slow
def test_tc_piecewise_with_inductor_pieces_on_torch_2_11s_split_module(monkeypatch, eager_engine):
    """The GPU image's torch lacks tuple_return: inductor's compiled pieces still return what the
    split module's code expects (compile_fx keeps a bare output bare)."""
    import capture.graph_split as graph_split

    monkeypatch.setattr(graph_split, "split_module", _split_module_without_tuple_return)
    engine = Engine(overrides=_plan(buckets="[32]"))
    batches = _batches()[3:5]  # 31 and 32 tokens: both run the 32-token pieces
    assert _generate(engine, batches) == _generate(eager_engine, batches)
    backend = engine.runner.backends[ForwardMode.EXTEND]
    assert backend.stats.compiles > 0 and backend.stats.executions >= 2

# -- the backend on the tiny model -------------------------------------------------------------


def test_tokens_equal_eager_around_bucket_edges(tc_engine, eager_engine):
    backend = tc_engine.runner.backends[ForwardMode.EXTEND]
    assert backend.name == "tc_piecewise" and tc_engine.runner.backends[ForwardMode.MIXED] is backend
    before = backend.stats.executions, backend.stats.fallbacks, backend.stats.padded_rows
    calls = _spy(tc_engine)
    got = _generate(tc_engine, _batches())
    del tc_engine.runner.forward_and_sample
    assert got == _generate(eager_engine, _batches())

    sizes = [fb.num_tokens for fb, _ in calls if fb.forward_mode.is_extend()]
    assert sizes == [sum(map(len, batch)) for batch in _batches()]
    fitting = [n for n in sizes if n <= 64]
    assert backend.stats.fallbacks - before[1] == len(sizes) - len(fitting) == 2
    assert backend.stats.executions - before[0] == len(fitting)
    assert backend.stats.padded_rows - before[2] == sum(bucket_for(n, backend.buckets) - n for n in fitting)
    assert_no_leak(tc_engine)


def test_pieces_are_splits_plus_one_and_attention_runs_between_them(tc_engine):
    backend = tc_engine.runner.backends[ForwardMode.EXTEND]
    layers = tc_engine.model_config.num_layers
    assert backend.stats.splits == {16: layers, 32: layers, 64: layers}
    assert backend.stats.pieces == {b: layers + 1 for b in (16, 32, 64)}
    # Two layers: first, middle and last piece all differ, so none is shared within a bucket.
    assert backend.stats.compiles == 3 * (layers + 1)

    attn = tc_engine.runner.attn_backend
    seen = []
    real = attn.forward

    def eager_attention(q, k, v, out, layer_id, ctx):
        # Real tensors, real batch: this call is not inside any compiled graph.
        seen.append((layer_id, type(out) is torch.Tensor, out.shape[0]))
        return real(q, k, v, out, layer_id, ctx)

    attn.forward = eager_attention
    try:
        tc_engine.generate([_batches()[0][0]], SamplingParams(max_new_tokens=1))
    finally:
        del attn.forward
    assert seen == [(layer, True, 16) for layer in range(layers)]
    assert_no_leak(tc_engine)


def _poison_real_slots(engine):
    """NaN in every real KV slot (the dummy slot 0 is left), after emptying the prefix cache so
    no cached KV is poisoned and every prompt computes all of its tokens."""
    kv = engine.kv_cache.token_pool
    engine.flush_cache()
    assert kv.num_free == kv.num_slots
    for buf in kv.k_buffers + kv.v_buffers:
        buf[1:] = float("nan")  # every real slot; the dummy slot 0 is not


def _slots_written(kv):
    """Per K/V buffer, how many real slots hold a number; the poison is cleared after."""
    counts = set()
    for buf in kv.k_buffers + kv.v_buffers:
        counts.add(int((~torch.isnan(buf[1:]).flatten(1).all(dim=1)).sum()))
        buf.nan_to_num_(0.0)
    return counts


def test_alone_equals_padded_and_padding_writes_no_real_slot(tc_engine):
    """A prompt alone (bucket 16) and first in a batch padded to 64 gets the same tokens and
    logits, and padded tokens write only the dummy slot, never a real one."""
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (10, 21, 19)]
    new_tokens = 6
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    kv = tc_engine.kv_cache.token_pool
    calls = _spy(tc_engine)
    try:
        _poison_real_slots(tc_engine)
        alone = tc_engine.generate(prompts[:1], params)[0].token_ids
        # Exactly the requests' own KV was written: its prompt plus all but its last token.
        assert _slots_written(kv) == {len(prompts[0]) + new_tokens - 1}
        _poison_real_slots(tc_engine)
        together = tc_engine.generate(prompts, params)
        assert _slots_written(kv) == {sum(len(p) + new_tokens - 1 for p in prompts)}
    finally:
        del tc_engine.runner.forward_and_sample
    prefills = [out for fb, out in calls if fb.forward_mode.is_extend()]
    assert [fb.num_tokens for fb, _ in calls if fb.forward_mode.is_extend()] == [10, 50]  # buckets 16, 64
    # Not bitwise: a GEMM over 16 rows and one over 64 round differently (so do eager's over 10
    # and 50 rows, by ~1e-5); padding must add nothing beyond that.
    torch.testing.assert_close(prefills[0].logits[0], prefills[1].logits[0], rtol=1e-5, atol=1e-4)
    assert together[0].token_ids == alone
    assert all(torch.isfinite(out.logits).all() for _, out in calls)
    assert_no_leak(tc_engine)


def test_eager_compiler_runs_the_same_pieces_uncompiled(eager_engine):
    engine = Engine(overrides=_plan(",compiler:eager", buckets="[32,64]"))
    backend = engine.runner.backends[ForwardMode.EXTEND]
    batches = _batches()[:6]
    assert _generate(engine, batches) == _generate(eager_engine, batches)
    assert backend.stats.compiles == 0 and backend.stats.pieces == {32: 3, 64: 3}
    assert backend.stats.padded_rows > 0


def test_chunked_and_mixed_batches_run_through_the_pieces(eager_engine):
    """Default budget (the largest bucket): long prompts are chunked to fit, and with mixed_chunk
    the running decodes ride along as one-token extends (MIXED); every batch runs in the pieces."""
    engine = Engine(overrides=_plan(budget=["scheduler.mixed_chunk=true"]))
    assert engine.config.scheduler.max_prefill_tokens == 64
    prompts = [p for batch in _batches() for p in batch]
    calls = _spy(engine)
    got = [o.token_ids for o in engine.generate(prompts, PARAMS)]
    assert got == [o.token_ids for o in eager_engine.generate(prompts, PARAMS)]
    modes = [fb.forward_mode for fb, _ in calls]
    backend = engine.runner.backends[ForwardMode.MIXED]
    assert ForwardMode.MIXED in modes and backend is engine.runner.backends[ForwardMode.EXTEND]
    assert backend.stats.fallbacks == 0 and backend.stats.executions == sum(m.is_extend() for m in modes)
    assert_no_leak(engine)


def test_one_graph_even_after_another_backend_broke_the_model_forward(eager_engine):
    """The breakable backend's graph breaks make Dynamo mark the model's forward as skipped for
    the whole process; tc_piecewise must still get the whole forward as one graph."""
    Engine(overrides=TINY + ["capture=eager", "+capture.extend={backend:breakable,buckets:[16],progress:false}"])
    engine = Engine(overrides=_plan(",compiler:eager", buckets="[16]"))
    backend = engine.runner.backends[ForwardMode.EXTEND]
    assert backend.stats.splits == {16: 2} and backend.stats.pieces == {16: 3}
    batches = _batches()[:2]
    assert _generate(engine, batches) == _generate(eager_engine, batches)


def test_a_forward_without_split_ops_is_refused():
    """A registered op the model never calls: no cut, so no piecewise forward to serve."""
    with pytest.raises(RuntimeError, match=r"did not reach the backend as one graph cut at \['aten::sin'\]"):
        Engine(overrides=_plan(",compiler:eager,split_ops:[aten::sin]", buckets="[16]"))


@pytest.mark.parametrize(
    "extra,message",
    [
        (",compiler:warp", "capture.extend.compiler='warp' is unknown"),
        (",compiler:tensorrt", "capture.extend.compiler=tensorrt needs device=cuda"),
        (",split_ops:[]", "capture.extend.split_ops must be a non-empty list"),
        (",split_ops:[nope::op]", "capture.extend.split_ops: 'nope::op' is not a registered op"),
        (",split_ops:attention", "capture.extend.split_ops must be a non-empty list"),
        (",turbo:1", "capture.extend.turbo is not a tc_piecewise option"),
        (",max_padding:1.5", "capture.extend.max_padding must be a fraction in [0, 1], got 1.5"),
    ],
)
def test_config_errors_name_the_option(extra, message):
    if torch.cuda.is_available() and "tensorrt" in extra:
        pytest.skip("tensorrt may be valid on this machine")
    with pytest.raises(ConfigError) as err:
        Engine(overrides=_plan(extra))
    assert message in str(err.value)


def test_a_batch_that_would_be_mostly_padding_runs_eager(eager_engine):
    """max_padding=0.25: 17 or 23 tokens in bucket 32 are 47 % or 28 % padding (eager); 24 is 25 % (graph)."""
    options = TcPiecewiseOptions(buckets=(16, 32), lazy=True, max_padding=0.25)
    backend = TcPiecewiseBackend(eager_engine.runner.eager.env, options)
    eager_engine.runner.capture_backend(backend)  # lazy: builds the pieced forward, compiles nothing yet

    def batch(tokens):
        return dataclasses.make_dataclass("Batch", ["phase", "num_tokens"])(Phase.TOKENS, tokens)

    assert [backend.can_run(batch(n)) for n in (12, 16, 17, 23, 24, 32, 33)] == [True, True, False, False, True, True, False]
    # One default, in capture/options.py, the same as configs/capture/graph_first.yaml.
    assert TcPiecewiseBackend(eager_engine.runner.eager.env, {"buckets": [16]}).options.max_padding == 0.05


# -- the real model ------------------------------------------------------------------------------


# ~25 s with a warm inductor cache, ~70 s cold (plus the shared eager SmolLM2 fixture).
@pytest.mark.slow
def test_smollm2_tc_piecewise_equals_eager(smollm2_engine):
    """SmolLM2-135M, 30 layers: 31 pieces per bucket, but only 3 distinct ones are compiled."""
    engine = Engine(
        overrides=[
            "model=smollm2-135m",
            "cache.num_slots=4096",
            "capture=eager",
            "+capture.extend={backend:tc_piecewise,buckets:[128],progress:false,max_padding:1.0}",
            "capture.mixed=${capture.extend}",
        ]
    )
    backend = engine.runner.backends[ForwardMode.EXTEND]
    tok = engine.tokenizer
    texts = ["Hi!", "Name a color.", "What is 2+2?"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    batches = [prompts, prompts[:1]]  # ~100 tokens and ~30, both in bucket 128 (the tiny tests cover several)
    assert _generate(engine, batches, params) == _generate(smollm2_engine, batches, params)
    assert backend.stats.pieces == {128: 31} and backend.stats.splits == {128: 30}
    assert backend.stats.compiles == 3
    assert backend.stats.executions == 2 and backend.stats.fallbacks == 0
    assert_no_leak(engine)


def test_graph_first_picks_the_measured_cpu_variant():
    """`piecewise` with variant auto resolves to tc_piecewise on CPU (bench/prefill.py measured it
    no slower than eager at every bucket; breakable was 0.92× at 64 tokens)."""
    engine = Engine(
        overrides=[
            "model=tiny-llama", "cache.num_slots=1024", "capture=graph_first", "capture.decode.buckets=[1]",
            "capture.extend.buckets=[64]", "capture.decode.progress=false", "capture.extend.progress=false",
        ]
    )
    runner = engine.runner
    assert runner.backends[ForwardMode.EXTEND].name == "tc_piecewise"
    assert runner.backends[ForwardMode.MIXED] is runner.backends[ForwardMode.EXTEND]
    assert engine.config.scheduler.max_prefill_tokens == 64
