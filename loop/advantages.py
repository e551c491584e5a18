"""Advantage estimators on a packed batch of responses.

Layout: N samples; their response tokens packed back to back (``T_r`` tokens), sample ``i`` owning
``cu_resp[i]:cu_resp[i+1]``. Scalar tensors per sample are ``[N]``; per-token tensors are ``[T_r]`` fp32.
Math follows slime (reference notes §3.1, §3.3), with one deliberate difference: ``kl_coef`` (KL in the reward)
is honoured by every estimator — group estimators subtract ``kl_coef · kl_t`` from each token's advantage, where
slime silently ignores it for grpo/gspo/cispo. The return recursions (``discounted_returns``, ``gae``) treat
tokens outside the loss mask in the middle of a response (multi-turn tool output) exactly as verl's do.
"""

import torch

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "gspo", "cispo")
WHITENED_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def group_centered(rewards: torch.Tensor, group_ids: torch.Tensor, *, std_normalize: bool,
                   eps: float = 1e-6) -> torch.Tensor:
    """``R_i − mean_{G(i)} R``, divided by the group's (unbiased) std + eps when ``std_normalize``."""
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, inverse, rewards) / count
    centered = rewards - mean[inverse]
    if not std_normalize:
        return centered
    sq = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, inverse, centered**2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return centered / (std[inverse] + eps)


def leave_one_out(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: ``R_i − mean_{j ∈ G(i), j ≠ i} R_j`` (0 for a group of one)."""
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, inverse, torch.ones_like(rewards))
    total = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, inverse, rewards)
    others = (count[inverse] - 1).clamp(min=1)
    baseline = (total[inverse] - rewards) / others
    return torch.where(count[inverse] > 1, rewards - baseline, torch.zeros_like(rewards))


def per_token(values: torch.Tensor, cu_resp: torch.Tensor) -> torch.Tensor:
    """Broadcast ``[N]`` per-sample values to their response tokens ``[T_r]``."""
    return torch.repeat_interleave(values, (cu_resp[1:] - cu_resp[:-1]).long())


def _padded(x: torch.Tensor, cu_resp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T_r]`` → ``[N, L_max]`` right-padded with zeros (False for bool), plus the validity mask."""
    lengths = (cu_resp[1:] - cu_resp[:-1]).long()
    n, width = len(lengths), int(lengths.max()) if len(lengths) else 0
    valid = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    out = torch.zeros(n, width, dtype=x.dtype)
    out[valid] = x
    return out, valid


def _padded_mask(loss_mask: torch.Tensor, cu_resp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_padded`` for the ``[T_r]`` bool loss mask, checked first."""
    if loss_mask.dtype != torch.bool or loss_mask.shape != (int(cu_resp[-1]),):
        raise ValueError(f"loss_mask must be a bool tensor [T_r={int(cu_resp[-1])}] over the response tokens, "
                         f"got {loss_mask.dtype} {tuple(loss_mask.shape)}")
    return _padded(loss_mask, cu_resp)


def discounted_returns(rewards: torch.Tensor, loss_mask: torch.Tensor, cu_resp: torch.Tensor,
                       gamma: float) -> torch.Tensor:
    """REINFORCE++ returns ``G_t = r_t + γ · m_{t+1} · G_{t+1}`` within each response (verl's
    ``compute_reinforce_plus_plus_outcome_advantage``); ``[T_r]`` rewards and bool ``loss_mask`` in, ``[T_r]`` out.

    A token outside the loss mask (``m = 0``: a tool or environment token) gets its own return but passes
    nothing back: the running return restarts at 0 before it, so tokens ahead of a masked span see only the
    rewards up to that span.
    """
    r, _ = _padded(rewards, cu_resp)
    keep, valid = _padded_mask(loss_mask, cu_resp)
    returns = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype)
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        returns[:, t] = running
        running = torch.where(keep[:, t], running, torch.zeros_like(running))
    return returns[valid]


def gae(rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, cu_resp: torch.Tensor, gamma: float,
        lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the loss-mask tokens (verl's ``compute_gae_advantage_return``);
    ``[T_r]`` rewards, values and bool ``loss_mask`` in, ``(advantages, returns)`` ``[T_r]`` out.

    Tokens outside the loss mask are skipped: for a token t in the mask, with ``n(t)`` the next token in the mask
    after t in its response (``V_{n(t)} = A_{n(t)} = 0`` when there is none),
    ``δ_t = r_t + γ V_{n(t)} − V_t`` and ``A_t = δ_t + γλ A_{n(t)}``; a token outside the mask takes
    ``A_{n(t)}`` and its reward and value are unused. ``returns = A + V`` at every token.
    """
    r, _ = _padded(rewards, cu_resp)
    v, _ = _padded(values, cu_resp)
    keep, valid = _padded_mask(loss_mask, cu_resp)
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=r.dtype)
    next_adv = torch.zeros_like(next_value)
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        next_value = torch.where(keep[:, t], v[:, t], next_value)
        next_adv = torch.where(keep[:, t], delta + gamma * lambd * next_adv, next_adv)
        adv[:, t] = next_adv
    advantages = adv[valid]
    return advantages, advantages + values


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, sum_over_ranks=None) -> torch.Tensor:
    """``(x − μ) / sqrt(σ² · n/(n−1) + eps)`` over masked entries (unbiased variance), unmasked left as is.
    ``sum_over_ranks(t) -> t`` (``DataParallel.sum_tensor``) makes μ and σ those of every rank's entries."""
    selected = x[mask].double()
    stats = torch.stack([selected.new_tensor(selected.numel()), selected.sum(), selected.square().sum()])
    n, total, squares = (sum_over_ranks(stats) if sum_over_ranks else stats).tolist()
    if n < 2:
        return x - total / n if n else x
    mean = total / n
    var = max(squares - n * mean * mean, 0.0) / (n - 1)
    return torch.where(mask, (x - mean) / (var + eps) ** 0.5, x)


