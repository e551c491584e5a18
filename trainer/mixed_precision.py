"""Mixed-precision training state: compute weights in the model's dtype, fp32 gradients, master weights and moments.

Layout (``MasterWeights``). The trainable parameters of one dtype become views of one flat *compute* buffer
``[N]`` (each at an offset aligned to ``ALIGN`` elements, ``N`` padded to a multiple of ``ALIGN · dp``). Beside it,
in the same index space:

- ``main_grad [N] fp32``: every parameter's ``p.main_grad`` is its view. A post-accumulate-grad hook adds each
  backward's low-precision ``p.grad`` into it and frees ``p.grad``, so micro-batches accumulate in fp32 (Megatron's
  main-grad buffer), never as a bf16 sum.
- this rank's shard ``[lo, hi)`` of the fp32 master weights and Adam moments: the whole range in one process,
  ``1/dp`` of it under data parallelism (ZeRO-1). With ``offload`` they live in pinned host memory.

An optimizer step (``MixedPrecisionAdamW.step`` after ``MasterWeights.reduce_and_clip``):
1. data parallel: ``main_grad`` all-reduced (SUM) in fp32 over the DP group — the documented choice: fp32 keeps the
   sum exact to fp32 rounding whatever the DP size, at twice the bytes of a bf16 reduce; the division by ``dp`` and
   the clip coefficient are folded into the fused AdamW's ``grad_scale`` (no extra pass);
2. the global gradient norm from the fp32 gradients (NaN/inf → the step is skipped by the caller);
3. one fused AdamW pass over the shard that also writes the rounded compute weights (``adamw_triton`` on a GPU;
   torch's fused AdamW and a copy on the CPU); with ``offload`` the shard streams through the GPU in chunks, the
   host→device copy of chunk k+1 overlapping the update of chunk k;
4. (data parallel) one all-gather of the compute buffer so every rank holds the same compute weights.
"""

import weakref

import torch
import torch.distributed as dist

from redline.kernels.lm_head_plan import round_up

ALIGN = 64  # elements: every parameter view starts 128-byte aligned in bf16 (TMA and vector loads need 16)
ALLOCATION_KINDS = ("compute", "main_grad", "master", "moment")  # the device buffers ``allocate`` is asked for
OFFLOAD_CHUNK = 64 * 2**20  # elements streamed per chunk with offload: 3 fp32 arrays × 256 MiB, double-buffered


class FlatGroup:
    """One dtype's trainable parameters as views of ``compute [N]``, with ``main_grad [N] fp32`` and this rank's
    fp32 ``master [hi - lo]`` (on ``master_device``; None: beside the compute weights, from ``allocate``)."""

    def __init__(self, params: list[torch.nn.Parameter], world: int, rank: int, master_device: torch.device,
                 allocate=None):
        self.params = params
        self.dtype, self.device = params[0].dtype, params[0].device
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset = round_up(offset + p.numel(), ALIGN)
        self.numel = round_up(max(offset, 1), ALIGN * world)
        allocate = allocate or _device_zeros(self.device)
        self.compute = allocate("compute", self.numel, self.dtype)
        self.main_grad = allocate("main_grad", self.numel, torch.float32)
        with torch.no_grad():
            for p, start in zip(params, self.offsets):
                view = self.compute[start:start + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)  # the old storage goes; the model now trains the flat buffer
                p.main_grad = self.main_grad[start:start + p.numel()].view_as(p)
                p.register_post_accumulate_grad_hook(_accumulate_main_grad)
        shard = self.numel // world
        self.lo, self.hi = rank * shard, (rank + 1) * shard
        self.master = (allocate("master", shard, torch.float32) if master_device is None
                       else state_buffer(shard, master_device, self.device))
        self.master.copy_(self.compute[self.lo:self.hi])

    @property
    def grad_shard(self) -> torch.Tensor:
        return self.main_grad[self.lo:self.hi]

    @property
    def compute_shard(self) -> torch.Tensor:
        return self.compute[self.lo:self.hi]


def state_buffer(numel: int, where: torch.device, compute_device: torch.device) -> torch.Tensor:
    """``[numel]`` fp32 zeros for master weights or moments on ``where``. On the host beside a GPU model they are
    page-locked with ``cudaHostRegister``, exactly their size: torch's pinned allocator rounds every block up to a
    power of two (up to twice the host memory: an 8B model's 98 GB of master weights and moments could take 192)."""
    buffer = torch.zeros(numel, dtype=torch.float32, device=where)
    if where.type == "cpu" and compute_device.type == "cuda":
        cudart = torch.cuda.cudart()
        pointer = buffer.data_ptr()
        error = cudart.cudaHostRegister(pointer, numel * buffer.element_size(), 0)
        if error != 0:
            raise RuntimeError(f"cudaHostRegister of {numel * 4 / 2**30:.1f} GiB of optimizer state failed ({error}): "
                               "not enough host memory to lock for --optimizer-cpu-offload?")
        weakref.finalize(buffer, cudart.cudaHostUnregister, pointer)  # before the memory goes back
    return buffer


