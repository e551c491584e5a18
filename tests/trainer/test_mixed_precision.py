"""Mixed-precision training state: fp32 master weights, moments and gradient accumulation for a bf16 model."""

import pytest
import torch
import torch.nn.functional as F

from redline.trainer import mixed_precision
from redline.trainer.mixed_precision import MasterWeights, MixedPrecisionAdamW
from redline.trainer.models import from_config

LENGTHS = (7, 5)


def bf16_model(config_of, seed=0, device="cpu"):
    return from_config(config_of("qwen3"), dtype=torch.bfloat16, seed=seed, device=device)


def batch(config, seed, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (sum(LENGTHS),), generator=generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return input_ids.to(device), cu_seqlens.to(device)


def next_token_loss(model, input_ids, cu_seqlens):
    logits = model.logits(input_ids, cu_seqlens).float()
    return F.cross_entropy(logits[:-1], input_ids[1:])


def flat_master(master: MasterWeights) -> list[torch.Tensor]:
    """Each trainable parameter's fp32 master values, in ``model.parameters()`` order (one process)."""
    group = master.groups[0]
    return [group.master[o:o + p.numel()].view_as(p) for p, o in zip(group.params, group.offsets)]


def matrix_weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters() if p.dim() == 2]


def moved_share(before, after) -> float:
    changed = sum(int((a != b).sum()) for a, b in zip(before, after))
    return changed / sum(a.numel() for a in before)


def train(model, optimizer, config, steps, step_fn, *, same_batch=False):
    device = next(model.parameters()).device
    for step in range(steps):
        optimizer.zero_grad()
        next_token_loss(model, *batch(config, seed=0 if same_batch else step, device=device)).backward()
        step_fn(optimizer)


def test_master_weights_move_a_bf16_model_at_rl_learning_rates_where_plain_bf16_adamw_does_not(config_of):
    config = config_of("qwen3")
    plain = bf16_model(config_of)
    before = matrix_weights(plain)
    # one batch throughout: a steady gradient, so an fp32 weight drifts by about lr per step
    train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-5), config, 20, lambda o: o.step(), same_batch=True)
    plain_share = moved_share(before, matrix_weights(plain))

    mixed = bf16_model(config_of)
    master = MasterWeights(mixed)
    optimizer = MixedPrecisionAdamW(master, lr=1e-5)

    def step(o):
        master.reduce_and_clip(float("inf"))
        o.step()

    train(mixed, optimizer, config, 20, step, same_batch=True)
    mixed_share = moved_share(before, matrix_weights(mixed))
    # measured: 90 % against 14 % (only the weights nearest zero, where bf16 is fine-grained, move without it)
    assert mixed_share > 0.8 and plain_share < 0.2, (mixed_share, plain_share)


@pytest.mark.parametrize("max_norm", [float("inf"), 0.5])
def test_master_weights_equal_an_fp32_model_trained_on_the_same_gradients(config_of, max_norm):
    config = config_of("qwen3")
    model = bf16_model(config_of)
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    master = MasterWeights(model)
    optimizer = MixedPrecisionAdamW(master, lr=1e-3, betas=(0.9, 0.98), weight_decay=0.1)
    expected = torch.optim.AdamW(reference, lr=1e-3, betas=(0.9, 0.98), weight_decay=0.1, fused=True)
    for step in range(4):
        optimizer.zero_grad()
        for micro in range(2):  # two micro-batches accumulate into the fp32 main grad
            (next_token_loss(model, *batch(config, seed=10 * step + micro)) / 2).backward()
        for p, r in zip(model.parameters(), reference):
            r.grad = p.main_grad.clone()
        norm = master.reduce_and_clip(max_norm)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference, max_norm), rtol=1e-6, atol=0)
        optimizer.step()
        expected.step()
    for p, master_values, r in zip(model.parameters(), flat_master(master), reference):
        if max_norm == float("inf"):  # the same fused AdamW on the same fp32 gradients: bit-exact
            assert torch.equal(master_values, r.detach())
        else:  # clipping divides inside the update where torch multiplies by the reciprocal: ulps apart
            torch.testing.assert_close(master_values, r.detach(), rtol=1e-5, atol=1e-7)
        assert torch.equal(p.detach(), master_values.bfloat16())  # compute weights: the master rounded


