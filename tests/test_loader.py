"""GGUF and Hugging Face directory loading, checked tensor by tensor against transformers."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from graphexec.errors import CheckpointError  # noqa: E402
from graphexec.loader import LoadedCheckpoint, default_smollm2_gguf, load_gguf, load_hf_dir  # noqa: E402
from graphexec.loader.gguf import unpermute_rotary_rows  # noqa: E402
from graphexec.text.tokenizer import Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def smollm2() -> LoadedCheckpoint:
    return load_gguf(default_smollm2_gguf(), name="smollm2-135m")


@pytest.fixture(scope="module")
def transformers_smollm2_tensors(hf_smollm2):
    """transformers' own GGUF weights for SmolLM2: `from_pretrained(..., gguf_file=...)` dequantizes
    and un-permutes them (transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint).  The
    session's reference model, so the file is read by transformers once per run."""
    tensors = hf_smollm2.state_dict()
    # No output.weight in the file: the head is the embedding (tied), not a tensor of its own.
    assert tensors.pop("lm_head.weight").data_ptr() == tensors["model.embed_tokens.weight"].data_ptr()
    return tensors


def test_smollm2_config(smollm2):
    c = smollm2.config
    assert c.name == "smollm2-135m"
    assert c.architecture == "llama"
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.rope_theta == 1e5
    assert c.rms_norm_eps == 1e-5
    assert (c.max_context, c.vocab_size) == (8192, 49152)
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert isinstance(smollm2.tokenizer, Tokenizer)


def test_smollm2_tensors_equal_transformers(smollm2, transformers_smollm2_tensors):
    ours, theirs = smollm2.state_dict, transformers_smollm2_tensors
    assert set(ours) == set(theirs) and "lm_head.weight" not in ours
    for key, tensor in ours.items():
        reference = torch.as_tensor(theirs[key])
        assert tensor.dtype == torch.float32 and tensor.shape == reference.shape, key
        if not torch.equal(tensor, reference):  # the full comparison is only worth its time on a mismatch
            torch.testing.assert_close(tensor, reference.float(), rtol=0, atol=1e-6, msg=key)


def test_unpermute_is_not_a_no_op_on_smollm2(smollm2):
    """So the tensor-by-tensor match above would catch a missing or wrong q/k un-permute."""
    for proj, heads in [("q_proj", 9), ("k_proj", 3)]:
        weight = smollm2.state_dict[f"model.layers.0.self_attn.{proj}.weight"]
        assert not torch.equal(llama_cpp_permute(weight, heads), weight)
        assert not torch.equal(unpermute_rotary_rows(weight, heads), weight)


def llama_cpp_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    # convert_hf_to_gguf.py's LlamaModel.permute, verbatim but in torch.
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )


@pytest.mark.parametrize("shape", [(12, 5), (12,)])
def test_unpermute_inverts_llama_cpp_permute(shape):
    weights = torch.randn(shape)
    assert torch.equal(unpermute_rotary_rows(llama_cpp_permute(weights, 3), 3), weights)


TINY = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def save_tiny(kind: str, directory, **overrides):
    transformers = pytest.importorskip("transformers")
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    model = model_class(config_class(**{**TINY, **overrides})).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("llama", dict(rope_theta=5000.0, tie_word_embeddings=False, bos_token_id=256, eos_token_id=[257, 2])),
        ("qwen2", dict(tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)),
    ],
)
def test_hf_dir_round_trip(kind, overrides, tmp_path):
    model = save_tiny(kind, tmp_path, **overrides)
    loaded = load_hf_dir(tmp_path, name="tiny")
    c = loaded.config
    assert (c.name, c.architecture, c.attention_bias) == ("tiny", kind, kind == "qwen2")
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (300, 32, 64, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.max_context) == (4, 2, 8, 128)
    assert c.rms_norm_eps == 1e-6
    assert c.rope_theta == overrides.get("rope_theta", 10000.0)
    assert c.tie_word_embeddings == overrides["tie_word_embeddings"]
    assert c.bos_token_id == overrides["bos_token_id"]
    eos = overrides["eos_token_id"]
    assert c.eos_token_ids == tuple(eos if isinstance(eos, list) else [eos])
    assert loaded.tokenizer is None

    reference = model.state_dict()
    if c.tie_word_embeddings:
        reference.pop("lm_head.weight")
    assert set(loaded.state_dict) == set(reference)
    for key, tensor in loaded.state_dict.items():
        assert torch.equal(tensor, reference[key]), key


