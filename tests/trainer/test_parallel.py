"""TP=2 (with and without SP, and with SP's collectives fused into the GEMMs: async TP), PP=2 (and 3) and DP=2
give the single-process loss, gradients and update; under PP (and TP x PP) export and save_pretrained give the
whole model; the TP overlap setting picks async TP only where it can run.

Each test spawns two processes (three for the 3-stage pipeline, four for TP x PP; gloo on CPU; the ``multigpu`` variants use NCCL
on two GPUs); every rank also builds the unsharded model from the same seed and computes the single-process
reference itself.
"""


import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers

from redline.trainer.models import from_config
from redline.trainer.parallel import ParallelConfig, clip_grad_norm, finalize_grads, one_f_one_b
from redline.trainer.parallel.async_tp import FUSED_OPS, all_gather_linear, linear_reduce_scatter
from redline.trainer.parallel.comm import gather_tokens, reduce_scatter_tokens
from redline.trainer.parallel.stages import stage_layers

LENGTHS = (5, 9, 2)  # 16 tokens: divisible by tp for sequence parallelism


def run_on_ranks(worker, tmp_path, *args, nccl=False, ranks=2):
    mp.spawn(_bootstrap, args=(worker, str(tmp_path / "store"), nccl, ranks, args), nprocs=ranks, join=True)


def _bootstrap(rank, worker, store, nccl, ranks, args):
    if nccl:
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    dist.init_process_group("nccl" if nccl else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=ranks)
    try:
        worker(rank, *args)
    finally:
        dist.destroy_process_group()
    # A passed rank leaves without Python's finalisation: gloo's worker thread can still be dropping its last
    # reference to a finished functional collective (which holds Python tensors) when the interpreter shuts
    # down, and that aborts the process (torch 2.13: std::terminate from PyThread_exit_thread in
    # ~AsyncAllgatherWork, about 1 run in 4 of the async-TP CPU test). A failing rank still raises above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def device():
    return torch.get_default_device()


def batch(config, lengths=LENGTHS, seed=0):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (sum(lengths),), generator=generator, device="cpu")
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths, device="cpu").cumsum(0).tolist()], dtype=torch.int32)
    return input_ids.to(device()), cu_seqlens.to(device())


def next_token_loss(logits, input_ids):
    return F.cross_entropy(logits, input_ids.roll(-1))


def full_grad(param):
    shard = getattr(param, "tp_shard", None)
    return shard.gather(param.grad) if shard is not None else param.grad


def tp_linears(model):
    """The column- and row-parallel linear modules of every layer."""
    return [m for layer in model.layers.values() for m in (layer.self_attn.qkv, layer.self_attn.o_proj,
                                                           layer.mlp.gate_up, layer.mlp.down)]