def _device_zeros(device: torch.device):
    """The default ``allocate``: ``torch.zeros`` on ``device`` whatever the kind."""
    return lambda kind, numel, dtype: torch.zeros(numel, dtype=dtype, device=device)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy that later updates of ``tensor`` do not reach (``.cpu()`` of a host tensor is itself)."""
    return tensor.to("cpu", copy=True)


def _accumulate_main_grad(param: torch.nn.Parameter) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


class MasterWeights:
    """fp32 master weights and fp32 gradient accumulation for ``model``'s trainable parameters (flattened per dtype,
    see the module docstring). ``parallel``: the model's ``redline.trainer.parallel.ParallelState`` (None in one
    process): its DP group shards master and moments (ZeRO-1) and, when TP/PP > 1, its gradients get the TP/PP
    finalisation and norm. ``offload``: master weights and moments in pinned host memory. ``allocate(kind, numel,
    dtype)``: ``[numel]`` zeros on the parameters' device for each buffer kept there, ``kind`` one of
    ``ALLOCATION_KINDS`` (``torch.zeros`` by default; ``redline.loop.train_offload`` gives pausable memory)."""

    def __init__(self, model: torch.nn.Module, *, parallel=None, offload: bool = False, allocate=None):
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("no trainable parameters")
        self.model, self.parallel, self.offload = model, parallel, offload
        self.dp = parallel.config.dp if parallel is not None else 1
        self.dp_group = parallel.dp_group if self.dp > 1 else None
        rank = dist.get_rank(self.dp_group) if self.dp > 1 else 0
        by_dtype: dict[torch.dtype, list] = {}
        for p in trainable:
            by_dtype.setdefault(p.dtype, []).append(p)
        master_device = torch.device("cpu") if offload else None
        self.allocate = allocate or _device_zeros(trainable[0].device)
        self.groups = [FlatGroup(group, self.dp, rank, master_device, self.allocate) for group in by_dtype.values()]
        self.params = trainable
        self.grad_scale: torch.Tensor | None = None  # set by reduce_and_clip for the next update

    def zero_grad(self) -> None:
        for group in self.groups:
            group.main_grad.zero_()
        for p in self.params:
            p.grad = None

    def reduce_and_clip(self, max_norm: float) -> torch.Tensor:
        """After the last backward of a step: gradients finalised (TP partial sums and tied PP copies, then SUM over
        DP) and their global norm taken in fp32; returns the norm of the DP-averaged gradient before clipping
        (NaN/inf when a gradient was). Sets ``grad_scale``, the divisor the next update applies to the summed
        gradients: ``dp`` times the clip factor (``torch.nn.utils.clip_grad_norm_``'s, ``(norm + 1e-6) / max_norm``
        when above 1)."""
        model_parallel = self.parallel is not None and (self.parallel.tp > 1 or self.parallel.pp > 1)
        if model_parallel:
            from redline.trainer.parallel.optim import finalize_grads, grad_norm

            finalize_grads(self.model, self.parallel, average_dp=False)
        if self.dp > 1:
            for group in self.groups:
                dist.all_reduce(group.main_grad, group=self.dp_group)
        if model_parallel:
            norm = grad_norm(self.model, self.parallel) / self.dp
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.main_grad)
                                                         for g in self.groups])) / self.dp
        self.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0) * self.dp
        return norm

    @torch.no_grad()
    def publish(self, *, written: bool = False) -> None:
        """Compute weights ← the master weights rounded (this rank's shard; ``written``: an update already wrote
        them), then gathered over the DP group."""
        for group in self.groups:
            if not written:
                group.compute_shard.copy_(group.master)
            self._gather(group)

    def _gather(self, group: FlatGroup) -> None:
        if self.dp > 1:
            # NCCL gathers in place (the input is the output's own slice); gloo needs a separate input
            shard = group.compute_shard if group.device.type == "cuda" else group.compute_shard.clone()
            dist.all_gather_into_tensor(group.compute, shard, group=self.dp_group)

    def layout(self) -> dict:
        """What a saved shard depends on: the DP size and each group's dtype and flat length."""
        return {"dp": self.dp, "groups": [{"dtype": str(g.dtype).removeprefix("torch."), "numel": g.numel}
                                          for g in self.groups]}

    def memory_rows(self, moments_per_param: int = 2) -> list[tuple[str, float, int, str]]:
        """``(what, bytes per parameter, total bytes, where)`` for this rank: compute weights, fp32 gradients,
        master weights and ``moments_per_param`` fp32 moments (sharded over DP; on the host with offload)."""
        numel = sum(g.numel for g in self.groups)
        compute = sum(g.numel * g.compute.element_size() for g in self.groups)
        device = str(self.groups[0].device.type)
        state_where = "host (pinned)" if self.offload else device
        shard = numel // self.dp
        return [("compute weights", compute / numel, compute, device),
                ("gradients (fp32 main grad)", 4.0, 4 * numel, device),
                ("master weights (fp32)", 4.0 / self.dp, 4 * shard, state_where),
                (f"Adam moments (fp32 × {moments_per_param})", 4.0 * moments_per_param / self.dp,
                 4 * moments_per_param * shard, state_where)]


