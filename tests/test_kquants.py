"""GGUF K-quant (Q4_K, Q5_K, Q6_K) and 5-bit (Q5_0, Q5_1) weights kept in their blocks: the
kernel's and the plain-torch reference's dequantization against the gguf package's, bit for bit;
graphexec::qlinear_blocks against a dense fp32 matmul; the op under torch.compile; fused linears
whose parts differ in type; and engines on a tiny K-quant GGUF against transformers, against
model.weights=dequantize, under a graph plan and at tp_size=2."""

import gguf
import numpy as np
import pytest
import torch

from graphexec import Engine, SamplingParams
from graphexec.errors import ConfigError
from graphexec.loader import load_gguf
from graphexec.quant import (
    BlockEmbedding,
    BlockLinear,
    BlockWeight,
    PartsLinear,
    RowParts,
    ensure_kernels,
    fuse_rows,
    packed_linear,
)
from graphexec.quant.kquants import BLOCK_FORMATS, dequantize_blocks_reference
from tests.invariants import assert_no_leak
from tests.reference import hf_greedy, hf_model_from
from tests.test_loader import save_tiny, write_tiny_gguf

# at::parallel_for's split between threads is part of what these test (tests/conftest.py)
pytestmark = pytest.mark.two_threads

Q = gguf.GGMLQuantizationType
TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"]
# Byte offsets of each type's fp16 fields (d, and dmin or m): the rest of a block is any bytes.
_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2)}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    ensure_kernels()


def _random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid GGUF blocks for an [n, k] weight: random bytes, with small finite fp16 scales of
    either sign (so values stay O(1) and every code, scale and min bit pattern occurs)."""
    fmt = BLOCK_FORMATS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n * k // fmt.elements, fmt.nbytes), dtype=np.uint8)
    for at in _HALVES[qtype]:
        half = (rng.uniform(1e-4, 2e-3, blocks.shape[0]) * rng.choice([-1, 1], blocks.shape[0])).astype(np.float16)
        blocks[:, at : at + 2] = half.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def _weight(qtype: str, n: int, k: int, seed: int = 0):
    """(BlockWeight, gguf's own fp32 dequantization of the same bytes)."""
    raw = _random_blocks(qtype, n, k, seed)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, Q[qtype]).reshape(n, k).astype(np.float32))
    return BlockWeight.from_gguf(raw, qtype, (n, k)), expected


