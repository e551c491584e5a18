"""The trainer → engine weight push of the RL loop, through ``redline.sync``'s bucket plan.

The plan (``redline.sync.plan.plan_for``) is made once from the model's HF-named export: dtype-homogeneous
buckets of at most ``--update-weight-buffer-size`` bytes, a layer's tensors never split. Each sync streams the
export through it (``named_buckets``) into ``engine.update_weights``: the embedded engine copies each bucket
into its fused tensors, the embedded engine process receives it by shared memory / CUDA IPC, SGLang gets one
``FlattenedTensorBucket`` payload per bucket (serialized by ``SGLangEngine``).

With ``--offload-rollout`` the engine gives its memory back after each rollout and the push follows the
colocated sequence of ``redline.rollout.engine``: ``resume_memory({"weights"})`` → ``update_weights`` →
``resume_memory({"kv_cache"})``, so the new weights land before the KV cache competes for memory.
"""

import torch

from redline.sync.plan import WeightPlan, named_buckets, plan_for


class WeightSync:
    """Owns the bucket plan and the engine's memory state between rollouts.

    ``model``: a ``redline.trainer.models`` decoder (``export_hf()``); ``engine``: any rollout engine.
    """

    def __init__(self, model, engine, *, bucket_bytes: int, offload: bool):
        self.model, self.engine, self.offload = model, engine, offload
        self.plan: WeightPlan = plan_for(model.export_hf(), bucket_bytes)
        self.released = False

    async def release(self) -> None:
        """After a rollout: with ``--offload-rollout``, free the engine's weights and KV cache for training."""
        if self.offload and not self.released:
            await self.engine.release_memory({"weights", "kv_cache"})
            self.released = True

    async def push(self, version: str) -> None:
        """Send the model's current weights to the engine as ``version``, taking back released memory around
        the update (weights first, KV cache after)."""
        if self.released:
            if torch.cuda.is_available():
                # blocks the trainer's caching allocator holds but does not use would starve the engine
                torch.cuda.empty_cache()
            await self.engine.resume_memory({"weights"})
        await self.engine.update_weights(named_buckets(self.plan, self.model.export_hf()), version=version)
        if self.released:
            await self.engine.resume_memory({"kv_cache"})
            self.released = False

    def describe(self) -> str:
        sizes = [b.nbytes for b in self.plan.buckets]
        return (f"weight sync: {len(sizes)} buckets, {self.plan.nbytes / 2**20:.1f} MiB "
                f"(largest {max(sizes) / 2**20:.1f} MiB){' · offload rollout' if self.offload else ''}")
