"""Weight sync: redline's colocated modes side by side against one HBM copy of the same bytes (issue 6).

Per Qwen3 shape (0.6B, 1.7B, 4B, 8B; random bf16 weights, HF names from transformers' Qwen3 on the meta
device) and bucket size (64 MiB - 2 GiB), into an engine process on the same GPU that owns the weights as
``{hf_name: tensor}`` (``redline.sync.receiver.target_process``, what the embedded engine process runs):

* baseline ``one D2D copy``: the trainer's tensors copied straight into the engine's tensors (opened over
  CUDA IPC) in one multi-tensor copy: the floor of any colocated sync;
* ``redline pipelined``: ping-pong staging buffers, pack k+1 while the engine loads k, checksums both sides;
* ``redline zero-copy``: the trainer's parameters live in flat bucket storage, exported as is;
* ``slime-style sequential``: 512 MiB, a new ``torch.cat`` buffer per bucket, one handle per bucket, the engine
  synchronizes before replying, ``ipc_collect`` + ``empty_cache`` per bucket, no overlap;
* ``per-tensor IPC``: a clone and a handle per tensor, one round trip each (OpenRLHF-style).

Stage lines: pack only, checksum only (trainer side). Memory: device memory after 100 consecutive syncs. Trainer
pause/resume of params + grads in ``PausableMemory`` with the residual device memory while paused.
Multi-GPU: disaggregated broadcast to N-1 receivers against a plain NCCL broadcast of the same bytes.
"""

import multiprocessing as mp
import time

import pytest
import torch

from redline.sync.checksum import bucket_checksum
from redline.sync.plan import BucketLayout, MiB, TensorSpec, WeightPlan, plan_buckets
from redline.sync.protocol import WeightSender
from redline.sync.receiver import make_transport, target_process

pytestmark = pytest.mark.gpu
QWEN3 = {  # hidden, layers, heads, kv heads, ffn, tied (head_dim 128, vocab 151936: the published configs)
    "0.6B": (1024, 28, 16, 8, 3072, True),
    "1.7B": (2048, 28, 16, 8, 6144, True),
    "4B": (2560, 36, 32, 8, 9728, True),
    "8B": (4096, 36, 32, 8, 12288, False),
}
BUCKET_MIB = [64, 256, 512, 1024, 2048]
SLIME_BUCKET_MIB = 512
ROUNDS, WARMUP = 5, 1
TIMEOUT_S = 600.0
DEVICE, TRANSPORT = "cuda", "cuda-ipc"


def qwen3_specs(size: str) -> tuple[list[TensorSpec], bool]:
    """HF export specs of a Qwen3 shape (names and shapes from transformers' own model class)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    hidden, layers, heads, kv_heads, ffn, tied = QWEN3[size]
    config = Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=128, intermediate_size=ffn, vocab_size=151936,
                         tie_word_embeddings=tied, torch_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [TensorSpec(n, tuple(p.shape), torch.bfloat16) for n, p in model.named_parameters()], tied


class Engine:
    """The engine process of one model shape, plus the trainer's handles to its weights."""

    def __init__(self, specs):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target_process,
                                args=(child, [(s.name, s.shape, s.dtype) for s in specs], TRANSPORT, True),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(TIMEOUT_S):
            raise RuntimeError("the engine process did not start")
        self.weights = self.conn.recv()

    def sender(self, plan, **kwargs):
        return WeightSender(self.conn, make_transport(TRANSPORT), plan, timeout=TIMEOUT_S,
                            alive=self.proc.is_alive, **kwargs)

    def close(self):
        self.weights = None
        self.conn.send(("close", 0, {}))
        self.proc.join(TIMEOUT_S)


class Trainer:
    """Random trainer weights for a plan, living in one flat uint8 storage per bucket (so zero-copy applies);
    ``export`` lists them in the model's export order, like ``export_hf()`` would."""

    def __init__(self, specs: list[TensorSpec], plan: WeightPlan):
        self.flats = [torch.empty(b.nbytes, dtype=torch.uint8, device=DEVICE) for b in plan.buckets]
        views = {}
        for bucket, flat in zip(plan.buckets, self.flats):
            for name, view in bucket.views(flat):
                view.normal_()
                views[name] = view
        self.export = [(s.name, views[s.name]) for s in specs if s.name in views]


