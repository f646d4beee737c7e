"""Dense model families (Llama 3.x RoPE scaling, Mistral, Qwen3, Phi-3 / Phi-4-mini, Gemma 2 and 3)
against Hugging Face transformers on the same tiny random weights, from HF directories and GGUF files.

Tolerance: both sides run fp32 on the CPU with the same weights; they differ only in summation
order (fused q/k/v and gate/up matmuls, the paged attention kernel), which leaves logits of
magnitude ~10 within ~1e-5.  ATOL = 1e-4 allows that with a margin while any formula error
(a wrong frequency, a missing attention factor or q/k norm) moves logits by 1e-2 or more.
The weights are rescaled so logits are peaked: greedy tokens are then decided by clear margins.
"""

from __future__ import annotations

import pytest
import torch

from graphexec import Engine, SamplingParams
from graphexec.errors import CheckpointError
from graphexec.loader import load_hf_dir
from tests.reference import hf_greedy, hf_last_logits

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
NEW_TOKENS = 12
PROMPTS = [[5, 17, 33, 100, 7, 8, 9, 250, 61, 2], [40, 41, 42], [300, 12, 77, 5, 9, 1, 200, 150, 30, 31, 90, 11, 3, 44, 18, 19, 20]]

TINY = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
# Each family's distinguishing features, in its own transformers config class.
FAMILIES = {
    "llama3": ("LlamaForCausalLM", "LlamaConfig", dict(
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64), rope_theta=10000.0)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict()),  # q/k/v bias
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        head_dim=32, tie_word_embeddings=True,  # head_dim != hidden / heads, as in Qwen3
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64), rope_theta=1e6)),
    # Shaped like Phi-4-mini: 3/4 of each head rotates, tied embeddings, a window past the context.
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=64, tie_word_embeddings=True, sliding_window=512,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 2.1, 3.5, 5.0],
                          long_factor=[2.0, 3.0, 4.0, 8.0, 16.0, 32.0]))),
    # Gemma: sandwich norms, (1 + w) norms, GeGLU, scaled embeddings, a softmax scale of its own,
    # sliding layers with a window the prompts outgrow.  Gemma 2: soft-capped scores and logits
    # (caps the tiny model's values reach), layers alternate.  Gemma 3: q/k norms, five sliding
    # layers then a full one, the sliding layers on their own RoPE base, linear scaling on the rest.
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(head_dim=16)),  # no sandwich norms, caps or windows
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=5.0,
        final_logit_softcapping=20.0)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        rope_scaling=dict(rope_type="linear", factor=4.0))),
    # Mixtures of experts: every expert routed to somewhere in the prompts, weights renormalised
    # (Mixtral always, Qwen3-MoE by norm_topk_prob) or not (Qwen2-MoE), Qwen2-MoE's gated shared expert.
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=48)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16, norm_topk_prob=True)),
}
GEMMA = ("gemma", "gemma2", "gemma3")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


