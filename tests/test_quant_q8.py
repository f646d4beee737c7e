"""8-bit activations (`model.activations=q8`): the activation quantization against its plain-torch
definition (codes exact, ties to even), graphexec::qlinear_q8 against a float64 computation of the
same quantized product, the op under torch.compile, and an engine on a tiny quantized GGUF against
transformers whose every linear quantizes its input the same way (fake quantization)."""

import pytest
import torch

from graphexec import Engine, SamplingParams
from graphexec.errors import ConfigError
from graphexec.loader import load_gguf
from graphexec.quant import QuantEmbedding, QuantLinear, ensure_kernels
from graphexec.quant.ops import (
    QBLOCK,
    fake_quantize_q8,
    qlinear_q8_reference,
    qlinear_q8_rows16_reference,
    rows16_codes,
    rows16_to_row_major,
    quantize_q8_reference,
)
from graphexec.quant.repack import block_rows16, repack_rows16
from tests.invariants import assert_no_leak
from tests.reference import hf_greedy, hf_model_from
from tests.test_kquants import TYPES as BLOCK_TYPES, _weight as _block_weight
from tests.test_quant import TYPES, _engine, _packed, _prompts, tiny_quantized_gguf  # noqa: F401 (fixture)

# at::parallel_for's split between threads is part of what these test (tests/conftest.py)
pytestmark = pytest.mark.two_threads


@pytest.fixture(scope="module", autouse=True)
def kernels():
    ensure_kernels()


def _q8(x, weight):
    packed = repack_rows16(weight)
    return torch.ops.graphexec.qlinear_q8(x, packed.codes, packed.scales, packed.mins, packed.rows)


@pytest.mark.parametrize("qtype", TYPES)
def test_rows16_repacking_is_a_lossless_shuffle(qtype):
    weight, _ = _packed(qtype, 37, 96)  # 37 rows: the third group holds 5 real rows and 11 of padding
    packed = repack_rows16(weight)
    assert packed.codes.shape[:2] == (3, 3) and packed.scales.shape == (3, 3, 16)
    back = packed.row_major()
    assert all(torch.equal(a, b) for a, b in zip(back.tensors(), weight.tensors()))
    assert not packed.codes[2, :, :, 5:].any() and not packed.scales[2, :, 5:].any()
    # Row 16g+r's block b, bytes 4j..4j+3, sit in lane r of group g.
    row, block, j = 21, 2, 1
    per_block = weight.codes.shape[1] // 3
    assert torch.equal(packed.codes[1, block, j, 5], weight.codes[row, block * per_block + 4 * j : block * per_block + 4 * j + 4])


def test_embedding_rows_come_back_from_the_interleaved_layout():
    weight, dense = _packed("Q8_0", 40, 64)
    ids = torch.tensor([[0, 17, 39], [16, 15, 33]])
    for activations in ("float", "q8"):
        embedding = QuantEmbedding(weight, torch.float32, activations)
        assert torch.equal(embedding(ids), dense[ids]), activations


def test_quantization_equals_its_definition_ties_and_zero_blocks_included():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5 * QBLOCK, generator=gen) * 3
    x[2, QBLOCK : 2 * QBLOCK] = 0.0  # an all-zero block: d = 0, codes 0
    # max |x| = 127 makes the scale exactly 1: x.5 values are ties, which round to even.
    x[4, :QBLOCK] = torch.tensor([127.0, 0.5, 1.5, -2.5, 3.5] + [0.0] * (QBLOCK - 5))
    q, d, s = torch.ops.graphexec.quantize_q8(x)
    expected = quantize_q8_reference(x)
    assert torch.equal(q, expected[0]) and torch.equal(d, expected[1])
    torch.testing.assert_close(s, expected[2], rtol=1e-6, atol=1e-6)
    assert q[4, :5].tolist() == [127, 0, 2, -2, 4]
    assert d[2, 1] == 0 and not q[2, QBLOCK : 2 * QBLOCK].any()
    # Dequantized, every element is within half a step of the input.
    steps = d.repeat_interleave(QBLOCK, dim=1)
    assert ((q.float() * steps - x).abs() <= steps / 2 + 1e-6).all()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("k", [96, 544, 1536])  # 3 (odd: a lone last block), 17 and 48 blocks
@pytest.mark.parametrize("rows", [1, 2, 5, 64])
def test_qlinear_q8_equals_the_quantized_product(qtype, k, rows):
    weight, dense = _packed(qtype, 37, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k + rows))
    out = _q8(x, weight)
    expected = qlinear_q8_reference(x, weight.codes, weight.scales, weight.mins)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    packed = repack_rows16(weight)  # what a device without the C++ kernel runs, from the op's arguments
    assert torch.equal(qlinear_q8_rows16_reference(x, packed.codes, packed.scales, packed.mins, packed.rows), expected)
    # And it is a good approximation of the exact float product.
    exact = x @ dense.T
    assert (out - exact).norm() / exact.norm() < 0.02


