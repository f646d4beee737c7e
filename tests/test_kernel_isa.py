"""The C++ kernels' instruction-set variant is chosen by the CPU the process runs on (torch's own
detection), never by the build machine, and each variant builds into its own folder.  Every
variant this CPU runs gives the same results as the portable one: the opt-in test below builds
each (about two minutes apiece on 2 cores), run it when the kernels or their flags change:
GRAPHEXEC_TEST_ALL_ISA=1 pytest tests/test_kernel_isa.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphexec import kernels
from graphexec.errors import CheckpointError

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("capability", "features", "expected"),
    [
        ("AVX512", {"avx512_vnni": True, "avx_vnni": True}, "avx512vnni"),  # Sapphire Rapids
        ("AVX512", {"avx512_vnni": True}, "avx512vnni"),  # Zen 4, Ice Lake server
        ("AVX512", {}, "avx512"),  # Skylake server
        ("AVX2", {"avx512_vnni": True, "avx_vnni": True}, "avxvnni"),  # ATEN_CPU_CAPABILITY=avx2 on SPR
        ("AVX2", {"avx_vnni": True}, "avxvnni"),  # Alder Lake
        ("AVX2", {}, "avx2"),
        ("DEFAULT", {"avx_vnni": True}, "portable"),
        ("SVE256", {}, "portable"),
    ],
)
def test_the_variant_follows_the_running_cpu(monkeypatch, capability, features, expected):
    monkeypatch.delenv("GRAPHEXEC_KERNEL_ISA", raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: features)
    assert kernels.isa() == expected


def test_a_lower_variant_may_be_chosen_a_higher_or_unknown_one_is_refused(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_vnni": True})
    monkeypatch.setenv("GRAPHEXEC_KERNEL_ISA", "avx2")
    assert kernels.isa() == "avx2"
    # AVX-VNNI is not implied by AVX-512 (Zen 4 and Ice Lake server have AVX512-VNNI only).
    monkeypatch.setenv("GRAPHEXEC_KERNEL_ISA", "avxvnni")
    with pytest.raises(CheckpointError, match="GRAPHEXEC_KERNEL_ISA='avxvnni' needs instructions this CPU lacks"):
        kernels.isa()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {})
    monkeypatch.setenv("GRAPHEXEC_KERNEL_ISA", "portable")
    assert kernels.isa() == "portable"
    monkeypatch.setenv("GRAPHEXEC_KERNEL_ISA", "avx512")
    with pytest.raises(CheckpointError, match="GRAPHEXEC_KERNEL_ISA='avx512' needs instructions this CPU lacks"):
        kernels.isa()
    monkeypatch.setenv("GRAPHEXEC_KERNEL_ISA", "native")
    with pytest.raises(CheckpointError, match="not a kernel variant"):
        kernels.isa()


def test_no_variant_asks_for_the_build_machines_cpu():
    source = (REPO / "graphexec" / "kernels" / "__init__.py").read_text()
    assert "march=native" not in source and "mtune=native" not in source
    assert not any("native" in flag for flags in kernels.ISA_FLAGS.values() for flag in flags)


_PROBE = """
import sys
import torch
from graphexec import Engine, SamplingParams, kernels
from graphexec.quant import ensure_kernels
from graphexec.quant.repack import block_rows16, repack_rows16
from tests.test_quant import TYPES, _packed

ensure_kernels()
out = {}
for qtype in TYPES:
    for rows in (1, 5, 48):  # 48 and up: the dequantized-tile GEMM path
        weight, _ = _packed(qtype, 130, 160, seed=rows)
        x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
        out[qtype, rows] = torch.ops.graphexec.qlinear(x, weight.codes, weight.scales, weight.mins)
        packed = repack_rows16(weight)
        out[qtype, rows, "q8"] = torch.ops.graphexec.qlinear_q8(x, packed.codes, packed.scales, packed.mins, packed.rows)