def _peaked_(model) -> None:
    """transformers' N(0, 0.02) init gives near-flat logits; give them clear margins instead."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def save_family(family: str, directory, **overrides):
    model_name, config_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**TINY, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    _peaked_(model)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def _engine(path) -> Engine:
    return Engine(overrides=["model=hf", f"model.path={path}", "capture=eager", "cache.num_slots=512"])


def _check_engine(engine: Engine, reference) -> None:
    from tests.test_fidelity import _runner_logits

    prefill, decode = _runner_logits(engine, PROMPTS, [7, 8, 9])
    for i, (prompt, token) in enumerate(zip(PROMPTS, [7, 8, 9])):
        torch.testing.assert_close(prefill[i], hf_last_logits(reference, prompt), atol=ATOL, rtol=0)
        torch.testing.assert_close(decode[i], hf_last_logits(reference, prompt + [token]), atol=ATOL, rtol=0)
    # The prompts were cached when the runner released them: these reuse all but their last token.
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        assert out.cached_tokens == len(prompt) - 1
        assert out.token_ids == hf_greedy(reference, prompt, NEW_TOKENS)[0]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_family(request.param, path)


def test_hf_dir_matches_transformers(hf_family):
    family, path, reference = hf_family
    _check_engine(_engine(path), reference)


# ---- RoPE frequencies against transformers' ROPE_INIT_FUNCTIONS ------------------------------

ROPE_CASES = {
    "llama3": ("LlamaConfig", FAMILIES["llama3"][2]),
    "linear": ("LlamaConfig", dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    "dynamic": ("LlamaConfig", dict(rope_scaling=dict(rope_type="dynamic", factor=2.0))),
    "yarn": ("Qwen3Config", FAMILIES["qwen3"][2]),
    "yarn-mscale": ("LlamaConfig", dict(rope_scaling=dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=32, mscale=0.9, mscale_all_dim=0.7,
        beta_fast=16, beta_slow=2))),
    "longrope": ("Phi3Config", FAMILIES["phi3"][2]),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_frequencies_equal_transformers(case, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from graphexec.loader.hf_config import model_config
    from graphexec.models.rope import inverse_frequencies

    config_name, extra = ROPE_CASES[case]
    hf_config = getattr(transformers, config_name)(**{**TINY, **extra})
    raw = hf_config.to_dict()  # what config.json holds
    ours = model_config(raw, "t", True, [], tmp_path)
    inv_freq, attention = inverse_frequencies(ours)
    kind = raw["rope_parameters"]["rope_type"]
    expected, expected_attention = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    torch.testing.assert_close(inv_freq, expected, atol=0, rtol=1e-6)
    assert attention == pytest.approx(expected_attention, rel=1e-6)
    plain = 1.0 / (ours.rope_theta ** (torch.arange(0, ours.rotary_dim, 2).float() / ours.rotary_dim))
    # Every case but dynamic (plain RoPE within its original context) really rescales.
    assert torch.equal(inv_freq, plain) == (case == "dynamic")


def test_longrope_long_factors_equal_transformers_past_the_original_context(tmp_path):
    """model.rope_long_factors=true: the long factors' frequencies are transformers' long ones,
    and an 80-token prompt (past Phi-3's original 64) gives transformers' logits and greedy tokens
    (transformers rotates a whole forward that reaches past the original context with them)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from graphexec import ConfigError
    from graphexec.loader.hf_config import model_config
    from graphexec.models.rope import inverse_frequencies, with_long_factors

    model = save_family("phi3", tmp_path)
    long = with_long_factors(model_config(model.config.to_dict(), "t", True, [], tmp_path))
    assert long.max_context == 256
    expected, attention = ROPE_INIT_FUNCTIONS["longrope"](model.config, "cpu", seq_len=65)
    inv_freq, ours = inverse_frequencies(long)
    torch.testing.assert_close(inv_freq, expected, atol=0, rtol=1e-6)
    assert ours == pytest.approx(attention, rel=1e-6)
    engine = Engine(overrides=["model=hf", f"model.path={tmp_path}", "model.rope_long_factors=true", "capture=eager",
                               "cache.num_slots=512"])
    prompt = [(7 * i + 3) % 380 + 2 for i in range(80)]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS)[0]
    from graphexec.loader import load_gguf

    write_family_gguf(tmp_path / "m.gguf", "phi3", model)  # rope_factors_long, as llama.cpp writes it
    from_gguf, attention_gguf = inverse_frequencies(with_long_factors(load_gguf(tmp_path / "m.gguf", "m").config))
    torch.testing.assert_close(from_gguf, expected, atol=0, rtol=1e-6)
    assert attention_gguf == pytest.approx(attention, rel=1e-6)
    with pytest.raises(ConfigError, match="model.rope_long_factors=true: .* has no LongRoPE long factors"):
        Engine(overrides=["model=tiny-llama", "model.rope_long_factors=true"])


def test_static_only_scalings_cap_the_context(tmp_path):
    from graphexec.loader.hf_config import model_config

    phi3 = model_config(transformers.Phi3Config(**{**TINY, **FAMILIES["phi3"][2]}).to_dict(), "t", True, [], tmp_path)
    assert phi3.max_context == 64  # LongRoPE: short factors only, within the original context
    dynamic = {**TINY, "rope_scaling": dict(rope_type="dynamic", factor=2.0, original_max_position_embeddings=128)}
    assert model_config(transformers.LlamaConfig(**dynamic).to_dict(), "t", True, [], tmp_path).max_context == 128
    llama3 = model_config(transformers.LlamaConfig(**{**TINY, **FAMILIES["llama3"][2]}).to_dict(), "t", True, [], tmp_path)
    assert llama3.max_context == 256  # llama3 scaling is static: the whole declared context


# ---- refusals -------------------------------------------------------------------------------


def _save_config(path, config) -> None:
    config.save_pretrained(path)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, path / "model.safetensors")


