"""The frozen reference policy (initial weights) for KL terms.

Resident: a second copy of the model on the device. Swapped: the initial weights wait in pinned host memory and
are copied into the policy model for a reference pass, with the policy's own weights parked in pinned host memory
meanwhile (slime keeps its reference the same way). Resident is chosen when the device has room for it.
"""

import copy
from contextlib import contextmanager

import torch


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    return out.copy_(tensor.detach())


class ReferencePolicy:
    def __init__(self, model: torch.nn.Module, *, resident: bool | None = None):
        params = list(model.parameters())
        model_bytes = sum(p.numel() * p.element_size() for p in params)
        if resident is None:
            on_gpu = params[0].is_cuda
            resident = not on_gpu or torch.cuda.mem_get_info(params[0].device)[0] > 3 * model_bytes
        self.resident = resident
        if resident:
            # the copy shares the policy's process groups (a parallelised model holds them; they do not copy)
            state = getattr(model, "parallel_state", None)
            shared = [state, state.mesh, state.tp_group, state.pp_group, state.dp_group] if state is not None else []
            memo = {id(o): o for o in shared}  # layers and shard infos hold the groups themselves too
            self.model = copy.deepcopy(model, memo).requires_grad_(False).eval()
            self.host_weights = None
        else:
            self.model = None
            self.host_weights = [_host_copy(p) for p in params]
            self.parked = [torch.empty_like(w, pin_memory=True) for w in self.host_weights]

    @contextmanager
    def active(self, policy: torch.nn.Module):
        """Yields a model computing the reference policy (for swapped mode: ``policy`` with the initial weights
        loaded, restored on exit)."""
        if self.resident:
            yield self.model
            return
        params = list(policy.parameters())
        with torch.no_grad():
            for p, parked, ref in zip(params, self.parked, self.host_weights):
                parked.copy_(p, non_blocking=True)
                p.copy_(ref, non_blocking=True)
        try:
            yield policy
        finally:
            with torch.no_grad():
                for p, parked in zip(params, self.parked):
                    p.copy_(parked, non_blocking=True)