def test_qlinear_q8_takes_half_precision_and_any_leading_shape():
    weight, _ = _packed("Q4_1", 40, 96)
    x = torch.randn(2, 3, 96)
    expected = qlinear_q8_reference(x, weight.codes, weight.scales, weight.mins)
    out = _q8(x, weight)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    half = _q8(x.bfloat16(), weight)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), qlinear_q8_reference(x.bfloat16().float(), weight.codes, weight.scales, weight.mins), rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="qlinear_q8: input has 64 features, the weight takes 96"):
        _q8(torch.randn(1, 64), weight)
    with pytest.raises(RuntimeError, match="qlinear_q8: codes must be contiguous \\[groups, blocks, J, 16, 4\\]"):
        torch.ops.graphexec.qlinear_q8(x, weight.codes, weight.scales, weight.mins, 40)
    assert _q8(torch.randn(0, 96), weight).shape == (0, 40)


def test_compile_sees_one_opaque_q8_node():
    weight, _ = _packed("Q4_0", 48, 64)
    layer = QuantLinear(weight, activations="q8")
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(4, 64)
    compiled = torch.compile(lambda v: layer(v) * 2, backend=recording_backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), qlinear_q8_reference(x, weight.codes, weight.scales, weight.mins) * 2, rtol=1e-5, atol=1e-5)
    (graph,) = graphs
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count("graphexec.qlinear_q8") == 1 and "graphexec.qlinear" not in targets, targets


def _fake_quantized_hf(path):
    """transformers on the dequantized weights, every linear (the tied LM head too) fed its input
    quantized per 32-element block and dequantized again: the q8 engine's arithmetic in fp32."""
    reference = load_gguf(path, name="tiny-q", weights="dequantize")
    hf = hf_model_from(reference.config, reference.state_dict)

    def quantize_input(module, args):
        return (fake_quantize_q8(args[0]),)

    for module in hf.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(quantize_input)
    return hf


def test_q8_engine_equals_fake_quantized_transformers(tiny_quantized_gguf):
    engine = _engine(tiny_quantized_gguf, "capture=eager", "model.activations=q8")
    model = engine.runner.model
    quantized = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert quantized and all(m.activations == "q8" for m in quantized)
    hf = _fake_quantized_hf(tiny_quantized_gguf)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(_prompts(), engine.generate(_prompts(), params)):
        assert out.token_ids == hf_greedy(hf, prompt, 12)[0]
    assert_no_leak(engine)
    engine.shutdown()


def test_q8_graphs_equal_q8_eager(tiny_quantized_gguf, tmp_path):
    params = [SamplingParams(max_new_tokens=8 + i, temperature=0.0, ignore_eos=True) for i in range(5)]
    # The default plan's AOT-compiled decode layers, every bucket kept, captured before serving
    # (graph_first's Dynamo path over the same ops: test_kquants.py and test_quant.py).
    auto = ["capture=auto", "capture.background=false", "capture.decode.buckets=[1,2,4]", "capture.decode.keep=all",
            f"capture.cache_dir={tmp_path / 'plans'}"]
    runs = {}
    for name, extra in {"eager": ["capture=eager"], "auto": auto}.items():
        engine = _engine(tiny_quantized_gguf, *extra, "model.activations=q8")
        runs[name] = [o.token_ids for o in engine.generate(_prompts(), params)]
        engine.shutdown()
    assert runs["auto"] == runs["eager"]


def test_q8_is_refused_where_no_weight_is_block_quantized():
    with pytest.raises(ConfigError, match=r"model\.activations=q8 applies to block-quantized weights.*model\.source=random"):
        Engine(overrides=["model=tiny-llama", "capture=eager", "model.activations=q8"])
    with pytest.raises(ConfigError, match=r"model\.activations must be one of \['float', 'q8'\], got 'int4'"):
        Engine(overrides=["model=tiny-llama", "capture=eager", "model.activations=int4"])


