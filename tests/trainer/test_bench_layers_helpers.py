"""The layer benchmark's CPU-side helpers: kernel categories of a profile, the scaling report."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_layers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_layers_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kernel, category", [
    # names from the committed H100 profiles (benchmarks/results/trainer/profile-*.txt)
    ("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("void transformer_engine::kv_cache::convert_thd_to_bshd_kernel<__nv_bfloat16>", "attention"),
    ("void transformer_engine::scaled_masked_softmax_warp_forward<__nv_bfloat16>", "attention"),
    ("_cast_transpose_kernel", "fp8_cast"),
    ("_amax_kernel", "fp8_cast"),
    ("_rowwise_cast_kernel", "fp8_cast"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda, "
     "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1>>", "copy"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("void transformer_engine::normalization::rmsnorm_fwd_tuned_kernel<float>", "norm"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "comm"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
])
def test_kernel_category(bench, kernel, category):
    assert bench.kernel_category(kernel) == category


def test_scaling_markdown_has_one_row_per_result_with_its_efficiency(bench):
    result = {"device": "NVIDIA H200", "shape": "llama3-8b", "layers": 4, "backend": "bf16",
              "attention": "redline:sdpa", "tp": 4, "sp": True, "pp": 1, "gpus": 4, "single_gpu_ms": 200.0,
              "parallel_ms": 58.0, "speedup": 200 / 58, "scaling_efficiency": 200 / (4 * 58),
              "tokens_per_s": 282482.0, "model_tflops_per_gpu": 390.0, "rank0_kernel_ms": {"comm_ms": 6.5}}
    table = bench.scaling_markdown([result, dict(result, tp=2, gpus=2)]).splitlines()
    rows = [line for line in table if line.startswith("| NVIDIA H200")]
    assert len(rows) == 2
    assert "| 86.2% |" in rows[0] and "| 6.50 |" in rows[0]


def test_layer_flops_counts_gemms_and_causal_attention(bench):
    from redline.trainer.models.spec import spec_from_hf

    spec = spec_from_hf(bench.SHAPES["llama3-8b"](1))
    gemm_params = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    attention_fwd = 4 * 2 * 4096 ** 2 * 32 * 128
    assert bench.layer_flops(spec, 16384, 4, 1) == 6 * 16384 * gemm_params + 3.5 * attention_fwd


def scaling_step_worker(rank, store, tp, pp, sp):
    import torch
    import torch.distributed as dist

    from redline.trainer.parallel import ParallelConfig
    from tests.trainer.conftest import tiny_config

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        spec = importlib.util.spec_from_file_location("bench_layers_in_worker", BENCH)
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        config = tiny_config("qwen3")
        input_ids = torch.randint(0, config.vocab_size, (32,), generator=torch.Generator().manual_seed(0))
        if pp > 1:  # the benchmark's PP layout: one 8-token sequence per micro-batch
            micro = [(input_ids[i * 8:(i + 1) * 8], torch.tensor([0, 8], dtype=torch.int32)) for i in range(4)]
        else:
            micro = [(input_ids, torch.arange(0, 33, 8, dtype=torch.int32))]
        model = bench.from_config(config, dtype=torch.float32, seed=0, parallel=ParallelConfig(tp=tp, pp=pp, sp=sp))
        bench._scaling_step(model, micro, 8)()
        for name, param in model.layers.named_parameters():
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, sp", [(2, 1, True), (1, 2, False)], ids=["tp2-sp", "pp2"])
def test_scaling_step_runs_a_parallel_training_step(tmp_path, tp, pp, sp):
    import torch.multiprocessing as mp

    mp.spawn(scaling_step_worker, args=(str(tmp_path / "store"), tp, pp, sp), nprocs=2, join=True)
