"""Packing samples into micro-batches."""

import pytest
import torch

from redline.kernels import LossConfig
from redline.kernels.reference import policy_loss_reference
from redline.loop.batching import aggregation_weight, balance_across_ranks, pack, split_by_token_budget
from redline.loop.data_parallel import SINGLE_PROCESS
from redline.rollout.types import Sample


def sample(prompt, response, mask=None):
    s = Sample(prompt="p", tokens=list(prompt) + list(response), response_length=len(response))
    s.loss_mask = mask if mask is not None else [1] * len(response)
    return s


def test_pack_aligns_targets_mask_and_values_with_positions():
    samples = [sample([5, 6], [7, 8]), sample([9], [10, 11, 12], mask=[1, 0, 1])]
    adv = [torch.tensor([0.5, 0.5]), torch.tensor([1.0, 2.0, 3.0])]
    mb = pack(samples, [0, 1], {"advantages": adv})
    assert mb.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert mb.cu_seqlens.tolist() == [0, 4, 8]
    # position 1 (token 6) predicts response token 7; position 5 (token 10) predicts masked-out 11
    assert mb.loss_mask.tolist() == [False, True, True, False, True, False, True, False]
    assert mb.targets[mb.loss_mask].tolist() == [7, 8, 10, 12]
    assert mb.token_values["advantages"].tolist() == [0, 0.5, 0.5, 0, 1.0, 2.0, 3.0, 0]
    back = mb.response_values(mb.token_values["advantages"], samples)
    assert back[1].tolist() == [1.0, 2.0, 3.0]


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="sample 0 has an empty prompt"):
        pack([sample([], [1, 2])], [0], {})


def test_token_budget_first_fit_decreasing():
    assert split_by_token_budget([6, 5, 4, 3, 2], max_tokens=8) == [[0, 4], [1, 3], [2]]
    assert split_by_token_budget([20, 1], max_tokens=8) == [[0], [1]]
    with pytest.raises(ValueError, match="max_tokens_per_gpu"):
        split_by_token_budget([1], 0)


def test_ranks_get_equal_counts_and_balanced_load():
    lengths = [8, 7, 6, 5, 4, 3]
    batches = [[0], [1], [2], [3, 4, 5]]
    per_rank = balance_across_ranks(batches, lengths, world_size=2)
    assert [len(r) for r in per_rank] == [2, 2]
    loads = [sum(lengths[i] for b in r for i in b) for r in per_rank]
    assert abs(loads[0] - loads[1]) <= 3


def test_an_uneven_count_is_evened_by_splitting_the_largest_batch():
    lengths = [8, 7, 6, 5, 4, 3]
    per_rank = balance_across_ranks([[0, 1, 2]], lengths, world_size=2)
    assert [len(r) for r in per_rank] == [1, 1]
    assert sorted(i for r in per_rank for b in r for i in b) == [0, 1, 2]
    with pytest.raises(ValueError, match="equal micro-batch counts"):
        balance_across_ranks([[0]], lengths, world_size=2)


def test_aggregation_weights():
    samples = [sample([1], [2, 3]), sample([4], [5], mask=[0])]
    mb = pack(samples, [0, 1], {})
    assert aggregation_weight(mb, "token-mean") == 2
    # the seq-mean modes count the sample whose loss mask is empty too
    assert aggregation_weight(mb, "seq-mean-token-mean") == 2
    assert aggregation_weight(mb, "seq-mean-token-sum") == 2
    assert aggregation_weight(mb, "seq-mean-token-sum-norm") == 2


@pytest.mark.parametrize("agg,agg_constant", [("token-mean", None), ("seq-mean-token-mean", None),
                                              ("seq-mean-token-sum", None), ("seq-mean-token-sum-norm", 4.0)])
def test_weighted_micro_batch_losses_sum_to_the_whole_steps_loss(agg, agg_constant):
    """What the step does (loss of each micro-batch × its share of the step's aggregation units) equals the loss
    aggregated over all the step's samples at once — with a sample whose loss mask is empty (slime's removed
    sample) in the step."""
    samples = [sample([1, 2], [3, 4, 5]), sample([6], [7, 8], mask=[0, 0]), sample([9], [10, 11, 12, 13]),
               sample([14, 15], [16], mask=[1]), sample([17], [18, 19], mask=[0, 1])]
    gen = torch.Generator().manual_seed(0)
    per_token = {name: [torch.randn(s.response_length, generator=gen, dtype=torch.float64) for s in samples]
                 for name in ("logp", "advantages")}
    cfg = LossConfig(estimator="cispo", eps_clip_high=0.3, agg=agg, agg_constant=agg_constant)

    def loss_of(batch):
        logp, adv = batch.token_values["logp"].double(), batch.token_values["advantages"].double()
        return policy_loss_reference(logp, logp + 0.1, adv, batch.loss_mask, cfg=cfg,
                                     cu_seqlens=batch.cu_seqlens)[0]

    batches = [pack(samples, ids, per_token) for ids in ([0, 1], [2], [3, 4])]
    weights = SINGLE_PROCESS.loss_weights([aggregation_weight(b, agg) for b in batches])
    stepped = sum(w * loss_of(b) for w, b in zip(weights, batches))
    assert stepped.item() == pytest.approx(loss_of(pack(samples, range(5), per_token)).item(), rel=1e-6)
