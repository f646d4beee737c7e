"""The `cpu` attention backend: its C++ kernels against a plain dense reference on random pools
(windows, a custom softmax scale, logit soft-capping), its binding against the torch_native
backend, per-layer windows through every CPU route, and greedy tokens against torch_native
through the engine."""

from __future__ import annotations

import pytest
import torch

from graphexec import Engine, SamplingParams
from graphexec.attention.backend import ForwardContext
from graphexec.attention.cpu import CpuAttnBackend, load_kernels
from graphexec.attention.forward_context import forward_context
from graphexec.attention.op import unified_attention
from graphexec.attention import torch_native
from graphexec.attention.torch_native import TorchNativeAttnBackend
from graphexec.batch.forward_batch import ForwardBatch
from graphexec.batch.forward_mode import ForwardMode
from graphexec.cache.kv_pool import TokenToKVPool

# at::parallel_for's split between threads is part of what these test (tests/conftest.py)
pytestmark = pytest.mark.two_threads


@pytest.fixture(scope="module", autouse=True)
def kernels():
    load_kernels()


class Batch:
    """A random pool (slots scattered) and the metadata of one forward over `runs`: (cached
    prefix, new tokens) per request, plus `pad` padded token rows at the end.  `window`: a
    sliding window (a query at p sees keys p - window + 1 .. p; 0: full attention), or a tuple of
    one per layer; `scale`: the softmax scale (None: head_dim ** -0.5); `softcap`: scores become
    softcap * tanh(score / softcap) before the mask (0: none)."""

    def __init__(self, runs, heads=9, kv_heads=3, head_dim=64, act=torch.float32, kv=torch.float32, pad=0,
                 layers=3, seed=0, window=0, scale=None, softcap=0.0):
        gen = torch.Generator().manual_seed(seed)
        self.window, self.scale, self.softcap = window, scale, softcap
        self.runs, self.heads, self.kv_heads, self.head_dim, self.pad = runs, heads, kv_heads, head_dim, pad
        total = sum(p + n for p, n in runs)
        num_slots = total + 8
        self.pool = TokenToKVPool(num_slots, layers, kv_heads, head_dim, kv)
        self.pool.k_pool.copy_(torch.randn(self.pool.k_pool.shape, generator=gen))
        self.pool.v_pool.copy_(torch.randn(self.pool.v_pool.shape, generator=gen))
        slots = torch.randperm(num_slots, generator=gen)[:total] + 1  # never the dummy slot 0
        self.table = torch.zeros(len(runs) + 1, max(p + n for p, n in runs) + 3, dtype=torch.int64)
        locs, at = [], 0
        for r, (p, n) in enumerate(runs):
            self.table[r + 1, : p + n] = slots[at : at + p + n]
            locs.append(slots[at + p : at + p + n])
            at += p + n
        self.tokens = sum(n for _, n in runs)
        rows = self.tokens + pad
        self.loc = torch.cat(locs + [torch.zeros(pad, dtype=torch.int64)])
        self.q = torch.randn(rows, heads * head_dim, generator=gen).to(act)
        self.k = torch.randn(rows, kv_heads * head_dim, generator=gen).to(act)
        self.v = torch.randn(rows, kv_heads * head_dim, generator=gen).to(act)
        self.req = torch.arange(1, len(runs) + 1)
        self.seq_lens = torch.tensor([p + n for p, n in runs])
        self.prefix = torch.tensor([p for p, _ in runs])
        self.lens = torch.tensor([n for _, n in runs])
        self.start = torch.cumsum(self.lens, 0) - self.lens

    def layer_window(self, layer) -> int:
        return self.window[layer] if isinstance(self.window, tuple) else self.window

    def reference(self, layer, softcap=None):
        """Write k/v then attend, in plain float64 (see dense_attention) over gathered keys; also
        the expected pools.  `softcap`: another cap than the batch's (0: none)."""
        d, t = self.head_dim, self.tokens
        window, softcap = self.layer_window(layer), self.softcap if softcap is None else softcap
        scale = d**-0.5 if self.scale is None else self.scale
        k_pool, v_pool = self.pool.k_pool.clone(), self.pool.v_pool.clone()
        k_pool[layer, self.loc[:t]] = self.k[:t].view(t, self.kv_heads, d).to(k_pool.dtype)
        v_pool[layer, self.loc[:t]] = self.v[:t].view(t, self.kv_heads, d).to(v_pool.dtype)
        out = torch.zeros(t + self.pad, self.heads * d, dtype=torch.float64)
        for r, (p, n) in enumerate(self.runs):
            slots = self.table[r + 1, : p + n]
            keys = k_pool[layer, slots].double().transpose(0, 1)[None]
            values = v_pool[layer, slots].double().transpose(0, 1)[None]
            s = int(self.start[r])
            queries = self.q[s : s + n].double().view(n, self.heads, d).transpose(0, 1)[None]
            o = dense_attention(queries, keys, values, p, window, scale, softcap)
            out[s : s + n] = o[0].transpose(0, 1).reshape(n, -1)
        return out, k_pool, v_pool

    def run_kernel(self, layer, decode):
        """paged_attention with every input explicit (its 0s: no window, head_dim ** -0.5, no cap)."""
        out = torch.full_like(self.q, float("nan"))
        if decode:
            req = torch.cat([self.req, torch.zeros(self.pad, dtype=torch.int64)])  # padded rows: request row 0
            seq_lens = torch.cat([self.seq_lens, torch.ones(self.pad, dtype=torch.int64)])  # ... seq_len 1
            extend = (None, None, None)
        else:
            req, seq_lens, extend = self.req, self.seq_lens, (self.prefix, self.lens, self.start)
        torch.ops.graphexec.paged_attention(
            self.q, self.k, self.v, out, self.pool.k_pool, self.pool.v_pool, layer, self.table, req, seq_lens,
            self.loc, *extend, self.tokens, self.layer_window(layer), self.scale or 0.0, self.softcap,
        )
        return out

    def forward_batch(self, decode) -> ForwardBatch:
        rows = self.tokens + self.pad
        ids = torch.zeros(rows, dtype=torch.int64)
        pad_rows = torch.zeros(self.pad, dtype=torch.int64)
        extend = dict(
            extend_prefix_lens=None, extend_seq_lens=None, extend_start_loc=None, extend_prefix_lens_cpu=None,
            extend_seq_lens_cpu=None, extend_num_tokens=None,
        )
        req, seq_lens = self.req, self.seq_lens
        if decode:
            req, seq_lens = torch.cat([req, pad_rows]), torch.cat([seq_lens, pad_rows + 1])
        else:
            extend = dict(
                extend_prefix_lens=self.prefix, extend_seq_lens=self.lens, extend_start_loc=self.start,
                extend_prefix_lens_cpu=tuple(self.prefix.tolist()), extend_seq_lens_cpu=tuple(self.lens.tolist()),
                extend_num_tokens=self.tokens,
            )
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, batch_size=int(req.numel()),
            input_ids=ids, positions=ids, req_pool_indices=req, seq_lens=seq_lens,
            seq_lens_cpu=tuple(seq_lens.tolist()), seq_lens_sum=int(seq_lens.sum()), out_cache_loc=self.loc,
            num_token_non_padded=self.tokens, sampling_info=None, **extend,
            num_token_non_padded_device=torch.tensor([self.tokens]) if self.pad else None,
        )