def _k(qtype: str, blocks: int) -> int:
    return BLOCK_FORMATS[qtype].elements * blocks


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n, blocks", [(1, 1), (7, 3), (33, 2)])
def test_dequantization_equals_gguf_bit_for_bit(qtype, n, blocks):
    k = _k(qtype, blocks)
    weight, expected = _weight(qtype, n, k, seed=n * blocks)
    assert weight.shape == (n, k) and weight.nbytes() == n * blocks * BLOCK_FORMATS[qtype].nbytes
    type_id = weight.format.type_id
    kernel = torch.ops.graphexec.qdequantize_blocks(weight.blocks, type_id, torch.float32)
    reference = dequantize_blocks_reference(weight.blocks, type_id)
    # Bit patterns, not values: -0.0 and +0.0 must come out as gguf has them.
    for got in (kernel, reference):
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(torch.ops.graphexec.qdequantize_blocks(weight.blocks, type_id, torch.bfloat16), expected.bfloat16())


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 64])  # 24 and up: the dequantized-tile GEMM path
def test_qlinear_blocks_equals_dense_fp32_matmul(qtype, rows):
    k = _k(qtype, 2 if qtype.endswith("K") else 5)
    weight, dense = _weight(qtype, 37, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = torch.ops.graphexec.qlinear_blocks(x, weight.blocks, weight.format.type_id)
    # The same weight values, so only the summation order differs (weights up to ~2, 512 terms:
    # fp32 reordering moves a sum of magnitude ~10 by a few 1e-6).
    torch.testing.assert_close(got, x @ dense.T, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_1"])
@pytest.mark.parametrize("rows", [1, 7, 48])
def test_qlinear_blocks_bf16_activations(qtype, rows):
    weight, dense = _weight(qtype, 20, 512, seed=rows)
    x = torch.randn(2, rows, 512).bfloat16()  # leading dims are kept
    got = torch.ops.graphexec.qlinear_blocks(x, weight.blocks, weight.format.type_id)
    assert got.dtype == torch.bfloat16 and got.shape == (2, rows, 20)
    torch.testing.assert_close(got.float(), x.float() @ dense.T, rtol=1e-2, atol=1e-2)


def test_qlinear_blocks_rejects_what_it_cannot_take():
    weight, _ = _weight("Q4_K", 4, 512)
    op, type_id = torch.ops.graphexec.qlinear_blocks, weight.format.type_id
    with pytest.raises(RuntimeError, match="input has 256 features, the weight takes 512"):
        op(torch.randn(2, 256), weight.blocks, type_id)
    with pytest.raises(RuntimeError, match="is not whole 144-byte blocks"):
        op(torch.randn(2, 512), weight.blocks[:, :200].contiguous(), type_id)
    with pytest.raises(RuntimeError, match="type id 2 is not one this kernel reads"):
        op(torch.randn(2, 512), weight.blocks, 2)
    with pytest.raises(RuntimeError, match="activations must be"):
        op(torch.randn(2, 512).double(), weight.blocks, type_id)
    assert op(torch.randn(0, 512), weight.blocks, type_id).shape == (0, 4)


def test_any_device_reference_equals_the_kernel():
    weight, _ = _weight("Q5_K", 9, 512)
    x = torch.randn(3, 512)
    reference = torch.nn.functional.linear(x, dequantize_blocks_reference(weight.blocks, weight.format.type_id))
    torch.testing.assert_close(torch.ops.graphexec.qlinear_blocks(x, weight.blocks, weight.format.type_id), reference, rtol=1e-5, atol=1e-5)


def test_compile_sees_one_opaque_node():
    weight, dense = _weight("Q6_K", 24, 256)
    layer = BlockLinear(weight)
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def forward(x):
        return torch.nn.functional.silu(layer(x)) * 2

    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    compiled = torch.compile(forward, backend=recording_backend, fullgraph=True)
    # Only the summation order differs from the dense matmul (the bound of the test above; an
    # unseeded x once landed 1.1e-5 off at atol 1e-5).
    torch.testing.assert_close(compiled(x), torch.nn.functional.silu(x @ dense.T) * 2, rtol=1e-5, atol=5e-5)
    (graph,) = graphs
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count("graphexec.qlinear_blocks") == 1, targets  # the op itself, nothing of its insides
    inductor = torch.compile(forward, fullgraph=True)
    torch.testing.assert_close(inductor(x), compiled(x), rtol=1e-5, atol=1e-5)


def test_fused_parts_of_different_types_equal_separate_linears():
    """q, k in Q4_K and v in Q6_K (as Q4_K_M files have): q and k share one weight, v stays its own."""
    q, _ = _weight("Q4_K", 16, 256, seed=1)
    k, _ = _weight("Q4_K", 8, 256, seed=2)
    v, _ = _weight("Q6_K", 8, 256, seed=3)
    fused = fuse_rows([q, k, v], "qkv")
    assert isinstance(fused, RowParts) and [p.qtype for p in fused.parts] == ["Q4_K", "Q6_K"]
    assert fused.shape == (32, 256) and fused.parts[0].shape == (24, 256)
    bias = torch.randn(32)
    module = packed_linear(fused, bias, torch.float32)
    assert isinstance(module, PartsLinear)
    x = torch.randn(5, 256)
    separate = torch.cat([BlockLinear(w)(x) for w in (q, k, v)], dim=-1) + bias
    assert torch.equal(module(x), separate)
    torch.testing.assert_close(module(x), x @ fused.dequantize().T + bias, rtol=1e-5, atol=1e-5)
    same = fuse_rows([q, k], "qk")  # one type: one weight, rows concatenated
    assert isinstance(same, BlockWeight) and torch.equal(same.dequantize(), torch.cat([q.dequantize(), k.dequantize()]))


# --- a tiny K-quant GGUF, end to end ----------------------------------------------------------

# Hidden 256 and intermediate 512: whole 256-element super-blocks along every K.
TINY_K = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
# As llama-quantize's Q4_K_M mixes them: attn_v and ffn_down wider in some layers, token_embd Q6_K.
# Layer 0 fuses q/k (Q4_K) with v (Q6_K), and gate (Q4_K) with up (Q5_K); layer 1 fuses one type.
# attn_output stays in 32-element blocks so tp_size=2 may cut its 256 columns in two.
KQ_TYPES = {
    "token_embd.weight": Q.Q6_K,  # tied: also the LM head, read in its blocks
    "blk.0.attn_q.weight": Q.Q4_K,
    "blk.0.attn_k.weight": Q.Q4_K,
    "blk.0.attn_v.weight": Q.Q6_K,
    "blk.1.attn_q.weight": Q.Q5_K,
    "blk.1.attn_k.weight": Q.Q5_K,
    "blk.1.attn_v.weight": Q.Q5_K,
    "attn_output.weight": Q.Q5_1,
    "blk.0.ffn_gate.weight": Q.Q4_K,
    "blk.0.ffn_up.weight": Q.Q5_K,
    "blk.1.ffn_gate.weight": Q.Q5_0,
    "blk.1.ffn_up.weight": Q.Q5_0,
    "ffn_down.weight": Q.Q6_K,
}


def quantize_k(values: np.ndarray, qtype) -> np.ndarray:
    """A plain K-quant quantizer (the gguf package has none): per-sub-block min/max scales,
    rounded to the 6- or 8-bit sub-block scales, then codes.  Other types: gguf's own."""
    name = Q(qtype).name
    if name not in ("Q4_K", "Q5_K", "Q6_K"):
        return gguf.quants.quantize(values, qtype)
    n = values.shape[0]
    x = values.reshape(-1, 256).astype(np.float32)
    nb = x.shape[0]

    def fp16(a):
        return a.astype(np.float16)

    def ratio(a, b):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(b > 0, a / np.where(b > 0, b, 1), 0)

    if name == "Q6_K":
        sub = x.reshape(nb, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = fp16(scale.max(-1) / 127)
        sc = np.rint(ratio(scale, d.astype(np.float32)[:, None])).clip(-128, 127).astype(np.int8)
        ds = d.astype(np.float32)[:, None] * sc
        q = (np.rint(ratio(sub, ds[..., None])).clip(-32, 31) + 32).astype(np.uint8).reshape(nb, 2, 128)
        ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)
        hi = (q >> 4).reshape(nb, 2, 4, 32)
        qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
        parts = [ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), d.view(np.uint8).reshape(nb, 2)]
        return np.concatenate(parts, axis=-1).reshape(n, -1)
    nmax = 15 if name == "Q4_K" else 31
    sub = x.reshape(nb, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
    scale, mn = (hi - lo) / nmax, -lo
    d, dmin = fp16(scale.max(-1) / 63), fp16(mn.max(-1) / 63)
    sc = np.rint(ratio(scale, d.astype(np.float32)[:, None])).clip(0, 63).astype(np.uint8)
    m = np.rint(ratio(mn, dmin.astype(np.float32)[:, None])).clip(0, 63).astype(np.uint8)
    ds, dm = d.astype(np.float32)[:, None] * sc, dmin.astype(np.float32)[:, None] * m
    q = np.rint(ratio(sub + dm[..., None], ds[..., None])).clip(0, nmax).astype(np.uint8)
    packed = np.concatenate(
        [sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6), (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)],
        axis=-1,
    )
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(nb, 128)
    parts = [d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2), packed]
    if name == "Q5_K":
        parts.append(sum(((q[:, j] >> 4) & 1) << j for j in range(8)).astype(np.uint8))
    return np.concatenate([*parts, qs], axis=-1).reshape(n, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_the_test_quantizer_writes_blocks_gguf_reads_back_close(qtype):
    values = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.05
    back = gguf.quants.dequantize(quantize_k(values, qtype), qtype).reshape(8, 512)
    assert np.abs(back - values).max() < 0.25 * np.abs(values).max()


def _write(path, types):
    model = save_tiny("llama", path.parent / f"{path.stem}-hf", tie_word_embeddings=True, **TINY_K)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    write_tiny_gguf(path, "llama", state, types=types, config=TINY_K, quantize=quantize_k)
    return path


@pytest.fixture(scope="module")
def tiny_k_gguf(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("tiny-k") / "tiny-k.gguf", KQ_TYPES)


def _engine(path, *extra):
    return Engine(overrides=["model.source=gguf", f"model.path={path}", "model.name=tiny-k", "cache.num_slots=2048", *extra])


def _prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 297, (n,), generator=gen).tolist() for n in (1, 6, 19, 33, 4)]