@pytest.mark.parametrize(
    "config_name, fields, match",
    [
        ("Qwen2Config", dict(use_sliding_window=True, sliding_window=32, layer_types=["chunked_attention"] * 2),
         r"attention layer types \['chunked_attention'\]"),
        ("OlmoeConfig", dict(num_experts=4), r"mixture-of-experts model \['OlmoeForCausalLM'\] is not supported"),
        ("LlamaConfig", dict(rope_scaling=dict(rope_type="proportional", factor=2.0)), "RoPE scaling 'proportional'"),
        ("Qwen3Config", dict(attention_bias=True), "attention_bias"),
    ],
)
def test_unsupported_checkpoints_are_refused_by_name(config_name, fields, match, tmp_path):
    config = getattr(transformers, config_name)(**{**TINY, **fields})
    arch = config_name.removesuffix("Config") + "ForCausalLM"
    config.architectures = [arch]
    _save_config(tmp_path, config)
    with pytest.raises(CheckpointError, match=match):
        load_hf_dir(tmp_path, "t")


def test_a_window_as_long_as_the_context_is_full_attention(tmp_path):
    from graphexec.loader.hf_config import model_config

    config = transformers.MistralConfig(**{**TINY, "sliding_window": 256})
    assert model_config(config.to_dict(), "t", True, [], tmp_path).sliding_window is None
    config.architectures = ["MistralForCausalLM"]
    _save_config(tmp_path, config)
    with pytest.raises(CheckpointError, match="tensors do not match"):  # got past the window check
        load_hf_dir(tmp_path, "t")


@pytest.mark.parametrize(
    "config_name, fields",
    [
        ("MistralConfig", dict(sliding_window=64)),
        ("Phi3Config", dict(sliding_window=31)),
        # Qwen: the window only with use_sliding_window, on layers from max_window_layers on.
        ("Qwen3Config", dict(use_sliding_window=True, sliding_window=32, max_window_layers=0)),
        ("Qwen2Config", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1)),
        ("Qwen3Config", dict(use_sliding_window=False, sliding_window=32, max_window_layers=0)),
        ("Qwen2Config", dict(use_sliding_window=True, sliding_window=32, max_window_layers=2)),  # no layer
        ("Qwen2Config", dict(use_sliding_window=True, sliding_window=32, layer_types=["sliding_attention", "full_attention"])),
        ("MistralConfig", dict(sliding_window=None)),
        ("Gemma2Config", dict(sliding_window=32, num_hidden_layers=3)),
        ("Gemma3TextConfig", dict(sliding_window=32, num_hidden_layers=7)),
        ("Gemma3TextConfig", dict(sliding_window=32, num_hidden_layers=4, sliding_window_pattern=2)),
    ],
)
def test_each_layers_window_is_read_as_transformers_reads_it(config_name, fields, tmp_path):
    """Per layer, as transformers' attention modules take it: the window on `sliding_attention`
    layers (Qwen: only with use_sliding_window), none on the others."""
    from graphexec.loader.hf_config import model_config

    config = getattr(transformers, config_name)(**{**TINY, **fields})
    raw = config.to_dict()
    uses = raw.get("use_sliding_window", True)
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    expected = tuple(config.sliding_window if kind == "sliding_attention" and uses else None for kind in kinds)
    assert model_config(raw, "t", True, [], tmp_path).layer_windows == expected
    if config_name.startswith("Gemma"):  # from transformers 4's spelling too: no layer_types, a pattern
        raw.pop("layer_types")
        if "gemma3" in raw["model_type"]:
            raw["sliding_window_pattern"] = fields.get("sliding_window_pattern", 6)
        assert model_config(raw, "t", True, [], tmp_path).layer_windows == expected


def test_gemma_refusals(tmp_path):
    from graphexec.loader.hf_config import model_config

    bidirectional = transformers.Gemma3TextConfig(**{**TINY, "use_bidirectional_attention": True}).to_dict()
    with pytest.raises(CheckpointError, match="use_bidirectional_attention"):
        model_config(bidirectional, "t", True, [], tmp_path)
    multimodal = {**transformers.Gemma3TextConfig(**TINY).to_dict(), "architectures": ["Gemma3ForConditionalGeneration"]}
    with pytest.raises(CheckpointError, match="unsupported model.*Gemma3ForConditionalGeneration"):
        model_config(multimodal, "t", True, [], tmp_path)


# ---- GGUF: what llama.cpp's converter writes for each family --------------------------------

