"""Trainer ranks sharing colocated SGLang engines of several GPUs (``--rollout-num-gpus-per-engine``), one process
each over gloo, for test_engine_placement.py. The CUDA-IPC serialization is replaced by a payload naming the rank
and the bucket's tensors; the leader's engine talks HTTP to a stand-in SGLang server in its process."""

import asyncio
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from redline.loop.engine_placement import colocated_seat, join_engine_groups, share_engine_url

BUCKET_BYTES = 4096


def init(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    return join_engine_groups(colocated_seat(rank, world, world), world)


class ExportingModel:
    """What WeightSync reads of a trainer model: the full HF-named tensors (the same on every rank, as a TP
    trainer's export gathers them), three layers of two tensors each."""

    def export_hf(self):
        gen = torch.Generator().manual_seed(0)
        for i in range(3):
            for part in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                yield f"model.layers.{i}.{part}", torch.randn(16, 16, generator=gen)

    def parameters(self):
        return iter(())


def push_through_seat(rank, world, port, offload, results):
    """Every rank builds WeightSync on its seat and runs two release/push rounds; the leader's server records the
    requests. ``results`` gets (rank, (the server's calls or None, the weight_version this rank's engine holds))."""
    from redline.loop import weight_sync
    from redline.rollout.engine import SerializedBucket
    from redline.rollout.sglang import payload
    from redline.rollout.sglang.engine import SGLangEngine
    from tests.rollout.fake_sglang import FakeSGLang

    try:
        seat = init(rank, world, port)
        payload.serialize_bucket = lambda bucket, tp_size=1: SerializedBucket(
            per_rank=(f"rank{rank}:" + ",".join(n for n, _ in bucket),) * tp_size)
        server = FakeSGLang(version="0.5.23", busy_flushes=0) if seat.is_leader else None

        def launch():
            server.__enter__()
            return SGLangEngine([server.url], tp_size=world), server.url

        engine, url = share_engine_url(seat, launch)
        engine = engine or SGLangEngine([url], tp_size=world)
        sync = weight_sync.WeightSync(ExportingModel(), engine, bucket_bytes=BUCKET_BYTES, offload=offload,
                                      seat=seat)
        assert sync.mode == "sglang-tp" and sync.controls_engine == seat.is_leader, (sync.mode, sync.controls_engine)

        async def rounds():
            for version in ("1", "2"):
                await sync.release()
                await sync.push(version)
            await engine.shutdown()

        asyncio.run(rounds())
        calls = [(path, body) for path, body in server.calls if path not in ("/server_info", "/health")] \
            if server else None
        results.put((rank, (calls, engine.weight_version, len(sync.plan.buckets), sync.describe(),
                            sorted(sync.timings))))
        if server:
            server.__exit__()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- any failure goes to the parent, which shows the traceback
        results.put((rank, traceback.format_exc()))


def share_a_launch(rank, world, port, fail, results):
    """The leader 'launches' (returns a URL, or raises when ``fail``); every rank reports what it got."""
    try:
        seat = init(rank, world, port)

        def launch():
            if fail:
                raise RuntimeError("no GPU for the server")
            return "engine-object", "http://127.0.0.1:1234"

        try:
            outcome = share_engine_url(seat, launch)
        except RuntimeError as error:
            outcome = ("raised", str(error))
        results.put((rank, outcome))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- any failure goes to the parent, which shows the traceback
        results.put((rank, traceback.format_exc()))


def embedded_engine_beside_parallel_trainer(rank, world, port, layout, mode, results):
    """A TP=2 or PP=2 trainer (gloo) with an unsharded in-process embedded engine on every rank: one push must
    leave each rank's engine holding the whole trained model. ``results`` gets (rank, max |engine - expected|)."""
    import os

    import transformers

    from redline.loop.weight_sync import IN_PROCESS_ENV, WeightSync
    from redline.rollout.embedded.engine import EmbeddedEngine
    from redline.trainer.models import from_config
    from redline.trainer.parallel import ParallelConfig

    try:
        os.environ[IN_PROCESS_ENV] = mode
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        config = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=64, tie_word_embeddings=False)
        parallel = ParallelConfig(tp=2) if layout == "tp2" else ParallelConfig(pp=2)
        trainer = from_config(config, dtype=torch.float32, device="cpu", seed=0, parallel=parallel)
        with torch.no_grad():  # stands in for an optimizer step: every shard and stage changes
            for p in trainer.parameters():
                p.mul_(1.5).add_(0.25)
        engine = EmbeddedEngine(from_config(config, dtype=torch.float32, device="cpu", seed=1), max_batch_size=2,
                                max_seq_len=16)
        sync = WeightSync(trainer, engine, bucket_bytes=4096, offload=False, device="cpu")
        asyncio.run(sync.push("1"))
        expected = from_config(config, dtype=torch.float32, device="cpu", seed=0)
        with torch.no_grad():
            for p in expected.parameters():
                p.mul_(1.5).add_(0.25)
        held = dict(engine.model.export_hf())
        diff = max((held[name] - tensor).abs().max().item() for name, tensor in expected.export_hf())
        results.put((rank, (sync.mode, len(held) == len(dict(expected.export_hf())), diff)))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- any failure goes to the parent, which shows the traceback
        results.put((rank, traceback.format_exc()))


def tp_trainer_through_seat(rank, world, port, results):
    """A TP=2 trainer on a seat of 2 (``--rollout-num-gpus-per-engine 2``): rank 0 holds the stand-in server's
    client, rank 1 generates nothing (engine None) but hands in its own copy of every bucket. The payload names each
    tensor with the hash of the bytes the rank packed. ``results`` gets (rank, (server calls or None,
    {hf_name: hash} of the unsharded reference, the sync's mode))."""
    import transformers

    from redline.loop import weight_sync
    from redline.rollout.engine import SerializedBucket
    from redline.rollout.sglang import payload
    from redline.rollout.sglang.engine import SGLangEngine
    from redline.trainer.models import from_config
    from redline.trainer.parallel import ParallelConfig
    from tests.rollout.fake_sglang import FakeSGLang
    from tests.rollout.test_sglang_weight_check import byte_hash

    try:
        seat = init(rank, world, port)
        payload.serialize_bucket = lambda bucket, tp_size=1: SerializedBucket(per_rank=(
            f"rank{rank}:" + ";".join(f"{n}={byte_hash(t.contiguous())}" for n, t in bucket),) * tp_size)
        config = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=64, tie_word_embeddings=False)
        trainer = from_config(config, dtype=torch.float32, device="cpu", seed=0, parallel=ParallelConfig(tp=2))
        server = FakeSGLang(version="0.5.23", busy_flushes=0) if seat.is_leader else None

        def launch():
            server.__enter__()
            return SGLangEngine([server.url], tp_size=world), server.url

        engine, _ = share_engine_url(seat, launch)  # rank 1 does not generate: no client
        sync = weight_sync.WeightSync(trainer, engine, bucket_bytes=BUCKET_BYTES, offload=True, seat=seat)

        async def push():
            await sync.release()
            await sync.push("1")
            if engine is not None:
                await engine.shutdown()

        asyncio.run(push())
        reference = from_config(config, dtype=torch.float32, device="cpu", seed=0)
        expected = {name: byte_hash(t.contiguous()) for name, t in reference.export_hf()}
        calls = [(p, b) for p, b in server.calls if p not in ("/server_info", "/health")] if server else None
        results.put((rank, (calls, expected, sync.mode)))
        if server:
            server.__exit__()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- any failure goes to the parent, which shows the traceback
        results.put((rank, traceback.format_exc()))