def test_q8_reaches_every_block_quantized_weight_of_a_mixed_file(tmp_path):
    """A fused linear of a Q4_0 part and a Q4_K part, a Q5_1 gate/up and a Q6_K down projection
    under q8: every part reads 8-bit activations (the fused one as two ops, PartsLinear), and the
    engine equals transformers whose every projection quantizes its input the same way."""
    from graphexec.quant import PartsLinear
    from tests.test_kquants import _write

    from gguf import GGMLQuantizationType as Q
    path = _write(tmp_path / "mix.gguf", {"attn_q.weight": Q.Q4_0, "attn_k.weight": Q.Q4_0, "attn_v.weight": Q.Q4_K,
                                          "ffn_gate.weight": Q.Q5_1, "ffn_up.weight": Q.Q5_1, "ffn_down.weight": Q.Q6_K})
    engine = Engine(overrides=["model.source=gguf", f"model.path={path}", "model.name=mix", "cache.num_slots=1024",
                               "capture=eager", "model.activations=q8"])
    layer = engine.runner.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, PartsLinear) and [p.qtype for p in qkv.parts] == ["Q4_0", "Q4_K"]
    projections = [*qkv.parts, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(isinstance(p, QuantLinear) and p.activations == "q8" for p in projections)

    reference = load_gguf(path, name="mix", weights="dequantize")
    hf = hf_model_from(reference.config, reference.state_dict)
    for hf_layer in hf.model.layers:
        attention, mlp = hf_layer.self_attn, hf_layer.mlp
        for proj in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            proj.register_forward_pre_hook(lambda module, args: (fake_quantize_q8(args[0]),))
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(_prompts()[:3], engine.generate(_prompts()[:3], params)):
        assert out.token_ids == hf_greedy(hf, prompt, 10)[0]
    engine.shutdown()


def test_layer_structure_tells_the_activation_paths_apart():
    """What keeps one compiled layer from serving a differently built one (capture/aot_region.py)."""
    from capture.aot_region import layer_structure

    weight, _ = _packed("Q4_1", 48, 64)
    same = [layer_structure(torch.nn.Sequential(QuantLinear(weight, activations=a))) for a in ("float", "float", "q8")]
    assert same[0] == same[1] and same[0] != same[2]


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_block_weights_run_the_integer_path_with_the_files_values(qtype, rows):
    """K-quants and Q5_x in qlinear_q8's layout (repack.block_rows16): exactly gguf's values
    (Q4_K repacked two codes a byte, 5- and 6-bit codes as nibbles plus bit planes, Q6_K's scales
    per half block), and qlinear_q8 over them equals the quantized activations times those
    values."""
    k = 512
    weight, dense = _block_weight(qtype, 37, k, seed=rows)  # 37 rows: a group of padding
    packed = block_rows16(weight)
    kind = {"Q4_K": (torch.uint8, 4), "Q6_K": (torch.uint8, 6)}.get(qtype, (torch.uint8, 5))
    assert (packed.codes.dtype, packed.codes.shape[2]) == kind
    halves = (2,) if qtype == "Q6_K" else ()
    assert packed.scales.shape == (3, k // QBLOCK, *halves, 16)
    assert packed.scales.dtype == (torch.float16 if qtype in ("Q5_0", "Q5_1") else torch.float32)
    q = rows16_codes(packed.codes, 37)
    _, scales, mins = rows16_to_row_major(packed.codes, packed.scales, packed.mins, 37)
    values = q.float().view(37, scales.shape[1], -1) * scales.float().unsqueeze(-1)
    if mins is not None:
        values = values + mins.float().unsqueeze(-1)
    assert torch.equal(values.reshape(37, k), dense)
    # The high bits of row 21, block 3, element 16 + 4 * 2 + 1: mask 2 * 2 + 1, lane 5, bit 4 * 5 + 1
    # (Q6_K's code is q + 32; its sixth bit sits in the second plane.)
    code = int(q[21, 3 * QBLOCK + 25]) + (32 if qtype == "Q6_K" else 0)
    for plane in range(kind[1] - 4):
        mask = int.from_bytes(packed.codes[1, 3, 4 + plane].flatten()[8 * 5 : 8 * 6].numpy().tobytes(), "little")
        assert (mask >> 21) & 1 == (code >> (4 + plane)) & 1
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    expected = (fake_quantize_q8(x, torch.float64) @ dense.double().T).float()
    out = torch.ops.graphexec.qlinear_q8(x, packed.codes, packed.scales, packed.mins, packed.rows)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # What a device without the C++ kernel runs, from the op's own arguments.
    other = qlinear_q8_rows16_reference(x, packed.codes, packed.scales, packed.mins, packed.rows)
    torch.testing.assert_close(other, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def test_q8_refuses_half_precision_scales_per_half_block():
    weight, _ = _block_weight("Q6_K", 16, 256)
    packed = block_rows16(weight)
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match=r"scales must be \[1, 8, 16\] \(or float32 \[1, 8, 2, 16\]"):
        torch.ops.graphexec.qlinear_q8(x, packed.codes, packed.scales.half(), None, 16)
