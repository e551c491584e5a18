"""fused_linear_policy_loss against linear_policy_loss_reference (fp64) on both execution paths."""

import pytest
import torch

from redline.kernels import LossConfig, fused_linear_policy_loss
from redline.kernels.reference import linear_policy_loss_reference
from tests.kernels.policy_inputs import CU_SEQLENS, TEMPERATURE, make_inputs

CONFIGS = {
    "ppo-k3-token-mean": LossConfig(estimator="ppo", kl_type="low_var_kl", kl_coef=0.1),
    "ppo-dualclip-k2-tis-seqmean": LossConfig(estimator="ppo", eps_clip_c=3.0, kl_type="k2", kl_coef=0.05,
                                              tis="truncate", agg="seq-mean-token-mean"),
    "gspo-k1-entropy-seqsum": LossConfig(estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4, kl_type="k1",
                                         kl_coef=0.02, entropy_coef=0.01, agg="seq-mean-token-sum"),
    "cispo-icepop-drgrpo": LossConfig(estimator="cispo", eps_clip_high=0.28, tis="icepop", tis_clip_low=0.5,
                                      agg="seq-mean-token-sum-norm", agg_constant=12.0, entropy_coef=0.003),
}


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("REDLINE_KERNELS_BACKEND", request.param)
    return request.param


# "one-pass": forced (gspo's chunks hold whole sequences); "two-pass": logits recomputed
@pytest.mark.parametrize("path", ["one-pass", "two-pass"])
@pytest.mark.parametrize("name", CONFIGS)
def test_loss_metrics_and_gradients_match_fp64_reference(backend, name, path):
    cfg = CONFIGS[name]
    one_pass = path == "one-pass"
    inputs = make_inputs()
    hidden = inputs["hidden"].clone().requires_grad_()
    weight = inputs["weight"].clone().requires_grad_()
    kwargs = dict(cfg=cfg, temperature=TEMPERATURE, ref_logp=inputs["ref_logp"], rollout_logp=inputs["rollout_logp"],
                  cu_seqlens=CU_SEQLENS)
    loss, metrics = fused_linear_policy_loss(hidden, weight, inputs["targets"], inputs["old_logp"],
                                             inputs["advantages"], inputs["mask"], one_pass=one_pass, **kwargs)
    (2.5 * loss).backward()

    hidden64 = inputs["hidden"].double().requires_grad_()
    weight64 = inputs["weight"].double().requires_grad_()
    ref_loss, ref_metrics = linear_policy_loss_reference(hidden64, weight64, inputs["targets"], inputs["old_logp"],
                                                         inputs["advantages"], inputs["mask"], **kwargs)
    (2.5 * ref_loss).backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    for key, value in ref_metrics.items():
        assert abs(metrics[key].item() - value.item()) < 1e-5, key
    torch.testing.assert_close(hidden.grad.double(), hidden64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), weight64.grad, rtol=1e-4, atol=1e-6)


def test_gradients_of_bf16_inputs_match_reference_to_bf16_precision(backend):
    cfg = CONFIGS["ppo-k3-token-mean"]
    inputs = make_inputs(dtype=torch.bfloat16, seed=1)
    hidden = inputs["hidden"].clone().requires_grad_()
    loss, _ = fused_linear_policy_loss(hidden, inputs["weight"], inputs["targets"], inputs["old_logp"],
                                       inputs["advantages"], inputs["mask"], cfg=cfg, temperature=TEMPERATURE,
                                       ref_logp=inputs["ref_logp"])
    loss.backward()
    hidden64 = inputs["hidden"].double().requires_grad_()
    ref_loss, _ = linear_policy_loss_reference(hidden64, inputs["weight"].double(), inputs["targets"],
                                               inputs["old_logp"], inputs["advantages"], inputs["mask"], cfg=cfg,
                                               temperature=TEMPERATURE, ref_logp=inputs["ref_logp"])
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    error = (hidden.grad.double() - hidden64.grad).norm() / hidden64.grad.norm()
    assert error < 1e-2  # dz and the gradient are rounded to bf16


def test_missing_mask_raises_value_error():
    inputs = make_inputs()
    with pytest.raises(ValueError, match="mask"):
        fused_linear_policy_loss(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["old_logp"],
                                 inputs["advantages"], None, cfg=LossConfig())


def test_compiled_function_calling_the_op_matches_eager(monkeypatch):
    monkeypatch.setenv("REDLINE_KERNELS_BACKEND", "torch")
    cfg = CONFIGS["ppo-k3-token-mean"]
    inputs = make_inputs(seed=2)

    def step(h, w):
        loss, metrics = fused_linear_policy_loss(h, w, inputs["targets"], inputs["old_logp"], inputs["advantages"],
                                                 inputs["mask"], cfg=cfg, temperature=TEMPERATURE,
                                                 ref_logp=inputs["ref_logp"])
        return loss * 3.0, metrics["clipfrac"]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        h, w = inputs["hidden"].clone().requires_grad_(), inputs["weight"].clone().requires_grad_()
        loss, clipfrac = fn(h, w)
        loss.backward()
        results.append((loss.detach(), clipfrac, h.grad, w.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("path", ["one-pass", "two-pass"])
def test_gradients_computed_in_the_forward_become_grad_without_a_copy(monkeypatch, path, device):
    """Autograd keeps the op's own gradient tensors as ``.grad`` (a copy would double the gradient memory)."""
    from redline.kernels import linear_policy_loss

    computed = []
    loss_and_grads = linear_policy_loss._loss_and_grads

    def recording(*args, **kwargs):
        results = loss_and_grads(*args, **kwargs)
        computed.append(tuple(g.data_ptr() for g in results[2:]))  # pointers only: no reference kept
        return results

    monkeypatch.setattr(linear_policy_loss, "_loss_and_grads", recording)
    inputs = {name: t.to(device) for name, t in make_inputs(seed=3).items()}
    h, w = inputs["hidden"].clone().requires_grad_(), inputs["weight"].clone().requires_grad_()
    loss, _ = fused_linear_policy_loss(h, w, inputs["targets"], inputs["old_logp"], inputs["advantages"],
                                       inputs["mask"], cfg=CONFIGS["ppo-k3-token-mean"], ref_logp=inputs["ref_logp"],
                                       one_pass=path == "one-pass")
    (2 * loss).backward()
    assert computed == [(h.grad.data_ptr(), w.grad.data_ptr())]
