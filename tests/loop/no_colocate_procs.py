"""Rank entry points of the ``--no-colocate`` tests under tensor / pipeline parallelism (spawned processes import
them by this module's name)."""

import asyncio
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

BUCKET_BYTES = 16 * 2**10  # several buckets of the tiny model, one of them holding tensors of both PP stages
NO_COLOCATE = ["--no-colocate", "--update-weight-buffer-size", str(BUCKET_BYTES)]  # the runs' placement flags
# pushes after every second step: the ranks must agree on which step pushes (only rank 0 takes a batch)
ONE_STEP = ["--async-rollout", "one-step", "--update-weights-interval", "2"]


def broadcast_from_parallel_trainer(rank, port, model_dir, layout, engine_kind, results):
    """A TP=2 + SP (``layout`` "tp2-sp") or PP=2 ("pp2") trainer over 2 gloo ranks; the group's leader holds the
    engine and broadcasts to it through ``ModelParallelBroadcastSync``, rank 1 only gathers and sends. The engine
    (``engine_kind``): an embedded engine process on the CPU (bucket checksums), or a stand-in SGLang server in a
    process of its own, attached, whose hashes of what it received are compared with the trainer's tensors after
    each push (``--check-sglang-weights``: the export read twice). Two pushes, each after every shard and stage
    moved (standing in for an optimizer step). ``results`` gets ``(rank, (describe line, bucket count, [largest
    |engine - unsharded reference| per push]))``; the list is empty off the leader, which alone can read its
    engine, and for SGLang, whose check is the hash comparison of the push itself."""
    import contextlib

    from redline.loop.data_parallel import DataParallel, model_parallel_group
    from redline.loop.parallel_sync import ModelParallelBroadcastSync
    from redline.trainer.models import from_pretrained
    from redline.trainer.parallel import ParallelConfig

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        parallel = ParallelConfig(tp=2, sp=True) if layout == "tp2-sp" else ParallelConfig(pp=2)
        state = parallel.build("cpu")
        dp = DataParallel(rank=state.dp_rank, world=1, state=state, mp_group=model_parallel_group(state))
        trainer = from_pretrained(model_dir, dtype=torch.float32, parallel=state)
        reference = from_pretrained(model_dir, dtype=torch.float32)  # the same steps on the unsharded model
        servers = contextlib.ExitStack()
        engine = _engine(engine_kind, model_dir, servers) if dp.holds_engine else None
        sync = ModelParallelBroadcastSync(trainer, [engine] if engine else [], dp, bucket_bytes=BUCKET_BYTES,
                                          device=torch.device("cpu"), timeout_s=60, verify=engine_kind == "sglang")

        async def pushes():
            await sync.connect()
            diffs = []
            for version in ("1", "2"):
                with torch.no_grad():
                    for model in (trainer, reference):
                        for p in model.parameters():
                            p.mul_(1.5).add_(0.25)
                await sync.push(version)
                if engine_kind == "embedded" and engine is not None:
                    held = dict(await engine.export_weights())
                    expected = dict(reference.export_hf())
                    assert sorted(held) == sorted(expected)
                    diffs.append(max((held[n] - t).abs().max().item() for n, t in expected.items()))
            await sync.close()
            if engine is not None:
                await engine.shutdown()
            return diffs

        with servers:
            diffs = asyncio.run(pushes())
        results.put((rank, (sync.describe(), len(sync.plan.buckets), diffs)))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- any failure goes to the parent, which shows the traceback
        results.put((rank, traceback.format_exc()))


def _engine(kind: str, model_dir, servers):
    """The leader's engine: an embedded engine process on the CPU, or an attached stand-in SGLang server (started
    in ``servers``) that reports byte hashes of the tensors it received."""
    if kind == "embedded":
        from redline.rollout.embedded.process import EmbeddedEngineProcess

        return EmbeddedEngineProcess(model_dir, dtype=torch.float32, device="cpu", max_batch_size=2, max_seq_len=16,
                                     seed=1)
    from redline.rollout.sglang import weight_check
    from redline.rollout.sglang.engine import SGLangEngine
    from tests.rollout.fake_sglang import fake_sglang_process
    from tests.rollout.test_sglang_weight_check import byte_hash

    weight_check.sglang_tensor_hash = lambda: byte_hash
    return SGLangEngine([servers.enter_context(fake_sglang_process(hash_fn=byte_hash))])