def test_micro_batch_gradients_accumulate_in_fp32(config_of):
    config = config_of("qwen3")
    model, plain = bf16_model(config_of), bf16_model(config_of)
    MasterWeights(model)
    expected = [torch.zeros(p.shape) for p in plain.parameters()]
    for micro in range(3):
        next_token_loss(model, *batch(config, seed=micro)).backward()
        assert all(p.grad is None for p in model.parameters())  # each bf16 gradient is freed once added
        plain.zero_grad()
        next_token_loss(plain, *batch(config, seed=micro)).backward()
        for total, p in zip(expected, plain.parameters()):
            total += p.grad.float()  # the fp32 sum of the bf16 gradients, in order
    for p, total in zip(model.parameters(), expected):
        assert p.main_grad.dtype == torch.float32 and torch.equal(p.main_grad, total)


def test_parameters_become_aligned_views_of_one_flat_buffer_per_dtype(config_of):
    model = bf16_model(config_of)
    values = [p.detach().clone() for p in model.parameters()]
    master = MasterWeights(model)
    (group,) = master.groups
    for p, offset, value in zip(model.parameters(), group.offsets, values):
        assert p.untyped_storage().data_ptr() == group.compute.untyped_storage().data_ptr()
        assert offset % mixed_precision.ALIGN == 0
        assert torch.equal(p.detach(), value)  # flattening keeps the values
    assert group.master.dtype == torch.float32 and group.numel % mixed_precision.ALIGN == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_offloaded_master_takes_the_same_steps_in_chunks(config_of, monkeypatch, device):
    """On a GPU: pinned host state streamed through two buffer sets on the copy streams."""
    monkeypatch.setattr(mixed_precision, "OFFLOAD_CHUNK", 1000)  # several chunks on a tiny model
    config = config_of("qwen3")
    results = []
    for offload in (False, True):
        model = bf16_model(config_of, device=device)
        master = MasterWeights(model, offload=offload)
        optimizer = MixedPrecisionAdamW(master, lr=1e-3)
        assert master.groups[0].master.numel() > 3 * mixed_precision.OFFLOAD_CHUNK

        def step(o):
            master.reduce_and_clip(1.0)
            o.step()

        train(model, optimizer, config, 3, step)
        assert master.groups[0].master.device.type == ("cpu" if offload else device)
        results.append(([p.detach().clone() for p in model.parameters()], master.groups[0].master.cpu()))
    (weights, master_values), (offloaded_weights, offloaded_master) = results
    assert torch.equal(master_values, offloaded_master)
    assert all(torch.equal(a, b) for a, b in zip(weights, offloaded_weights))


def test_state_dict_resumes_the_same_updates(config_of):
    config = config_of("qwen3")

    def make():
        model = bf16_model(config_of)
        master = MasterWeights(model)
        return model, master, MixedPrecisionAdamW(master, lr=1e-3)

    def step(master):
        return lambda o: (master.reduce_and_clip(1.0), o.step())

    model, master, optimizer = make()
    train(model, optimizer, config, 2, step(master))
    saved = optimizer.state_dict()
    train(model, optimizer, config, 2, step(master))

    resumed_model, resumed_master, resumed = make()
    resumed.load_state_dict(saved)  # restores the master and publishes it into the model
    train(resumed_model, resumed, config, 2, step(resumed_master))
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(master.groups[0].master, resumed_master.groups[0].master)


