"""redline in verl: the registered policy loss "redline" and the fused-head backend against verl's own code.

verl 0.9.1 pins transformers < 5.11, so it is not part of the test extra; install it beside the repository's
transformers with ``pip install --no-deps verl==0.9.1 tensordict==0.10.0 omegaconf hydra-core codetiming ray``
(kernels/README.md, "With verl"). The actor loss is verl's own ``workers/utils/losses.ppo_loss`` on an
``ActorConfig`` and a TensorDict batch laid out as its FSDP engine hands them over (packed per-sequence log-probs).
"""

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed (see module docstring)")

from redline.kernels import fused_linear_policy_loss
from redline.kernels.integrations.verl import aggregation_scale, loss_config_from_verl, register
from tensordict import TensorDict
from transformers import Qwen3Config, Qwen3ForCausalLM
from verl.models.transformers import monkey_patch
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
from verl.workers.config.actor import ActorConfig, PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

register()
VOCAB, PROMPT, RESPONSE, BATCH = 64, 3, 6, 4
MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def actor_config(loss_mode="vanilla", global_batch_info=None, **overrides):
    options = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "entropy_coeff": 0.01,
               "use_kl_loss": True, "kl_loss_coef": 0.05, "kl_loss_type": "low_var_kl", **overrides}
    config = ActorConfig(strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                         policy_loss=PolicyLossConfig(loss_mode=loss_mode), **options)
    config.global_batch_info.update(global_batch_info or {})
    return config


def per_token_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(BATCH, RESPONSE, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2] = False  # a sample with no response token
    base = -torch.rand(BATCH, RESPONSE, generator=g) * 3 - 0.5
    return {"response_mask": mask, "old_log_prob": base + torch.randn(BATCH, RESPONSE, generator=g) * 0.4,
            "ref_log_prob": base + torch.randn(BATCH, RESPONSE, generator=g) * 0.3,
            "advantages": torch.tensor([1.5, -0.7, 0.3, -1.2])[:, None].expand(BATCH, RESPONSE).clone(),
            "rollout_is_weights": torch.rand(BATCH, RESPONSE, generator=g) * 2,
            "log_prob": base + torch.randn(BATCH, RESPONSE, generator=g) * 0.2}


def verl_actor_loss(config, log_probs, entropy, data):
    """verl's actor loss (``ppo_loss``) of per-position model outputs ``[B, L]`` (rolled labels, as the fused
    forward returns them): each sample's ``P + R_i`` positions packed back to back, as the engine's are."""
    mask = data["response_mask"]
    lengths = (PROMPT + mask.sum(1)).tolist()
    packed = {"log_probs": torch.cat([row[:n] for row, n in zip(log_probs, lengths)]),
              "entropy": torch.cat([row[:n] for row, n in zip(entropy, lengths)])}
    batch = TensorDict({"prompts": torch.zeros(BATCH, PROMPT, dtype=torch.long),
                        "responses": torch.zeros(BATCH, RESPONSE, dtype=torch.long),
                        "attention_mask": torch.cat([torch.ones(BATCH, PROMPT, dtype=torch.long), mask.long()], 1),
                        "response_mask": mask.long(), "old_log_probs": data["old_log_prob"],
                        "advantages": data["advantages"], "ref_log_prob": data["ref_log_prob"]},
                       batch_size=[BATCH])
    for name in ("dp_size", "batch_num_tokens", "global_batch_size"):
        batch.set_non_tensor(name, 1 if name == "dp_size" else None)
    loss, _ = ppo_loss(config, packed, batch)
    return loss


@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("global_info", [{}, {"dp_size": 2, "batch_num_tokens": 25, "global_batch_size": 7}])
@pytest.mark.parametrize("mode", MODES)
def test_registered_policy_loss_equals_verls_vanilla(mode, global_info, weights):
    data = per_token_batch()
    results = []
    for loss_mode in ("vanilla", "redline"):
        config = actor_config(loss_mode, {**global_info, "loss_scale_factor": 5}, loss_agg_mode=mode)
        log_prob = data["log_prob"].clone().requires_grad_()
        loss, metrics = core_algos.get_policy_loss_fn(loss_mode)(
            old_log_prob=data["old_log_prob"], log_prob=log_prob, advantages=data["advantages"],
            response_mask=data["response_mask"], loss_agg_mode=mode, config=config,
            rollout_is_weights=data["rollout_is_weights"] if weights else None)
        loss.backward()
        results.append((loss.detach(), log_prob.grad, metrics["actor/pg_clipfrac"]))
    (expected, expected_grad, expected_clipfrac), (loss, grad, _) = results
    assert expected_clipfrac > 0  # the batch takes the clipped branches
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