def deal_rollout(rank, port, results):
    """Two gloo DP ranks: rank 0 generates a batch of 4 groups of 2 samples and its metrics, rank 1 nothing;
    ``dealt_rollout.deal`` hands them out. ``results`` gets ``(rank, (group indices of its samples, sample
    indices, metrics))``."""
    from redline.loop.data_parallel import DataParallel
    from redline.loop.dealt_rollout import deal
    from redline.rollout.types import Sample

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        dp = DataParallel(rank=rank, world=2)
        samples, metrics = [], {}
        if rank == 0:
            samples = [Sample(prompt=f"p{g}", tokens=[g], group_index=g, index=2 * g + i)
                       for g in range(4) for i in range(2)]
            metrics = {"rollout/reward_mean": 0.375, "rollout/samples": 8.0, "rollout/dropped_groups": 1.0}
        mine, shared = deal(dp, lambda: (samples, metrics))  # called on rank 0 alone
        results.put((rank, ([s.group_index for s in mine], [s.index for s in mine], shared)))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- any failure goes to the parent, which shows the traceback
        results.put((rank, traceback.format_exc()))


def failing_rollout(rank, port, world, timeout_s, all_reported, results):
    """The step's rollout (``dealt_rollout.rollout_batch``) with dealt rollouts, where rank 0's rollout raises
    ``KeyError('reward exploded')`` (a stand-in rollout manager: a reward that fails); ``_report_failure``'s
    ranks and results."""
    from types import SimpleNamespace

    from redline.loop.dealt_rollout import rollout_batch

    class ExplodingRollout:
        async def generate(self, rollout_id):
            raise KeyError("reward exploded")

    def call(dp, loop):
        state = SimpleNamespace(dp=dp, config=SimpleNamespace(parallel=SimpleNamespace(colocate=False)), loop=loop,
                                rollout=ExplodingRollout())
        rollout_batch(state, 0)

    _report_failure(rank, port, world, timeout_s, all_reported, results, call)


def failed_rollout_ahead_at_checkpoint(rank, port, world, timeout_s, all_reported, results):
    """``--async-rollout one-step`` with dealt rollouts: rank 0's schedule holds the next rollout, which raised
    ``KeyError('reward exploded')`` while the trainer trained, when a checkpoint takes the rollout's state
    (``ScheduledRollout.state_dict``, on every rank) and saves; ``_report_failure``'s ranks and results."""
    from types import SimpleNamespace

    from redline.loop.async_schedule import OneStepOff

    class Rollout:
        def state_dict(self):
            return {"data_source": {"buffer": []}}

    def call(dp, loop):
        config = SimpleNamespace(sync=SimpleNamespace(update_weights_interval=1),
                                 rollout=SimpleNamespace(num_rollout=3), parallel=SimpleNamespace(colocate=False))
        state = SimpleNamespace(dp=dp, config=config, loop=loop, rollout=Rollout(), weight_sync=None)
        schedule = OneStepOff(state)  # puts its wrappers into ``state``
        if dp.is_main:
            schedule.pending = loop.create_future()
            schedule.pending.set_exception(KeyError("reward exploded"))
        state.rollout.state_dict()
        dp.barrier()  # checkpoint.save's first collective

    _report_failure(rank, port, world, timeout_s, all_reported, results, call)


def _report_failure(rank, port, world, timeout_s, all_reported, results, call):
    """``call(dp, event loop)`` on ``world`` gloo ranks (2: DP=2; 4: DP=2 × TP=2) whose process group times out
    after ``timeout_s``. Every rank keeps its process group until all have reported (``all_reported``, a barrier),
    as a rank does while it shuts its engines down: a rank waiting for a result that never comes waits for the
    timeout, not for a closed connection. ``results`` gets ``(rank, (what ``call`` raised: type name, message,
    seconds))``."""
    import threading
    import time

    from redline.loop.data_parallel import DataParallel, model_parallel_group
    from redline.trainer.parallel import ParallelConfig

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        parallel = ParallelConfig(tp=world // 2, dp=2).build("cpu")
        dp = DataParallel(rank=parallel.dp_rank, world=2, state=parallel,
                          mp_group=model_parallel_group(parallel) if world > 2 else None)
        began = time.perf_counter()
        try:
            call(dp, asyncio.new_event_loop())
            outcome = ("returned", "", time.perf_counter() - began)
        except Exception as exc:  # noqa: BLE001 -- what each rank raises is the test's subject
            outcome = (type(exc).__name__, str(exc), time.perf_counter() - began)
        results.put((rank, outcome))
        try:
            all_reported.wait(timeout_s * 3)
        except threading.BrokenBarrierError:  # a rank that never reported: its missing outcome fails the test
            pass
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- any failure goes to the parent, which shows the traceback
        results.put((rank, traceback.format_exc()))
