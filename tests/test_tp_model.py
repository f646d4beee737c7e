"""The sharded model (graphexec/models/tp_layout.py, sharding.py, parallel_layers.py) against the
unsharded one on the same weights.

Layout and cutting tests run in-process.  The model tests spawn real ranks (gloo over a file://
store, one thread each); every rank loads its part through the same loader path the engine uses
(graphexec/engine/rank_setup.py), runs one prefill and one decode step through the runner, and
rank 0 sends back its hidden rows and logits, which must match tp_size=1's within 1e-3 (the
all-reduce changes the summation order; the measured maximum is printed).
"""

from __future__ import annotations


import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from graphexec.errors import ConfigError
from graphexec.models.config import ModelConfig
from graphexec.models.sharding import Cut, cut_for, cut_weight, shard_state_dict
from graphexec.models.tp_layout import TPLayout
from graphexec.quant import QuantizedWeight

ATOL = 1e-3


def _config(**fields) -> ModelConfig:
    base = dict(
        name="t", architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=160, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_context=64,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_ids=(),
    )
    return ModelConfig(**{**base, **fields})


SMOLLM2 = _config(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                  num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


# ---- layout (in-process) -------------------------------------------------------------------


def test_smollm2_tp3_layout():
    layouts = [TPLayout.build(SMOLLM2, 3, rank) for rank in range(3)]
    assert [lay.q_heads for lay in layouts] == [(0, 3), (3, 6), (6, 9)]
    assert [lay.kv_heads for lay in layouts] == [(0, 1), (1, 2), (2, 3)]
    assert [lay.intermediate for lay in layouts] == [(0, 512), (512, 1024), (1024, 1536)]
    assert [lay.vocab for lay in layouts] == [(0, 16384), (16384, 32768), (32768, 49152)]
    local = layouts[1].local_config()
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 512)
    assert local.vocab_size == 49152  # batches and the sampler see the whole vocabulary


def test_kv_heads_are_replicated_when_ranks_exceed_them():
    layouts = [TPLayout.build(_config(), 4, rank) for rank in range(4)]
    assert [lay.q_heads for lay in layouts] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [lay.kv_heads for lay in layouts] == [(0, 1), (0, 1), (1, 2), (1, 2)]


@pytest.mark.parametrize("heads, kv, size", [(4, 2, 2), (4, 2, 4), (4, 1, 4), (9, 3, 3), (8, 8, 4), (8, 2, 8), (6, 3, 3)])
def test_every_query_head_reads_its_own_kv_head(heads, kv, size):
    """Query head h attends with KV head h // (heads / kv) in the whole model; each rank must own it."""
    config = _config(num_heads=heads, num_kv_heads=kv, intermediate_size=256)
    for rank in range(size):
        lay = TPLayout.build(config, size, rank)
        for h in range(*lay.q_heads):
            kv_head = h // (heads // kv)
            local_q = h - lay.q_heads[0]
            local_kv = local_q // (lay.local_config().num_heads // lay.local_config().num_kv_heads)
            assert lay.kv_heads[0] + local_kv == kv_head


def test_vocab_is_padded_to_a_multiple_of_the_ranks():
    layouts = [TPLayout.build(_config(vocab_size=322, num_heads=6, num_kv_heads=3), 3, r) for r in range(3)]
    assert [lay.vocab for lay in layouts] == [(0, 108), (108, 216), (216, 322)]
    assert {lay.vocab_shard for lay in layouts} == {108}
    assert layouts[2].vocab_rows == 106


def test_mlp_splits_on_32_element_units():
    spans = [TPLayout.build(_config(num_heads=6, num_kv_heads=3), 3, r).intermediate for r in range(3)]
    assert spans == [(0, 64), (64, 128), (128, 160)]  # 160 = 5 blocks: 2, 2, 1
    odd = [TPLayout.build(_config(intermediate_size=150), 2, r).intermediate for r in range(2)]
    assert odd == [(0, 75), (75, 150)]  # not block-sized (dense only): split by element


@pytest.mark.parametrize(
    "fields, size, match",
    [
        (dict(), 3, "divide the query heads"),
        (dict(num_heads=12, num_kv_heads=6), 4, "divide the KV heads"),
        (dict(num_heads=12, num_kv_heads=4), 6, "multiple of them"),
        (dict(num_heads=12, num_kv_heads=4, intermediate_size=64), 4, "units of 32"),
    ],
)
def test_unsupported_tp_sizes_are_config_errors(fields, size, match):
    with pytest.raises(ConfigError, match=f"parallel.tp_size={size}.*({match})"):
        TPLayout.build(_config(**fields), size, 0)