def _update(tensors, grad: torch.Tensor, compute: torch.Tensor, step: int, scale: torch.Tensor, hyper: dict) -> None:
    """One AdamW update of ``tensors = (master, exp_avg, exp_avg_sq)`` from ``grad / scale``, the rounded master
    written into ``compute``: one Triton pass on a GPU (``redline.trainer.adamw_triton``); torch's fused AdamW and
    a copy on the CPU."""
    if compute.is_cuda:
        from redline.trainer.adamw_triton import adamw_publish

        adamw_publish(tensors[0], grad, tensors[1], tensors[2], compute, scale, step=step, **hyper)
        return
    torch._fused_adamw_([tensors[0]], [grad], [tensors[1]], [tensors[2]], [], [torch.tensor(float(step))],
                        grad_scale=scale, amsgrad=False, maximize=False, **hyper)
    compute.copy_(tensors[0])


class MixedPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) over a ``MasterWeights``' fp32 master shards, one fused kernel per chunk.

    ``step()`` divides the fp32 gradients by the ``grad_scale`` that ``MasterWeights.reduce_and_clip`` found
    (averaging over DP and clipping) inside the fused update, which also writes the rounded master weights into
    the model. Several optimizers may
    share one ``MasterWeights`` (the SFT warm-up and the RL optimizer): each keeps its own moments."""

    def __init__(self, master: MasterWeights, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        self.master = master
        super().__init__([g.master for g in master.groups],
                         dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for g in master.groups:
            self.state[g.master] = {"step": 0, **{name: self._moment(g) for name in ("exp_avg", "exp_avg_sq")}}
        self._staging = None  # offload: two sets of GPU chunk buffers (master, exp_avg, exp_avg_sq), made once

    def _moment(self, group: FlatGroup) -> torch.Tensor:
        """``[shard]`` fp32 zeros beside ``group``'s master (host with offload, else the master's allocator)."""
        if self.master.offload:
            return state_buffer(group.master.numel(), group.master.device, group.device)
        return self.master.allocate("moment", group.master.numel(), torch.float32)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.master.zero_grad()

    @torch.no_grad()
    def step(self) -> None:
        """One update of every master shard from the fp32 gradients divided by the master's ``grad_scale`` (1
        when no ``reduce_and_clip`` ran), writing the rounded master into the compute weights, then (data
        parallel) the compute weights gathered."""
        options = self.param_groups[0]
        beta1, beta2 = options["betas"]
        hyper = dict(lr=float(options["lr"]), beta1=beta1, beta2=beta2, eps=options["eps"],
                     weight_decay=options["weight_decay"])
        for group in self.master.groups:
            state = self.state[group.master]
            state["step"] += 1
            scale = self.master.grad_scale
            scale = (torch.ones((), device=group.device) if scale is None else scale).to(group.device, torch.float32)
            tensors = (group.master, state["exp_avg"], state["exp_avg_sq"])
            if self.master.offload:
                self._streamed_update(group, tensors, state["step"], scale, hyper)
            else:
                _update(tensors, group.grad_shard, group.compute_shard, state["step"], scale, hyper)
        self.master.publish(written=True)

    @torch.no_grad()
    def warm_up(self) -> None:
        """Run the update once on scratch buffers of every group's device and dtype (its state untouched), so its
        GPU kernel compiles before the first step does."""
        options = self.param_groups[0]
        hyper = dict(lr=0.0, beta1=options["betas"][0], beta2=options["betas"][1], eps=options["eps"],
                     weight_decay=0.0)
        for group in self.master.groups:
            scratch = [torch.zeros(ALIGN, dtype=torch.float32, device=group.device) for _ in range(4)]
            compute = torch.zeros(ALIGN, dtype=group.dtype, device=group.device)
            _update(scratch[:3], scratch[3], compute, 1, torch.ones((), device=group.device), hyper)

    def _streamed_update(self, group: FlatGroup, host: tuple, step: int, scale, hyper) -> None:
        """The update of host-resident ``host = (master, exp_avg, exp_avg_sq)`` in chunks of ``OFFLOAD_CHUNK``:
        each chunk copied to the GPU, updated (writing its compute weights), copied back. Copies in and out run on
        their own streams with two buffer sets, so chunk k+1 arrives and chunk k-1 leaves while chunk k is
        updated. Without CUDA the same chunked update runs in place (what the CPU tests run)."""
        size = group.master.numel()
        chunks = [(a, min(a + OFFLOAD_CHUNK, size)) for a in range(0, size, OFFLOAD_CHUNK)]
        if group.device.type != "cuda":
            for a, b in chunks:
                _update([t[a:b] for t in host], group.grad_shard[a:b], group.compute_shard[a:b], step, scale, hyper)
            return
        if self._staging is None:  # shared by every group: sized for the largest
            length = min(OFFLOAD_CHUNK, max(g.master.numel() for g in self.master.groups))
            self._staging = [[torch.empty(length, dtype=torch.float32, device=group.device) for _ in range(3)]
                             for _ in range(2)]
            self._streams = (torch.cuda.Stream(group.device), torch.cuda.Stream(group.device))
        compute, (copy_in, copy_out) = torch.cuda.current_stream(group.device), self._streams
        loaded, updated, freed = ([torch.cuda.Event() for _ in range(2)] for _ in range(3))
        copy_in.wait_stream(compute)  # the last step's copies out (compute waited for them) have landed

        def load(k: int) -> None:
            a, b = chunks[k]
            with torch.cuda.stream(copy_in):
                if k >= 2:
                    copy_in.wait_event(freed[k % 2])
                for buffer, source in zip(self._staging[k % 2], host):
                    buffer[:b - a].copy_(source[a:b], non_blocking=True)
                loaded[k % 2].record(copy_in)

        load(0)
        for k, (a, b) in enumerate(chunks):
            if k + 1 < len(chunks):
                load(k + 1)
            buffers = [t[:b - a] for t in self._staging[k % 2]]
            compute.wait_event(loaded[k % 2])
            _update(buffers, group.grad_shard[a:b], group.compute_shard[a:b], step, scale, hyper)
            updated[k % 2].record(compute)
            with torch.cuda.stream(copy_out):
                copy_out.wait_event(updated[k % 2])
                for buffer, target in zip(buffers, host):
                    target[a:b].copy_(buffer, non_blocking=True)
                freed[k % 2].record(copy_out)
        compute.wait_stream(copy_out)

    def state_dict(self) -> dict:
        """This rank's shards (master weights and moments, fp32), the step count and hyper-parameters, and the
        layout they were cut with (``MasterWeights.layout``)."""
        if self.master.groups[0].device.type == "cuda":
            torch.cuda.synchronize(self.master.groups[0].device)  # offload: the last copies back have landed
        return {"layout": self.master.layout(),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "shards": [{"step": self.state[g.master]["step"], "master": _host_copy(g.master),
                            "exp_avg": _host_copy(self.state[g.master]["exp_avg"]),
                            "exp_avg_sq": _host_copy(self.state[g.master]["exp_avg_sq"])} for g in self.master.groups]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict`` saved with the same layout (else ``ValueError`` naming both) and publish the
        restored master weights into the model."""
        device = self.master.groups[0].device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # offload: the last step's copies back into host memory have landed
        if state.get("layout") != self.master.layout():
            raise ValueError(f"optimizer state saved with layout {state.get('layout')} (data-parallel size and flat "
                             f"parameter groups) cannot be loaded into this run's {self.master.layout()}")
        for options, saved in zip(self.param_groups, state["param_groups"]):
            options.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        for group, saved in zip(self.master.groups, state["shards"]):
            own = self.state[group.master]
            own["step"] = int(saved["step"])
            group.master.copy_(saved["master"])
            own["exp_avg"].copy_(saved["exp_avg"])
            own["exp_avg_sq"].copy_(saved["exp_avg_sq"])
        self.master.publish()
