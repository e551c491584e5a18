"""Tuning the LM-head GEMMs ahead of the calls (``redline.kernels.lm_head_tuning``) on a Hopper GPU: afterwards no
call at any row count up to the bound times configs or compiles the GEMM, and a process seeded from the table
times nothing."""

import pytest
import torch

H, V, MAX_ROWS = 256, 5000, 700


@pytest.fixture
def hopper(cuda, monkeypatch):
    if torch.cuda.get_device_capability(cuda) < (9, 0):
        pytest.skip("the LM-head Triton GEMMs need TMA (compute capability 9.0 or newer)")
    monkeypatch.setenv("REDLINE_LM_HEAD_GEMM", "triton-dz")  # the dz GEMM at every row count, not from 16384
    from redline.kernels import lm_head_tuning

    for kernel in lm_head_tuning.AUTOTUNED.values():
        monkeypatch.setattr(kernel, "cache", {})
    weight = (torch.randn(V, H, generator=torch.Generator().manual_seed(0)) * H ** -0.5).to(torch.bfloat16)
    return weight.to(cuda)


def _tune(weight):
    from redline.kernels import lm_head_tuning

    shapes = lm_head_tuning.reachable(MAX_ROWS, V, H, weight.dtype, torch.cuda.get_device_capability(weight.device))
    assert set(shapes) == {"gemm_dz"}
    return lm_head_tuning.tune(weight, shapes)


def _fwd_bwd(weight, n):
    from redline.kernels import fused_linear_logprobs

    gen = torch.Generator().manual_seed(n)
    hidden = torch.randn(n, H, generator=gen).to(torch.bfloat16).to(weight.device).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=gen).to(weight.device)
    mask = (torch.rand(n, generator=gen) > 0.2).to(weight.device)
    w = weight.clone().requires_grad_()
    logp, entropy = fused_linear_logprobs(hidden, w, targets, mask=mask, return_entropy=True)
    (logp + entropy).sum().backward()
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_after_tuning_no_row_count_tunes_or_compiles_the_gemm(hopper, monkeypatch):
    import triton

    from redline.kernels.lm_head_gemm_triton import _gemm_dz_kernel

    assert _tune(hopper) > 0
    tuned = dict(_gemm_dz_kernel.cache)
    compiled = []
    monkeypatch.setattr(triton.knobs.compilation, "listener",
                        lambda *, src, metadata, **_: compiled.append(metadata.get("name", str(src))))
    for n in (1, 2, 17, 255, 256, 300, 511, 512, 699, 700):
        _fwd_bwd(hopper, n)
    assert _gemm_dz_kernel.cache == tuned
    assert not [name for name in compiled if "gemm_dz" in name]


@pytest.mark.gpu
def test_gpu_a_process_seeded_from_the_table_times_no_config(hopper, monkeypatch, tmp_path):
    from redline.kernels import lm_head_tuning, tuning_table
    from redline.kernels.lm_head_gemm_triton import _gemm_dz_kernel

    _tune(hopper)
    fp = tuning_table.current_fingerprint(hopper.device)
    tuning_table.save(tmp_path / "t.json", fp, tuning_table.harvest(lm_head_tuning.AUTOTUNED))
    tuned = dict(_gemm_dz_kernel.cache)
    _gemm_dz_kernel.cache.clear()  # a fresh process's autotuner
    assert tuning_table.apply(lm_head_tuning.AUTOTUNED, tuning_table.load(tmp_path / "t.json", fp)) == len(tuned)
    assert _gemm_dz_kernel.cache == tuned

    def no_timing(*args, **kwargs):
        raise AssertionError("a seeded key was timed again")

    monkeypatch.setattr(_gemm_dz_kernel, "_bench", no_timing)
    for n in (5, 300, 700):
        _fwd_bwd(hopper, n)