out["quantize_q8"] = torch.ops.graphexec.quantize_q8(torch.randn(9, 160, generator=torch.Generator().manual_seed(9)))
# GGUF's own blocks (K-quants, Q5_x): dequantized bit for bit, and streamed (1, 5, 9) or tiled (48).
from tests.test_kquants import TYPES as BLOCK_TYPES, _weight
for qtype in BLOCK_TYPES:
    weight, _ = _weight(qtype, 40, 512)
    out[qtype, "dequantize"] = torch.ops.graphexec.qdequantize_blocks(weight.blocks, weight.format.type_id, torch.float32)
    for rows in (1, 5, 9, 48):  # 9: AVX2 streams more than 4 rows four at a time
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        out[qtype, rows] = torch.ops.graphexec.qlinear_blocks(x, weight.blocks, weight.format.type_id)
        packed = block_rows16(weight)  # the 8-bit activation path's layout
        out[qtype, rows, "q8"] = torch.ops.graphexec.qlinear_q8(x, packed.codes, packed.scales, packed.mins, packed.rows)
# The C++ attention with Gemma's options (a custom scale, logit soft-capping, the window of the
# layer called): decode rows with split keys, short and blocked extend runs, AVX-512 and any head_dim.
from tests.test_attention_cpu import Batch
for decode, runs in ((True, [(0, 1), (63, 1), (200, 1), (2999, 1)]), (False, [(0, 100), (37, 70), (0, 5), (130, 3)])):
    for head_dim in (64, 8):
        batch = Batch(runs, head_dim=head_dim, window=(7, 0, 7), scale=0.5, softcap=5.0)
        out["attention", decode, head_dim] = batch.run_kernel(0, decode)
# The C++ attention (decode and extend) inside a real engine's greedy run.
engine = Engine(["model=tiny-llama", "capture=eager", "attention_backend=cpu", "cache.num_slots=1024"])
outputs = engine.generate(["hello world, " * 9, "abc"], SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=1))
out["tokens"] = [o.token_ids for o in outputs]
engine.shutdown()
torch.save((kernels.isa(), out), sys.argv[1])
"""


@pytest.mark.skipif(not os.environ.get("GRAPHEXEC_TEST_ALL_ISA"), reason="builds every variant (minutes): set GRAPHEXEC_TEST_ALL_ISA=1")
def test_every_variant_this_cpu_runs_equals_the_portable_one(tmp_path):
    variants = kernels.runnable()
    results = {}
    for variant in variants:
        out = tmp_path / f"{variant}.pt"
        env = os.environ | {"GRAPHEXEC_KERNEL_ISA": variant, "PYTHONPATH": str(REPO)}
        subprocess.run([sys.executable, "-c", _PROBE, str(out)], cwd=REPO, env=env, check=True, timeout=900)
        results[variant] = torch.load(out)
    for variant, (built, out) in results.items():
        assert built == variant
        reference = results["portable"][1]
        assert out["tokens"] == reference["tokens"], variant
        for key, value in out.items():
            if key == "quantize_q8":  # every path rounds the same products: the codes are equal
                assert all(torch.equal(a, b) for a, b in zip(value, reference[key])), variant
                continue
            if key != "tokens" and key[-1] == "dequantize":  # gguf's fp32 values on every variant
                assert torch.equal(value.view(torch.int32), reference[key].view(torch.int32)), f"{variant} {key}"
            if key != "tokens":  # the same values; only the vector width changes the summation order
                # (an error bound relative to the output's scale: K-quant outputs reach the hundreds)
                scale = max(1.0, reference[key].abs().max().item())
                torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-5 * scale, msg=f"{variant} {key}")


def test_a_build_lock_left_by_a_killed_build_does_not_hang_every_later_start(tmp_path, capsys):
    """torch waits on its build lock until the file goes; a build killed mid-way leaves it."""
    import time

    kernels._clear_stale_lock(tmp_path)
    assert capsys.readouterr().err == ""  # no lock: nothing to say
    lock = tmp_path / "lock"
    lock.touch()  # just taken (an up-to-date library's no-op build, say): waited for in silence
    kernels._clear_stale_lock(tmp_path)
    assert lock.exists() and capsys.readouterr().err == ""
    building = time.time() - 60  # a build running for a minute: waited for, and said so
    os.utime(lock, (building, building))
    kernels._clear_stale_lock(tmp_path)
    assert lock.exists() and f"remove {lock}" in capsys.readouterr().err
    left = time.time() - kernels.STALE_LOCK_S - 60  # older than any build: removed
    os.utime(lock, (left, left))
    kernels._clear_stale_lock(tmp_path)
    assert not lock.exists() and "did not finish" in capsys.readouterr().err
