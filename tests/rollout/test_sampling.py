"""Sampling: greedy, temperature-scaled log-probs, top-k / top-p truncation, seeded reproducibility."""

import torch
from redline.rollout.embedded.sampling import sample, truncation_mask


def params(b, temperature=1.0, top_k=-1, top_p=1.0):
    return (torch.full((b,), float(temperature)), torch.full((b,), top_k, dtype=torch.long),
            torch.full((b,), float(top_p)))


def test_greedy_takes_argmax_with_unscaled_logp():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    tokens, logp = sample(logits, *params(2, temperature=0.0), [None, None])
    assert tokens.tolist() == [1, 0]
    expected = torch.log_softmax(logits, -1)[[0, 1], [1, 0]]
    torch.testing.assert_close(logp, expected)


def test_logp_is_under_temperature_scaled_untruncated_distribution():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    tokens, logp = sample(logits, *params(4, temperature=0.7, top_k=5, top_p=0.9), [None] * 4,
                          torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logp, expected)


def test_top_k_restricts_draws_to_k_most_likely():
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(2)).repeat(400, 1)
    tokens, _ = sample(logits, *params(400, temperature=5.0, top_k=3), [None] * 400,
                       torch.Generator().manual_seed(3))
    assert set(tokens.tolist()) == set(logits[0].topk(3).indices.tolist())


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    keep = truncation_mask(probs, torch.tensor([-1]), torch.tensor([0.8]))
    assert keep.tolist() == [[True, True, False, False]]  # 0.5 < 0.8 so the second token is needed, then 0.8


def test_top_p_always_keeps_the_top_token():
    keep = truncation_mask(torch.tensor([[0.1, 0.9]]), torch.tensor([-1]), torch.tensor([0.01]))
    assert keep.tolist() == [[False, True]]


def test_draws_follow_the_distribution():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).repeat(20000, 1)
    tokens, _ = sample(logits, *params(20000), [None] * 20000, torch.Generator().manual_seed(4))
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.015, rtol=0)


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(5))
    alone, _ = sample(logits[1:2], *params(1), [torch.Generator().manual_seed(9)])
    in_batch, _ = sample(logits, *params(3), [None, torch.Generator().manual_seed(9), None],
                         torch.Generator().manual_seed(0))
    assert in_batch[1] == alone[0]


def test_untruncated_fast_path_draws_the_same_tokens():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    full, _ = sample(logits, *params(4), [None] * 4, torch.Generator().manual_seed(7), truncate=True)
    fast, _ = sample(logits, *params(4), [None] * 4, torch.Generator().manual_seed(7), truncate=False)
    assert torch.equal(full, fast)