def test_native_k_gguf_keeps_blocks_and_matches_transformers(tiny_k_gguf):
    native = _engine(tiny_k_gguf, "capture=eager")
    model = native.runner.model
    assert isinstance(model.embed_tokens, BlockEmbedding) and model.embed_tokens.qtype == "Q6_K"
    layer0, layer1 = model.layers
    assert isinstance(layer0.self_attn.qkv_proj, PartsLinear) and layer0.self_attn.qkv_proj.qtype == "Q4_K+Q6_K"
    assert isinstance(layer0.mlp.gate_up_proj, PartsLinear) and layer0.mlp.gate_up_proj.qtype == "Q4_K+Q5_K"
    assert isinstance(layer1.self_attn.qkv_proj, BlockLinear) and layer1.self_attn.qkv_proj.qtype == "Q5_K"
    assert isinstance(layer1.mlp.gate_up_proj, BlockLinear) and layer1.mlp.gate_up_proj.qtype == "Q5_0"
    assert layer0.self_attn.o_proj.qtype == "Q5_1" and layer0.mlp.down_proj.qtype == "Q6_K"
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model.parameters())

    reference = load_gguf(tiny_k_gguf, name="tiny-k", weights="dequantize")
    hf = hf_model_from(reference.config, reference.state_dict)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(_prompts(), native.generate(_prompts(), params)):
        assert out.token_ids == hf_greedy(hf, prompt, 12)[0]
    assert_no_leak(native)


