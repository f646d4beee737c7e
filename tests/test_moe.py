"""The mixture-of-experts MLP (graphexec/models/moe.py): routing against transformers' routers, the
grouped expert op against a token-by-token reference, one opaque node under torch.compile, and
sparse/dense layer patterns end to end.  (tests/test_model_families.py runs Mixtral, Qwen2-MoE and
Qwen3-MoE against transformers from HF directories and GGUF files, eager and as a decode graph.)"""

from __future__ import annotations

import pytest
import torch

from graphexec.models.moe import route

# at::parallel_for's split between threads is part of what these test (tests/conftest.py)
pytestmark = pytest.mark.two_threads

transformers = pytest.importorskip("transformers")

HIDDEN, INTER, EXPERTS = 32, 24, 6


def _weights(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    return gate_up, down


def _reference(x, ids, weights, gate_up, down):
    """Token by token, choice by choice: sum_j w[t, j] * expert_{ids[t, j]}(x[t])."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _experts(x, ids, weights, gate_up, down):
    return torch.ops.graphexec.moe_experts.default(x, ids, weights, gate_up, down, "silu")


@pytest.mark.parametrize(
    "ids",
    [
        [[0, 1], [1, 0], [5, 2], [2, 5], [3, 4]],  # every expert used, several tokens per expert
        [[3, 3], [3, 1], [1, 3]],  # one expert chosen twice by a token (the op allows it)
        [[4, 2]],  # one token: experts 0, 1, 3 and 5 unused
    ],
)
def test_grouped_experts_equal_the_token_by_token_sum(ids):
    gate_up, down = _weights()
    ids = torch.tensor(ids)
    x = torch.randn(ids.shape[0], HIDDEN, generator=torch.Generator().manual_seed(1))
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_experts(x, ids, weights, gate_up, down), _reference(x, ids, weights, gate_up, down),
                               atol=1e-5, rtol=1e-5)


def test_only_the_routed_experts_are_read():
    """Experts no token chose hold NaN: reading any of their weights would poison the output."""
    gate_up, down = _weights()
    unused = [0, 2, 5]
    gate_up[unused] = float("nan")
    down[unused] = float("nan")
    ids = torch.tensor([[1, 3], [4, 1], [3, 4]])
    x = torch.randn(3, HIDDEN)
    out = _experts(x, ids, torch.full((3, 2), 0.5), gate_up, down)
    assert torch.isfinite(out).all()


def test_no_tokens():
    gate_up, down = _weights()
    out = _experts(torch.empty(0, HIDDEN), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2), gate_up, down)
    assert out.shape == (0, HIDDEN)


@pytest.mark.parametrize("family", ["qwen3_moe_norm", "qwen3_moe", "mixtral"])
def test_routing_equals_transformers_including_ties(family):
    """Experts 1 and 4 have identical router rows, so every token's probabilities tie between
    them: the same top-k choice and weights as transformers' own router."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if family == "mixtral":
        config = transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=2)
        hf, renormalise = MixtralTopKRouter(config), True
    else:
        norm = family.endswith("norm")
        config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=norm)
        hf, renormalise = Qwen3MoeTopKRouter(config), norm
    with torch.no_grad():
        hf.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(3)))
        hf.weight[4] = hf.weight[1]
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(4))
    _, hf_weights, hf_ids = hf(x)
    weights, ids = route(torch.nn.functional.linear(x, hf.weight), 2, renormalise)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float(), atol=0, rtol=0)
    assert ((ids == 1) | (ids == 4)).any()  # the tie was exercised


def test_the_experts_are_one_opaque_node_of_a_full_graph():
    """torch.compile(fullgraph=True) over the MoE MLP: routing traced, the experts one call of the
    op (whatever the routing: the same graph serves a changed routing), results equal eager."""
    from graphexec.models.config import ModelConfig
    from graphexec.models.moe import SparseMoE

    config = ModelConfig(
        name="t", architecture="qwen3_moe", vocab_size=8, hidden_size=HIDDEN, intermediate_size=INTER, num_layers=1,
        num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, max_context=16,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_ids=(), num_experts=EXPERTS,
        num_experts_per_tok=2, moe_intermediate_size=INTER,
    )
    moe = SparseMoE(config)
    gate_up, down = _weights()
    with torch.no_grad():
        moe.gate.weight = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN), requires_grad=False)
        moe.experts.gate_up_proj.copy_(gate_up)
        moe.experts.down_proj.copy_(down)
    graphs = []

    def keep_graph(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(moe, backend=keep_graph, fullgraph=True, dynamic=False)
    for seed in range(3):  # different tokens, different experts, one graph
        x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(10 + seed))
        torch.testing.assert_close(compiled(x), moe(x), atol=0, rtol=0)
    assert len(graphs) == 1
    calls = [n for n in graphs[0].graph.nodes if n.target is torch.ops.graphexec.moe_experts.default]
    assert len(calls) == 1