def tiny_model(cls=Qwen3ForCausalLM):
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    return cls(config)


def model_batch():
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, VOCAB, (BATCH, PROMPT + RESPONSE), generator=g)
    return input_ids, input_ids[:, PROMPT:]


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_actor_loss_through_the_fused_head_equals_verls(mode):
    """One actor loss (verl's ppo_loss) on a batch: verl's logits path with the vanilla loss, the redline backend
    and loss, and the whole loss in one fused_linear_policy_loss call: the same loss and gradients (fp32)."""
    data, temperature = per_token_batch(), 0.9
    input_ids, responses = model_batch()
    config = actor_config(loss_agg_mode=mode, loss_scale_factor=RESPONSE)

    model = tiny_model()
    logits = model(input_ids=input_ids).logits / temperature
    rolled = torch.roll(input_ids, shifts=-1, dims=-1)
    expected = verl_actor_loss(config, logprobs_from_logits(logits, rolled), entropy_from_logits(logits), data)
    expected.backward()
    expected_grads = grads(model)

    fused = tiny_model(type("FusedQwen3", (Qwen3ForCausalLM,), {}))  # verl patches the class's forward
    monkey_patch.patch_forward_with_backends(fused, use_fused_kernels=True, fused_kernels_backend="redline")
    out = fused(input_ids=input_ids, temperature=temperature, return_dict=True)
    loss = verl_actor_loss(actor_config("redline", loss_agg_mode=mode, loss_scale_factor=RESPONSE), out.log_probs,
                           out.entropy, data)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    for name, grad in grads(fused).items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")

    one_call = tiny_model()
    hidden = one_call.model(input_ids=input_ids).last_hidden_state[:, PROMPT - 1:-1]
    rows, scale = aggregation_scale(mode, data["response_mask"], {})
    pick = slice(None) if rows is None else rows
    per_token = {k: data[k][pick].reshape(-1) for k in ("old_log_prob", "advantages", "ref_log_prob")}
    n = per_token["advantages"].numel() // RESPONSE
    loss, _ = fused_linear_policy_loss(
        hidden[pick].reshape(-1, hidden.shape[-1]), one_call.lm_head.weight, responses[pick].reshape(-1),
        per_token["old_log_prob"], per_token["advantages"], data["response_mask"][pick].reshape(-1),
        cfg=loss_config_from_verl(config, response_length=RESPONSE), temperature=temperature,
        ref_logp=per_token["ref_log_prob"],
        cu_seqlens=torch.arange(0, n * RESPONSE + 1, RESPONSE, dtype=torch.int32))
    (loss * scale).backward()
    torch.testing.assert_close(loss * scale, expected, rtol=1e-5, atol=1e-7)
    for name, grad in grads(one_call).items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kl_type, expected", [("k3", "low_var_kl"), ("low_var_kl", "low_var_kl"), ("kl", "k1"),
                                               ("mse", "k2")])
def test_kl_types_map(kl_type, expected):
    assert loss_config_from_verl(actor_config(kl_loss_type=kl_type)).kl_type == expected


@pytest.mark.parametrize("overrides, option", [({"kl_loss_type": "abs"}, "kl_loss_type"),
                                               ({"kl_loss_type": "k3+"}, "kl_loss_type"),
                                               ({"loss_agg_mode": "seq-sum"}, "loss_agg_mode")])
def test_options_without_a_redline_equivalent_are_refused_by_name(overrides, option):
    config = {"use_kl_loss": True, **overrides}  # a plain mapping: ActorConfig itself rejects an unknown agg mode
    with pytest.raises(ValueError, match=f"{option}=.*no redline equivalent"):
        loss_config_from_verl(config)
