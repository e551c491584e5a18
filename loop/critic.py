"""The PPO critic: the policy's architecture with a scalar value head, trained on GAE returns.

``values(batch) -> [T]`` is ``V(s)`` at every position of a packed stream (the value of the state *before* the
token at ``p + 1``, the same positions the policy's log-probs sit at). The loss is slime's clipped value loss,
token-mean over the loss positions: ``max((V_clip − R)², (V − R)²)`` with
``V_clip = V_old + clip(V − V_old, −value_clip, value_clip)``.
"""

import math

import torch
from torch import nn

from redline.loop.data_parallel import SINGLE_PROCESS, DataParallel
from redline.loop.gradients import accumulate_and_clip
from redline.loop.schedule import build_optimizer, build_scheduler, master_weights_for
from redline.loop.worker import _forward_hidden


class ValueModel(nn.Module):
    """``decoder`` (a ``redline.trainer.models`` model) + ``head``: Linear(H, 1), zero-initialised so the first
    values are 0 and the first advantages equal the discounted rewards."""

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder
        weight = decoder.lm_head_weight()
        self.head = nn.Linear(weight.shape[1], 1, dtype=weight.dtype, device=weight.device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, batch) -> torch.Tensor:
        return self.head(_forward_hidden(self.decoder, batch)).squeeze(-1).float()


class CriticWorker:
    def __init__(self, decoder, train_cfg, *, total_steps: int, value_clip: float, lr: float | None,
                 dp: DataParallel = SINGLE_PROCESS):
        self.model = ValueModel(decoder)
        self.dp = dp
        self.cfg = train_cfg
        self.value_clip = value_clip
        self.master = master_weights_for(self.model, train_cfg, dp)
        self.optimizer = build_optimizer(self.model.parameters(), train_cfg, lr=lr, master=self.master)
        self.scheduler = build_scheduler(self.optimizer, train_cfg, total_steps)
        self.device = self.model.head.weight.device

    @torch.no_grad()
    def values(self, batch) -> torch.Tensor:
        return self.model(batch.to(self.device)).masked_fill(~batch.loss_mask.to(self.device), 0.0)

    def value_loss(self, batch):
        values = self.model(batch)
        old, returns = batch.token_values["old_values"], batch.token_values["returns"]
        clipped = old + (values - old).clamp(-self.value_clip, self.value_clip)
        per_token = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
        mask = batch.loss_mask
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
        clipfrac = (((values - old).abs() > self.value_clip) & mask).sum() / mask.sum().clamp(min=1)
        return loss, {"value_loss": loss.detach(), "value_clipfrac": clipfrac.float()}

    def step(self, batches, weights) -> dict[str, float]:
        """One optimizer step of the value loss over micro-batches (token-mean weights)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals = accumulate_and_clip(self.model, batches, weights, self.value_loss, device=self.device,
                                     clip=self.cfg.clip_grad, dp=self.dp, master=self.master)
        totals["value_grad_norm"] = totals.pop("grad_norm")
        del totals["loss"]  # the same number as value_loss
        if all(math.isfinite(v) for v in totals.values()):  # a NaN/inf step is skipped, as the actor's
            self.optimizer.step()
            self.scheduler.step()
        return totals

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