def test_native_k_graph_first_equals_eager_and_dequantize(tiny_k_gguf):
    params = [SamplingParams(max_new_tokens=8 + i, temperature=0.0, ignore_eos=True) for i in range(5)]
    small_plan = ["capture.decode.buckets=[1,2,4,8]", "capture.extend.buckets=[32,64]", "capture.extend.max_padding=1.0"]
    runs = {
        name: [o.token_ids for o in _engine(tiny_k_gguf, *extra).generate(_prompts(), params)]
        for name, extra in {
            "eager": ["capture=eager"],
            "graph_first": small_plan,
            "dequantize": ["capture=eager", "model.weights=dequantize"],
        }.items()
    }
    assert runs["graph_first"] == runs["eager"] == runs["dequantize"]


def test_tp2_on_k_quants_equals_tp1(tiny_k_gguf, tmp_path):
    from tests.test_tp_model import _check_sharded

    overrides = ["model.source=gguf", f"model.path={tiny_k_gguf}", "model.name=tiny-k", "cache.num_slots=512", "capture=eager"]
    _check_sharded(2, overrides, overrides, tmp_path)


def test_tp_cut_inside_a_super_block_names_the_way_out(tmp_path):
    """attn_output in Q4_K: tp_size=2 cuts its 256 input columns at 128, inside a super-block."""
    path = _write(tmp_path / "cut.gguf", {**KQ_TYPES, "attn_output.weight": Q.Q4_K})
    for rank, span in [(0, r"\[0, 128\)"), (1, r"\[128, 256\)")]:
        with pytest.raises(ConfigError, match=rf"o_proj.*{span}.*256-element Q4_K block.*model\.weights=dequantize"):
            load_gguf(path, "cut", weights="native", tp_size=2, tp_rank=rank)