@pytest.fixture(scope="module", params=list(QWEN3), ids=[f"qwen3_{size.replace('.', '_')}" for size in QWEN3])
def model(request):
    specs, tied = qwen3_specs(request.param)
    engine = Engine(specs)
    yield request.param, specs, tied, engine
    engine.close()


def _plan(specs, tied, bucket_mib):
    return plan_buckets(specs, bucket_mib * MiB, tie_word_embeddings=tied)


def _group(size, plan):
    return f"weight sync Qwen3-{size} ({plan.nbytes / 1e9:.2f} GB bf16)"


def _info(plan, bucket_mib):
    return dict(model_bytes=plan.nbytes, bucket_mib=bucket_mib, buckets=len(plan.buckets),
                tensors=sum(len(b.tensors) for b in plan.buckets))


def test_reference_one_copy(gpu_bench, model):
    size, specs, tied, engine = model
    plan = _plan(specs, tied, 512)
    trainer = Trainer(specs, plan)
    dsts = [engine.weights[n] for n, _ in trainer.export]
    srcs = [t for _, t in trainer.export]
    gpu_bench(lambda: torch._foreach_copy_(dsts, srcs), group=_group(size, plan),
              provider="one D2D copy into the engine's tensors (reference)", baseline=True, rounds=ROUNDS,
              warmup=WARMUP, bytes_moved=2 * plan.nbytes, **_info(plan, 512))


@pytest.mark.parametrize("bucket_mib", BUCKET_MIB)
def test_redline_pipelined(gpu_bench, model, bucket_mib):
    size, specs, tied, engine = model
    plan = _plan(specs, tied, bucket_mib)
    trainer = Trainer(specs, plan)
    sender = engine.sender(plan, num_slots=2)
    gpu_bench(lambda: sender.sync(trainer.export), group=_group(size, plan),
              provider=f"redline pipelined, {bucket_mib} MiB x2", rounds=ROUNDS, warmup=WARMUP,
              **_info(plan, bucket_mib))
    _assert_engine_has(engine, trainer)


@pytest.mark.parametrize("bucket_mib", [512, 2048])
def test_redline_zero_copy(gpu_bench, model, bucket_mib):
    size, specs, tied, engine = model
    plan = _plan(specs, tied, bucket_mib)
    trainer = Trainer(specs, plan)
    sender = engine.sender(plan)
    gpu_bench(lambda: sender.sync_flat(trainer.flats), group=_group(size, plan),
              provider=f"redline zero-copy, {bucket_mib} MiB", rounds=ROUNDS, warmup=WARMUP,
              **_info(plan, bucket_mib))
    _assert_engine_has(engine, trainer)


@pytest.mark.parametrize("mode", ["pipelined", "zero-copy"])
def test_redline_sampled_checksum(gpu_bench, model, mode):
    """The same modes with checksums over every 16th row: what the full checks cost, read off side by side."""
    size, specs, tied, engine = model
    plan = _plan(specs, tied, 512)
    trainer = Trainer(specs, plan)
    sender = engine.sender(plan, checksum_row_stride=16)
    run = (lambda: sender.sync(trainer.export)) if mode == "pipelined" else (lambda: sender.sync_flat(trainer.flats))
    gpu_bench(run, group=_group(size, plan), provider=f"redline {mode}, 512 MiB, checksum 1/16 rows",
              rounds=ROUNDS, warmup=WARMUP, **_info(plan, 512))
    _assert_engine_has(engine, trainer)


def _one_at_a_time(engine, plan, trainer, make_buffer):
    """Each bucket of ``plan`` in its own fresh buffer and its own session: export, load, device sync, reply,
    then free + ipc_collect + empty_cache before the next (slime's loop; per-tensor IPC with 1-tensor plans)."""
    senders = [engine.sender(WeightPlan((BucketLayout(0, bucket.dtype, bucket.tensors),), plan.aliases))
               for bucket in plan.buckets]
    tensors = dict(trainer.export)

    def run():
        for bucket, sender in zip(plan.buckets, senders):
            buffer = make_buffer([tensors[n] for n in bucket.names])
            sender.sync_flat([buffer])
            del buffer
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()

    return run


