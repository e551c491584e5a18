"""Decoder-layer throughput: bf16 vs TransformerEngine FP8 recipes vs native FP8 (GPU only).

One decoder layer and a 4-layer stack, forward + backward, at Llama-3-8B and Qwen3-8B shapes on 16,384 packed
tokens (4 sequences of 4,096). Each case reports, in pytest-benchmark's ``extra_info``: tokens/s, model
TFLOP/s and its ratio to the bf16 and FP8 GEMM peaks measured in the same run (8192^3 ``a @ b`` and
``torch._scaled_mm``), peak memory above the weights, and for native FP8 the time of its quantisation
casts alone (the FP8 overhead: every cast a layer's fwd+bwd performs, on the same shapes).

    python -m pytest benchmarks/bench_layers.py --benchmark-json $OUT/bench_layers.json -s

FLOPs counted: GEMMs 2*T*params (x3 for fwd+bwd); causal attention 2*s^2*h*d per sequence forward (half of
4*s^2*h*d), x3.5 for fwd+bwd (flash-attention convention).
"""

import pytest
import torch
import transformers

from redline.extras import available
from redline.trainer.layers import layer_backend
from redline.trainer.models import from_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")

TOKENS, SEQUENCES = 16384, 4
ROUNDS, WARMUP = 10, 3

SHAPES = {
    "llama3-8b": lambda layers: transformers.LlamaConfig(
        vocab_size=1024, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen3-8b": lambda layers: transformers.Qwen3Config(
        vocab_size=1024, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}
BACKENDS = {
    "bf16": ("bf16", {}),
    "te-delayed": ("te", {"recipe": "delayed"}),
    "te-current": ("te", {"recipe": "current"}),
    "te-block": ("te", {"recipe": "block"}),
    "native-tensorwise": ("native", {"scaling": "tensorwise"}),
    "native-rowwise": ("native", {"scaling": "rowwise"}),
}


def cuda_time_ms(fn, rounds=ROUNDS, warmup=WARMUP) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@pytest.fixture(scope="module")
def peaks():
    """Measured dense GEMM peaks of this GPU, TFLOP/s: bf16 and FP8 (e4m3, tensorwise, fast accumulation)."""
    n = 8192
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda",
                                                                                dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device="cuda")
    flops = 2 * n ** 3
    bf16 = flops / cuda_time_ms(lambda: a @ b, rounds=20) / 1e9
    fp8 = flops / cuda_time_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16,
                                                         use_fast_accum=True), rounds=20) / 1e9
    print(f"\nmeasured peaks: bf16 {bf16:.0f} TFLOP/s, fp8 {fp8:.0f} TFLOP/s")
    return {"bf16": bf16, "fp8": fp8}


def layer_flops(spec, tokens, sequences, layers) -> float:
    gemm_params = spec.hidden_size * (spec.q_dim + 2 * spec.kv_dim) + spec.q_dim * spec.hidden_size \
        + 3 * spec.hidden_size * spec.intermediate_size
    seq = tokens // sequences
    attention_fwd = sequences * 2 * seq * seq * spec.num_heads * spec.head_dim
    return layers * (3 * 2 * tokens * gemm_params + 3.5 * attention_fwd)


def stack_step(model, hidden, cu_seqlens, grad):
    """fwd + bwd of the decoder layers only (no embedding, no head) on ``hidden [T, H]``."""
    from redline.trainer.models.rope import packed_positions

    positions = packed_positions(cu_seqlens, hidden.shape[0])
    seqlen = TOKENS // SEQUENCES

    def step():
        x = hidden
        with model.backend.autocast():
            cos, sin = model.rope(positions, x.dtype)
            for layer in model.layers.values():
                x = layer(x, cos, sin, cu_seqlens, seqlen)
        x.backward(grad)
    return step


def native_cast_ms(spec) -> float:
    """Every quantisation cast of one layer's fwd+bwd under native tensorwise FP8 (inputs, weights, grads)."""
    from redline.trainer.fp8.quantize import quantize
    from redline.trainer.fp8.scaling import E4M3, E5M2

    h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    linears = [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]  # (in, out)
    tensors = []
    for k, n in linears:
        tensors += [(torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16), E4M3),
                    (torch.randn(n, k, device="cuda", dtype=torch.bfloat16), E4M3),
                    (torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16), E5M2)]

    def casts():
        for t, fmt in tensors:
            quantize(t, fmt, transpose=True)
    return cuda_time_ms(casts)


