"""use_redline_kernels(GRPOTrainer): the same loss and gradients as TRL's own GRPO loss, option by option."""

import copy

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[trl]')")
datasets = pytest.importorskip("datasets", reason="datasets (a TRL dependency) is not installed")

from redline.kernels.integrations.trl import loss_config_from_trl, use_redline_kernels
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

VOCAB = 64
PROMPT, COMPLETION, BATCH = 3, 6, 4


def tokenizer():
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t1", eos_token="t2", unk_token="t0")


def tiny_model(seed=0):
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                         pad_token_id=1, eos_token_id=2, bos_token_id=2)
    return Qwen3ForCausalLM(config)


def make_trainer(model, **options):
    args = trl.GRPOConfig(output_dir="/tmp/redline-trl-test", per_device_train_batch_size=BATCH, num_generations=2,
                          max_completion_length=COMPLETION, use_cpu=True, report_to=[], bf16=False, max_steps=1,
                          save_strategy="no", logging_steps=1, temperature=0.9, **options)
    dataset = datasets.Dataset.from_dict({"prompt": ["t3 t4 t5", "t6 t7 t8"] * 4})
    return trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                           args=args, train_dataset=dataset, processing_class=tokenizer())


def batch(*, old=True, ref=False, ratio=None):
    """A generated batch as TRL's _generate_and_score_completions hands it to the loss: a left-padded prompt,
    right-padded completions (one fully masked), per-sequence advantages, off-policy old/ref log-probs."""
    g = torch.Generator().manual_seed(1)
    prompt_mask = torch.ones(BATCH, PROMPT, dtype=torch.long)
    prompt_mask[1, 0] = 0
    completion_mask = torch.ones(BATCH, COMPLETION, dtype=torch.long)
    completion_mask[0, 4:] = 0
    completion_mask[2, :] = 0
    inputs = {"prompt_ids": torch.randint(3, VOCAB, (BATCH, PROMPT), generator=g), "prompt_mask": prompt_mask,
              "completion_ids": torch.randint(3, VOCAB, (BATCH, COMPLETION), generator=g),
              "completion_mask": completion_mask, "advantages": torch.tensor([1.5, -0.7, 0.3, -1.2]),
              "num_items_in_batch": completion_mask.sum().float()}
    logp_like = -torch.rand(BATCH, COMPLETION, generator=g) * 4 - 2
    if old:  # ratios far enough from 1 that both clip branches and the dual clip are taken
        inputs["old_per_token_logps"] = logp_like + torch.randn(BATCH, COMPLETION, generator=g) * 0.4
    if ref:
        inputs["ref_per_token_logps"] = logp_like + torch.randn(BATCH, COMPLETION, generator=g) * 0.3
    if ratio is not None:
        inputs["importance_sampling_ratio"] = ratio
    return inputs


def loss_and_grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, copy.deepcopy(inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def assert_same_step(options, inputs, *, use_vllm=False, model=None):
    trainer = make_trainer(model or tiny_model(), **options)
    trainer.use_vllm = use_vllm  # the loss reads the flag only; no generation runs here
    trainer.current_gradient_accumulation_steps = 2  # set by train(); 2 checks the accumulation scaling
    expected_loss, expected_grads = loss_and_grads(trainer, inputs)
    use_redline_kernels(trainer)
    loss, grads = loss_and_grads(trainer, inputs)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    assert any(g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
def test_each_loss_type_gives_trls_loss_and_gradients(loss_type):
    assert_same_step({"loss_type": loss_type, "epsilon": 0.2, "epsilon_high": 0.28}, batch())


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_on_policy_step_without_old_logps(loss_type):
    assert_same_step({"loss_type": loss_type}, batch(old=False))


def test_cispo():
    assert_same_step({"loss_type": "cispo", "epsilon_high": 1.3}, batch())


def test_sequence_level_importance_sampling():
    assert_same_step({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4,
                      "epsilon_high": 4e-4}, batch())


def test_beta_kl_and_delta(tmp_path):
    tiny_model().save_pretrained(tmp_path)  # with beta, TRL loads its reference model from the model's path
    assert_same_step({"loss_type": "bnpo", "beta": 0.05, "use_bias_correction_kl": False, "delta": 1.5},
                     batch(ref=True), model=str(tmp_path))


@pytest.mark.parametrize("shape", [(BATCH, COMPLETION), (BATCH, 1)])
def test_vllm_importance_sampling_correction(shape):
    ratio = torch.rand(*shape, generator=torch.Generator().manual_seed(3)) * 2
    ratio[0, 0] = 0.0  # a masked-out (mask mode) weight
    assert_same_step({"loss_type": "dapo"}, batch(ratio=ratio), use_vllm=True)


def test_one_training_step_matches_end_to_end():
    """trainer.train() for one step (generation, rewards, loss, SGD update): the same parameters either way."""
    options = {"loss_type": "grpo", "optim": "sgd", "learning_rate": 0.1, "seed": 7}
    plain, switched = make_trainer(tiny_model(), **options), use_redline_kernels(make_trainer(tiny_model(), **options))
    for trainer in (plain, switched):  # the same sampling noise: the same completions
        torch.manual_seed(7)
        trainer.train()
    assert switched.state.log_history[0]["loss"] == pytest.approx(plain.state.log_history[0]["loss"], rel=1e-5,
                                                                  abs=1e-7)
    for (name, p), q in zip(plain.model.named_parameters(), switched.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    assert any(not torch.equal(p, q) for p, q in zip(plain.model.parameters(), tiny_model().parameters()))


@pytest.mark.parametrize("options, option", [
    ({"loss_type": "sapo"}, "loss_type"),
    ({"loss_type": "grpo", "entropy_coef": 0.01}, "entropy_coef"),
    ({"loss_type": "grpo", "top_entropy_quantile": 0.2}, "top_entropy_quantile"),
    ({"loss_type": "grpo", "off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold"),
    ({"loss_type": "grpo", "beta": 0.1}, "use_bias_correction_kl"),
    ({"loss_type": "grpo", "delta": 1.1, "epsilon_high": 0.2}, "delta"),
])
def test_options_without_a_redline_equivalent_are_refused_by_name(options, option):
    args = trl.GRPOConfig(output_dir="/tmp/redline-trl-test", report_to=[], use_cpu=True, bf16=False, **options)
    with pytest.raises(ValueError, match=option):
        loss_config_from_trl(args)


def test_importing_the_kernels_imports_no_trainer_library():
    import subprocess
    import sys

    # (triton is left out: torch's own custom-op machinery, torch._dynamo, imports it where it is installed)
    code = ("import sys, torch; before = set(sys.modules); "
            "import redline.kernels, redline.kernels.integrations.trl, redline.kernels.integrations.verl; "
            "print(sorted(m for m in ('trl', 'verl', 'transformers', 'accelerate', 'datasets') "
            "if m in sys.modules and m not in before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