def test_slime_style_sequential(gpu_bench, model):
    size, specs, tied, engine = model
    plan = _plan(specs, tied, SLIME_BUCKET_MIB)
    trainer = Trainer(specs, plan)
    flatten = lambda ts: torch.cat([t.flatten().view(torch.uint8) for t in ts])  # FlattenedTensorBucket's cat
    gpu_bench(_one_at_a_time(engine, plan, trainer, flatten), group=_group(size, plan),
              provider=f"slime-style sequential, {SLIME_BUCKET_MIB} MiB, new buffer per bucket", rounds=ROUNDS,
              warmup=WARMUP, **_info(plan, SLIME_BUCKET_MIB))
    _assert_engine_has(engine, trainer)


def test_per_tensor_ipc(gpu_bench, model):
    size, specs, tied, engine = model
    plan = plan_buckets(specs, 1, tie_word_embeddings=tied, group_of=lambda name: name)  # one tensor per bucket
    trainer = Trainer(specs, plan)
    clone = lambda ts: ts[0].clone().flatten().view(torch.uint8)
    gpu_bench(_one_at_a_time(engine, plan, trainer, clone), group=_group(size, plan),
              provider="per-tensor IPC (clone + handle + round trip per tensor)", rounds=3, warmup=1,
              **_info(plan, 0))
    _assert_engine_has(engine, trainer)


def test_stage_pack(gpu_bench, model):
    """Trainer side alone: packing every bucket into one staging buffer (what the pipelined mode overlaps)."""
    size, specs, tied, engine = model
    plan = _plan(specs, tied, 512)
    trainer = Trainer(specs, plan)
    staging = torch.empty(plan.capacity, dtype=torch.uint8, device=DEVICE)
    tensors = dict(trainer.export)

    def pack():
        for bucket in plan.buckets:
            torch._foreach_copy_([m.view(staging) for m in bucket.tensors], [tensors[n] for n in bucket.names])

    gpu_bench(pack, group=_group(size, plan), provider="stage: pack only, 512 MiB", rounds=ROUNDS,
              warmup=WARMUP, **_info(plan, 512))


def test_stage_checksum(gpu_bench, model):
    """One side's checksums over all the model's bytes (each sync pays this on both sides)."""
    size, specs, tied, engine = model
    plan = _plan(specs, tied, 512)
    trainer = Trainer(specs, plan)
    gpu_bench(lambda: [bucket_checksum(f, b.nbytes) for b, f in zip(plan.buckets, trainer.flats)],
              group=_group(size, plan), provider="stage: checksum only (one side)", rounds=ROUNDS, warmup=WARMUP,
              **_info(plan, 512))


def test_memory_flat_over_100_syncs(benchmark, model):
    size, specs, tied, engine = model
    if size != "1.7B":
        pytest.skip("measured on one shape (1.7B) to keep the suite short")
    plan = _plan(specs, tied, 512)
    trainer = Trainer(specs, plan)
    sender = engine.sender(plan)
    sender.sync(trainer.export)
    torch.cuda.synchronize()
    used_before = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    benchmark.pedantic(lambda: [sender.sync(trainer.export) for _ in range(100)], rounds=1, iterations=1)
    used_after = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
    benchmark.extra_info.update(device_used_before=used_before, device_used_after=used_after,
                                growth_bytes=used_after - used_before, syncs=100, **_info(plan, 512))
    assert used_after - used_before < 2 * plan.capacity, "device memory grew over 100 syncs"


@pytest.mark.parametrize("keep_contents", [True, False])
def test_trainer_pause_resume(gpu_bench, benchmark, model, keep_contents):
    """Params + grads (2x the model bytes) in PausableMemory: pause then resume, and the residual device memory
    of the whole GPU while paused (engine weights included; the engine stand-in does not release)."""
    from redline.sync.memory import PausableMemory

    size, specs, tied, engine = model
    memory = PausableMemory()
    with memory.region():
        state = [torch.empty(s.shape, dtype=s.dtype, device=DEVICE) for s in specs for _ in range(2)]
    nbytes = sum(t.numel() * t.element_size() for t in state)
    residual = {}

    def cycle():
        memory.pause(keep_contents=keep_contents)
        free, total = torch.cuda.mem_get_info()
        residual["device_used_while_paused"] = total - free
        residual["pool_mapped_while_paused"] = memory.stats()["mapped_bytes"]
        memory.resume()

    gpu_bench(cycle, group=f"trainer pause+resume Qwen3-{size} params+grads ({nbytes / 1e9:.1f} GB)",
              provider=f"PausableMemory {'keep contents (pinned host)' if keep_contents else 'discard'}",
              baseline=keep_contents, rounds=3, warmup=1, state_bytes=nbytes)
    benchmark.extra_info.update(residual)  # gpu_bench records into this same benchmark
    torch.cuda.synchronize()
    del state
    torch.cuda.empty_cache()
    assert residual["pool_mapped_while_paused"] == 0