def test_dense_and_sparse_layers_mixed_equal_transformers(tmp_path):
    """Qwen2-MoE with mlp_only_layers (layer 1 dense, layer 0 sparse with a shared expert):
    logits and greedy tokens as transformers'."""
    from graphexec import Engine, SamplingParams
    from tests.reference import hf_greedy, hf_last_logits
    from tests.test_model_families import ATOL, FAMILIES, PROMPTS, save_family

    reference = save_family("qwen2_moe", tmp_path, mlp_only_layers=[1])
    assert FAMILIES["qwen2_moe"][2]["shared_expert_intermediate_size"]
    engine = Engine(overrides=["model=hf", f"model.path={tmp_path}", "capture=eager", "cache.num_slots=256"])
    assert [engine.model_config.is_sparse_layer(i) for i in range(2)] == [True, False]
    outputs = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS[:2], outputs):
        assert out.token_ids == hf_greedy(reference, prompt, 8)[0]
    from tests.test_fidelity import _runner_logits

    prefill, _ = _runner_logits(engine, PROMPTS[:1], [7])
    torch.testing.assert_close(prefill[0], hf_last_logits(reference, PROMPTS[0]), atol=ATOL, rtol=0)


def test_tensor_parallel_needs_enough_expert_rows():
    from graphexec.errors import ConfigError
    from graphexec.models.config import ModelConfig
    from graphexec.models.tp_layout import TPLayout

    config = ModelConfig(
        name="t", architecture="mixtral", vocab_size=8, hidden_size=HIDDEN, intermediate_size=INTER, num_layers=1,
        num_heads=2, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, max_context=16,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_ids=(), num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=1,
    )
    with pytest.raises(ConfigError, match=r"parallel.tp_size=2 exceeds .*moe_intermediate_size 1"):
        TPLayout.build(config, 2, 0)


def test_packed_experts_are_cut_on_block_boundaries():
    """A rank's part of packed experts, in the file's bytes (StackedBlocks) or as arrays
    (StackedQuantized) (gate/up: every expert's rows; down: whole blocks of its columns),
    dequantizes to the same part of the dense experts; a cut inside a block is refused."""
    from gguf import GGMLQuantizationType as Q

    from graphexec.errors import ConfigError
    from graphexec.models.sharding import Cut, cut_weight
    from graphexec.quant import StackedBlocks, StackedQuantized
    from tests.test_kquants import quantize_k

    values = torch.randn(3, 64, 512, generator=torch.Generator().manual_seed(5)).numpy()
    name = "model.layers.0.mlp.experts.down_proj.weight"
    blocks = StackedBlocks("Q4_K", torch.from_numpy(quantize_k(values.reshape(-1, 512), Q.Q4_K).reshape(3, 64, -1)))
    for qtype in ("Q4_1", "Q8_0"):
        raw = quantize_k(values.reshape(-1, 512), Q[qtype]).reshape(3, 64, -1)
        quantized = StackedQuantized.from_gguf(raw, qtype, (3, 64, 512))
        for stacked, cuts in ((blocks, (Cut(1, 16, 48), Cut(2, 256, 512))), (quantized, (Cut(1, 8, 40), Cut(2, 96, 224)))):
            dense = stacked.dequantize()
            for cut in cuts:
                part = cut_weight(name, stacked, cut)
                assert torch.equal(part.dequantize(), dense.narrow(cut.dim, cut.start, cut.stop - cut.start))
    with pytest.raises(ConfigError, match="inside a 256-element Q4_K block"):
        cut_weight(name, blocks, Cut(2, 0, 128))
    with pytest.raises(ConfigError, match="inside a 32-element Q8_0 block"):
        cut_weight(name, quantized, Cut(2, 0, 48))


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_1", "Q4_0")])
def test_packed_gguf_experts_equal_their_dequantized_values(types, tmp_path):
    """A Qwen3-MoE GGUF's experts as a Q4_K_M file has them (gate and up Q4_K: one kernel call
    reads both) or each of another type: under model.weights=native they stay packed
    (PackedExperts: graphexec::qlinear_blocks or graphexec::qlinear per routed expert) and give
    the logits and tokens of the same file dequantized to float; tensor-parallel ranks read
    their cut of them."""
    from gguf import GGMLQuantizationType as Q

    from graphexec import Engine, SamplingParams
    from graphexec.models.moe import PackedExperts
    from tests.test_fidelity import _runner_logits
    from tests.test_model_families import PROMPTS, save_family, write_family_gguf

    model = save_family("qwen3_moe", tmp_path / "hf", hidden_size=256, moe_intermediate_size=512)
    path = tmp_path / "m.gguf"
    write_family_gguf(path, "qwen3_moe", model, types=dict(zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), (Q[t] for t in types))))
    engines = {
        weights: Engine(overrides=["model=hf", "model.source=gguf", f"model.path={path}", f"model.weights={weights}",
                                   "capture=eager", "cache.num_slots=256"])
        for weights in ("native", "dequantize")
    }
    packed = [m for m in engines["native"].runner.model.modules() if isinstance(m, PackedExperts)]
    assert len(packed) == 2 and packed[0].qtypes == "/".join(types)
    assert engines["native"].runner.weight_nbytes() < 0.5 * engines["dequantize"].runner.weight_nbytes()
    logits = {w: _runner_logits(e, PROMPTS, [7, 8, 9]) for w, e in engines.items()}
    for native, dense in zip(logits["native"], logits["dequantize"]):
        for a, b in zip(native, dense):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {w: [o.token_ids for o in e.generate(PROMPTS, params)] for w, e in engines.items()}
    assert tokens["native"] == tokens["dequantize"]
    # 8-bit activations: the experts in qlinear_q8's layout, logits near the exact ones (the
    # activations' rounding; the kernel itself against q8 linears: the test below).
    q8 = Engine(overrides=["model=hf", "model.source=gguf", f"model.path={path}", "model.activations=q8",
                           "capture=eager", "cache.num_slots=256"])
    fused = types[0] == types[1]  # gate and up rows in one projection: no separate up
    expected_types = (-2, 0, -2) if fused else (-2, -2, -2)
    assert {tuple(m.types) for m in q8.runner.model.modules() if isinstance(m, PackedExperts)} == {expected_types}
    prefill, _ = _runner_logits(q8, PROMPTS, [7, 8, 9])
    for a, b in zip(prefill, logits["dequantize"][0]):
        assert (a - b).abs().max() < 0.05 * b.abs().max()
    # Tensor-parallel ranks read their part of the packed experts: the cut of the whole.
    from graphexec.loader import load_gguf
    from graphexec.models.sharding import cut_for, cut_weight
    from graphexec.models.tp_layout import TPLayout

    whole = load_gguf(path, "m", weights="native")
    for rank in range(2):
        part = load_gguf(path, "m", weights="native", tp_size=2, tp_rank=rank).state_dict
        layout = TPLayout.build(whole.config, 2, rank)
        for key in [k for k in part if ".experts." in k]:
            expected = cut_weight(key, whole.state_dict[key], cut_for(key, layout))
            assert torch.equal(part[key].dequantize(), expected.dequantize()), (rank, key)


