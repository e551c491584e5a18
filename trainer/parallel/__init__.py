"""Parallelism applied to a built decoder from outside: TP/SP (``tensor``), PP (``pipeline``), DP with ZeRO-1,
gradient clipping (``optim``) and activation recompute (``recompute``), all from one ``ParallelConfig``."""

from redline.trainer.parallel.config import ParallelConfig, ParallelState
from redline.trainer.parallel.optim import clip_grad_norm, finalize_grads, grad_norm
from redline.trainer.parallel.pipeline import one_f_one_b, split_stage
from redline.trainer.parallel.recompute import apply_recompute
from redline.trainer.parallel.tensor import apply_tensor_parallel


def parallelize(model, parallel: ParallelConfig | ParallelState):
    """Shard ``model`` for TP/SP and cut it to this rank's pipeline stage; returns the same module."""
    state = parallel.build() if isinstance(parallel, ParallelConfig) else parallel
    if state.tp > 1:
        apply_tensor_parallel(model, state.tp_group, state.sp, state.config.tp_overlap)
    if state.pp > 1:
        split_stage(model, state)
    model.parallel_state = state
    return model


__all__ = ["ParallelConfig", "ParallelState", "apply_recompute", "clip_grad_norm", "finalize_grads", "grad_norm",
           "one_f_one_b", "parallelize", "split_stage"]