def terminal_reward(rewards: torch.Tensor, cu_resp: torch.Tensor) -> torch.Tensor:
    """``[T_r]`` with each sample's scalar reward on its last response token and 0 elsewhere."""
    out = torch.zeros(int(cu_resp[-1]), dtype=rewards.dtype)
    lengths = cu_resp[1:] - cu_resp[:-1]
    has_tokens = lengths > 0
    out[(cu_resp[1:] - 1)[has_tokens].long()] = rewards[has_tokens]
    return out


def compute_advantages(estimator: str, rewards: torch.Tensor, group_ids: torch.Tensor, cu_resp: torch.Tensor,
                       loss_mask: torch.Tensor, *, kl: torch.Tensor | None = None, kl_coef: float = 0.0,
                       normalize_by_std: bool = True, gamma: float = 1.0, lambd: float = 1.0,
                       values: torch.Tensor | None = None, sum_over_ranks=None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages ``[T_r]`` (and PPO returns, else None) for one rollout batch.

    ``rewards [N]`` fp32 scalar rewards; ``group_ids [N]`` the prompt group of each sample; ``loss_mask [T_r]`` bool;
    ``kl [T_r]`` the per-token KL(old ‖ ref) estimate, needed when ``kl_coef > 0``; ``values [T_r]`` for ppo.
    Whitening (reinforce_plus_plus*, ppo) is over the whole batch: with data parallelism pass ``sum_over_ranks``.
    """
    rewards = rewards.float()
    if kl_coef and kl is None:
        raise ValueError("kl_coef > 0 needs the per-token kl (reference log-probs were not computed)")
    kl_penalty = kl_coef * kl * loss_mask if kl_coef else torch.zeros(int(cu_resp[-1]))
    if estimator in GROUP_ESTIMATORS:
        std = normalize_by_std and estimator != "dr_grpo"
        return per_token(group_centered(rewards, group_ids, std_normalize=std), cu_resp) - kl_penalty, None
    if estimator == "rloo":
        return per_token(leave_one_out(rewards, group_ids), cu_resp) - kl_penalty, None
    if estimator == "reinforce_plus_plus_baseline":
        adv = per_token(group_centered(rewards, group_ids, std_normalize=False), cu_resp) - kl_penalty
        return masked_whiten(adv, loss_mask, sum_over_ranks=sum_over_ranks), None
    if estimator == "reinforce_plus_plus":
        token_rewards = terminal_reward(rewards, cu_resp) - kl_penalty
        return masked_whiten(discounted_returns(token_rewards, loss_mask, cu_resp, gamma), loss_mask,
                             sum_over_ranks=sum_over_ranks), None
    if estimator == "ppo":
        if values is None:
            raise ValueError("advantage_estimator 'ppo' needs critic values")
        token_rewards = terminal_reward(rewards, cu_resp) - kl_penalty
        advantages, returns = gae(token_rewards, values, loss_mask, cu_resp, gamma, lambd)
        return masked_whiten(advantages, loss_mask, sum_over_ranks=sum_over_ranks), returns
    raise ValueError(f"unknown advantage_estimator {estimator!r}")


class AdaptiveKLController:
    """Adaptive KL-in-reward coefficient (Ziegler et al. 2019): steer the measured KL towards ``target``."""

    def __init__(self, init_coef: float, target: float, horizon: int):
        self.coef, self.target, self.horizon = init_coef, target, horizon

    def update(self, current_kl: float, n_samples: int) -> float:
        error = max(-0.2, min(0.2, current_kl / self.target - 1.0))
        self.coef *= 1.0 + error * n_samples / self.horizon
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["coef"]
