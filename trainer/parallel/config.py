"""``ParallelConfig(tp, pp, dp, sp, tp_overlap)`` and the process groups it builds (``torch.distributed``
device mesh)."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from redline.trainer.parallel.async_tp import check_tp_overlap
from redline.trainer.parallel.stages import head_cost_layers, stage_sizes

MESH_DIMS = ("dp", "pp", "tp")  # outermost first: the rank order of ``ParallelConfig.global_rank``


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of tensor (``tp``), pipeline (``pp``) and data (``dp``) parallelism; ``sp`` turns on sequence
    parallelism inside the TP group; ``tp_overlap`` (``"auto"``, ``"off"``, ``"symm_mem"``) whether SP's
    collectives run micro-pipelined with the GEMMs (``async_tp``; ``"auto"``: wherever they can).
    ``tp * pp * dp`` must equal the world size. ``first_stage_layers`` / ``last_stage_layers``: decoder layers
    on the first / last pipeline stage (None: ``stages.stage_sizes`` balances them, the LM head counted)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    tp_overlap: str = "auto"
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def stage_sizes(self, spec) -> list[int]:
        """Decoder layers per pipeline stage of a model of ``spec`` (a ``ModelSpec``), first to last."""
        return stage_sizes(spec.num_layers, self.pp, first=self.first_stage_layers, last=self.last_stage_layers,
                           head_layers=head_cost_layers(spec))

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.sp and self.tp == 1:
            raise ValueError("ParallelConfig.sp=True needs tp > 1 (sequence parallelism splits over the TP group)")
        check_tp_overlap(self.tp_overlap, self.sp)

    @property
    def model_parallel(self) -> int:
        """Ranks in one model-parallel group (``tp * pp``): one data-parallel replica of the model."""
        return self.tp * self.pp

    def global_rank(self, dp: int, pp: int, tp: int) -> int:
        """The global rank at mesh coordinates ``(dp, pp, tp)``: ``dp·(pp·tp) + pp_rank·tp + tp_rank``. Data
        parallelism outermost so each model-parallel group is a block of consecutive ranks (on one node when
        its size divides the node's processes): a colocated engine of several GPUs sits on whole groups, its
        GPUs consecutive as SGLang's ``--base-gpu-id`` takes them."""
        for name, value, size in (("dp", dp, self.dp), ("pp", pp, self.pp), ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} outside 0..{size - 1}")
        return (dp * self.pp + pp) * self.tp + tp

    def build(self, device_type: str | None = None) -> "ParallelState":
        """Create the TP/PP/DP groups, ranks ordered as ``global_rank`` (tp fastest, then pp, dp outermost)."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelConfig.build needs torch.distributed initialised (run under torchrun)")
        world = dist.get_world_size()
        if self.tp * self.pp * self.dp != world:
            raise ValueError(f"tp*pp*dp = {self.tp}*{self.pp}*{self.dp} != world size {world}")
        # the backend's device, not whether a GPU exists: gloo ranks on a GPU machine hold CPU tensors
        device_type = device_type or ("cuda" if "nccl" in str(dist.get_backend()) else "cpu")
        mesh = init_device_mesh(device_type, (self.dp, self.pp, self.tp), mesh_dim_names=MESH_DIMS)
        return ParallelState(self, mesh)


class ParallelState:
    """This rank's groups and coordinates; what ``parallelize`` and the schedules consume."""

    def __init__(self, config: ParallelConfig, mesh):
        self.config = config
        self.mesh = mesh
        self.tp_group = mesh.get_group("tp")
        self.pp_group = mesh.get_group("pp")
        self.dp_group = mesh.get_group("dp")
        self.tp_rank = mesh.get_local_rank("tp")
        self.pp_rank = mesh.get_local_rank("pp")
        self.dp_rank = mesh.get_local_rank("dp")

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def sp(self) -> bool:
        return self.config.sp

    def stage_sizes(self, spec) -> list[int]:
        """Decoder layers per pipeline stage (``ParallelConfig.stage_sizes``)."""
        return self.config.stage_sizes(spec)

    def pp_peer(self, offset: int) -> int:
        """Global rank of the pipeline stage ``offset`` away from this one (same tp/dp coordinates)."""
        return dist.get_global_rank(self.pp_group, self.pp_rank + offset)
