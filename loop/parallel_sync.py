"""Weight sync from a tensor / pipeline parallel trainer into its model-parallel group's engine.

``WeightSync`` does the push (its plan, modes, checks and the colocated memory transition); here it reads the model
through ``GroupExport``, whose export is the model-parallel group's stream:

* planning reads every stage's HF tensors at full size from the shards' metadata (``stage_specs``, exchanged over
  the pipeline group once): no gather, and every rank of the group gets the same plan;
* ``full_buckets``: on every TP rank of a stage, that stage's part of each bucket as full HF-named tensors. One
  all-gather per bucket over the TP group (the part's shards flattened into one buffer), started for bucket k+1
  once bucket k is assembled and before it is handed on, so the next gather runs while the current bucket is
  sent: at most two buckets are gathered at a time (gathered rows and assembled tensors together, when the
  consumer drops a bucket before asking for the next), never the whole model. This is the step a multi-GPU
  engine needs (each TP rank holds the bucket's full tensors and can hand its engine rank its own payload);
* ``seat_parts``: for a colocated SGLang engine of several GPUs (``--rollout-num-gpus-per-engine``, an engine
  seat), every (bucket, stage) part in plan order on every rank of the group, see its docstring for the route;
* ``leader_stream``: the group's leader (TP rank 0 of the first stage, the rank that holds the engine) gets every
  bucket in plan order: its own stage's part from its gathers, each later stage's part from that stage's TP rank
  0 (one point-to-point message per bucket part, over the pipeline group). The other ranks gather and send their
  part and yield nothing; they run as many passes per push as the leader's mode reads the export
  (``ModelParallelWeightSync``). With ``--no-colocate`` (``ModelParallelBroadcastSync``) the leader is instead
  the source of ``BroadcastWeightSync``'s weight-update group and broadcasts that stream to the engine processes.
"""

from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist

from redline.loop.model_parallel import pipeline_state, tp_group_of
from redline.loop.weight_sync import BroadcastWeightSync, WeightSync, _clock
from redline.sync.plan import BucketLayout, TensorSpec, WeightPlan
from redline.trainer.models.export import full_shape, hf_entries
from redline.trainer.parallel.comm import _all_gather_single

# how many times a push reads the export in its sync, by WeightSync mode (direct compares what the engine holds with
# the export); a check after the sync reads it once more when the leader says so (``ModelParallelWeightSync``)
SYNC_PASSES = {"direct": 2}


def stage_specs(model) -> list[list[TensorSpec]]:
    """Every stage's HF tensors at their full (unsharded) shapes, in export order (collective over the pipeline
    group; one stage without pipeline parallelism)."""
    mine = []
    for names, tensor, parts in hf_entries(model):
        rest = tuple(full_shape(tensor))[1:]
        mine.extend(TensorSpec(name, (size, *rest), tensor.dtype) for name, size in zip(names, parts))
    state = pipeline_state(model)
    if state is None:
        return [mine]
    everyone = [None] * state.pp
    dist.all_gather_object(everyone, mine, group=state.pp_group)
    return everyone


def _part(layout: BucketLayout, names: set[str]):
    """The tensors of ``layout`` among ``names`` and their byte range in the bucket (contiguous: a bucket holds
    tensors in export order and each stage's tensors follow the previous stage's)."""
    metas = [m for m in layout.tensors if m.name in names]
    return metas, (metas[0].start_idx, metas[-1].end_idx) if metas else (0, 0)


