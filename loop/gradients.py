"""The gradient half of an optimizer step, shared by the policy and the critic: weighted backward over
micro-batches, the average over data-parallel ranks, clipping."""

import torch

from redline.loop.data_parallel import DataParallel
from redline.loop.model_parallel import pipeline_state, pipeline_totals


def accumulate_and_clip(model, batches, weights: list[float], loss_fn, *, device, clip: float,
                        dp: DataParallel, master=None) -> dict[str, float]:
    """``Σ weight · loss`` backward over ``batches`` (``loss_fn(batch) -> (loss, metrics)``), gradients averaged
    over the DP ranks, then clipped to ``clip`` (<= 0: no clipping). With ``master`` (a
    ``redline.trainer.mixed_precision.MasterWeights``) the gradients accumulate in its fp32 buffer, and the
    averaging and clip factor are left to its optimizer's fused update. Returns the weighted sums of ``loss`` and
    each metric, averaged over the ranks (with ``DataParallel.loss_weights`` these are whole-batch means), and
    ``grad_norm``, the norm before clipping (NaN/inf when a gradient was). The backward is ``weighted_backward``'s
    (the 1F1B schedule for a pipeline-split model)."""
    totals = weighted_backward(model, batches, weights, loss_fn, device=device)
    max_norm = clip if clip > 0 else float("inf")
    if master is not None:  # every data-parallel run (its master shards are ZeRO-1's), every run below fp32
        norm = master.reduce_and_clip(max_norm)
    else:  # one process stepping fp32 parameters itself
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    result = dp.reduce_metrics({k: float(v) for k, v in totals.items()})
    result["grad_norm"] = float(norm)
    return result


def weighted_backward(model, batches, weights: list[float], loss_fn, *, device) -> dict[str, torch.Tensor | float]:
    """``Σ weight · loss`` backward over ``batches`` on this rank, gradients left in ``.grad`` (with master weights,
    its fp32 buffer); returns the weighted sums of ``loss`` and each metric. A pipeline-split model runs its
    forwards and backwards in the 1F1B schedule (``model_parallel.pipeline_totals``), ``loss_fn(batch, hidden=)``
    on the last stage."""
    if pipeline_state(model) is not None:
        return pipeline_totals(model, [b.to(device) for b in batches], weights, loss_fn)
    totals: dict[str, torch.Tensor | float] = {}
    for batch, weight in zip(batches, weights):
        loss, metrics = loss_fn(batch.to(device))
        (loss * weight).backward()
        for key, value in {"loss": loss.detach(), **metrics}.items():
            totals[key] = totals.get(key, 0.0) + value.detach().float() * weight
    return totals