def test_smollm2_tp2_is_refused_naming_its_heads():
    with pytest.raises(ConfigError, match=r"parallel.tp_size=2 .*9 query and 3 KV heads"):
        TPLayout.build(SMOLLM2, 2, 0)


# ---- cutting (in-process) ------------------------------------------------------------------


def test_cuts_per_tensor():
    lay = TPLayout.build(SMOLLM2, 3, 2)
    assert cut_for("model.layers.4.self_attn.q_proj.weight", lay) == Cut(0, 384, 576)
    assert cut_for("model.layers.4.self_attn.k_proj.weight", lay) == Cut(0, 128, 192)
    assert cut_for("model.layers.4.self_attn.o_proj.weight", lay) == Cut(1, 384, 576)
    assert cut_for("model.layers.4.mlp.up_proj.weight", lay) == Cut(0, 1024, 1536)
    assert cut_for("model.layers.4.mlp.down_proj.weight", lay) == Cut(1, 1024, 1536)
    assert cut_for("model.embed_tokens.weight", lay) == Cut(0, 32768, 49152)
    assert cut_for("model.layers.4.input_layernorm.weight", lay) is None
    assert cut_for("model.norm.weight", lay) is None
    assert cut_for("model.layers.4.mlp.up_proj.weight", TPLayout.build(SMOLLM2, 1, 0)) is None