def full_buckets(model, plan: WeightPlan, stage_names: list[set[str]]
                 ) -> Iterator[tuple[BucketLayout, list[tuple[str, torch.Tensor]]]]:
    """``(layout, [(hf_name, full tensor)])``: this stage's part of each bucket that has one, in plan order, on
    every TP rank of the stage (``stage_names[s]``: the HF names stage ``s`` holds). Every TP rank of the stage
    must iterate to the end (the gathers are collectives); a bucket's tensors stay valid after the next is
    yielded."""
    state = pipeline_state(model)
    mine = stage_names[state.pp_rank if state is not None else 0]
    entries = list(hf_entries(model))
    entry_of = {name: i for i, (names, _, _) in enumerate(entries) for name in names}
    group = tp_group_of(model)
    layouts = [b for b in plan.buckets if any(n in mine for n in b.names)]

    def start(layout):
        """Launch the bucket's gather: ``(its entries, the sharded ones, the output, the pending work)``."""
        members = list(dict.fromkeys(entry_of[n] for n in layout.names if n in mine))
        sharded = [i for i in members if hasattr(entries[i][1], "tp_shard")] if group is not None else []
        if not sharded:
            return members, sharded, None, None
        flat = torch.cat([entries[i][1].detach().reshape(-1) for i in sharded])
        out = torch.empty(dist.get_world_size(group) * flat.numel(), dtype=flat.dtype, device=flat.device)
        return members, sharded, out, _all_gather_single(out, flat, group=group, async_op=True)

    def finish(layout, members, sharded, out, work):
        full = {}
        if work is not None:
            work.wait()
            rows, offset = out.view(dist.get_world_size(group), -1), 0
            for i in sharded:
                shard = entries[i][1]
                full[i] = shard.tp_shard.assemble([row[offset:offset + shard.numel()].view_as(shard) for row in rows])
                offset += shard.numel()
        named = {}
        for i in members:
            names, tensor, parts = entries[i]
            named.update(zip(names, full.get(i, tensor.detach()).split(parts, dim=0)))
        return [(n, named[n]) for n in layout.names if n in mine]

    pending = start(layouts[0]) if layouts else None
    for k, layout in enumerate(layouts):
        # bucket k assembled before k+1's gather is allocated: its gathered rows and its full tensors are never
        # live beside a third bucket (with a consumer that lets go of k-1 before asking for k)
        named, pending = finish(layout, *pending), None  # bucket k's gathered rows go with its pending entry
        if k + 1 < len(layouts):
            pending = start(layouts[k + 1])  # in flight while bucket k is sent
        yield layout, named
        del named  # the consumer's references alone keep bucket k alive