def dense_attention(queries, keys, values, prefix: int, window: int, scale: float, softcap: float) -> torch.Tensor:
    """The plain definition: queries [1, heads, n, d] at positions prefix.., keys/values
    [1, kv_heads, prefix + n, d]; scores scale * q.k, soft-capped (cap * tanh(s / cap), before
    the mask, as transformers' Gemma 2), causal and windowed mask, softmax, times values."""
    group = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = queries @ keys.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    n, k_len = scores.shape[-2:]
    q_pos, k_pos = torch.arange(prefix, prefix + n)[:, None], torch.arange(k_len)[None, :]
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ values


def _check(batch: Batch, decode: bool, layer: int = 1, tol: float = 2e-5) -> None:
    expected, k_pool, v_pool = batch.reference(layer)
    out = batch.run_kernel(layer, decode)
    t = batch.tokens
    torch.testing.assert_close(out[:t].double(), expected[:t], atol=tol, rtol=tol)
    assert torch.equal(out[t:], torch.zeros_like(out[t:]))  # padded rows: zero, finite
    # Exactly the real tokens' slots were written, in this layer only (padded rows write nothing).
    assert torch.equal(batch.pool.k_pool, k_pool) and torch.equal(batch.pool.v_pool, v_pool)


# -- kernels against SDPA -----------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128, 16, 8])  # 8: the portable (non-AVX-512) path
def test_decode_ragged_rows_gqa_and_padding(head_dim):
    runs = [(0, 1), (4, 1), (63, 1), (64, 1), (200, 1), (700, 1)]
    _check(Batch(runs, head_dim=head_dim, pad=3), decode=True)


