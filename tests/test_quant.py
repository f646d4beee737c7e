"""Native quantized weights: packing against the gguf package's own dequantization, the
graphexec::qlinear kernel against a dense fp32 matmul, the op under torch.compile, and engines
loading a quantized GGUF (native vs dequantize, and against transformers)."""

import gguf
import numpy as np
import pytest
import torch

from graphexec import Engine, SamplingParams
from graphexec.errors import CheckpointError
from graphexec.loader import load_gguf
from graphexec.quant import PartsLinear, QuantEmbedding, QuantLinear, dequantize_reference, ensure_kernels, from_gguf_blocks
from tests.invariants import assert_no_leak
from tests.reference import hf_greedy, hf_model_from
from tests.test_loader import TINY, save_tiny, write_tiny_gguf

# at::parallel_for's split between threads is part of what these test (tests/conftest.py)
pytestmark = pytest.mark.two_threads

Q = gguf.GGMLQuantizationType
TYPES = ["Q4_0", "Q4_1", "Q8_0"]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    ensure_kernels()


def _packed(qtype: str, n: int, k: int, seed: int = 0):
    """A random [n, k] weight quantized by the gguf package: (our packing, gguf's fp32 dequantization)."""
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(values, Q[qtype])
    expected = torch.from_numpy(gguf.quants.dequantize(raw, Q[qtype]).reshape(n, k).astype(np.float32))
    return from_gguf_blocks(raw, qtype, (n, k)), expected


@pytest.mark.parametrize("qtype", TYPES)
def test_packing_reproduces_gguf_dequantization_exactly(qtype):
    weight, expected = _packed(qtype, 37, 96)
    assert weight.shape == (37, 96)
    assert torch.equal(weight.dequantize(), expected)
    ops_view = torch.ops.graphexec.qdequantize(weight.codes, weight.scales, weight.mins, torch.float32)
    assert torch.equal(ops_view, expected)
    # 4-bit codes take half a byte an element, 8-bit a byte; a float16 scale (and min) per 32.
    blocks = 37 * 96 // 32
    assert weight.nbytes() == (blocks * (16 + 4) if qtype.startswith("Q4") else blocks * (32 + 2))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 47, 64])
@pytest.mark.parametrize("n, k", [(37, 96), (1, 32), (130, 160)])
def test_qlinear_equals_dense_fp32_matmul(qtype, rows, n, k):
    weight, dense = _packed(qtype, n, k, seed=rows)
    x = torch.randn(rows, k)
    got = torch.ops.graphexec.qlinear(x, weight.codes, weight.scales, weight.mins)
    # The same weight values, so only the summation order differs.
    torch.testing.assert_close(got, x @ dense.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 7, 48, 100])  # 48 and up take the dequantized-tile GEMM path
def test_qlinear_bf16_activations(qtype, rows):
    weight, dense = _packed(qtype, 70, 128, seed=rows)
    x = torch.randn(2, rows, 128).bfloat16()  # leading dims are kept
    got = torch.ops.graphexec.qlinear(x, weight.codes, weight.scales, weight.mins)
    assert got.dtype == torch.bfloat16 and got.shape == (2, rows, 70)
    torch.testing.assert_close(got.float(), x.float() @ dense.T, rtol=2e-2, atol=2e-2)