@pytest.mark.parametrize("types", [("Q4_K", "Q5_0", "Q6_K"), ("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_1", "Q4_0"),
                                   ("Q8_0", "Q8_0", "Q8_0")])
@pytest.mark.parametrize("tokens", [1, 5])
def test_packed_experts_with_q8_activations_equal_q8_linears_token_by_token(types, tokens):
    """model.activations=q8: each expert read through qlinear_q8 exactly as a dense weight of its
    type would be (packed_linear's q8 conversion), summed in expert order."""
    from gguf import GGMLQuantizationType as Q

    from graphexec.models.moe import PackedExperts
    from graphexec.quant import StackedBlocks, StackedQuantized, ensure_kernels, packed_linear
    from tests.test_kquants import quantize_k

    ensure_kernels()
    experts, hidden, inter = 4, 256, 256
    gen = torch.Generator().manual_seed(6)

    def stacked(qtype: str, rows: int, cols: int):
        values = (torch.randn(experts * rows, cols, generator=gen) / cols**0.5).numpy()
        raw = quantize_k(values, Q[qtype]).reshape(experts, rows, -1)
        if qtype in ("Q8_0", "Q4_0", "Q4_1"):
            return StackedQuantized.from_gguf(raw, qtype, (experts, rows, cols))
        return StackedBlocks(qtype, torch.from_numpy(raw))

    weights = [stacked(types[0], inter, hidden), stacked(types[1], inter, hidden), stacked(types[2], hidden, inter)]
    module = PackedExperts(*weights, "silu", activations="q8")
    assert module.types == ([-2, 0, -2] if types[0] == types[1] else [-2, -2, -2])

    def linear(weight, e: int):
        return packed_linear(weight.expert(e), None, torch.float32, "q8")

    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.tensor([[3, 1], [0, 3], [2, 1], [1, 0], [3, 2]][:tokens])
    topk = torch.rand(tokens, 2, generator=gen)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in sorted(range(2), key=lambda j: int(ids[t, j])):
            e = int(ids[t, j])
            gate, up, down = (linear(w, e) for w in weights)
            h = torch.nn.functional.silu(gate(x[t : t + 1])) * up(x[t : t + 1])
            expected[t] += topk[t, j] * down(h)[0]
    torch.testing.assert_close(module(x, ids, topk), expected, atol=1e-5, rtol=1e-5)


def test_experts_that_differ_only_in_type_are_different_layer_structures():
    """Q5_K and Q5_0 rows of 256 are both 176 bytes: the same buffers' shapes and dtypes.  A
    compiled layer (module guards skipped) must never serve both: the type is part of the layer
    structure it is keyed by."""
    from capture.aot_region import layer_structure
    from graphexec.models.moe import PackedExperts
    from graphexec.quant import StackedBlocks

    blocks = torch.zeros(2, 4, 176, dtype=torch.uint8)
    q5_k, q5_0 = (PackedExperts(*[StackedBlocks(t, blocks)] * 3, "silu") for t in ("Q5_K", "Q5_0"))
    assert [b.shape for b in q5_k.buffers()] == [b.shape for b in q5_0.buffers()]
    assert layer_structure(q5_k) != layer_structure(q5_0)