def test_decode_long_context_few_rows_splits_keys():
    """One row of 3000 keys: split across threads, partial softmaxes combined."""
    _check(Batch([(2999, 1)]), decode=True, layer=2)
    _check(Batch([(2047, 1), (5, 1)], heads=8, kv_heads=1), decode=True)


@pytest.mark.parametrize("head_dim", [64, 16, 8])
def test_extend_with_and_without_prefix_in_one_batch(head_dim):
    # Long runs (blocked kernel, partial tiles, prefixes off block boundaries), short runs (a
    # MIXED batch's decode rows, query at a time), and padded token rows.
    runs = [(0, 100), (37, 70), (0, 5), (130, 3), (5, 1), (64, 64), (0, 1)]
    _check(Batch(runs, head_dim=head_dim, pad=5), decode=False)


def test_extend_1024_tokens_causal():
    _check(Batch([(0, 1024)], layers=1), decode=False, layer=0)


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_reduced_precision_activations_and_cache(act, kv):
    tol = 2e-5 if act == torch.float32 else 2e-2  # the output's own rounding
    _check(Batch([(0, 40), (77, 9), (3, 1)], heads=4, kv_heads=2, act=act, kv=kv, pad=2), decode=False, tol=tol)
    _check(Batch([(40, 1), (600, 1)], heads=4, kv_heads=2, act=act, kv=kv, pad=1), decode=True, tol=tol)


def test_bad_metadata_is_refused_not_read():
    batch = Batch([(10, 1)])
    batch.table[1, 3] = batch.pool.num_slots + 5  # past the pool
    with pytest.raises(RuntimeError, match="not a slot of the pool"):
        batch.run_kernel(0, decode=True)
    batch = Batch([(10, 1)])
    with pytest.raises(RuntimeError, match="layer 7 is not in the pool"):
        batch.run_kernel(7, decode=True)


@pytest.mark.parametrize("window", [1, 7, 64, 100, 5000])
def test_sliding_window_decode_and_extend(window):
    """Windows shorter than a block, one block, off block boundaries and past every length: decode
    rows (split-K for the long one), short runs (query at a time) and long runs (the blocked loop,
    whole key blocks below the window skipped) against windowed SDPA."""
    decode_runs = [(0, 1), (4, 1), (63, 1), (200, 1), (700, 1)]
    _check(Batch(decode_runs, pad=2, window=window), decode=True)
    _check(Batch([(2999, 1)], window=window), decode=True, layer=2)  # keys split across threads
    extend_runs = [(0, 100), (37, 70), (0, 5), (130, 3), (5, 1), (64, 64), (300, 200)]
    _check(Batch(extend_runs, pad=3, window=window), decode=False)
    _check(Batch(extend_runs, head_dim=8, window=window), decode=False)  # the portable path