def test_hf_dir_dtype_and_unused_keys_dropped(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny("llama", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(weights, tmp_path / "model.safetensors")
    loaded = load_hf_dir(tmp_path, name="tiny", dtype=torch.bfloat16)
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in loaded.state_dict
    assert all(t.dtype == torch.bfloat16 for t in loaded.state_dict.values())


def test_hf_dir_rejects_unexpected_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny("llama", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="o_proj.bias"):
        load_hf_dir(tmp_path, name="tiny")


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_tiny_gguf(path, kind: str, state_dict: dict[str, torch.Tensor], types=None, config=None, quantize=None) -> None:
    """What llama.cpp's converter would write for a tiny model: renamed, llama q/k permuted, embedding in F16.

    `types` maps GGUF tensor names (or their suffix after `blk.N.`) to a quantization type to store
    them in, as llama-quantize would; `quantize(array, qtype)` makes the blocks (default: the gguf
    package's, which has no K-quant quantizer).  `config` overrides TINY's fields (save_tiny's)."""
    import gguf
    from tokenizers import pre_tokenizers

    c = {**TINY, **(config or {})}
    quantize = quantize or gguf.quants.quantize
    writer = gguf.GGUFWriter(path, kind)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(1e6)
    writer.add_vocab_size(c["vocab_size"])
    # Byte-level vocabulary: 256 byte tokens, two merges, then control and user-defined tokens.
    tokens = pre_tokenizers.ByteLevel.alphabet() + ["he", "hel", "<|endoftext|>", "<|eot|>", "<think>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if kind == "qwen2" else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 258 + [3, 3, 4])
    writer.add_token_merges(["h e", "he l"])
    writer.add_bos_token_id(258)
    writer.add_eos_token_id(258)
    writer.add_eot_token_id(259)
    for key, tensor in state_dict.items():
        array = tensor.numpy()
        if key == "model.embed_tokens.weight":
            name, array = "token_embd.weight", array.astype("float16")
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        elif key == "lm_head.weight":
            name = "output.weight"
        else:
            _, _, layer, rest = key.split(".", 3)
            name = f"blk.{layer}.{GGUF_NAMES[rest]}"
            heads = c["num_attention_heads"] if ".q_proj." in key else c["num_key_value_heads"]
            if kind == "llama" and (".q_proj." in key or ".k_proj." in key):
                array = llama_cpp_permute(tensor, heads).numpy()
        qtype = (types or {}).get(name, (types or {}).get(name.split(".", 2)[-1]))
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, quantize(array.astype("float32"), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind, tied", [("llama", False), ("qwen2", True)])
def test_tiny_gguf_round_trip(kind, tied, tmp_path):
    model = save_tiny(kind, tmp_path / "hf", tie_word_embeddings=tied)
    reference = model.state_dict()
    if tied:
        reference.pop("lm_head.weight")
    write_tiny_gguf(tmp_path / "tiny.gguf", kind, reference)

    loaded = load_gguf(tmp_path / "tiny.gguf", name="tiny-gguf")
    c = loaded.config
    assert (c.architecture, c.attention_bias, c.tie_word_embeddings) == (kind, kind == "qwen2", tied)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (4, 2, 8, 300)
    assert (c.rope_theta, c.rms_norm_eps, c.max_context) == (1e6, 1e-6, 128)
    assert c.bos_token_id == 258 and c.eos_token_ids == (258, 259)
    assert set(loaded.state_dict) == set(reference)
    for key, tensor in loaded.state_dict.items():
        expected = reference[key].half().float() if key == "model.embed_tokens.weight" else reference[key]
        assert torch.equal(tensor, expected), key

    tokenizer = loaded.tokenizer
    ids = tokenizer.encode("hello<think> 12345<|eot|>")
    assert ids[0] == 257 and 260 in ids and ids[-1] == 259  # "hel" merged; added tokens whole
    assert tokenizer.decode(ids) == "hello<think> 12345"  # user-defined tokens are not special
    assert tokenizer.eos_token_ids == (258, 259)


def test_missing_paths_raise_checkpoint_error_naming_the_path(tmp_path):
    missing_file = tmp_path / "absent.gguf"
    with pytest.raises(CheckpointError, match="absent.gguf"):
        load_gguf(missing_file, name="x")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="garbage.gguf"):
        load_gguf(garbage, name="x")

    with pytest.raises(CheckpointError, match="no_such_dir"):
        load_hf_dir(tmp_path / "no_such_dir", name="x")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="config.json.*empty_dir"):
        load_hf_dir(empty, name="x")
    (empty / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(CheckpointError, match="safetensors.*empty_dir"):
        load_hf_dir(empty, name="x")


def test_default_smollm2_gguf_exists():
    path = default_smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
