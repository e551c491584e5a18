"""Vocab-parallel (tp_group) fused_linear_logprobs / fused_linear_policy_loss over 2 gloo processes on CPU.

Each rank holds half of the vocabulary; its results must equal the single-process results on the full
weight: the same logp/entropy/loss everywhere, the full d_hidden on every rank, its own slice of d_weight.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from redline.kernels import LossConfig, fused_linear_logprobs, fused_linear_policy_loss
from redline.kernels.reference import linear_logprobs_reference
from redline.ports import free_port

T, H, V = 23, 16, 90  # V/2 = 45 columns per rank
WORLD = 2
TEMPERATURE = 0.9
CFG = LossConfig(estimator="ppo", kl_type="k3", kl_coef=0.1, entropy_coef=0.01, agg="seq-mean-token-mean")
GSPO = LossConfig(estimator="gspo", eps_clip=0.2, eps_clip_high=0.28, kl_type="k3", kl_coef=0.1, entropy_coef=0.01,
                  agg="seq-mean-token-mean")
CU_SEQLENS = torch.tensor([0, 4, 9, 9, 16, 23], dtype=torch.int32)  # gspo: 3 chunks of whole sequences
PATHS = {"policy_loss one pass": (CFG, True), "policy_loss two passes": (CFG, False),
         "gspo one pass": (GSPO, True), "gspo two passes": (GSPO, False)}


def inputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen)
    targets = torch.randint(0, V, (T,), generator=gen)
    mask = torch.rand(T, generator=gen) > 0.2
    g = torch.randn(2, T, generator=gen)
    # near the current log-probs: sequence ratios (gspo) near 1, on both sides of the clip bounds
    logp = linear_logprobs_reference(hidden, weight, targets, temperature=TEMPERATURE)
    old_logp = logp + torch.randn(T, generator=gen) * 0.3
    ref_logp = old_logp + torch.randn(T, generator=gen) * 0.1
    advantages = torch.randn(T, generator=gen)
    return hidden, weight, targets, mask, g, old_logp, ref_logp, advantages


def run_logprobs(hidden, weight, targets, mask, g, group=None):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = fused_linear_logprobs(hidden, weight, targets, temperature=TEMPERATURE, mask=mask,
                                          return_entropy=True, tp_group=group)
    (logp * g[0] + entropy * g[1]).sum().backward()
    return logp.detach(), entropy.detach(), hidden.grad, weight.grad


def run_policy_loss(hidden, weight, targets, mask, old_logp, ref_logp, advantages, path, group=None):
    cfg, one_pass = PATHS[path]
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    # a workspace of a few tokens: several token chunks, each with its own all-reduce of the statistics
    loss, metrics = fused_linear_policy_loss(hidden, weight, targets, old_logp, advantages, mask, cfg=cfg,
                                             temperature=TEMPERATURE, ref_logp=ref_logp, cu_seqlens=CU_SEQLENS,
                                             tp_group=group, one_pass=one_pass, workspace_bytes=4096)
    loss.backward()
    return loss.detach(), metrics["entropy"], hidden.grad, weight.grad


def worker(rank, port, backend, result_dir):
    os.environ["REDLINE_KERNELS_BACKEND"] = backend
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        hidden, weight, targets, mask, g, old_logp, ref_logp, advantages = inputs()
        shard = weight.chunk(WORLD)[rank]
        results = {"logprobs": run_logprobs(hidden, shard, targets, mask, g, dist.group.WORLD)}
        for path in PATHS:
            results[path] = run_policy_loss(hidden, shard, targets, mask, old_logp, ref_logp, advantages, path,
                                            dist.group.WORLD)
        torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=["torch", "triton"])
def rank_results(request, tmp_path_factory):
    result_dir = str(tmp_path_factory.mktemp(f"tp-{request.param}"))
    mp.spawn(worker, args=(free_port(), request.param, result_dir), nprocs=WORLD, join=True)
    return [torch.load(os.path.join(result_dir, f"rank{r}.pt")) for r in range(WORLD)]


def test_logprobs_match_the_unsharded_op_on_every_rank(rank_results):
    hidden, weight, targets, mask, g, *_ = inputs()
    logp, entropy, d_hidden, d_weight = run_logprobs(hidden, weight, targets, mask, g)
    for rank, results in enumerate(rank_results):
        tp_logp, tp_entropy, tp_d_hidden, tp_d_weight = results["logprobs"]
        torch.testing.assert_close(tp_logp, logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tp_entropy, entropy, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tp_d_hidden, d_hidden, rtol=1e-4, atol=1e-5)  # summed over the ranks
        torch.testing.assert_close(tp_d_weight, d_weight.chunk(WORLD)[rank], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_policy_loss_matches_the_unsharded_op_on_every_rank(rank_results, path):
    hidden, weight, targets, mask, _, old_logp, ref_logp, advantages = inputs()
    loss, entropy_metric, d_hidden, d_weight = run_policy_loss(hidden, weight, targets, mask, old_logp, ref_logp,
                                                               advantages, path)
    for rank, results in enumerate(rank_results):
        tp_loss, tp_entropy_metric, tp_d_hidden, tp_d_weight = results[path]
        torch.testing.assert_close(tp_loss, loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tp_entropy_metric, entropy_metric, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tp_d_hidden, d_hidden, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(tp_d_weight, d_weight.chunk(WORLD)[rank], rtol=1e-4, atol=1e-6)
