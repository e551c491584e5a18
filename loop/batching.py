"""Packing samples into micro-batches: THD token streams (no padding) filled to a token budget.

Position ``p`` of a packed stream predicts the token at ``p + 1``; a position is in the loss when that next token
is a response token with loss_mask 1. Per-response-token values (advantages, log-probs) are scattered to those
positions, so every per-token tensor of a micro-batch is ``[T]`` aligned with ``input_ids``.
"""

from dataclasses import dataclass, field

import torch

from redline.rollout.types import Sample
from redline.trainer.models.seq_bounds import remember


@dataclass
class MicroBatch:
    """One packed stream. ``input_ids/targets [T]`` int64, ``cu_seqlens [S+1]`` int32, ``loss_mask [T]`` bool,
    ``token_values``: name → ``[T]`` fp32 (zeros off the loss positions), ``sample_ids``: index of each sequence
    in the step's sample list."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor
    sample_ids: list[int]
    token_values: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device) -> "MicroBatch":
        """The batch on ``device``; a host ``cu_seqlens``'s values are recorded for the moved one
        (``seq_bounds.remember``), so attention never reads them back from the device."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        cu_seqlens = move(self.cu_seqlens)
        if not self.cu_seqlens.is_cuda:
            remember(cu_seqlens, self.cu_seqlens.tolist())
        return MicroBatch(move(self.input_ids), move(self.targets), cu_seqlens, move(self.loss_mask),
                          self.sample_ids, {k: move(v) for k, v in self.token_values.items()})

    def response_values(self, values: torch.Tensor, samples: list[Sample]) -> list[torch.Tensor]:
        """Gather a ``[T]`` tensor back into one ``[response_length]`` tensor per sequence of this batch."""
        out = []
        for seq, sid in enumerate(self.sample_ids):
            start = int(self.cu_seqlens[seq]) + samples[sid].prompt_length - 1
            out.append(values[start:start + samples[sid].response_length])
        return out


def pack(samples, sample_ids: list[int], per_token: dict) -> MicroBatch:
    """Pack ``samples[i] for i in sample_ids`` into one stream; ``per_token[name][i]`` is ``[response_length]``.
    ``samples`` and each ``per_token[name]``: a list, or a dict keyed by sample index (a rank's received share)."""
    ids, targets, mask, cu = [], [], [], [0]
    values = {name: [] for name in per_token}
    for sid in sample_ids:
        sample = samples[sid]
        tokens = torch.tensor(sample.tokens, dtype=torch.long)
        n, prompt, resp = len(tokens), sample.prompt_length, sample.response_length
        if prompt < 1:
            raise ValueError(f"sample {sid} has an empty prompt; the first response token needs a context")
        ids.append(tokens)
        targets.append(torch.cat([tokens[1:], tokens.new_zeros(1)]))
        position_mask = torch.zeros(n, dtype=torch.bool)
        position_mask[prompt - 1:n - 1] = torch.tensor(sample.loss_mask, dtype=torch.bool)
        mask.append(position_mask)
        for name, per_sample in per_token.items():
            v = torch.zeros(n, dtype=torch.float32)
            v[prompt - 1:n - 1] = per_sample[sid][:resp]
            values[name].append(v)
        cu.append(cu[-1] + n)
    return MicroBatch(input_ids=torch.cat(ids), targets=torch.cat(targets),
                      cu_seqlens=torch.tensor(cu, dtype=torch.int32), loss_mask=torch.cat(mask),
                      sample_ids=list(sample_ids), token_values={k: torch.cat(v) for k, v in values.items()})


def split_by_token_budget(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``max_tokens`` tokens (first-fit decreasing).

    A sample longer than the budget gets a micro-batch of its own. Deterministic for the same input.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_gpu must be positive, got {max_tokens}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[index] <= max_tokens:
                bins[b].append(index)
                loads[b] += lengths[index]
                break
        else:
            bins.append([index])
            loads.append(lengths[index])
    return [sorted(b) for b in bins]


def balance_across_ranks(batches: list[list[int]], lengths: list[int], world_size: int) -> list[list[list[int]]]:
    """Assign micro-batches to data-parallel ranks, heaviest first to the least-loaded rank.

    Every rank gets the same number of micro-batches (needed for lock-step gradient all-reduce); when the count
    does not divide, the largest micro-batches are split further.
    """
    batches = [list(b) for b in batches]
    while len(batches) % world_size:
        largest = max(range(len(batches)), key=lambda b: (len(batches[b]) > 1, sum(lengths[i] for i in batches[b])))
        if len(batches[largest]) < 2:
            raise ValueError(f"cannot give {world_size} data-parallel ranks equal micro-batch counts from "
                             f"{len(batches)} single-sample micro-batches; raise global_batch_size")
        half = len(batches[largest]) // 2
        batches[largest:largest + 1] = [batches[largest][:half], batches[largest][half:]]
    per_rank: list[list[list[int]]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    quota = len(batches) // world_size
    for batch in sorted(batches, key=lambda b: -sum(lengths[i] for i in b)):
        rank = min((r for r in range(world_size) if len(per_rank[r]) < quota), key=lambda r: loads[r])
        per_rank[rank].append(batch)
        loads[rank] += sum(lengths[i] for i in batch)
    return per_rank


def aggregation_weight(batch: MicroBatch, agg: str) -> int:
    """How many units the loss aggregation ``agg`` averages over in this micro-batch: masked tokens for
    token-mean, every sequence for the seq-mean modes — also one whose loss mask is empty, as slime, TRL and
    verl count it (the policy loss divides by S, ``redline.kernels.reference``). A micro-batch's loss times
    ``weight / Σ weights over the step`` sums to the loss aggregated over the whole step."""
    if agg == "token-mean":
        return int(batch.loss_mask.sum())
    return len(batch.sample_ids)
