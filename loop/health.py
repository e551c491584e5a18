"""Signs that a run has stopped learning while it still exits 0: gradients that are all zero, or a policy whose
entropy has collapsed to the uniform distribution's, ``log(vocab)`` (what ``--lr 1e3`` does to the quickstart),
for ``patience`` consecutive RL steps. ``RunHealth`` turns each such streak into one warning, which the loop
prints and ``report.md`` lists.
"""

import math

UNIFORM_SHARE = 0.95  # entropy at or above this share of log(vocab) counts as uniform
PATIENCE = 3


class RunHealth:
    """Feed it each RL step's metrics (``train/grad_norm``, ``train/entropy`` in nats per token); it returns the
    warnings that step raised and keeps them all in ``warnings``."""

    def __init__(self, vocab_size: int, patience: int = PATIENCE):
        if vocab_size < 2 or patience < 1:
            raise ValueError(f"RunHealth needs vocab_size >= 2 and patience >= 1, got {vocab_size}, {patience}")
        self.uniform_entropy = math.log(vocab_size)
        self.patience = patience
        self.streaks = {"zero_grad": 0, "uniform": 0}
        self.warnings: list[str] = []

    def observe(self, step: int, metrics: dict[str, float]) -> list[str]:
        grad_norm, entropy = metrics.get("train/grad_norm"), metrics.get("train/entropy")
        signs = {"zero_grad": grad_norm is not None and grad_norm == 0.0,
                 "uniform": entropy is not None and entropy >= UNIFORM_SHARE * self.uniform_entropy}
        raised = []
        for name, present in signs.items():
            self.streaks[name] = self.streaks[name] + 1 if present else 0
            if self.streaks[name] == self.patience:
                raised.append(self._describe(name, step, entropy))
        self.warnings += raised
        return raised

    def _describe(self, name: str, step: int, entropy: float | None) -> str:
        first = step - self.patience + 1
        if name == "zero_grad":
            return (f"steps {first}-{step}: every gradient is zero (train/grad_norm 0): the policy no longer "
                    f"changes; check the rewards (all equal in every group?) and --lr")
        return (f"steps {first}-{step}: the policy's entropy {entropy:.3f} is that of a uniform distribution "
                f"over the vocabulary (log V = {self.uniform_entropy:.3f}): it has collapsed to noise; lower --lr "
                f"or --entropy-coef")
