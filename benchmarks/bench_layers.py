"""Decoder-layer throughput: bf16 vs TransformerEngine FP8 recipes vs native FP8 (GPU only).

One decoder layer and a 4-layer stack, forward + backward, at Llama-3-8B and Qwen3-8B shapes on 16,384 packed
tokens (4 sequences of 4,096). Each case reports, in pytest-benchmark's ``extra_info``: tokens/s, model
TFLOP/s and its ratio to the bf16 and FP8 GEMM peaks measured in the same run (8192^3 ``a @ b`` and
``torch._scaled_mm``), peak memory above the weights, and for native FP8 the time of its quantisation
casts alone (the FP8 overhead: every cast a layer's fwd+bwd performs, on the same shapes).

    python -m pytest benchmarks/bench_layers.py --benchmark-json $OUT/bench_layers.json -s

Every case also records which core attention ran (``attention``: ``redline:flash-attn-4 varlen``,
``redline:sdpa``, ``te:FusedAttention`` ...) and, from one extra profiled step, the GPU time by kernel category
(``gemm_ms``, ``attention_ms``, ``fp8_cast_ms``, ``norm_ms``, ``comm_ms``, ``copy_ms``, ``other_ms``; their sum
``kernels_ms``; see ``kernel_category``), so a missed target can be explained from the same run.

FLOPs counted: GEMMs 2*T*params (x3 for fwd+bwd); causal attention 2*s^2*h*d per sequence forward (half of
4*s^2*h*d), x3.5 for fwd+bwd (flash-attention convention).

Multi-GPU scaling (TP/SP/PP) runs under torchrun, not pytest; see ``scaling_main`` at the end of this file.
"""

import functools
import re

import pytest
import torch
import transformers

from cuda_timing import cuda_time_ms
from redline.extras import available
from redline.trainer.layers import layer_backend
from redline.trainer.models import from_config
from redline.trainer.models.attention import varlen_attention_impl

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
    # TE linear layers with redline's attention whatever TE's attention can do: tells TE's attention cost apart
    "te-current-redline-attn": ("te", {"recipe": "current", "attention": "redline"}),
    "native-tensorwise": ("native", {"scaling": "tensorwise"}),
    "native-rowwise": ("native", {"scaling": "rowwise"}),
}


# Kernel-name patterns per category, tried in this order (first match wins; case-insensitive). FP8 casts are
# redline's Triton kernels (_amax_kernel, _cast_transpose_kernel, _rowwise_cast_kernel) and TE's cast /
# quantize / amax / scale kernels; PyTorch's dtype-converting copies (LoadWithCast) are "copy", not casts.
# Async TP (symmetric memory) communicates by peer copies, which count as "copy", and barrier kernels ("comm").
KERNEL_CATEGORIES = (
    ("comm", r"nccl|all_?gather|reduce_?scatter|all_?reduce|barrier_kernel"),
    ("attention", r"flash|fmha|sdpa|attn|attention|softmax|thd_to|bshd_to"),
    ("fp8_cast", r"cast_transpose|_cast_kernel|cast_fp8|amax|quantize|compute_scale|scale_from|fp8"),
    ("norm", r"rmsnorm|layernorm|rms_norm|layer_norm|normaliz"),
    ("gemm", r"nvjet|gemm|cutlass|xmma|cublas|wgmma|matmul"),
    ("copy", r"memcpy|memset|copy|catarray"),
)
CATEGORIES = tuple(name for name, _ in KERNEL_CATEGORIES) + ("other",)


def kernel_category(name: str) -> str:
    """The category of a CUDA kernel by its name (``KERNEL_CATEGORIES``); ``other`` for the rest (RoPE, SwiGLU,
    residual adds, norms written as several elementwise kernels, ...)."""
    for category, pattern in KERNEL_CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return category
    return "other"