def test_state_saved_with_another_layout_is_refused_naming_both(config_of):
    model = bf16_model(config_of)
    optimizer = MixedPrecisionAdamW(MasterWeights(model), lr=1e-3)
    saved = optimizer.state_dict()
    saved["layout"] = {**saved["layout"], "dp": 2}
    with pytest.raises(ValueError, match=r"'dp': 2.*'dp': 1"):
        optimizer.load_state_dict(saved)


def test_memory_rows_count_bytes_per_parameter(config_of):
    model = bf16_model(config_of)
    rows = {name: (per_param, total) for name, per_param, total, _ in MasterWeights(model).memory_rows()}
    numel = MasterWeights(bf16_model(config_of)).groups[0].numel
    assert rows["compute weights"] == (2.0, 2 * numel)
    assert rows["master weights (fp32)"] == (4.0, 4 * numel)
    assert rows["Adam moments (fp32 × 2)"] == (8.0, 8 * numel)


INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs on CPU tensors only under its "
                                      "interpreter, which conftest turns on where no GPU is visible")


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=INTERPRETER_ONLY),
                                    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_pass_triton_adamw_matches_torchs_fused_adamw_and_writes_the_rounded_master(device):
    """The GPU update (``adamw_triton``; the Triton interpreter on the CPU) against torch's fused AdamW."""
    from redline.trainer.adamw_triton import adamw_publish

    generator = torch.Generator().manual_seed(0)
    n = 5000  # two blocks, the second partial
    master = torch.randn(n, generator=generator).to(device)
    expected = master.clone()
    exp_avg, exp_avg_sq = torch.zeros(n, device=device), torch.zeros(n, device=device)
    expected_moments = (torch.zeros(n, device=device), torch.zeros(n, device=device))
    compute = torch.empty(n, dtype=torch.bfloat16, device=device)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.1)
    scale = torch.tensor(3.0, device=device)
    for step in range(1, 4):
        grad = torch.randn(n, generator=generator).to(device)
        adamw_publish(master, grad, exp_avg, exp_avg_sq, compute, scale, step=step, **hyper)
        torch._fused_adamw_([expected], [grad.clone()], [expected_moments[0]], [expected_moments[1]], [],
                            [torch.tensor(float(step), device=device)], grad_scale=scale, amsgrad=False,
                            maximize=False, **hyper)
    torch.testing.assert_close(master, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(exp_avg_sq, expected_moments[1], rtol=1e-6, atol=1e-12)
    assert torch.equal(compute, master.bfloat16())


def test_warm_up_leaves_the_optimizer_state_untouched(config_of):
    model = bf16_model(config_of)
    optimizer = MixedPrecisionAdamW(MasterWeights(model), lr=1e-3)
    before = optimizer.state_dict()
    optimizer.warm_up()
    after = optimizer.state_dict()
    assert after["shards"][0]["step"] == before["shards"][0]["step"] == 0
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(after["shards"][0][key], before["shards"][0][key])


@pytest.mark.gpu
def test_offload_streams_groups_of_several_dtypes_through_one_set_of_buffers(monkeypatch):
    """The staging buffers serve every dtype group: sized for the largest, whichever comes first."""
    monkeypatch.setattr(mixed_precision, "OFFLOAD_CHUNK", 1000)
    results = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(64, 64)).cuda()
        model[0].to(torch.bfloat16)  # a small bf16 group first, then a larger fp32 one
        master = MasterWeights(model, offload=offload)
        optimizer = MixedPrecisionAdamW(master, lr=1e-3)
        assert [g.master.numel() < mixed_precision.OFFLOAD_CHUNK for g in master.groups] == [True, False]
        for group in master.groups:
            group.main_grad.normal_(generator=torch.Generator("cuda").manual_seed(1))
        master.reduce_and_clip(1.0)
        optimizer.step()
        results.append([g.master.cpu() for g in master.groups])
    for plain, offloaded in zip(*results):
        assert torch.equal(plain, offloaded)
