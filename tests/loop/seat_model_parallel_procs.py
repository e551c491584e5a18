"""Ranks of a TP (× PP) trainer on the GPUs of one colocated SGLang engine (``--rollout-num-gpus-per-engine`` =
the model-parallel group), one gloo process each, for test_seat_under_model_parallel.py. The CUDA-IPC
serialization is replaced by a payload naming the rank and, per tensor, a hash of the bytes it packed; the
leader's engine talks HTTP to a stand-in SGLang server in its process. Every rank measures the bytes of gathered
weights it holds at once: the TP gathers' outputs, the tensors assembled from them and the other stages' parts
it receives (not the trainer's own parameters)."""

import asyncio
import os
import time
import traceback
import weakref

import torch

BUCKET_BYTES = 110_000  # 8 layers of the model below: 5 buckets, the middle one (layers 3, 4) across the stages of PP=2
SETTLE_S = 0.05


class LiveGathered:
    """The storages of gathered tensors still alive and the largest total of their bytes seen at any point one
    was added or a bucket was serialized."""

    def __init__(self, own_storages: set[int]):
        self.own = own_storages  # the parameters' storages: what the rank holds anyway
        self.live: list[tuple[weakref.ref, int]] = []
        self.peak = 0

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.live = [(ref, n) for ref, n in self.live if ref() is not None]
        if storage.data_ptr() in self.own or any(ref().data_ptr() == storage.data_ptr() for ref, _ in self.live):
            return
        self.live.append((weakref.ref(storage), storage.nbytes()))
        self.measure()

    def measure(self) -> None:
        # a finished gloo collective's worker thread and asyncio.to_thread's executor thread let go of their
        # tensors just after the caller resumes: with this thread (the push's) held still, what is alive after a
        # moment is what the push holds
        time.sleep(SETTLE_S)
        self.live = [(ref, n) for ref, n in self.live if ref() is not None]
        self.peak = max(self.peak, sum(n for _, n in self.live))


def model_config(num_layers=8):
    import transformers

    return transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=64, tie_word_embeddings=False)


def instrument(trainer, serialize_payload):
    """Count every gathered tensor of the push (the TP gathers' outputs, their assembled full tensors, the parts
    ``seat_parts`` hands on) in a ``LiveGathered``; each serialization also measures."""
    from redline.loop import parallel_sync
    from redline.rollout.engine import SerializedBucket
    from redline.rollout.sglang import payload
    from redline.trainer.parallel.tensor import ShardInfo

    tracker = LiveGathered({p.untyped_storage().data_ptr() for p in trainer.parameters()})
    gather, assemble, parts = parallel_sync._all_gather_single, ShardInfo.assemble, parallel_sync.seat_parts

    def tracked_gather(out, flat, **kwargs):
        work = gather(out, flat, **kwargs)
        tracker.add(out)
        return work

    def tracked_assemble(self, pieces):
        full = assemble(self, pieces)
        tracker.add(full)
        return full

    def tracked_parts(*args):
        for named in parts(*args):
            for _, tensor in named:
                tracker.add(tensor)
            del tensor  # the count's own references must not keep a bucket alive
            yield named
            del named

    def serialize(bucket, tp_size=1):
        tracker.measure()
        return SerializedBucket(per_rank=(serialize_payload(bucket),) * tp_size)

    parallel_sync._all_gather_single = tracked_gather
    ShardInfo.assemble = tracked_assemble
    parallel_sync.seat_parts = tracked_parts
    payload.serialize_bucket = serialize
    return tracker