def test_sliding_window_reduced_precision_pool():
    _check(Batch([(0, 40), (77, 9), (3, 1)], heads=4, kv_heads=2, act=torch.bfloat16, kv=torch.bfloat16, window=13),
           decode=False, tol=2e-2)
    _check(Batch([(40, 1), (600, 1)], heads=4, kv_heads=2, act=torch.bfloat16, kv=torch.bfloat16, window=13),
           decode=True, tol=2e-2)


@pytest.mark.parametrize("head_dim", [64, 8])  # 8: the portable (non-AVX-512) path
def test_custom_scale_and_logit_softcap(head_dim):
    """Gemma's options in the kernels: a softmax scale other than head_dim ** -0.5, and scores
    soft-capped before the running max (decode rows, split keys, short runs and the blocked
    extend loop, with and without a window).  Scale 0.5 makes scores of tens, so a cap of 5
    changes the output (checked against the uncapped reference too)."""
    decode_runs, extend_runs = [(0, 1), (4, 1), (63, 1), (200, 1)], [(0, 100), (37, 70), (0, 5), (130, 3)]
    for window in (0, 7):
        _check(Batch(decode_runs, head_dim=head_dim, pad=2, window=window, scale=0.05), decode=True)
        _check(Batch(extend_runs, head_dim=head_dim, pad=2, window=window, scale=0.05), decode=False)
        for runs, decode in ((decode_runs, True), (extend_runs, False), ([(2999, 1)], True)):
            batch = Batch(runs, head_dim=head_dim, pad=2, window=window, scale=0.5, softcap=5.0)
            _check(batch, decode=decode, tol=5e-5)
            uncapped = batch.reference(1, softcap=0.0)[0][: batch.tokens]
            assert (batch.reference(1)[0][: batch.tokens] - uncapped).abs().max() > 0.1


# -- the backend: binding, routes, against torch_native ------------------------------------------


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("decode", [True, False])
def test_backend_matches_torch_native(decode, window):
    """Through init_forward_metadata and the model's op call: the C++ route (bound) equals the
    torch_native backend, KV writes included, with and without a sliding window."""
    runs = [(5, 1), (40, 1), (130, 1)] if decode else [(0, 30), (12, 17), (50, 1)]
    outputs, pools = [], []
    for cls in (TorchNativeAttnBackend, CpuAttnBackend):
        batch = Batch(runs, pad=2)
        fb = batch.forward_batch(decode)
        backend = cls(batch.heads, batch.kv_heads, batch.head_dim, sliding_window=window)
        with torch.inference_mode(), forward_context(ForwardContext(fb, backend, batch.pool, None)):
            backend.init_forward_metadata(fb, batch.table)
            outputs.append(unified_attention(batch.q, batch.k, batch.v, 1))
        pools.append((batch.pool.k_pool, batch.pool.v_pool))
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-5, rtol=2e-5)
    assert torch.equal(outputs[1][-2:], torch.zeros_like(outputs[1][-2:]))
    if window is not None:  # torch_native against windowed SDPA too (Batch.reference)
        reference = Batch(runs, pad=2, window=window).reference(1)[0]
        torch.testing.assert_close(outputs[0][:-2].double(), reference[:-2], atol=2e-5, rtol=2e-5)
    # The same real slots written (torch_native also writes padded rows into the dummy slot 0).
    assert all(torch.equal(a[:, 1:], b[:, 1:]) for a, b in zip(pools[0], pools[1]))


WINDOWS = (4, None, 4)  # per layer, Gemma-style: windowed, full, windowed


def _cpu_python_route(*args, **kwargs) -> CpuAttnBackend:
    """A cpu backend served through Python (paged_attention with the layer's window), not the binding."""
    backend = CpuAttnBackend(*args, **kwargs)
    backend.forward = lambda *a: type(backend).forward(backend, *a)
    return backend