def kernel_breakdown(step) -> tuple[dict[str, float], object]:
    """GPU time (ms) of one call of ``step`` by kernel category, plus ``kernels_ms`` (their sum), and the
    profiler (for its kernel table)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for event in prof.key_averages():
        micros = getattr(event, "self_device_time_total", None)
        if micros is None:
            micros = getattr(event, "self_cuda_time_total", 0)
        if micros:
            totals[kernel_category(event.key)] += micros / 1e3
    breakdown = {f"{name}_ms": ms for name, ms in totals.items()}
    breakdown["kernels_ms"] = sum(totals.values())
    return breakdown, prof


def attention_impl(model) -> str:
    """What core attention ``model``'s layers run (recorded with every case)."""
    impl = getattr(model.backend, "attention_impl", None)
    return impl or f"redline:{varlen_attention_impl('cuda', torch.bfloat16)}"


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
    info["attention"] = attention_impl(model)
    breakdown, _ = kernel_breakdown(step)
    info.update({k: round(v, 3) for k, v in breakdown.items()})
    benchmark.extra_info.update(info)
    parts = "  ".join(f"{name} {breakdown[f'{name}_ms']:.1f}" for name in CATEGORIES if breakdown[f"{name}_ms"])
    print(f"\n{backend_name:24s} {shape} x{layers}: {seconds * 1e3:8.2f} ms  {info['tokens_per_s']:9.0f} tok/s  "
          f"{tflops:6.0f} TFLOP/s ({info['of_bf16_peak']:.0%} bf16 peak, {info['of_fp8_peak']:.0%} fp8 peak)  "
          f"mem {peak_gib:.1f} GiB  attention {info['attention']}"
          + (f"  casts {info['fp8_cast_ms_per_step']:.2f} ms" if "fp8_cast_ms_per_step" in info else "")
          + f"\n    GPU ms by kernel category: {parts} (sum {breakdown['kernels_ms']:.1f})")


# ---- Multi-GPU scaling (run under torchrun, not pytest) -------------------------------------------------------