def trainer_through_seat(rank, world, port, tp, pp, results):
    """TP ``tp`` × PP ``pp`` trainer ranks (× the data-parallel rest of ``world``) on one engine seat: one push through
    ``ModelParallelWeightSync``. ``results`` gets (rank, (server calls or None, {hf_name: hash} of the unsharded
    model, the plan's bucket sizes, this rank's peak gathered bytes, the sync's mode and description))."""
    from redline.loop.data_parallel import init_data_parallel
    from redline.loop.engine_placement import (
        colocated_seat,
        join_engine_groups,
        share_engine_url,
    )
    from redline.loop.parallel_sync import ModelParallelWeightSync
    from redline.rollout.sglang.engine import SGLangEngine
    from redline.trainer.models import from_config

    from tests.rollout.fake_sglang import FakeSGLang
    from tests.rollout.test_sglang_weight_check import byte_hash

    try:
        os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        dp = init_data_parallel(1.0, tp=tp, pp=pp)
        seat = join_engine_groups(colocated_seat(rank, world, world), world)
        config = model_config()
        trainer = from_config(config, dtype=torch.float32, device="cpu", seed=0, parallel=dp.state)
        with torch.no_grad():  # stands in for an optimizer step: every shard and stage changes
            for p in trainer.parameters():
                p.mul_(1.5).add_(0.25)
        tracker = instrument(trainer, lambda bucket: f"rank{rank}:" + ";".join(
            f"{n}={byte_hash(t.contiguous())}" for n, t in bucket))
        server = FakeSGLang(version="0.5.23", busy_flushes=0) if seat.is_leader else None

        def launch():
            server.__enter__()
            return SGLangEngine([server.url], tp_size=world), server.url

        engine, _ = share_engine_url(seat, launch)
        sync = ModelParallelWeightSync(trainer, engine if dp.holds_engine else None, dp, seat=seat,
                                       bucket_bytes=BUCKET_BYTES, offload=True, device="cpu")

        async def push():
            await sync.release()
            await sync.push("1")
            if engine is not None:
                await engine.shutdown()

        asyncio.run(push())
        reference = from_config(config, dtype=torch.float32, device="cpu", seed=0)
        with torch.no_grad():
            for p in reference.parameters():
                p.mul_(1.5).add_(0.25)
        expected = {name: byte_hash(t.contiguous()) for name, t in reference.export_hf()}
        calls = [(p, b) for p, b in server.calls if p not in ("/server_info", "/health")] if server else None
        results.put((rank, (calls, expected, [b.nbytes for b in sync.plan.buckets], tracker.peak, sync.mode,
                            sync.describe())))
        if server:
            server.__exit__()
        dp.close()
    except Exception:  # noqa: BLE001 -- any failure goes to the parent, which shows the traceback
        results.put((rank, traceback.format_exc()))


def trainer_beside_one_gpu_engine(rank, world, port, checked, results):
    """A TP=``world`` trainer whose leader holds an SGLang engine of one GPU (``--rollout-num-gpus-per-engine 1``):
    the other ranks only gather. ``checked``: the server loads through redline's checked loader (the push reads the
    export once), else it takes flattened buckets and is checked by ``/weights_checker`` (the push reads the
    export twice: the group must agree on that per push). ``results`` gets (rank, (the sync's mode, server paths
    or None, whether the server holds the trained weights or None))."""
    from redline.loop.data_parallel import init_data_parallel
    from redline.loop.parallel_sync import ModelParallelWeightSync
    from redline.rollout.engine import SerializedBucket
    from redline.rollout.sglang import engine as sglang_engine
    from redline.rollout.sglang import payload, weight_check
    from redline.rollout.sglang.engine import SGLangEngine
    from redline.rollout.sglang.weight_check import expected_checksums
    from redline.trainer.models import from_config

    from tests.rollout.fake_sglang import FakeSGLang, FakeSGLangModel, Payloads
    from tests.rollout.test_sglang_weight_check import byte_hash

    try:
        os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        dp = init_data_parallel(1.0, tp=world)
        config = model_config()
        trainer = from_config(config, dtype=torch.float32, device="cpu", seed=0, parallel=dp.state)
        reference = from_config(config, dtype=torch.float32, device="cpu", seed=0)
        for model in (trainer, reference):
            with torch.no_grad():  # stands in for an optimizer step: every shard changes
                for p in model.parameters():
                    p.mul_(1.5).add_(0.25)
        trained = list(reference.export_hf())
        server, engine = None, None
        if dp.holds_engine:
            if checked:
                registry = Payloads()
                payload.serialize_payload = registry.serialize  # CUDA IPC stood in for, in this process
                server = FakeSGLang(busy_flushes=0, loader_model=FakeSGLangModel(trained), payloads=registry)
            else:
                server = FakeSGLang(busy_flushes=0)
                weight_check.sglang_tensor_hash = lambda: byte_hash

                def serialize(named_tensors, tp_size=1):
                    server.checksums.update(expected_checksums(named_tensors, byte_hash))  # "loaded" what was sent
                    return SerializedBucket(per_rank=("bucket",) * tp_size)

                sglang_engine.serialize_bucket = serialize
            server.__enter__()
            engine = SGLangEngine([server.url])  # attached: whether it loads checked is asked at the first push
        sync = ModelParallelWeightSync(trainer, engine, dp, bucket_bytes=BUCKET_BYTES, offload=False, device="cpu")

        async def push():
            await sync.push("1")
            if engine is not None:
                await engine.shutdown()

        asyncio.run(push())
        holds = None
        if checked and server is not None:
            held = dict(server.loader_model.named_parameters())
            holds = all(torch.equal(held[n][:t.shape[0]], t) for n, t in trained if n in held)
        paths = [p for p, _ in server.calls if p not in ("/server_info", "/health")] if server else None
        results.put((rank, (sync.mode, paths, holds)))
        if server:
            server.__exit__()
        dp.close()
    except Exception:  # noqa: BLE001 -- any failure goes to the parent, which shows the traceback
        results.put((rank, traceback.format_exc()))