class _NativeStatic(TorchNativeAttnBackend):
    """torch_native building its decode metadata into the fixed buffers of graph capture."""

    def init_forward_metadata(self, fb, req_to_token):
        if self._static is None:
            self.enable_static_decode_metadata(8, req_to_token.shape[1], req_to_token.device)
        super().init_forward_metadata(fb, req_to_token)


@pytest.mark.parametrize("options", [{}, dict(scale=0.5, softcap=5.0)], ids=["plain", "scale-softcap"])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("make", [TorchNativeAttnBackend, _NativeStatic, CpuAttnBackend, _cpu_python_route],
                         ids=["torch_native", "torch_native-static", "cpu", "cpu-python"])
def test_per_layer_windows_match_dense_reference(make, decode, options, monkeypatch):
    """One backend, sliding_window=(4, None, 4): each layer's call (the op, with the layer id the
    model passes) attends with its own layer's window, against the dense reference with that
    window; rows longer than the window, prefixes and none, short and long extend runs, padding.
    With a custom scale and a soft-cap too (torch_native's explicit scores in chunks of 16 queries)."""
    monkeypatch.setattr(torch_native, "_SOFTCAP_QUERY_CHUNK", 16)
    runs = [(0, 1), (3, 1), (10, 1), (40, 1), (130, 1)] if decode else [(0, 30), (12, 17), (50, 1), (5, 3), (0, 70)]
    windows = tuple(w or 0 for w in WINDOWS)
    batch = Batch(runs, pad=2, window=windows, scale=options.get("scale"), softcap=options.get("softcap", 0.0))
    fb = batch.forward_batch(decode)
    backend = make(batch.heads, batch.kv_heads, batch.head_dim, sliding_window=WINDOWS, scale=options.get("scale"),
                   logit_softcap=options.get("softcap"))
    assert [backend.window(layer) for layer in range(3)] == [4, None, 4]
    expected = [batch.reference(layer) for layer in range(3)]
    with torch.inference_mode(), forward_context(ForwardContext(fb, backend, batch.pool, None)):
        backend.init_forward_metadata(fb, batch.table)
        try:
            outputs = [unified_attention(batch.q, batch.k, batch.v, layer) for layer in range(3)]
        finally:
            backend.end_forward()
    t = batch.tokens
    for layer, (out, (ref, k_pool, v_pool)) in enumerate(zip(outputs, expected)):
        torch.testing.assert_close(out[:t].double(), ref[:t], atol=5e-5, rtol=5e-5, msg=f"layer {layer}")
        assert torch.equal(out[t:], torch.zeros_like(out[t:]))
        assert torch.equal(batch.pool.k_pool[layer, 1:], k_pool[layer, 1:])  # slot 0: torch_native's padding
    # The windows bite: layer 1 (full) differs from layer 0's window on the same inputs.
    assert not torch.allclose(expected[0][0][:t], Batch(runs, pad=2, window=0, scale=batch.scale,
                                                        softcap=batch.softcap).reference(0)[0][:t])


def test_window_and_option_arguments():
    backend = TorchNativeAttnBackend(4, 2, 16, sliding_window=(3, None))
    assert backend.windows == (3, None) and backend.window(1) is None and backend.scale == 0.25
    assert backend.logit_softcap is None
    uniform = TorchNativeAttnBackend(4, 2, 16, sliding_window=9, scale=0.1, logit_softcap=0.0)
    assert uniform.window(5) == 9 and uniform.windows == (9,) and uniform.scale == 0.1 and uniform.logit_softcap is None
    # A per-layer tuple of one window is that window (a model config's list for every layer).
    assert TorchNativeAttnBackend(4, 2, 16, sliding_window=(9, 9, 9)).sliding_window == 9
    assert TorchNativeAttnBackend(4, 2, 16, sliding_window=[None, None]).sliding_window is None
    for bad in (0, (4, 0), (), (4, 2.5)):
        with pytest.raises(ValueError, match="sliding_window"):
            TorchNativeAttnBackend(4, 2, 16, sliding_window=bad)
    with pytest.raises(ValueError, match="layer 2 has no sliding_window"):
        backend.window(2)