def test_qlinear_rejects_what_it_cannot_take():
    weight, _ = _packed("Q4_1", 8, 64)
    with pytest.raises(RuntimeError, match="input has 32 features, the weight takes 64"):
        torch.ops.graphexec.qlinear(torch.randn(2, 32), weight.codes, weight.scales, weight.mins)
    with pytest.raises(RuntimeError, match="4-bit codes need mins"):
        torch.ops.graphexec.qlinear(torch.randn(2, 64), weight.codes, weight.scales, None)
    with pytest.raises(RuntimeError, match="not a multiple of the block size"):
        codes = weight.codes[:, :20].contiguous()
        torch.ops.graphexec.qlinear(torch.randn(2, 40), codes, weight.scales[:, :1].contiguous(), weight.mins[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="contiguous 2-D"):
        torch.ops.graphexec.qlinear(torch.randn(2, 64), weight.codes[::2], weight.scales[::2], weight.mins[::2])
    with pytest.raises(RuntimeError, match="activations must be"):
        torch.ops.graphexec.qlinear(torch.randn(2, 64).double(), weight.codes, weight.scales, weight.mins)
    assert torch.ops.graphexec.qlinear(torch.randn(0, 64), weight.codes, weight.scales, weight.mins).shape == (0, 8)


def test_any_device_reference_equals_the_kernel():
    """The plain-torch path other devices run (CUDA: TODO(gpu) fused kernel) is the same function."""
    weight, _ = _packed("Q4_1", 33, 64)
    x = torch.randn(3, 64)
    reference = torch.nn.functional.linear(x, dequantize_reference(weight.codes, weight.scales, weight.mins))
    got = torch.ops.graphexec.qlinear(x, weight.codes, weight.scales, weight.mins)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


def test_compile_sees_one_opaque_node():
    weight, dense = _packed("Q4_1", 48, 64)
    layer = QuantLinear(weight)
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def forward(x):
        return torch.nn.functional.silu(layer(x)) * 2

    x = torch.randn(4, 64)
    compiled = torch.compile(forward, backend=recording_backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.nn.functional.silu(x @ dense.T) * 2, rtol=1e-5, atol=1e-5)
    (graph,) = graphs
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count("graphexec.qlinear") == 1, targets  # the op itself, nothing of its insides
    inductor = torch.compile(forward, fullgraph=True)
    torch.testing.assert_close(inductor(x), compiled(x), rtol=1e-5, atol=1e-5)


# --- a tiny quantized GGUF, end to end -------------------------------------------------------

TINY_TYPES = {
    "token_embd.weight": Q.Q8_0,  # tied: also the LM head, read in its blocks
    "attn_q.weight": Q.Q4_0,
    "attn_k.weight": Q.Q4_0,
    "attn_v.weight": Q.Q4_0,
    "attn_output.weight": Q.Q8_0,
    "ffn_gate.weight": Q.Q4_1,
    "ffn_up.weight": Q.Q4_1,
    "ffn_down.weight": Q.Q4_1,
}


@pytest.fixture(scope="module")
def tiny_quantized_gguf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-q")
    model = save_tiny("llama", directory / "hf", tie_word_embeddings=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = directory / "tiny-q.gguf"
    write_tiny_gguf(path, "llama", state, types=TINY_TYPES)
    return path


def _engine(path, *extra):
    return Engine(overrides=["model.source=gguf", f"model.path={path}", "model.name=tiny-q", "cache.num_slots=2048", *extra])


def _prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, TINY["vocab_size"] - 3, (n,), generator=gen).tolist() for n in (1, 6, 19, 33, 4)]


def test_native_gguf_keeps_blocks_and_matches_transformers(tiny_quantized_gguf):
    native = _engine(tiny_quantized_gguf, "capture=eager")
    model = native.runner.model
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.qtype == "Q8_0"
    qkv, gate_up = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj
    assert isinstance(qkv, QuantLinear) and qkv.qtype == "Q4_0" and gate_up.qtype == "Q4_1"
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model.parameters())

    reference = load_gguf(tiny_quantized_gguf, name="tiny-q", weights="dequantize")
    hf = hf_model_from(reference.config, reference.state_dict)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = native.generate(_prompts(), params)
    for prompt, out in zip(_prompts(), outputs):
        assert out.token_ids == hf_greedy(hf, prompt, 12)[0]
    assert_no_leak(native)


def test_native_graph_first_equals_eager_and_dequantize(tiny_quantized_gguf):
    params = [SamplingParams(max_new_tokens=8 + i, temperature=0.0, ignore_eos=True) for i in range(5)]
    small_plan = ["capture.decode.buckets=[1,2,4,8]", "capture.extend.buckets=[32,64]", "capture.extend.max_padding=1.0"]
    runs = {
        name: [o.token_ids for o in _engine(tiny_quantized_gguf, *extra).generate(_prompts(), params)]
        for name, extra in {
            "eager": ["capture=eager"],
            "graph_first": small_plan,
            "dequantize": ["capture=eager", "model.weights=dequantize"],
            # Same shapes, other modules, same process: must not replay the quantized engine's graphs.
            "graph_first dequantize": small_plan + ["model.weights=dequantize"],
        }.items()
    }
    assert runs["graph_first"] == runs["eager"] == runs["dequantize"] == runs["graph_first dequantize"]


def test_unsupported_type_names_tensor_type_and_way_out(tmp_path):
    model = save_tiny("llama", tmp_path / "hf", tie_word_embeddings=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "mxfp4.gguf"
    # MXFP4: a type gguf writes but model.weights=native does not keep (Q5_0 and the K-quants it does).
    write_tiny_gguf(path, "llama", state, types={"ffn_down.weight": Q.MXFP4})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_down\.weight is MXFP4.*Q4_K.*model\.weights=dequantize"):
        load_gguf(path, name="mxfp4", weights="native")
    assert load_gguf(path, name="mxfp4", weights="dequantize").state_dict["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32


def test_mixed_fused_types_run_each_part_and_equal_dequantize(tmp_path):
    """q in Q4_1, k in Q8_0, v dense: the fused qkv runs each part's op (graphexec/quant/row_parts.py)."""
    model = save_tiny("llama", tmp_path / "hf", tie_word_embeddings=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, "llama", state, types={"attn_q.weight": Q.Q4_1, "attn_k.weight": Q.Q8_0})
    native = _engine(path, "capture=eager")
    qkv = native.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, PartsLinear) and qkv.qtype == "Q4_1+Q8_0+dense"
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    dequantized = _engine(path, "capture=eager", "model.weights=dequantize")
    assert [o.token_ids for o in native.generate(_prompts(), params)] == [o.token_ids for o in dequantized.generate(_prompts(), params)]
