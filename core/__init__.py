"""redline: reinforcement-learning post-training for LLMs, PyTorch only.

Subsystems: ``redline.kernels`` (fused Triton kernels, importable alone), ``redline.trainer`` (models,
parallelism, optimiser), ``redline.rollout`` (engines, data, rewards), ``redline.sync`` (weight sync and
colocation memory) and ``redline.loop`` (the RL step and ``redline train``).
"""

__version__ = "0.1.0"