def test_binding_never_serves_another_backend():
    """A cpu backend's binding lives for its forward only (`end_forward`, called when the runner's
    forward scope closes), so the next backend that serves from Python on this thread gets the
    op; a spy on forward routes the op through Python."""
    batch = Batch([(8, 1), (3, 1)])
    fb = batch.forward_batch(True)
    cpu = CpuAttnBackend(9, 3, 64)
    native = TorchNativeAttnBackend(9, 3, 64)
    seen = []

    def spy(q, k, v, out, layer_id, ctx):
        seen.append(layer_id)
        return type(native).forward(native, q, k, v, out, layer_id, ctx)

    with torch.inference_mode():
        with forward_context(ForwardContext(fb, cpu, batch.pool, None)):
            cpu.init_forward_metadata(fb, batch.table)  # binds
            cpu.end_forward()  # unbinds, as ModelRunner's forward scope does on exit
        native.forward = spy
        with forward_context(ForwardContext(fb, native, batch.pool, None)):
            native.init_forward_metadata(fb, batch.table)
            unified_attention(batch.q, batch.k, batch.v, 0)
        assert seen == [0]
        cpu.forward = lambda *args: seen.append("cpu") or type(cpu).forward(cpu, *args)
        with forward_context(ForwardContext(fb, cpu, batch.pool, None)):
            cpu.init_forward_metadata(fb, batch.table)
            unified_attention(batch.q, batch.k, batch.v, 1)
        assert seen == [0, "cpu"]


def test_a_binding_outliving_its_tensors_is_dropped():
    """The binding holds no tensor alive (a thread ending at interpreter shutdown must not need
    the GIL to drop one): once its forward's tensors are gone the op takes the Python route."""
    batch = Batch([(8, 1)])
    q, k, v = batch.q, batch.k, batch.v
    fb = batch.forward_batch(True)
    cpu = CpuAttnBackend(9, 3, 64)
    with torch.inference_mode():
        with forward_context(ForwardContext(fb, cpu, batch.pool, None)):
            cpu.init_forward_metadata(fb, batch.table)
        del cpu, fb, batch
        with pytest.raises(RuntimeError, match="no forward context"):
            unified_attention(q, k, v, 0)


def test_pool_buffers_are_views_of_one_tensor_per_side():
    pool = TokenToKVPool(10, 3, 2, 4, torch.float32)
    pool.k_buffers[1][5] = 1.0
    pool.write(2, torch.tensor([3]), torch.ones(1, 2, 4, dtype=torch.bfloat16), torch.ones(1, 2, 4))
    assert pool.k_pool[1, 5].eq(1).all() and pool.k_pool[2, 3].eq(1).all() and pool.v_pool[2, 3].eq(1).all()
    assert pool.nbytes() == 2 * 3 * 11 * 2 * 4 * 4


# -- engine --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2"])
def test_engine_greedy_tokens_equal_torch_native(model):
    """Batched prefill (with prefix-cache hits on the second round), decode, chunked prefill."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 300, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 17, 60)] + [[5, 6]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    tokens = {}
    for backend in ("torch_native", "cpu"):
        engine = Engine(overrides=[f"model={model}", "capture=eager", "cache.num_slots=2048",
                                   "scheduler.max_prefill_tokens=64", "scheduler.mixed_chunk=true",
                                   f"attention_backend={backend}"])
        rounds = [[o.token_ids for o in engine.generate(prompts, params)] for _ in range(2)]
        tokens[backend] = rounds
        assert rounds[0] == rounds[1]
    assert tokens["cpu"] == tokens["torch_native"]