def scaling_main(argv=None):
    """TP/SP/PP scaling of the decoder stack on the GPUs of one host, one JSON + markdown per backend.

        export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 UB_SKIPMC=1
        torchrun --nproc-per-node 4 benchmarks/bench_layers.py --tp 4 --sp --out $OUT/scaling
        torchrun --nproc-per-node 2 benchmarks/bench_layers.py --pp 2 --out $OUT/scaling

    The baseline is measured in the same launch: first every rank times the unsharded stack alone on its own GPU
    (the same tokens, and for PP the same micro-batches run one after another), then the parallel model, under
    SP once per ``--tp-overlap`` setting (default: ``off`` and ``symm_mem``, i.e. without and with async TP);
    each time is a median over rounds, the baseline the fastest rank's and the parallel time the slowest rank's,
    and ``scaling_efficiency = t_single / (gpus * t_parallel)`` (1.0 = linear). Writes
    ``OUT/scaling-<shape>-<backend>-tp<N>[-sp]-pp<M>[-m<micro-batches>][-<tp overlap>].json`` and ``.md`` per
    backend and overlap (no suffix for ``off``) and rewrites ``OUT/scaling.md`` with every result in OUT. A
    backend that cannot run an overlap (``symm_mem`` needs the ``bf16`` one) skips it, saying why. The pipeline
    bubble alone caps PP efficiency at ``m / (m + pp - 1)`` for ``m`` micro-batches (8/9 = 89% at the default 8
    and pp=2).
    """
    import argparse
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    from redline.trainer.parallel import ParallelConfig
    from redline.trainer.parallel.async_tp import TP_OVERLAPS

    parser = argparse.ArgumentParser(description="TP/SP/PP scaling of the decoder stack (run under torchrun)")
    parser.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    parser.add_argument("--backend", default="bf16",
                        help=f"comma-separated, each one of {', '.join(BACKENDS)}")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism inside the TP group")
    parser.add_argument("--tp-overlap", default=None,
                        help=f"comma-separated, each one of {', '.join(TP_OVERLAPS)} (async TP under SP); "
                             "default off,symm_mem with --sp, else off")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--sequences", type=int, default=SEQUENCES, help="equal-length sequences (TP)")
    parser.add_argument("--micro-batches", type=int, default=8, help="pipeline micro-batches of tokens/N each")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    backends = args.backend.split(",")
    for name in backends:
        if name not in BACKENDS:
            parser.error(f"--backend {name!r} is unknown; expected {', '.join(BACKENDS)}")
    overlaps = (args.tp_overlap or ("off,symm_mem" if args.sp else "off")).split(",")
    for name in overlaps:
        if name not in TP_OVERLAPS:
            parser.error(f"--tp-overlap {name!r} is unknown; expected {', '.join(TP_OVERLAPS)}")

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.tp * args.pp != world:
        raise SystemExit(f"--tp {args.tp} x --pp {args.pp} must equal the number of processes ({world})")
    out_dir = Path(args.out)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    config = SHAPES[args.shape](args.layers)
    pieces = args.micro_batches if args.pp > 1 else args.sequences
    if args.tokens % pieces:
        raise SystemExit(f"--tokens {args.tokens} must divide into {pieces} equal sequences / micro-batches")
    length = args.tokens // pieces
    generator = torch.Generator(device="cuda").manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (args.tokens,), device="cuda", generator=generator)
    if args.pp > 1:  # one sequence per micro-batch
        micro = [(input_ids[i * length:(i + 1) * length], torch.tensor([0, length], dtype=torch.int32,
                                                                        device="cuda")) for i in range(pieces)]
    else:
        micro = [(input_ids, torch.arange(0, args.tokens + 1, length, dtype=torch.int32, device="cuda"))]

    def reduce(value: float, op) -> float:
        tensor = torch.tensor([value], device="cuda")
        dist.all_reduce(tensor, op=op)
        return tensor.item()

    for backend_name in backends:
        kind, options = BACKENDS[backend_name]
        if kind == "te" and not available("transformer_engine"):
            if rank == 0:
                print(f"{backend_name}: skipped, TransformerEngine is not installed")
            continue
        build = functools.partial(from_config, config, dtype=torch.bfloat16, device="cuda", seed=0)
        single = build(backend=layer_backend(kind, **options))
        t_single = cuda_time_ms(_scaling_step(single, micro, length), rounds=args.rounds)
        impl = attention_impl(single)
        single = None  # its memory goes back before the parallel model is built
        torch.cuda.empty_cache()
        t_single_best = reduce(t_single, dist.ReduceOp.MIN)
        t_single_worst = reduce(t_single, dist.ReduceOp.MAX)
        for overlap in overlaps:
            try:
                model = build(backend=layer_backend(kind, **options),
                              parallel=ParallelConfig(tp=args.tp, pp=args.pp, sp=args.sp, tp_overlap=overlap))
            except ValueError as error:  # the same on every rank: tp_overlap this backend cannot run
                if rank == 0:
                    print(f"{backend_name} tp_overlap={overlap}: skipped, {error}")
                continue
            step = _scaling_step(model, micro, length)
            dist.barrier()
            torch.cuda.reset_peak_memory_stats()
            t_parallel = cuda_time_ms(step, rounds=args.rounds)
            breakdown, _ = kernel_breakdown(step)
            t_parallel_worst = reduce(t_parallel, dist.ReduceOp.MAX)
            peak_gib = reduce(torch.cuda.max_memory_allocated() / 2**30, dist.ReduceOp.MAX)
            flops = layer_flops(model.spec, args.tokens, pieces, args.layers)
            tag = (f"scaling-{args.shape}-{backend_name}-tp{args.tp}{'-sp' if args.sp else ''}-pp{args.pp}"
                   + (f"-m{pieces}" if args.pp > 1 else "") + ("" if overlap == "off" else f"-{overlap}"))
            result = {
                "shape": args.shape, "backend": backend_name, "attention": impl, "layers": args.layers,
                "tokens": args.tokens, "sequences_or_micro_batches": pieces, "tp": args.tp, "sp": args.sp,
                "tp_overlap": overlap, "async_tp": _runs_async_tp(model), "pp": args.pp, "gpus": world,
                "single_gpu_ms": t_single_best, "single_gpu_ms_slowest_rank": t_single_worst,
                "parallel_ms": t_parallel_worst, "scaling_efficiency": t_single_best / (world * t_parallel_worst),
                "speedup": t_single_best / t_parallel_worst, "tokens_per_s": args.tokens / t_parallel_worst * 1e3,
                "model_tflops_per_gpu": flops / world / t_parallel_worst / 1e9, "peak_memory_gib_max_rank": peak_gib,
                "rank0_kernel_ms": {k: round(v, 3) for k, v in breakdown.items()},
                "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rounds": args.rounds,
            }
            if rank == 0:
                print(json.dumps(result))
                (out_dir / f"{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
                (out_dir / f"{tag}.md").write_text(scaling_markdown([result]))
                (out_dir / "scaling.md").write_text(scaling_markdown(
                    [json.loads(p.read_text()) for p in sorted(out_dir.glob("scaling-*.json"))]))
            model = step = None
            torch.cuda.empty_cache()
    dist.destroy_process_group()


def _runs_async_tp(model) -> bool:
    """Whether ``model``'s TP layers run async TP (``tp_overlap`` resolved; False for TE's own layers)."""
    return any(getattr(module, "async_tp", False) for module in model.modules())


def _scaling_loss(hidden):
    return hidden.float().square().mean()


def _scaling_step(model, micro, max_seqlen):
    """One training step's fwd + bwd (+ gradient finalisation when parallel) over the micro-batches ``micro``
    (``[(input_ids, cu_seqlens)]``, padded here to what the model's backend and parallelism need)."""
    from redline.trainer.padding import pad_packed, token_multiple
    from redline.trainer.parallel import finalize_grads, one_f_one_b

    state = getattr(model, "parallel_state", None)
    batches = [pad_packed(ids, cu, token_multiple(model)) for ids, cu in micro]

    def step():
        if state is not None and state.pp > 1:
            one_f_one_b(model, batches, lambda hidden, _: _scaling_loss(hidden), state)
        else:
            for ids, cu_seqlens in batches:
                _scaling_loss(model(ids, cu_seqlens, max_seqlen)).backward()
        if state is not None:
            finalize_grads(model, state)
    return step


def scaling_markdown(results: list[dict]) -> str:
    """A markdown table of scaling results (``scaling_main``'s JSON records)."""
    lines = ["# decoder-stack scaling", "",
             "| device | shape | backend | attention | tp | sp | async TP | pp | sequences / micro-batches | gpus | "
             "1 GPU ms | parallel ms | speedup | efficiency | tok/s | TFLOP/s/GPU | comm ms (rank 0) |",
             "| --- | --- | --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
             "---: | ---: |"]
    for r in results:
        comm = r.get("rank0_kernel_ms", {}).get("comm_ms")
        lines.append(f"| {r['device']} | {r['shape']} x{r['layers']} | {r['backend']} | {r.get('attention', '')} | "
                     f"{r['tp']} | {'yes' if r['sp'] else 'no'} | {'yes' if r.get('async_tp') else 'no'} | "
                     f"{r['pp']} | "
                     f"{r.get('sequences_or_micro_batches', '')} | {r['gpus']} | "
                     f"{r['single_gpu_ms']:.2f} | {r['parallel_ms']:.2f} | {r['speedup']:.2f} | "
                     f"{r['scaling_efficiency']:.1%} | {r['tokens_per_s']:.0f} | {r['model_tflops_per_gpu']:.0f} | "
                     f"{'' if comm is None else f'{comm:.2f}'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    scaling_main()