def tp_worker(rank, config, sequence_parallel, tp_overlap="off"):
    reference = from_config(config, dtype=torch.float32, device=device(), seed=0)
    model = from_config(config, dtype=torch.float32, device=device(), seed=0,
                        parallel=ParallelConfig(tp=2, sp=sequence_parallel, tp_overlap=tp_overlap))
    assert {m.async_tp for m in tp_linears(model)} == {tp_overlap == "symm_mem"}
    columns = [m for layer in model.layers.values() for m in (layer.self_attn.qkv, layer.mlp.gate_up)]
    # under SP the column GEMMs gather their tokens themselves (gather_tokens_linear: dx's reduce-scatter beside
    # dW's GEMM in backward, or async TP's fused op)
    assert {m.matmul_gathers for m in columns} == {sequence_parallel}
    input_ids, cu_seqlens = batch(config)
    expected = next_token_loss(reference.logits(input_ids, cu_seqlens), input_ids)
    expected.backward()
    loss = next_token_loss(model.logits(input_ids, cu_seqlens), input_ids)
    loss.backward()
    finalize_grads(model, model.parallel_state)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(full_grad(param), reference_params[name].grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    exported = dict(model.export_hf())
    for name, tensor in reference.export_hf():
        assert torch.equal(exported[name], tensor), name
    norm = clip_grad_norm(model, model.parallel_state, max_norm=1e9)
    expected_norm = torch.stack([p.grad.norm() for p in reference.parameters()]).norm()
    torch.testing.assert_close(norm, expected_norm, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama3-tied"])
def test_tensor_parallel_matches_single_process(config_of, family, tmp_path):
    run_on_ranks(tp_worker, tmp_path, config_of(family), False)


@pytest.mark.slow
def test_sequence_parallel_matches_single_process(config_of, tmp_path):
    run_on_ranks(tp_worker, tmp_path, config_of("qwen3"), True)


@pytest.mark.multigpu
@pytest.mark.parametrize(("sequence_parallel", "tp_overlap"), [(False, "off"), (True, "off"), (True, "symm_mem")],
                         ids=["tp", "tp+sp", "tp+sp+async-tp"])
def test_tensor_parallel_over_nccl_matches_single_gpu(config_of, tmp_path, sequence_parallel, tp_overlap):
    run_on_ranks(tp_worker, tmp_path, config_of("qwen3"), sequence_parallel, tp_overlap, nccl=True)


def async_tp_worker(rank, config):
    """TP=2 + SP with async TP against the same without it: loss and every gradient, after a second step too
    (the symmetric-memory workspace is reused), on a batch whose local token count is not a GEMM-friendly
    size."""
    models = {overlap: from_config(config, dtype=torch.float32, device=device(), seed=0,
                                   parallel=ParallelConfig(tp=2, sp=True, tp_overlap=overlap))
              for overlap in ("off", "symm_mem")}
    assert all(m.async_tp for m in tp_linears(models["symm_mem"]))
    for step, lengths in enumerate([LENGTHS, (7, 31)]):
        input_ids, cu_seqlens = batch(config, lengths, seed=step)
        losses, grads = {}, {}
        for overlap, model in models.items():
            model.zero_grad()
            losses[overlap] = next_token_loss(model.logits(input_ids, cu_seqlens), input_ids)
            losses[overlap].backward()
            finalize_grads(model, model.parallel_state)
            grads[overlap] = {name: full_grad(p) for name, p in model.named_parameters()}
        torch.testing.assert_close(losses["symm_mem"], losses["off"], rtol=1e-5, atol=1e-6)
        for name, grad in grads["off"].items():
            torch.testing.assert_close(grads["symm_mem"][name], grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")


@pytest.mark.multigpu
def test_async_tensor_parallel_over_nccl_matches_unfused(config_of, tmp_path):
    run_on_ranks(async_tp_worker, tmp_path, config_of("llama3"), nccl=True)


def serve_symm_mem_ops_on_cpu(calls=None):
    """Register torch's own unfused definitions of the symm_mem fused ops (its fallbacks) as their CPU kernels,
    counting each op's calls in ``calls`` when given; returns the library (keep it alive)."""
    import torch.distributed._symmetric_memory as symm_mem

    def counted(name, fallback):
        def op(*args, **kwargs):
            calls[name] += 1
            return fallback(*args, **kwargs)
        return op

    library = torch.library.Library("symm_mem", "IMPL")
    for name in FUSED_OPS:
        fallback = getattr(symm_mem, f"_{name}_fallback")
        library.impl(name, fallback if calls is None else counted(name, fallback), "CPU")
    return library


def async_tp_functions_worker(rank):
    """Async TP's autograd Functions against gather_tokens / reduce_scatter_tokens around F.linear: output and
    both gradients. On CPU the fused ops are served by torch's own unfused definitions of them (its fallbacks),
    so this checks the Functions' math; the NCCL tests above check the CUDA ops."""
    library = serve_symm_mem_ops_on_cpu()  # noqa: F841 - registered while it lives
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(rank)
    cases = [  # fused, unfused, shapes of x, weight, dy (per rank; 2 ranks)
        (all_gather_linear, lambda x, w: F.linear(gather_tokens(x, group), w), (6, 8), (5, 8), (12, 5)),
        (linear_reduce_scatter, lambda x, w: reduce_scatter_tokens(F.linear(x, w), group), (12, 4), (7, 4), (6, 7)),
    ]
    for fused, unfused, *shapes in cases:
        x, weight, dy = (torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes)
        results = []
        for product in (lambda x, w, fused=fused: fused(x, w, group), unfused):
            x_leaf, weight_leaf = x.clone().requires_grad_(), weight.clone().requires_grad_()
            y = product(x_leaf, weight_leaf)
            y.backward(dy)
            results.append((y, x_leaf.grad, weight_leaf.grad))
        torch.testing.assert_close(results[0], results[1], msg=lambda m, fused=fused: f"{fused.__name__}: {m}")


def async_tp_recompute_worker(rank):
    """Selective recompute keeps async TP's fused outputs: a TP=2+SP block (column then row parallel) calls
    each fused op once in the forward and once in the backward, recomputed or not (CPU: torch's fallbacks)."""
    from redline.trainer.parallel.recompute import apply_recompute

    calls = dict.fromkeys(FUSED_OPS, 0)
    library = serve_symm_mem_ops_on_cpu(calls)  # noqa: F841 - registered while it lives
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(rank)
    w_column, w_row = torch.randn(6, 4, generator=generator), torch.randn(3, 6, generator=generator)

    class Block(torch.nn.Module):
        def forward(self, x):
            return linear_reduce_scatter(torch.relu(all_gather_linear(x, w_column, group)), w_row, group)

    grads = {}
    for mode in ("none", "selective"):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleDict({"0": Block()})
        apply_recompute(model, mode)
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        for name in calls:
            calls[name] = 0
        model.layers["0"](x).square().sum().backward()
        assert calls == {"fused_all_gather_matmul": 2, "fused_matmul_reduce_scatter": 2}, (mode, calls)
        grads[mode] = x.grad
    torch.testing.assert_close(grads["selective"], grads["none"])


@pytest.mark.slow
@pytest.mark.parametrize("worker", [async_tp_functions_worker, async_tp_recompute_worker],
                         ids=["functions-equal-unfused-collectives-around-linear",
                              "selective-recompute-keeps-fused-outputs"])
def test_async_tp_on_cpu_through_torchs_unfused_fallbacks(tmp_path, worker):
    symm_mem = pytest.importorskip("torch.distributed._symmetric_memory")
    if not all(hasattr(symm_mem, f"_{name}_fallback") for name in FUSED_OPS):
        pytest.skip(f"torch {torch.__version__} has no unfused definitions of the symm_mem fused ops")
    run_on_ranks(worker, tmp_path)


def test_parallel_config_rejects_an_unknown_tp_overlap():
    with pytest.raises(ValueError, match="tp_overlap='nccl' is unknown"):
        ParallelConfig(tp=2, sp=True, tp_overlap="nccl")


def test_parallel_config_rejects_symm_mem_without_sequence_parallelism():
    with pytest.raises(ValueError, match="needs sequence parallelism"):
        ParallelConfig(tp=2, tp_overlap="symm_mem")


def tp_overlap_choice_worker(rank, config):
    """On gloo (CPU): "auto" keeps SP's separate collectives; "symm_mem" names what is missing, for the bf16
    backend the NCCL group on CUDA, for the native FP8 backend the F.linear matmul."""
    from redline.trainer.layers import layer_backend

    model = from_config(config, dtype=torch.float32, device=device(), seed=0, parallel=ParallelConfig(tp=2, sp=True))
    assert not any(m.async_tp for m in tp_linears(model))
    with pytest.raises(ValueError, match="tp_overlap='symm_mem' needs an NCCL process group on CUDA tensors"):
        from_config(config, dtype=torch.float32, device=device(), seed=0,
                    parallel=ParallelConfig(tp=2, sp=True, tp_overlap="symm_mem"))
    with pytest.raises(ValueError, match="needs the bf16 layer backend .* backend 'native'"):
        from_config(config, backend=layer_backend("native", scaling="tensorwise"), dtype=torch.float32,
                    device=device(), seed=0, parallel=ParallelConfig(tp=2, sp=True, tp_overlap="symm_mem"))


@pytest.mark.slow
def test_tp_overlap_auto_is_off_and_symm_mem_is_refused_on_gloo(config_of, tmp_path):
    run_on_ranks(tp_overlap_choice_worker, tmp_path, config_of("qwen3"))


def pp_worker(rank, config, micro_lengths, first_stage_layers=None):
    stages = dist.get_world_size()
    reference = from_config(config, dtype=torch.float32, device=device(), seed=0)
    stage = from_config(config, dtype=torch.float32, device=device(), seed=0,
                        parallel=ParallelConfig(pp=stages, first_stage_layers=first_stage_layers))
    micro_batches = [batch(config, lengths, seed=i) for i, lengths in enumerate(micro_lengths)]
    scale = 1.0 / len(micro_batches)
    expected = []
    for input_ids, cu_seqlens in micro_batches:
        loss = next_token_loss(reference.logits(input_ids, cu_seqlens), input_ids) * scale
        loss.backward()
        expected.append(loss.detach())

    def loss_fn(hidden, micro_batch):
        return next_token_loss(hidden @ stage.lm_head_weight().t(), micro_batch[0]) * scale

    state = stage.parallel_state
    losses = one_f_one_b(stage, micro_batches, loss_fn, state)
    finalize_grads(stage, state)
    if state.pp_rank == stages - 1:
        torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    else:
        assert losses == []
    assert sorted(stage.layers, key=int) == [str(i) for i in stage_layers(state.stage_sizes(stage.spec), rank)]
    reference_params = dict(reference.named_parameters())
    for name, param in stage.named_parameters():
        # the last stage's tied LM-head copy carries the embedding's gradient
        source = "embed_tokens.weight" if name == "lm_head.weight" and config.tie_word_embeddings else name
        torch.testing.assert_close(param.grad, reference_params[source].grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    norm = clip_grad_norm(stage, state, max_norm=1e9)
    expected_norm = torch.stack([p.grad.norm() for p in reference.parameters()]).norm()
    torch.testing.assert_close(norm, expected_norm, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3-tied"])
def test_pipeline_1f1b_matches_single_process(config_of, family, tmp_path):
    # micro-batches of different token counts, as RL packing produces
    run_on_ranks(pp_worker, tmp_path, config_of(family), [(5, 3), (7,), (2, 2, 4), (6,)])


@pytest.mark.slow
def test_three_stage_pipeline_matches_single_process(config_of, tmp_path):
    # a middle stage both receives and sends in every step: checks the pairing of the batched sends/receives
    config = config_of("llama3-tied")
    config.num_hidden_layers = 3
    run_on_ranks(pp_worker, tmp_path, config, [(5, 3), (7,), (2, 2, 4), (6,), (3,)], ranks=3)


@pytest.mark.slow
def test_uneven_pipeline_split_matches_single_process(config_of, tmp_path):
    # --decoder-first-pipeline-num-layers 3 of 4: the last stage holds one layer beside the LM head
    config = config_of("qwen3-tied")
    config.num_hidden_layers = 4
    run_on_ranks(pp_worker, tmp_path, config, [(5, 3), (7,), (2, 2, 4)], 3)


@pytest.mark.multigpu
def test_pipeline_over_nccl_matches_single_gpu(config_of, tmp_path):
    run_on_ranks(pp_worker, tmp_path, config_of("qwen3-tied"), [(5, 3), (7,), (2, 2, 4), (6,)], nccl=True)


@pytest.mark.multigpu
def test_pipeline_over_nccl_with_messages_larger_than_nccl_buffers(config_of, tmp_path):
    # 4 MiB is NCCL's default buffer: a lone blocking send of a bigger activation waits for its receiver, which
    # deadlocks a schedule whose stages send before they receive; 2 x 4096 x 512 fp32 = 8 MiB per message
    config = config_of("qwen3")
    config.hidden_size, config.intermediate_size, config.head_dim = 512, 1024, 64
    run_on_ranks(pp_worker, tmp_path, config, [(4096,), (1000, 3096), (4096,)], nccl=True)


def stage_of(hf_name, sizes):
    """The pipeline stage that holds ``hf_name`` (``sizes``: layers per stage): its layer's, the embedding on the
    first, the rest on the last."""
    if hf_name.startswith("model.layers."):
        layer = int(hf_name.split(".")[2])
        return next(s for s in range(len(sizes)) if layer in stage_layers(sizes, s))
    return 0 if hf_name == "model.embed_tokens.weight" else len(sizes) - 1


def pp_export_worker(rank, config, tp, directory):
    pp = dist.get_world_size() // tp
    reference = from_config(config, dtype=torch.float32, device=device(), seed=0)
    model = from_config(config, dtype=torch.float32, device=device(), seed=0, parallel=ParallelConfig(tp=tp, pp=pp))
    expected = list(reference.export_hf())
    exported = list(model.export_hf())
    assert [name for name, _ in exported] == [name for name, _ in expected]
    for (name, tensor), (_, want) in zip(exported, expected):
        assert torch.equal(tensor, want), name
    pp_rank = model.parallel_state.pp_rank
    assert [name for name, _ in model.export_hf(stage_only=True)] == [
        name for name, _ in expected if stage_of(name, model.parallel_state.stage_sizes(model.spec)) == pp_rank]
    model.save_pretrained(directory / f"rank{rank}")  # by default only global rank 0 writes


def check_pipeline_save(config, tmp_path, tp, ranks):
    run_on_ranks(pp_export_worker, tmp_path, config, tp, tmp_path, ranks=ranks)
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "rank0", dtype=torch.float32).eval()
    reference = from_config(config, dtype=torch.float32, seed=0)
    input_ids, cu_seqlens = batch(config, (13,))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(input_ids[None]).logits[0], reference.logits(input_ids, cu_seqlens),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3-tied"])
def test_pipeline_export_and_save_are_the_whole_model(config_of, family, tmp_path):
    # tied: the embedding lives on the first stage and the LM-head copy on the last; the checkpoint has one
    check_pipeline_save(config_of(family), tmp_path, tp=1, ranks=2)


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_export_and_save_are_the_whole_model(config_of, tmp_path):
    check_pipeline_save(config_of("qwen2"), tmp_path, tp=2, ranks=4)


@pytest.mark.multigpu
def test_pipeline_export_and_save_over_nccl_are_the_whole_model(config_of, tmp_path):
    run_on_ranks(pp_export_worker, tmp_path, config_of("qwen3-tied"), 1, tmp_path, nccl=True)
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0"]


def dp_worker(rank, config):
    """Each DP rank sees half the batch; after one ZeRO-1 step (each rank updates its half of the fp32 master
    weights and moments, then the weights are all-gathered) the weights equal one process's AdamW step on the
    whole batch (mean loss)."""
    from redline.trainer.mixed_precision import MasterWeights, MixedPrecisionAdamW

    reference = from_config(config, dtype=torch.float32, device=device(), seed=0)
    model = from_config(config, dtype=torch.float32, device=device(), seed=0,
                        parallel=ParallelConfig(dp=2))
    halves = [batch(config, (6, 2), seed=10), batch(config, (3, 5), seed=11)]
    for input_ids, cu_seqlens in halves:
        (next_token_loss(reference.logits(input_ids, cu_seqlens), input_ids) / 2).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    torch.optim.AdamW(reference.parameters(), lr=1e-2).step()
    master = MasterWeights(model, parallel=model.parallel_state)
    optimizer = MixedPrecisionAdamW(master, lr=1e-2, weight_decay=1e-2)
    input_ids, cu_seqlens = halves[rank]
    next_token_loss(model.logits(input_ids, cu_seqlens), input_ids).backward()
    master.reduce_and_clip(1.0)
    optimizer.step()
    (group,) = master.groups
    assert group.master.numel() == group.numel // 2  # this rank's shard of master weights and moments
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_data_parallel_zero1_step_matches_single_process(config_of, tmp_path):
    run_on_ranks(dp_worker, tmp_path, config_of("qwen3"))


def te_tp_worker(rank, config, sequence_parallel):
    """TE modules (no FP8, bf16) under TE's own TP/SP against the bf16 backend on one GPU."""
    from redline.trainer.layers import layer_backend

    reference = from_config(config, dtype=torch.bfloat16, device=device(), seed=0)
    model = from_config(config, backend=layer_backend("te", recipe=None), dtype=torch.bfloat16, device=device(),
                        seed=0, parallel=ParallelConfig(tp=2, sp=sequence_parallel))
    input_ids, cu_seqlens = batch(config, (48, 80))
    expected = next_token_loss(reference.logits(input_ids, cu_seqlens).float(), input_ids)
    expected.backward()
    loss = next_token_loss(model.logits(input_ids, cu_seqlens).float(), input_ids)
    loss.backward()
    finalize_grads(model, model.parallel_state)
    torch.testing.assert_close(loss, expected, rtol=2e-2, atol=1e-3)
    exported = dict(model.export_hf())
    for name, tensor in reference.export_hf():
        assert torch.equal(exported[name], tensor), name
    norm = clip_grad_norm(model, model.parallel_state, max_norm=1e9)
    expected_norm = torch.stack([p.grad.float().norm() for p in reference.parameters()]).norm()
    torch.testing.assert_close(norm, expected_norm, rtol=3e-2, atol=1e-3)


@pytest.mark.multigpu
@pytest.mark.te
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_te_tensor_parallel_matches_single_gpu_bf16(config_of, tmp_path, sequence_parallel):
    config = config_of("qwen3")
    config.hidden_size, config.intermediate_size, config.head_dim = 128, 256, 32
    run_on_ranks(te_tp_worker, tmp_path, config, sequence_parallel, nccl=True)


def test_average_over_dp_reduces_dtype_homogeneous_buckets_within_the_limit(monkeypatch):
    """In-process: the all-reduce is replaced by "the other rank has g + 1" (SUM = 2g + 1), so every gradient
    must come back as g + 0.5, and each collective must carry one dtype and at most the bucket limit (a tensor
    larger than the limit alone)."""
    from types import SimpleNamespace

    from redline.trainer.parallel import optim

    monkeypatch.setattr(optim, "DP_BUCKET_BYTES", 64)
    reduced = []

    def all_reduce(flat, group):
        reduced.append((flat.dtype, flat.numel() * flat.element_size()))
        flat.mul_(2).add_(1)

    monkeypatch.setattr(optim.dist, "all_reduce", all_reduce)
    shapes = [(4,), (8,), (3, 2), (40,), (5,), (2,)]
    params = []
    for i, shape in enumerate(shapes):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float32 if i % 2 else torch.bfloat16))
        p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(shape)
        params.append(p)
    expected = [p.grad.float() + 0.5 for p in params]
    optim.average_over_dp(params, SimpleNamespace(dp_group=None, config=SimpleNamespace(dp=2)))
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.grad.float(), want)
    # bf16 8 + 12 + 10 bytes fit one bucket; fp32 32, then 160 (over the limit: alone), then 8 (after it)
    assert reduced == [(torch.bfloat16, 30), (torch.float32, 32), (torch.float32, 160), (torch.float32, 8)]