@torch.no_grad()
def leader_stream(model, plan: WeightPlan, stage_names: list[set[str]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every bucket's ``(hf_name, full tensor)`` in plan order on the model-parallel group's leader (TP rank 0 of
    the first stage); on the group's other ranks their part (gathers, a later stage's sends) and nothing yielded.
    Every rank of the group must iterate to the end."""
    state = getattr(model, "parallel_state", None)
    tp_rank = state.tp_rank if state is not None else 0
    pp = pipeline_state(model)
    own = full_buckets(model, plan, stage_names)
    if pp is not None and pp.pp_rank > 0:
        leader = dist.get_global_rank(pp.pp_group, 0)
        for layout, named in own:
            if tp_rank == 0:
                buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=named[0][1].device)
                metas, (lo, hi) = _part(layout, stage_names[pp.pp_rank])
                for meta, (_, tensor) in zip(metas, named):
                    meta.view(buffer).copy_(tensor)
                dist.send(buffer[lo:hi], dst=leader, group=pp.pp_group)
                del buffer, tensor
            del named  # before the next bucket is assembled (full_buckets' two-bucket bound)
        return
    if tp_rank != 0:
        deque(own, maxlen=0)  # holds no bucket while the next is assembled
        return
    if pp is None:
        for _, named in own:
            yield from named
            del named
        return
    device = next(model.parameters()).device
    for layout in plan.buckets:
        buffer = None
        for stage, names in enumerate(stage_names):
            metas, (lo, hi) = _part(layout, names)
            if not metas:
                continue
            if stage == 0:
                yield from next(own)[1]
                continue
            buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=device) if buffer is None else buffer
            dist.recv(buffer[lo:hi], src=dist.get_global_rank(pp.pp_group, stage), group=pp.pp_group)
            yield from ((meta.name, meta.view(buffer)) for meta in metas)


def seat_parts(model, plan: WeightPlan, stage_names: list[set[str]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Every bucket's ``(hf_name, full tensor)`` on every rank of the model-parallel group, one list per (bucket,
    stage) part, in plan order and, within a bucket, stage order: what each engine TP rank of a colocated
    SGLang engine needs on its own GPU (``redline.sync.sglang.gathered_buckets`` then sends one request per part,
    one payload per engine rank).

    Route: the TP ranks of the part's stage hold its full tensors from their own per-bucket TP gather
    (``full_buckets``); every other stage's rank receives them from the rank of the part's stage at its own TP
    rank, by one broadcast per tensor over its pipeline group (the ranks of one TP rank across the stages), into
    a fresh buffer of the part's bytes. So a rank holds at most two buckets' bytes of gathered weights: a bucket's
    gathered rows beside its assembled tensors, or the part it hands on beside its own stage's next bucket's rows
    (in flight meanwhile). Every rank of the group must iterate to the end (the gathers and
    broadcasts are collectives) and drop each part before asking for the next."""
    pp = pipeline_state(model)
    own = full_buckets(model, plan, stage_names)
    if pp is None:
        for _, named in own:
            yield named
            del named  # before the next bucket is assembled
        return
    device = next(model.parameters()).device
    for layout in plan.buckets:
        for stage, names in enumerate(stage_names):
            metas, (lo, hi) = _part(layout, names)
            if not metas:
                continue
            if stage == pp.pp_rank:
                named = next(own)[1]
                tensors = [t.contiguous() for _, t in named]
            else:
                buffer = torch.empty(hi - lo, dtype=torch.uint8, device=device)
                named = [(m.name, buffer[m.start_idx - lo:m.end_idx - lo].view(m.dtype).view(m.shape))
                         for m in metas]
                tensors = [t for _, t in named]
                del buffer  # the views keep it: it goes when the part does
            _broadcast(tensors, dist.get_global_rank(pp.pp_group, stage), pp.pp_group)
            del tensors
            yield named
            del named


def _broadcast(tensors: list[torch.Tensor], src: int, group) -> None:
    """``tensors`` from global rank ``src`` to ``group``, all in flight at once (the finished works, which hold
    the tensors, go on return)."""
    for work in [dist.broadcast(t, src=src, group=group, async_op=True) for t in tensors]:
        work.wait()


class GroupExport:
    """The model as ``WeightSync`` reads it under TP/PP: ``export_hf()`` is the planning stream (every stage's
    tensors at full size, on the meta device: nothing gathered) until ``plan`` is set, then ``leader_stream``.
    Anything else is the model's."""

    def __init__(self, model):
        self.model = model
        self.specs = stage_specs(model)
        self.stage_names = [{s.name for s in specs} for specs in self.specs]
        self.plan: WeightPlan | None = None

    def export_hf(self):
        if self.plan is None:
            return ((s.name, torch.empty(s.shape, dtype=s.dtype, device="meta")) for specs in self.specs
                    for s in specs)
        return leader_stream(self.model, self.plan, self.stage_names)

    def __getattr__(self, name):
        return getattr(self.model, name)


class ModelParallelWeightSync(WeightSync):
    """``WeightSync`` of a TP/PP trainer's model-parallel group (``dp``: its ``DataParallel``): the leader, which
    holds ``engine``, pushes the group's stream into it in any ``WeightSync`` mode but zero-copy (the pushed
    tensors are gathered, not the trainer's storage); every other rank passes ``engine=None`` and is a
    ``contributor``: each push it gathers and sends its part as many times as the leader's mode reads the
    export. With an engine ``seat`` (a colocated SGLang engine of several GPUs) every rank of the seat is in
    mode ``sglang-tp`` and hands its engine TP rank each (bucket, stage) part of ``seat_parts``. Options as
    ``WeightSync``'s."""

    def __init__(self, model, engine, dp, *, seat=None, **options):
        export = GroupExport(model)
        super().__init__(export, engine, zero_copy=False, seat=seat, **options)
        export.plan = self.plan
        self.dp = dp
        if seat is not None:
            return
        self.controls_engine = dp.holds_engine
        if not dp.holds_engine:
            self.mode = "contributor"
        self.passes = dp.from_model_leader(lambda: SYNC_PASSES.get(self.mode, 1))
        # only an SGLang leader may read the export once more after a push, and only it says so per push
        self.leader_checks_after_sync = dp.from_model_leader(lambda: self.mode == "sglang")

    def _seat_buckets(self):
        return seat_parts(self.model.model, self.plan, self.model.stage_names)

    async def _sync(self, version: str) -> None:
        if self.seat is not None:
            return await super()._sync(version)
        if self.mode != "contributor":
            await super()._sync(version)
            if self.leader_checks_after_sync:
                self.dp.from_model_leader(self._checked_after_sync)
            return
        for _ in range(self.passes):
            self._contribute()
        if self.leader_checks_after_sync and self.dp.from_model_leader(lambda: None):
            self._contribute()  # the leader's check after the sync

    def _checked_after_sync(self) -> bool:
        """Whether the SGLang leader's push reads the export once more after the sync: servers whose load did not
        check itself are checked by ``/weights_checker`` (known only once the push has run)."""
        return not self.engine.last_push_checked

    def _contribute(self) -> None:
        for _ in self.model.export_hf():  # this rank's shards gathered to the leader, bucket by bucket
            pass

    def describe(self) -> str:
        if self.mode == "contributor":
            return (f"weight sync: this rank gathers and sends its shards of {len(self.plan.buckets)} buckets to its "
                    "model-parallel group's engine")
        if self.mode == "sglang-tp":
            return super().describe() + (" · gathered over TP per bucket; each pipeline stage's part broadcast to "
                                         "the other stages' ranks, one request per (bucket, stage)")
        return super().describe() + " · gathered over TP per bucket, each pipeline stage's part sent to the engine"


class ModelParallelBroadcastSync(BroadcastWeightSync):
    """``--no-colocate`` under TP/PP (one model-parallel group, DP=1): ``BroadcastWeightSync`` over the group's
    stream (``GroupExport``). The group's leader (``dp.holds_engine``: global rank 0) holds ``engines``, is rank 0
    of the weight-update group and broadcasts every bucket of ``leader_stream`` to them; every other rank passes
    ``engines=[]`` and is a contributor: it joins no group, and each push it takes part in the TP gathers and
    sends its stage's part to the leader, as many times as the leader reads the export (once, twice with SGLang's
    hash check). Every rank of the group must construct it (the plan comes from the shards' metadata, exchanged
    over the pipeline group) and push together. Options as ``BroadcastWeightSync``'s."""

    def __init__(self, model, engines, dp, **options):
        export = GroupExport(model)
        super().__init__(export, engines, **options)
        export.plan = self.plan
        self.contributor = not dp.holds_engine
        self.passes = dp.from_model_leader(lambda: 1 + len(self.verifiers))  # the broadcast, then one per check

    async def connect(self) -> None:
        if not self.contributor:
            await super().connect()

    async def push(self, version: str) -> None:
        if not self.contributor:
            return await super().push(version)
        start = _clock(self.device)
        for _ in range(self.passes):
            deque(self.model.export_hf(), maxlen=0)  # the gathers and this stage's sends; nothing yielded here
        self.timings["perf/sync_time"] = _clock(self.device) - start

    def describe(self) -> str:
        if self.contributor:
            return (f"weight sync: this rank gathers and sends its shards of {len(self.plan.buckets)} buckets to rank "
                    "0, which broadcasts them to the engines")
        return super().describe() + " · gathered over TP per bucket, each pipeline stage's part sent to rank 0"