def test_every_packed_module_equals_its_dequantized_twin(tiny_k_gguf):
    """Module by module, the native model against the model.weights=dequantize one: the rows of
    each fused part (un-permuted q/k, mixed-type parts in order) must be the very rows."""
    from graphexec.models.llama import LlamaForCausalLM

    models = {}
    for mode in ("native", "dequantize"):
        checkpoint = load_gguf(tiny_k_gguf, name="tiny-k", weights=mode)
        models[mode] = LlamaForCausalLM(checkpoint.config)
        models[mode].load_weights(checkpoint.state_dict, torch.float32)
    dense = dict(models["dequantize"].named_modules())
    ids = torch.tensor([[0, 5, 299], [17, 17, 2]])
    assert torch.equal(models["native"].embed_tokens(ids), dense["embed_tokens"](ids))
    x = torch.randn(3, 256)
    torch.testing.assert_close(models["native"].compute_logits(x), models["dequantize"].compute_logits(x), rtol=1e-5, atol=1e-5)
    checked = 0
    for name, module in models["native"].named_modules():
        if isinstance(module, (BlockLinear, PartsLinear)) and "." in name and not name.split(".")[-1].isdigit():
            inputs = torch.randn(5, module.in_features)
            torch.testing.assert_close(module(inputs), dense[name](inputs), rtol=1e-5, atol=5e-5, msg=name)
            checked += 1
    assert checked == 2 * 4


def test_regional_plan_compiles_one_layer_per_layer_structure(tiny_k_gguf, tmp_path):
    """Layer 0 and layer 1 of this file are built differently (PartsLinear vs BlockLinear): the
    regional plan's ahead-of-time layer (module guards filtered out) must not hand one layer's graph
    to the other (it raised KeyError 'blocks' on a real Q4_K_M file): one compiled layer per
    structure, each its own artifact, tokens equal eager's, and a second engine loads them all."""
    # One bucket (2: the two requests, then the longer one alone padded to 2): each compile is
    # per structure and bucket, so a second bucket only repeated the same check at twice the cost.
    params = [SamplingParams(max_new_tokens=6 + i, temperature=0.0, ignore_eos=True) for i in range(2)]
    auto = ["capture=auto", "capture.background=false", "capture.decode.buckets=[2]", "capture.decode.keep=all",
            "capture.decode.compile.regional=true", "capture.decode.compile.whole_forward_buckets=[]",
            f"capture.cache_dir={tmp_path / 'plans'}"]
    eager = [o.token_ids for o in _engine(tiny_k_gguf, "capture=eager").generate(_prompts()[:2], params)]
    for expected_origin in ("compiled", "artifact"):
        engine = _engine(tiny_k_gguf, *auto)
        assert [o.token_ids for o in engine.generate(_prompts()[:2], params)] == eager
        stats = engine.runner.backend_stats()["decode"]
        assert {b["origin"] for b in stats["buckets"].values()} == {expected_origin}, stats["buckets"]
        if expected_origin == "compiled":
            assert stats["aot_compiles"] == 2 and stats["artifacts_saved"] == 2  # 2 structures x 1 bucket
        else:
            assert stats["artifacts_loaded"] == 2 and stats["aot_compiles"] == 0
        engine.shutdown()