def _random_q4(rows: int, cols: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(rows * cols)
    codes = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8)
    scales = torch.rand(rows, cols // 32, generator=gen).half()
    mins = -torch.rand(rows, cols // 32, generator=gen).half()
    return QuantizedWeight("Q4_1", codes, scales, mins)


@pytest.mark.parametrize("cut", [Cut(0, 8, 24), Cut(1, 32, 96), Cut(1, 0, 32)])
def test_a_packed_cut_dequantizes_to_the_dense_cut(cut):
    weight = _random_q4(32, 128)
    part = cut_weight("w", weight, cut)
    dense = weight.dequantize().narrow(cut.dim, cut.start, cut.stop - cut.start)
    assert part.shape == cut.shape(weight.shape)
    assert torch.equal(part.dequantize(), dense)


def test_a_packed_column_cut_inside_a_block_is_refused():
    with pytest.raises(ConfigError, match="model.weights=dequantize"):
        cut_weight("model.layers.0.mlp.down_proj.weight", _random_q4(8, 128), Cut(1, 16, 80))


def test_smollm2_gguf_loader_cut_equals_cutting_the_whole():
    """The loader slices the packed blocks (and unpermutes q/k per head) while reading; the
    result must be the whole checkpoint, cut."""
    from graphexec.loader import default_smollm2_gguf, load_gguf

    path = default_smollm2_gguf()
    whole = load_gguf(path, "smol", weights="native")
    part = load_gguf(path, "smol", weights="native", tp_size=3, tp_rank=1)
    assert part.tp_shard == (3, 1)
    expected = shard_state_dict(whole.state_dict, TPLayout.build(whole.config, 3, 1))
    assert set(part.state_dict) == set(expected)
    for key, weight in part.state_dict.items():
        want = expected[key]
        if isinstance(weight, QuantizedWeight):
            assert all(torch.equal(a, b) for a, b in zip(weight.tensors(), want.tensors(), strict=True)), key
        else:
            assert torch.equal(weight, want), key
    whole_bytes = sum(_nbytes(w) for w in whole.state_dict.values())
    part_bytes = sum(_nbytes(w) for w in part.state_dict.values())
    assert part_bytes < 0.45 * whole_bytes  # norms are replicated, everything else a third


def _nbytes(weight) -> int:
    return weight.nbytes() if isinstance(weight, QuantizedWeight) else weight.numel() * weight.element_size()


def test_gguf_column_cut_inside_a_block_falls_back_clearly(tmp_path):
    """tiny's o_proj has 32 input columns: at tp_size 2 each rank's 16 lie inside one block.
    Kept packed that is refused, naming the way out; dequantized it loads, equal to the whole cut."""
    from graphexec.loader import load_gguf
    from tests.test_loader import save_tiny, write_tiny_gguf

    reference = save_tiny("llama", tmp_path / "hf", tie_word_embeddings=False).state_dict()
    from gguf import GGMLQuantizationType as Q

    types = {"attn_output.weight": Q.Q4_1, "attn_q.weight": Q.Q4_0, "ffn_down.weight": Q.Q8_0}
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", reference, types=types)
    with pytest.raises(ConfigError, match="o_proj.*model.weights=dequantize"):
        load_gguf(tmp_path / "tiny.gguf", "tiny", weights="native", tp_size=2, tp_rank=1)
    whole = load_gguf(tmp_path / "tiny.gguf", "tiny", weights="dequantize")
    part = load_gguf(tmp_path / "tiny.gguf", "tiny", weights="dequantize", tp_size=2, tp_rank=1)
    expected = shard_state_dict(whole.state_dict, TPLayout.build(whole.config, 2, 1))
    assert set(part.state_dict) == set(expected)
    for key, tensor in part.state_dict.items():
        assert torch.equal(tensor, expected[key]), key


@pytest.mark.parametrize("kind, tied", [("llama", False), ("qwen2", True)])
def test_hf_loader_reads_only_the_rank_slices(kind, tied, tmp_path):
    from graphexec.loader import load_hf_dir
    from tests.test_loader import save_tiny

    save_tiny(kind, tmp_path, tie_word_embeddings=tied)
    whole = load_hf_dir(tmp_path, "tiny")
    for rank in range(2):
        part = load_hf_dir(tmp_path, "tiny", tp_size=2, tp_rank=rank)
        expected = shard_state_dict(whole.state_dict, TPLayout.build(whole.config, 2, rank))
        assert set(part.state_dict) == set(expected)
        for key, tensor in part.state_dict.items():
            assert torch.equal(tensor, expected[key]), key


# ---- the sharded model in real process groups -----------------------------------------------

TINY = ["model=tiny-llama", "cache.num_slots=512", "capture=eager"]
# 6 query / 3 KV heads, vocab 322 (padded to 3 x 108), MLP 160 = blocks 2/2/1: every uneven case at tp_size 3.
TINY_UNEVEN = [*TINY, "model.architecture.num_heads=6", "model.architecture.num_kv_heads=3", "model.architecture.vocab_size=322"]
SMOL = ["model=smollm2-135m", "cache.num_slots=512", "cache.max_context=256"]
# The decode graph with its all-reduces compiled in; extend pieces under tp: tests/test_tp_engine.py.
GRAPH = ["capture=graph_first", "capture.decode.buckets=[2]", "capture.extend.backend=eager"]
# Two prompts of 10 + 6 tokens: exactly the 16-token extend bucket, so graph_first runs its pieces.
PROMPTS = [[5, 17, 33, 100, 7, 8, 9, 250, 61, 2], [40, 41, 42, 43, 44, 45]]


def _rank(rank: int, size: int, store: str, runs: list[tuple[list[str], str]]) -> None:
    """This rank's side of each (overrides, out file) run, in order, in one process group."""
    import torch.distributed as dist

    from graphexec.parallel.group import SINGLE, TPGroup

    # graphexec's own calls must not use deprecated collectives (all_gather_tensor warned).
    warnings.filterwarnings("error", category=FutureWarning, module=r"graphexec\.")
    torch.set_num_threads(1)
    tp = SINGLE
    if size > 1:
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=size)
        tp = TPGroup(rank, size, dist.group.WORLD)
    try:
        for overrides, out_file in runs:
            _rank_run(rank, tp, overrides, out_file)
    finally:
        if size > 1:
            dist.destroy_process_group()


def _rank_run(rank: int, tp, overrides: list[str], out_file: str) -> None:
    from graphexec.batch.request import Req
    from graphexec.config import EngineConfig
    from graphexec.engine.rank_setup import load_and_capture
    from graphexec.sampling_params import SamplingParams
    from graphexec.scheduler.hand_batches import HandBatches

    config = EngineConfig.from_overrides(overrides)
    with torch.inference_mode():
        rank_parts = load_and_capture(config, tp)
        runner = rank_parts.runner
        hand = HandBatches(rank_parts.kv_cache)
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        reqs = [Req(f"r{i}", p, params, (), runner.max_context) for i, p in enumerate(PROMPTS)]
        batch = hand.extend(reqs)
        fb = runner.init_forward_batch(batch)
        prefill_hidden = runner.forward(fb)
        prefill_logits = runner.logits_processor(prefill_hidden, fb)
        hand.ran(batch, prefill_logits.argmax(-1).tolist())
        fb = runner.init_forward_batch(hand.decode(reqs))
        decode_hidden = runner.forward(fb)
        decode_logits = runner.logits_processor(decode_hidden, fb)
    result = dict(
        prefill_hidden=prefill_hidden, prefill_logits=prefill_logits,
        decode_hidden=decode_hidden, decode_logits=decode_logits,
    )
    kv_heads = runner.kv_cache.token_pool.k_pool.shape[2]
    stats = runner.backend_stats()
    ran = {mode: (stats[mode]["backend"], stats[mode]["executions"], stats[mode]["fallbacks"]) for mode in ("extend", "decode")}
    torch.save((rank, {k: v.clone().numpy() for k, v in result.items()}, runner.weight_nbytes(), kv_heads, ran), out_file)


def _run_ranks(*groups: tuple[int, list[str]], tmp_path) -> list[list[tuple]]:
    """Each (size, overrides) group's ranks as plain subprocesses, all groups at once (a reference
    run overlaps the sharded one), results per group."""
    return [series[0] for series in _run_rank_series(*[(size, [overrides]) for size, overrides in groups], tmp_path=tmp_path)]


def _run_rank_series(*groups: tuple[int, list[list[str]]], tmp_path) -> list[list[list[tuple]]]:
    """Each (size, [overrides, ...]) group's ranks as plain subprocesses that run every overrides
    in turn (one process per rank, not per run: each start imports torch again), all groups at
    once; results per group, per run, per rank.  Subprocesses, not multiprocessing: its resource
    tracker would outlive the test, and tests/test_tp_engine.py checks that nothing does."""
    runs = []
    for g, (size, series) in enumerate(groups):
        store = f"file://{tmp_path}/store-{g}-{size}"
        outs = [[tmp_path / f"group{g}-run{i}-rank{r}-of-{size}.pt" for r in range(size)] for i in range(len(series))]
        jobs = [[(overrides, str(outs[i][r])) for i, overrides in enumerate(series)] for r in range(size)]
        runs.append((outs, [
            subprocess.Popen([sys.executable, "-c", f"from tests.test_tp_model import _rank; _rank{(r, size, store, jobs[r])!r}"],
                             cwd=Path(__file__).parent.parent)
            for r in range(size)
        ]))
    procs = [p for _, group in runs for p in group]
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * len(procs)
    return [[[torch.load(out, weights_only=False) for out in run] for run in outs] for outs, _ in runs]


def _max_diff(a: dict, b: dict) -> dict[str, float]:
    return {key: float((torch.from_numpy(a[key]) - torch.from_numpy(b[key])).abs().max()) for key in a}


def _check_sharded(size: int, overrides: list[str], reference_overrides: list[str], tmp_path) -> list[tuple]:
    [reference], ranks = _run_ranks((1, reference_overrides), (size, overrides), tmp_path=tmp_path)
    diffs = _max_diff(ranks[0][1], reference[1])
    print(f"tp={size} {overrides}: max |diff| vs tp=1: {diffs}")
    assert max(diffs.values()) < ATOL, diffs
    for _, result, *_ in ranks[1:]:  # every rank ends with the same whole rows
        assert max(_max_diff(result, ranks[0][1]).values()) == 0.0
    # The KV cache holds only the rank's KV heads (one each here, replicated at tp_size 4).
    assert [r[3] for r in ranks] == [max(1, reference[3] // size)] * size
    # Each rank holds a part of the weights, well under the whole.
    assert all(r[2] < reference[2] * (0.75 if size == 2 else 0.6) for r in ranks)
    return ranks


@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: 12-27 s here
def test_tiny_llama_sharded_matches_unsharded(size, tmp_path):
    _check_sharded(size, TINY, TINY, tmp_path)


def test_tiny_uneven_tp3_matches_unsharded(tmp_path):
    """Uneven MLP blocks and a padded vocabulary (322 = 108 + 108 + 106)."""
    _check_sharded(3, TINY_UNEVEN, TINY_UNEVEN, tmp_path)


@pytest.mark.slow
def test_smollm2_q4_1_tp3_graphs_match_unsharded_eager(tmp_path):
    """Native Q4_1 weights cut on block boundaries and the all-reduces inside the compiled decode
    graph, against tp=1 eager (the engine's ranks as processes, scheduler, step messages and the
    extend pieces under tp: the tiny model's tp=2 tests in tests/test_tp_engine.py)."""
    ranks = _check_sharded(3, [*SMOL, *GRAPH], [*SMOL, "capture=eager"], tmp_path)
    # The decode step ran in the captured graph (2 rows, the decode bucket).
    for *_, ran in ranks:
        assert ran["decode"][0] == "full_graph" and ran["decode"][1:] == (1, 0), ran


def test_q8_activations_tp2_match_unsharded(tmp_path):
    """model.activations=q8 on packed weights cut on block boundaries: each rank repacks its own
    rows, and a column cut hands each rank whole activation blocks, quantized as tp=1 quantizes them."""
    from tests.test_loader import save_tiny, write_tiny_gguf
    from tests.test_quant import TINY_TYPES

    model = save_tiny("llama", tmp_path / "hf", hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    write_tiny_gguf(tmp_path / "q.gguf", "llama", state, types=TINY_TYPES, config=dict(hidden_size=64, intermediate_size=128))
    overrides = ["model.source=gguf", f"model.path={tmp_path / 'q.gguf'}", "model.name=q", "model.activations=q8",
                 "cache.num_slots=512", "capture=eager"]
    _check_sharded(2, overrides, overrides, tmp_path)