def _assert_engine_has(engine, trainer):
    """The benchmark's last sync left the trainer's exact bytes in the engine (a fast mode must be a correct one)."""
    torch.cuda.synchronize()
    for name, tensor in trainer.export:
        assert torch.equal(engine.weights[name], tensor), name


# -- disaggregated: 2x / 4x GPUs -------------------------------------------------------------------------------
BROADCAST_SIZES = ["1.7B", "8B"]
BROADCAST_BUCKET_MIB = 512


def _broadcast_rank(rank, world, port, specs, tied, commands, results):
    """One GPU of the weight-update group: rank 0 is the trainer, the others engine GPUs owning the weights."""
    import torch.distributed as dist

    from redline.sync.broadcast import BroadcastReceiver, BroadcastSender, init_weight_update_group
    from redline.sync.receiver import TargetLoader

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = init_weight_update_group("127.0.0.1", port, rank, world, "redline-bench-pp0", backend="nccl")
    plan = _plan(specs, tied, BROADCAST_BUCKET_MIB)
    if rank == 0:
        trainer = Trainer(specs, plan)
        sync = lambda: BroadcastSender(group, plan, device).sync(trainer.export)
    else:
        loader = TargetLoader({s.name: torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs})
        sync = lambda: BroadcastReceiver(group, plan, device).sync(loader)
    raw = torch.empty(plan.capacity, dtype=torch.uint8, device=device)

    def nccl_only():  # the same bytes in the same chunks, no packing, loading or checks
        for bucket in plan.buckets:
            dist.broadcast(raw[:bucket.nbytes], group_src=0, group=group)

    while (command := commands.get()) != "stop":
        torch.cuda.synchronize()
        start = time.perf_counter()
        (sync if command == "sync" else nccl_only)()
        torch.cuda.synchronize()
        results.put((rank, time.perf_counter() - start))


@pytest.mark.multigpu
@pytest.mark.parametrize("size", BROADCAST_SIZES)
@pytest.mark.parametrize("mode", ["nccl broadcast of the same bytes (reference)", "redline broadcast sync"])
def test_disaggregated_broadcast(benchmark, size, mode):
    import socket

    world = torch.cuda.device_count()
    specs, tied = qwen3_specs(size)
    plan = _plan(specs, tied, BROADCAST_BUCKET_MIB)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    commands = [ctx.Queue() for _ in range(world)]
    results = ctx.Queue()
    procs = [ctx.Process(target=_broadcast_rank, args=(r, world, port, specs, tied, commands[r], results),
                         daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()
    command = "sync" if mode.startswith("redline") else "nccl"

    def one_round():
        for queue in commands:
            queue.put(command)
        return max(results.get(timeout=TIMEOUT_S)[1] for _ in range(world))

    try:
        one_round()  # warm-up: NCCL communicator setup, allocations
        benchmark.group = f"disaggregated Qwen3-{size} ({plan.nbytes / 1e9:.2f} GB) to {world - 1} GPUs"
        benchmark.extra_info.update(provider=mode, baseline=mode.endswith("(reference)"), gpus=world,
                                    **_info(plan, BROADCAST_BUCKET_MIB))
        seconds = [0.0]

        def timed():
            seconds[0] = one_round()

        benchmark.pedantic(timed, rounds=ROUNDS, iterations=1)
        benchmark.extra_info["last_round_gbps"] = plan.nbytes / seconds[0] / 1e9
    finally:
        for queue in commands:
            queue.put("stop")
        for proc in procs:
            proc.join(TIMEOUT_S)