@pytest.mark.parametrize("layers", [1, 4], ids=["1-layer", "4-layers"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_layer_stack_fwd_bwd(benchmark, peaks, backend_name, shape, layers):
    kind, options = BACKENDS[backend_name]
    if kind == "te" and not available("transformer_engine"):
        pytest.skip("TransformerEngine is not installed (pip install 'redline[te]')")
    torch.cuda.empty_cache()
    model = from_config(SHAPES[shape](layers), backend=layer_backend(kind, **options), dtype=torch.bfloat16,
                        device="cuda", seed=0)
    model.embed_tokens = None  # layers only; the vocab-sized tensors are not part of this benchmark
    spec = model.spec
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(TOKENS, spec.hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
    hidden.requires_grad_()
    grad = torch.randn_like(hidden)
    cu_seqlens = torch.arange(0, TOKENS + 1, TOKENS // SEQUENCES, device="cuda", dtype=torch.int32)
    step = stack_step(model, hidden, cu_seqlens, grad)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak_gib = (torch.cuda.max_memory_allocated() - baseline) / 2**30

    def timed():
        step()
        torch.cuda.synchronize()

    benchmark.group = f"decoder {shape} x{layers} fwd+bwd, {TOKENS} tokens"
    flops = layer_flops(spec, TOKENS, SEQUENCES, layers)
    benchmark.extra_info.update(provider=backend_name, baseline=backend_name == "bf16", flops=flops)
    benchmark.pedantic(timed, rounds=ROUNDS, iterations=1, warmup_rounds=WARMUP)
    seconds = benchmark.stats.stats.median
    tflops = flops / seconds / 1e12
    info = {"tokens_per_s": TOKENS / seconds, "model_tflops": tflops, "of_bf16_peak": tflops / peaks["bf16"],
            "of_fp8_peak": tflops / peaks["fp8"], "peak_bf16_tflops": peaks["bf16"],
            "peak_fp8_tflops": peaks["fp8"], "activation_peak_gib": peak_gib}
    if backend_name == "native-tensorwise":
        info["fp8_cast_ms_per_step"] = layers * native_cast_ms(spec)
        info["fp8_cast_share"] = info["fp8_cast_ms_per_step"] / 1e3 / seconds
    benchmark.extra_info.update(info)
    print(f"\n{backend_name:18s} {shape} x{layers}: {seconds * 1e3:8.2f} ms  {info['tokens_per_s']:9.0f} tok/s  "
          f"{tflops:6.0f} TFLOP/s ({info['of_bf16_peak']:.0%} bf16 peak, {info['of_fp8_peak']:.0%} fp8 peak)  "
          f"mem {peak_gib:.1f} GiB" + (f"  casts {info['fp8_cast_ms_per_step']:.2f} ms" if "fp8_cast_ms_per_step"
                                     in info else ""))


# ---- Multi-GPU scaling (run under torchrun, not pytest) -------------------------------------------------------
#   torchrun --nproc-per-node 2 benchmarks/bench_layers.py --tp 2 --sp --out $OUT/tp2.json
#   torchrun --nproc-per-node 4 benchmarks/bench_layers.py --tp 4 --sp --out $OUT/tp4.json
#   torchrun --nproc-per-node 2 benchmarks/bench_layers.py --pp 2 --out $OUT/pp2.json
# Each rank first times the unsharded 4-layer stack alone on its GPU (t1), then the parallel run on the same
# 16k tokens (tn); scaling efficiency = t1 / (n * tn). PP runs 8 micro-batches of 2k tokens through 1F1B.


def scaling_main(argv=None):
    import argparse
    import json
    import os

    import torch.distributed as dist

    from redline.trainer.parallel import ParallelConfig, finalize_grads, one_f_one_b

    parser = argparse.ArgumentParser(description="TP/SP/PP scaling of the 4-layer stack")
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--backend", choices=list(BACKENDS), default="bf16")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8, help="pipeline micro-batches (PP only)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    kind, options = BACKENDS[args.backend]
    config = SHAPES[args.shape](args.layers)
    lengths = [TOKENS // SEQUENCES] * SEQUENCES
    if args.pp > 1:
        lengths = [TOKENS // args.micro_batches] * args.micro_batches
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    torch.manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (TOKENS,), device="cuda")
    micro = [(input_ids[int(cu[i]):int(cu[i + 1])], torch.tensor([0, lengths[i]], dtype=torch.int32, device="cuda"))
             for i in range(len(lengths))] if args.pp > 1 else [(input_ids, cu)]

    def build(parallel=None):
        return from_config(config, backend=layer_backend(kind, **options), dtype=torch.bfloat16, device="cuda",
                           seed=0, parallel=parallel)

    def loss_of(hidden):
        return hidden.float().square().mean()

    single = build()

    def single_step():
        for ids, cu_seqlens in micro:
            loss_of(single(ids, cu_seqlens)).backward()
    t1 = cuda_time_ms(single_step)
    single = None  # free its memory before the parallel model is built
    torch.cuda.empty_cache()

    model = build(ParallelConfig(tp=args.tp, pp=args.pp, sp=args.sp))
    state = model.parallel_state

    def parallel_step():
        if args.pp > 1:
            one_f_one_b(model, micro, lambda hidden, _: loss_of(hidden), state)
        else:
            loss_of(model(input_ids, cu)).backward()
        finalize_grads(model, state)
    dist.barrier()
    tn = cuda_time_ms(parallel_step)
    world = dist.get_world_size()
    result = {"shape": args.shape, "backend": args.backend, "tp": args.tp, "pp": args.pp, "sp": args.sp,
              "layers": args.layers, "tokens": TOKENS, "gpus": world, "single_gpu_ms": t1, "parallel_ms": tn,
              "scaling_efficiency": t1 / (world * tn), "device": torch.cuda.get_device_name()}
    if dist.get_rank() == 0:
        print(json.dumps(result))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    scaling_main()
