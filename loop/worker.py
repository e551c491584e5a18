"""The trainer worker: owns the policy, its optimiser and the reference; computes log-probs and takes steps.

A plain class with narrow methods, so a Ray actor can wrap it unchanged. All LM-head work goes through
``redline.kernels`` (no ``[T, V]`` logits tensor is ever built).
"""

import math

import torch

from redline.kernels import LossConfig, fused_linear_logprobs, fused_linear_policy_loss, policy_loss
from redline.loop.batching import MicroBatch
from redline.loop.data_parallel import SINGLE_PROCESS, DataParallel
from redline.loop.gradients import accumulate_and_clip
from redline.loop.model_parallel import last_stage_outputs, padded_stream, tp_group_of
from redline.loop.reference import ReferencePolicy
from redline.loop.schedule import build_optimizer, build_scheduler, master_weights_for


def _forward_hidden(model, batch: MicroBatch) -> torch.Tensor:
    """``hidden [T, H]`` of a model without pipeline stages (``padded_stream``: padded to the backend's token
    multiple, the padded rows cut)."""
    input_ids, cu_seqlens = padded_stream(model, batch)
    return model(input_ids, cu_seqlens)[:batch.input_ids.shape[0]]


class TrainerWorker:
    """``temperature``: the rollout temperature the log-probs are taken at (logits / temperature); ``dp``: the
    data-parallel ranks whose gradients each step averages (one process by default)."""

    def __init__(self, model, train_cfg, *, total_steps: int, temperature: float, keep_reference: bool,
                 dp: DataParallel = SINGLE_PROCESS):
        self.model = model
        self.dp = dp
        self.cfg = train_cfg
        self.temperature = temperature
        # the reference first: it copies the weights before they become views of the master's flat buffer
        self.reference = ReferencePolicy(model) if keep_reference else None
        self.master = master_weights_for(model, train_cfg, dp)
        self.optimizer = build_optimizer(model.parameters(), train_cfg, master=self.master)
        self.scheduler = build_scheduler(self.optimizer, train_cfg, total_steps)
        self.rl_optimizer = (self.optimizer, self.scheduler)
        self.bad_steps = 0
        self.device = next(model.parameters()).device
        self.num_parameters = sum(p.numel() for p in model.parameters())

    @torch.no_grad()
    def logprobs(self, batch: MicroBatch, *, reference: bool = False,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``logp [T]`` (0 off the loss positions) and optionally ``entropy [T]`` of the policy or reference."""
        batch = batch.to(self.device)
        if reference:
            with self.reference.active(self.model) as model:
                return self._logprobs(model, batch, with_entropy)
        return self._logprobs(self.model, batch, with_entropy)

    def _logprobs(self, model, batch, with_entropy):
        def head(hidden):
            logp, entropy = fused_linear_logprobs(hidden, model.lm_head_weight(), batch.targets,
                                                  temperature=self.temperature, mask=batch.loss_mask,
                                                  return_entropy=with_entropy, tp_group=tp_group_of(model))
            return (logp, entropy) if with_entropy else (logp,)

        outputs = last_stage_outputs(model, batch, head, count=2 if with_entropy else 1)
        return outputs[0], outputs[1] if with_entropy else None

    def policy_loss(self, batch: MicroBatch, loss_cfg: LossConfig, *, reuse_old_logp: bool,
                    hidden: torch.Tensor | None = None):
        """Loss and metrics of one micro-batch (graph attached). With ``reuse_old_logp`` the old log-probs are
        this forward's own (detached): exact when weights have not changed since the rollout. ``hidden``: the
        model's output for ``batch`` when the caller ran the forward (the pipeline schedule, on the last stage);
        the LM head runs vocab-parallel under TP."""
        values = batch.token_values
        hidden = _forward_hidden(self.model, batch) if hidden is None else hidden
        weight, group = self.model.lm_head_weight(), tp_group_of(self.model)
        # the engine's log-probs enter the loss only for TIS; they always feed the logprob-gap metric
        optional = dict(ref_logp=values.get("ref_logp"),
                        rollout_logp=values.get("rollout_logp") if loss_cfg.tis else None,
                        cu_seqlens=batch.cu_seqlens)
        if reuse_old_logp:
            logp, entropy = fused_linear_logprobs(hidden, weight, batch.targets, temperature=self.temperature,
                                                  mask=batch.loss_mask, return_entropy=True, tp_group=group)
            loss, metrics = policy_loss(logp, logp.detach(), values["advantages"], batch.loss_mask, cfg=loss_cfg,
                                        entropy=entropy, **optional)
            diff = (logp.detach() - values["rollout_logp"]).abs()
            mask = batch.loss_mask
            # masked_fill, not diff[mask]: boolean indexing would wait for the GPU to learn the selection's size
            metrics["rollout_logprob_abs_diff"] = diff.masked_fill(~mask, 0).sum() / mask.sum().clamp(min=1)
            return loss, metrics
        return fused_linear_policy_loss(hidden, weight, batch.targets, values["old_logp"], values["advantages"],
                                        batch.loss_mask, cfg=loss_cfg, temperature=self.temperature, tp_group=group,
                                        **optional)

    def sft_loss(self, batch: MicroBatch, hidden: torch.Tensor | None = None):
        """Token-mean negative log-likelihood of the masked tokens (at temperature 1); ``hidden`` as in
        ``policy_loss``."""
        hidden = _forward_hidden(self.model, batch) if hidden is None else hidden
        logp, _ = fused_linear_logprobs(hidden, self.model.lm_head_weight(), batch.targets, mask=batch.loss_mask,
                                        tp_group=tp_group_of(self.model))
        loss = -logp.sum() / batch.loss_mask.sum().clamp(min=1)
        return loss, {"sft_loss": loss.detach()}

    def begin_sft(self, lr: float, steps: int) -> None:
        """Switch to a fresh optimiser for an SFT warm-up of ``steps`` steps at ``lr`` (warmup, then constant); it
        shares the master weights, not the moments, of the RL optimiser."""
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg, lr=lr, master=self.master)
        self.scheduler = build_scheduler(self.optimizer, self.cfg, steps)

    def end_sft(self) -> None:
        """Back to the RL optimiser (its moments untouched by the warm-up)."""
        self.optimizer, self.scheduler = self.rl_optimizer

    def step(self, batches: list[MicroBatch], weights: list[float], loss_fn) -> dict[str, float]:
        """One optimizer step over micro-batches: Σ weight·loss, clip, step; NaN/inf loss or gradient → skip.

        ``loss_fn(batch, hidden=None) -> (loss, metrics)`` (``hidden``: see ``policy_loss``); returns metric
        averages (by weight), ``grad_norm``, ``lr`` and ``skipped`` (1.0 when the step was skipped)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        result = accumulate_and_clip(self.model, batches, weights, loss_fn, device=self.device,
                                     clip=self.cfg.clip_grad, dp=self.dp, master=self.master)
        result["lr"] = self.optimizer.param_groups[0]["lr"]
        if not (math.isfinite(result["loss"]) and math.isfinite(result["grad_norm"])):
            self.optimizer.zero_grad(set_to_none=True)
            self.bad_steps += 1
            result["skipped"] = 1.0
            return result
        self.optimizer.step()
        self.scheduler.step()
        result["skipped"] = 0.0
        return result

    def state_dict(self) -> dict:
        """This rank's optimizer state (with mixed precision: its shard of the fp32 master weights and moments),
        scheduler, counters."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "bad_steps": self.bad_steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.bad_steps = state["bad_steps"]