# Mistral 7B converts as llama
GGUF_ARCH = {"llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma": "gemma",
             "gemma2": "gemma2", "gemma3": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
GGUF_BLOCK_NAMES = {
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # Phi-3: gate and up stacked, no ffn_gate
    "mlp.gate.weight": "ffn_gate_inp.weight",  # a mixture's router, stacked experts, shared expert
    "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
GGUF_GEMMA_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def _gguf_name(key: str, arch: str) -> str:
    from tests.test_loader import GGUF_NAMES

    if key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}[key]
    _, _, layer, rest = key.split(".", 3)
    gemma = GGUF_GEMMA_NAMES if arch in ("gemma2", "gemma3") else {}
    return f"blk.{layer}.{gemma.get(rest) or GGUF_BLOCK_NAMES.get(rest) or GGUF_NAMES[rest]}"


def _rope_metadata(writer, family: str, hf_config) -> None:
    """The RoPE keys and tensors llama.cpp's converter writes for each family's scaling."""
    import math

    import gguf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if family == "llama3":
        # llama.cpp stores Llama 3's scaling as per-pair divisors of the plain frequencies.
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
        plain = 1.0 / (hf_config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
        writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype("float32"))
    elif family == "qwen3":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(64)
    elif family == "gemma3":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)
    elif family == "phi3":
        params = hf_config.rope_parameters
        writer.add_rope_dimension_count(12)
        writer.add_rope_scaling_orig_ctx_len(64)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(256 / 64) / math.log(64)))
        writer.add_tensor("rope_factors_long.weight", torch.tensor(params["long_factor"]).numpy())
        writer.add_tensor("rope_factors_short.weight", torch.tensor(params["short_factor"]).numpy())


def _moe_metadata(writer, family: str, c) -> None:
    """What llama.cpp's converter writes for a mixture (Mixtral's expert size is feed_forward_length)."""
    writer.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if family != "mixtral":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_weights_norm(bool(c.norm_topk_prob))
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)


def _stacked_experts(state: dict, hf_config, path) -> dict:
    """The per-expert tensors stacked as GGUF files hold them, as the HF loader stacks them."""
    from graphexec.loader.experts import stack_experts
    from graphexec.loader.hf_config import model_config

    return stack_experts(dict(state), model_config(hf_config.to_dict(), "t", True, [], path), path)


def write_family_gguf(path, family: str, model, sliding_window: int | None = None, types=None) -> None:
    """`types`: GGUF tensor kinds (the name after `blk.N.`, no `.weight`) to store quantized."""
    import gguf

    from tests.test_loader import llama_cpp_permute

    arch, c = GGUF_ARCH[family], model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3: per layer kind
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if arch in ("gemma2", "gemma3"):  # llama.cpp's converter: the window and the caps; the rest is hard-coded there
        writer.add_sliding_window(c.sliding_window)
        if c.attn_logit_softcapping is not None:
            writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        if c.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(c.final_logit_softcapping)
    _rope_metadata(writer, family, c)
    state = model.state_dict()
    if family in MOE:
        _moe_metadata(writer, family, c)
        state = _stacked_experts(state, c, path)
    if c.tie_word_embeddings:
        state.pop("lm_head.weight")
    for key, tensor in state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if arch == "llama" and (".q_proj." in key or ".k_proj." in key):
            heads = c.num_attention_heads if ".q_proj." in key else c.num_key_value_heads
            tensor = llama_cpp_permute(tensor, heads)  # the converter's q/k row interleave
        if key.endswith("shared_expert_gate.weight"):
            tensor = tensor.reshape(-1)  # llama.cpp's converter stores the one-row gate as a vector
        if arch in GEMMA and key.endswith("norm.weight"):
            tensor = tensor + 1  # the converter stores Gemma's norms as 1 + w
        name, array = _gguf_name(key, arch), tensor.detach().numpy().astype("float32")
        qtype = (types or {}).get(name.split(".")[-2])
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            from tests.test_kquants import quantize_k  # gguf's own for the types it quantizes

            rows = quantize_k(array.reshape(-1, array.shape[-1]), qtype)  # stacked experts: rows of rows
            writer.add_tensor(name, rows.reshape(*array.shape[:-1], -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_matches_transformers(hf_family, tmp_path):
    family, _, reference = hf_family
    if family in ("gemma2", "gemma3"):
        # llama.cpp scales Gemma's attention by head_dim (query_pre_attn_scalar is not stored).
        reference = save_family(family, tmp_path / "hf", query_pre_attn_scalar=16)
    write_family_gguf(tmp_path / "m.gguf", family, reference)
    engine = Engine(overrides=["model=hf", "model.source=gguf", f"model.path={tmp_path / 'm.gguf'}",
                               "capture=eager", "cache.num_slots=512"])
    # A llama file with experts is Mixtral; qwen2moe / qwen3moe are the families' own names.
    assert engine.model_config.architecture == (family if family in MOE else GGUF_ARCH[family])
    _check_engine(engine, reference)


def test_gguf_sliding_window_is_read(tmp_path):
    """<arch>.attention.sliding_window: one window for every layer; one as long as the context is
    full attention.  (tests/test_sliding_window.py runs a windowed GGUF against transformers.)"""
    from graphexec.loader import load_gguf

    model = save_family("mistral", tmp_path / "hf")
    write_family_gguf(tmp_path / "m.gguf", "mistral", model, sliding_window=64)
    assert load_gguf(tmp_path / "m.gguf", "m").config.sliding_window == 64
    write_family_gguf(tmp_path / "full.gguf", "mistral", model, sliding_window=256)
    full = load_gguf(tmp_path / "full.gguf", "m").config
    assert full.max_context == 256 and full.sliding_window is None


# ---- graphs ---------------------------------------------------------------------------------


def test_decode_graph_equals_transformers(hf_family):
    """Each family's decode recorded as one graph (the op tape: no breaks, so q/k norm, partial
    rotary and the scaled tables all live inside it) and replayed: greedy tokens still HF's."""
    from graphexec.batch.forward_mode import ForwardMode

    _, path, reference = hf_family
    engine = Engine(overrides=[
        "model=hf", f"model.path={path}", "cache.num_slots=512", "capture=graph_first", "capture.decode.buckets=[4]",
        "capture.decode.graph=tape", "capture.decode.progress=false", "capture.extend.backend=eager",
    ])
    backend = engine.runner.backends[ForwardMode.DECODE]
    recorded = backend.segments_of(4)
    assert recorded.num_segments == 1 and recorded.breaks == ()
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(reference, prompt, NEW_TOKENS)[0]
    assert backend.stats.executions == NEW_TOKENS - 1 and backend.stats.fallbacks == 0


@pytest.mark.slow
def test_gemma3_compiled_decode_graph_equals_transformers(tmp_path):
    """The default plan's compiled decode layer (AOT, regional, module guards skipped) on Gemma 3:
    one compiled layer serves sliding and full layers, their two RoPE tables handed in as an
    argument and their windows looked up by layer id; greedy tokens are transformers'."""
    from graphexec.batch.forward_mode import ForwardMode

    reference = save_family("gemma3", tmp_path / "hf")
    engine = Engine(overrides=[
        "model=hf", f"model.path={tmp_path / 'hf'}", "cache.num_slots=512", "capture.background=false",
        "capture.decode.keep=all", "capture.decode.buckets=[4]", "capture.decode.progress=false",
        f"capture.cache_dir={tmp_path / 'capture'}",
    ])
    outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(reference, prompt, NEW_TOKENS)[0]
    stats = engine.runner.backends[ForwardMode.DECODE].stats
    assert stats.executions == NEW_TOKENS - 1 and stats.fallbacks == 0


# ---- tensor parallelism ---------------------------------------------------------------------


@pytest.mark.parametrize("families", [("qwen3", "gemma2", "qwen2_moe", "mixtral", "gemma"),
                                      ("phi3", "qwen2", "gemma3", "qwen3_moe", "mistral")])
def test_tp2_equals_tp1(families, tmp_path):
    """Qwen3 (replicated per-head q/k norms), Gemma 2 (output norms after the all-reduce,
    soft-capped logits gathered), Phi-3 (fused tensors split, then cut, while loading), Qwen2
    (cut biases), Gemma 3 (two RoPE bases, per-layer windows on each rank's heads), Qwen2-MoE
    (every expert's rows and the shared expert's cut, the router whole), Mixtral, Qwen3-MoE,
    Mistral and Gemma at
    parallel.tp_size=2 against 1, all ranks as real processes at once; ATOL as
    tests/test_tp_model.py's (the all-reduce changes the summation order).  (Llama 3's scaled
    RoPE tables are built as Llama's are.)"""
    from tests.test_tp_model import ATOL, _max_diff, _run_rank_series

    series = []
    for family in families:
        save_family(family, tmp_path / family)
        series.append(["model=hf", f"model.path={tmp_path / family}", "cache.num_slots=512", "capture=eager"])
    references, sharded = _run_rank_series((1, series), (2, series), tmp_path=tmp_path)
    assert len(references) == len(sharded) == len(families)
    for (reference,), ranks in zip(references, sharded):
        diffs = _max_diff(ranks[0][1], reference[1])
        assert max(diffs.values()) < ATOL, diffs
        assert max(_max_diff(ranks[1][1], ranks[0][1]).values()) == 0.0
        assert all(r[2] < reference[2] * 0.75 for r in ranks)  # each rank holds a part of the weights


def test_gguf_yarn_attn_factor_multiplies_the_yarn_correction(tmp_path):
    """llama.cpp scales cos/sin by rope.scaling.attn_factor times YaRN's 0.1 ln(factor) + 1."""
    import math

    from graphexec.loader.gguf_config import config_from_metadata
    from graphexec.models.rope import inverse_frequencies

    metadata = {
        "general.architecture": "qwen3", "qwen3.context_length": 256, "qwen3.embedding_length": 64,
        "qwen3.attention.head_count": 4, "qwen3.attention.key_length": 16, "qwen3.feed_forward_length": 128,
        "qwen3.block_count": 2, "qwen3.vocab_size": 384, "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0,
        "qwen3.rope.scaling.original_context_length": 64,
    }
    plain = config_from_metadata(metadata, set(), {}, "t", tmp_path)
    assert inverse_frequencies(plain)[1] == pytest.approx(0.1 * math.log(4.0) + 1)
    scaled = config_from_metadata({**metadata, "qwen3.rope.scaling.attn_factor": 0.5}, set(), {}, "t", tmp_path)
    assert inverse_frequencies(scaled)[1] == pytest.approx(0.5 * (0.1 * math.log(4.0) + 1))


def test_gguf_fused_quantized_tensors_split_packed_and_cut(tmp_path):
    """Phi-3's attn_qkv and stacked ffn_up kept Q8_0 (model.weights=native) split by rows into
    packed q/k/v and gate/up, whole and as tensor-parallel ranks of 2, equal to the dense split."""
    from gguf import GGMLQuantizationType as Q

    from graphexec.loader import load_gguf
    from graphexec.models.sharding import shard_state_dict
    from graphexec.models.tp_layout import TPLayout
    from graphexec.quant import QuantizedWeight

    path = tmp_path / "q8.gguf"
    write_family_gguf(path, "phi3", save_family("phi3", tmp_path / "hf"), types={"attn_qkv": Q.Q8_0, "ffn_up": Q.Q8_0})
    native = load_gguf(path, "q", weights="native").state_dict
    dense = load_gguf(path, "q", weights="dequantize").state_dict
    fused_parts = [k for k in native if k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")]
    assert len(fused_parts) == 10 and all(isinstance(native[k], QuantizedWeight) for k in fused_parts)
    for key in fused_parts:
        assert torch.equal(native[key].dequantize(), dense[key]), key
    for rank in range(2):
        part = load_gguf(path, "q", weights="native", tp_size=2, tp_rank=rank).state_dict
        expected = shard_state_dict(dense, TPLayout.build(load_gguf(path, "q").config, 2, rank))
        for key in fused_parts:
            assert torch.equal(part[key].dequantize(), expected[key]), (rank, key)


def test_a_random_model_yaml_spells_rope_scaling_as_a_mapping():
    """`model.architecture.rope_scaling` in a random model's YAML is a mapping of RopeScaling's
    fields; a bad one is a ConfigError naming model.architecture."""
    from graphexec import ConfigError
    from graphexec.config import EngineConfig
    from graphexec.loader.resolve import load_checkpoint
    from graphexec.models.config import RopeScaling

    overrides = ["model=tiny-llama", "+model.architecture.rope_scaling={kind: linear, factor: 2.0}"]
    source = EngineConfig.from_overrides(overrides).model
    checkpoint = load_checkpoint(source, torch.float32)
    assert checkpoint.config.rope_scaling == RopeScaling(kind="linear", factor=2.0)
    bad = EngineConfig.from_overrides(["model=tiny-llama", "+model.architecture.rope_scaling={kind: spiral}"]).model
    with pytest.raises(ConfigError, match="model.architecture"):
        load_checkpoint(bad, torch.float32)
