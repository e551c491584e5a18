"""Weight sync: redline's colocated modes side by side against one HBM copy of the same bytes (issue 6).

Per Qwen3 shape (0.6B, 1.7B, 4B, 8B; random bf16 weights, HF names from transformers' Qwen3 on the meta
device) and bucket size (64 MiB - 2 GiB), into an engine process on the same GPU that owns the weights as
``{hf_name: tensor}`` (``redline.sync.receiver.target_process``; it loads with the fused copy + checksum kernel,
as the embedded engine's receiver does):

* baseline ``one D2D copy``: the trainer's tensors copied straight into the engine's tensors (opened over
  CUDA IPC) in one multi-tensor copy: the floor of any colocated sync;
* ``redline pipelined``: persistent ping-pong staging slots, pack k+1 while the engine loads k, checksums on
  both sides fused into the pack and load copies (two copies of the bytes: 2x the floor at best);
* ``redline zero-copy``: the trainer's parameters live in flat bucket storage, mapped once by the engine; one
  copy (the engine's load, checksummed in the same pass) plus the sender's checksum read: full (every row,
  ~1.5x the floor) or sampled (every 16th row, ~1.03x);
* ``slime-style sequential``: 512 MiB, a new ``torch.cat`` buffer per bucket, one handle per bucket opened and
  closed per bucket, the engine synchronizes before replying, ``ipc_collect`` + ``empty_cache`` per bucket, no
  overlap;
* ``per-tensor IPC``: a clone and a handle per tensor, one round trip each (OpenRLHF-style).

Stage lines: pack only (``_foreach_copy_``), fused pack + checksum, checksum only (trainer side). Memory: device
memory of the whole GPU over 100 consecutive syncs of each redline mode (must stay flat). Trainer pause/resume
of params + grads in ``PausableMemory``, with the first (pinning) cycle timed apart from the steady state.

Colocated transition (8B): the embedded engine (``redline.rollout.embedded.engine.EmbeddedEngine``, random
weights) in its own process, receiving over the redline protocol into its fused parameters, and
``redline.sync.colocate.colocated_step`` timing every phase: train-state pause -> engine resumes weights ->
sync -> engine resumes KV cache -> generate -> engine releases -> trainer resumes; reported against the same
sync alone (target: transition <= 2x sync-only).

SGLang (marked ``sglang``): a live server (dummy weights of a Qwen3 shape) fed slime's way, one
``/update_weights_from_tensor`` ``flattened_bucket`` payload per 512 MiB bucket; our side (flatten + serialize)
and the server's round trip are timed apart, with a 1-tensor update as the control-path floor, so the share of
time SGLang's own handling takes is named.

Multi-GPU (``-m multigpu``, 2 or 4 GPUs): disaggregated broadcast to N-1 receivers and a plain NCCL broadcast of
the same bytes in the same chunks, measured alternately by the same processes; the redline row records the
fraction of NCCL's bandwidth it reaches (target >= 0.8). A third mode runs redline's sync over a second group whose
NCCL stream has normal priority (``init_weight_update_group(high_priority=False)``), to show what the default's
high-priority stream buys.
"""

import asyncio
import functools
import gc
import multiprocessing as mp
import statistics
import threading
import time
import traceback

import pytest
import torch

from redline.ports import free_port
from redline.sync.bucket_copy import BucketCopier
from redline.sync.checksum import bucket_checksum, new_accumulator
from redline.sync.plan import BucketLayout, MiB, TensorSpec, WeightPlan, plan_buckets
from redline.sync.protocol import WeightSender, layout_spans
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
SAMPLED_ROW_STRIDE = 16
ROUNDS, WARMUP = 5, 1
TIMEOUT_S = 600.0
DEVICE, TRANSPORT = "cuda", "cuda-ipc"


def qwen3_config(size: str):
    from transformers import Qwen3Config

    hidden, layers, heads, kv_heads, ffn, tied = QWEN3[size]
    return Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=128, intermediate_size=ffn, vocab_size=151936,
                       tie_word_embeddings=tied, torch_dtype=torch.bfloat16, eos_token_id=None, bos_token_id=None,
                       pad_token_id=0, architectures=["Qwen3ForCausalLM"])


def qwen3_specs(size: str) -> tuple[list[TensorSpec], bool]:
    """HF export specs of a Qwen3 shape (names and shapes from transformers' own model class)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen3_config(size))
    return [TensorSpec(n, tuple(p.shape), torch.bfloat16) for n, p in model.named_parameters()], QWEN3[size][5]


class Engine:
    """The stand-in engine process of one model shape, plus the trainer's handles to its weights."""

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


class StandIn:
    """A shape's stand-in engine, started when first asked for; the big tests (transition, SGLang) stop it to
    have the GPU's memory, and a later test of the shape starts it again."""

    running: list = []  # noqa: RUF012 - one registry for the whole module

    def __init__(self, specs):
        self.specs, self._engine = specs, None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            StandIn.stop_all()
            self._engine = Engine(self.specs)
            StandIn.running.append(self)
        return self._engine

    def stop(self):
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self in StandIn.running:
            StandIn.running.remove(self)

    @classmethod
    def stop_all(cls):
        for stand_in in list(cls.running):
            stand_in.stop()
        torch.cuda.empty_cache()


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
    stand_in = StandIn(specs)
    yield request.param, specs, tied, stand_in
    stand_in.stop()


def _plan(specs, tied, bucket_mib):
    return plan_buckets(specs, bucket_mib * MiB, tie_word_embeddings=tied)


def _group(size, plan):
    return f"weight sync Qwen3-{size} ({plan.nbytes / 1e9:.2f} GB bf16)"


def _info(plan, bucket_mib):
    return dict(model_bytes=plan.nbytes, bucket_mib=bucket_mib, buckets=len(plan.buckets),
                tensors=sum(len(b.tensors) for b in plan.buckets))


def test_reference_one_copy(gpu_bench, model):
    size, specs, tied, stand_in = model
    engine = stand_in.engine
    plan = _plan(specs, tied, 512)
    trainer = Trainer(specs, plan)
    dsts = [engine.weights[n] for n, _ in trainer.export]
    srcs = [t for _, t in trainer.export]
    gpu_bench(lambda: torch._foreach_copy_(dsts, srcs), group=_group(size, plan),
              provider="one D2D copy into the engine's tensors (reference)", baseline=True, rounds=ROUNDS,
              warmup=WARMUP, bytes_moved=2 * plan.nbytes, **_info(plan, 512))


@pytest.mark.parametrize("bucket_mib", BUCKET_MIB)
def test_redline_pipelined(gpu_bench, model, bucket_mib):
    size, specs, tied, stand_in = model
    engine = stand_in.engine
    plan = _plan(specs, tied, bucket_mib)
    trainer = Trainer(specs, plan)
    sender = engine.sender(plan, num_slots=2)
    gpu_bench(lambda: sender.sync(trainer.export), group=_group(size, plan),
              provider=f"redline pipelined, {bucket_mib} MiB x2", rounds=ROUNDS, warmup=WARMUP,
              **_info(plan, bucket_mib))
    _assert_engine_has(engine, trainer)
    sender.release()


@pytest.mark.parametrize("bucket_mib", [512, 2048])
def test_redline_zero_copy(gpu_bench, model, bucket_mib):
    size, specs, tied, stand_in = model
    engine = stand_in.engine
    plan = _plan(specs, tied, bucket_mib)
    trainer = Trainer(specs, plan)
    sender = engine.sender(plan)
    gpu_bench(lambda: sender.sync_flat(trainer.flats), group=_group(size, plan),
              provider=f"redline zero-copy, {bucket_mib} MiB", rounds=ROUNDS, warmup=WARMUP,
              **_info(plan, bucket_mib))
    _assert_engine_has(engine, trainer)
    sender.release()


@pytest.mark.parametrize("bucket_mib", [512, 2048])
@pytest.mark.parametrize("mode", ["pipelined", "zero-copy"])
def test_redline_sampled_checksum(gpu_bench, model, mode, bucket_mib):
    """The same modes with checksums over every 16th row (and each bucket's last): what the checks cost, read
    off side by side. Pipelined reads every byte anyway, so only zero-copy should gain."""
    size, specs, tied, stand_in = model
    engine = stand_in.engine
    plan = _plan(specs, tied, bucket_mib)
    trainer = Trainer(specs, plan)
    sender = engine.sender(plan, checksum_row_stride=SAMPLED_ROW_STRIDE)
    run = (lambda: sender.sync(trainer.export)) if mode == "pipelined" else (lambda: sender.sync_flat(trainer.flats))
    gpu_bench(run, group=_group(size, plan),
              provider=f"redline {mode}, {bucket_mib} MiB, checksum 1/{SAMPLED_ROW_STRIDE} rows", rounds=ROUNDS,
              warmup=WARMUP, **_info(plan, bucket_mib))
    _assert_engine_has(engine, trainer)
    sender.release()


def _one_at_a_time(engine, plan, trainer, make_buffer):
    """Each bucket of ``plan`` in its own fresh buffer and its own session: export, open, load, device sync,
    reply, unmap, then free + ipc_collect + empty_cache before the next (slime's loop; per-tensor IPC with
    1-tensor plans)."""
    senders = [engine.sender(WeightPlan((BucketLayout(0, bucket.dtype, bucket.tensors),), plan.aliases))
               for bucket in plan.buckets]
    tensors = dict(trainer.export)

    def run():
        for bucket, sender in zip(plan.buckets, senders):
            buffer = make_buffer([tensors[n] for n in bucket.names])
            sender.sync_flat([buffer], keep_mapped=False)
            del buffer
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()

    return run, senders


def test_slime_style_sequential(gpu_bench, model):
    size, specs, tied, stand_in = model
    engine = stand_in.engine
    plan = _plan(specs, tied, SLIME_BUCKET_MIB)
    trainer = Trainer(specs, plan)
    flatten = lambda ts: torch.cat([t.flatten().view(torch.uint8) for t in ts])  # FlattenedTensorBucket's cat
    run, senders = _one_at_a_time(engine, plan, trainer, flatten)
    gpu_bench(run, group=_group(size, plan),
              provider=f"slime-style sequential, {SLIME_BUCKET_MIB} MiB, new buffer per bucket", rounds=ROUNDS,
              warmup=WARMUP, **_info(plan, SLIME_BUCKET_MIB))
    _assert_engine_has(engine, trainer)
    for sender in senders:
        sender.release()


def test_per_tensor_ipc(gpu_bench, model):
    size, specs, tied, stand_in = model
    engine = stand_in.engine
    plan = plan_buckets(specs, 1, tie_word_embeddings=tied, group_of=lambda name: name)  # one tensor per bucket
    trainer = Trainer(specs, plan)
    clone = lambda ts: ts[0].clone().flatten().view(torch.uint8)
    run, senders = _one_at_a_time(engine, plan, trainer, clone)
    gpu_bench(run, group=_group(size, plan), provider="per-tensor IPC (clone + handle + round trip per tensor)",
              rounds=3, warmup=1, **_info(plan, 0))
    _assert_engine_has(engine, trainer)
    for sender in senders:
        sender.release()


def _pack_stage(model):
    """What the pack stages measure: the model's 512 MiB plan, one staging buffer, the export by name."""
    size, specs, tied, _ = model
    plan = _plan(specs, tied, 512)
    staging = torch.empty(plan.capacity, dtype=torch.uint8, device=DEVICE)
    return size, plan, staging, dict(Trainer(specs, plan).export)


def test_stage_pack(gpu_bench, model):
    """Trainer side alone: packing every bucket into one staging buffer (what the pipelined mode overlaps)."""
    size, plan, staging, tensors = _pack_stage(model)

    def pack():
        for bucket in plan.buckets:
            torch._foreach_copy_([m.view(staging) for m in bucket.tensors], [tensors[n] for n in bucket.names])

    gpu_bench(pack, group=_group(size, plan), provider="stage: pack only (_foreach_copy_), 512 MiB", rounds=ROUNDS,
              warmup=WARMUP, **_info(plan, 512))


def test_stage_fused_pack(gpu_bench, model):
    """Trainer side alone: the pipelined sender's pack, which also computes every bucket's full checksum."""
    size, plan, staging, tensors = _pack_stage(model)
    copier = BucketCopier()
    acc = new_accumulator(len(plan.buckets), DEVICE)

    def pack():
        for bucket in plan.buckets:
            copier.pack(staging, bucket.nbytes, layout_spans(bucket), [tensors[n] for n in bucket.names],
                        acc[bucket.index])

    gpu_bench(pack, group=_group(size, plan), provider="stage: fused pack + checksum, 512 MiB", rounds=ROUNDS,
              warmup=WARMUP, **_info(plan, 512))


def test_stage_checksum(gpu_bench, model):
    """One side's checksums over all the model's bytes, as a separate pass (what fusing saves)."""
    size, specs, tied, _ = model
    plan = _plan(specs, tied, 512)
    trainer = Trainer(specs, plan)
    gpu_bench(lambda: [bucket_checksum(f, b.nbytes) for b, f in zip(plan.buckets, trainer.flats)],
              group=_group(size, plan), provider="stage: checksum only, separate pass (one side)", rounds=ROUNDS,
              warmup=WARMUP, **_info(plan, 512))


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device_used():
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


@pytest.mark.parametrize("mode", ["pipelined", "zero-copy"])
def test_memory_flat_over_100_syncs(benchmark, model, mode):
    """Device memory of the whole GPU (trainer and engine processes) after syncs 1, 10, 50 and 100, after three
    warm-up syncs (staging slots, mappings, kernel tables): it must not grow."""
    size, specs, tied, stand_in = model
    if size != "1.7B":
        pytest.skip("measured on one shape (1.7B) to keep the suite short")
    engine = stand_in.engine
    plan = _plan(specs, tied, 512)
    trainer = Trainer(specs, plan)
    sender = engine.sender(plan)
    sync = (lambda: sender.sync(trainer.export)) if mode == "pipelined" else (lambda: sender.sync_flat(trainer.flats))
    for _ in range(3):
        sync()
    used = {"before": _device_used()}

    def hundred():
        for i in range(1, 101):
            sync()
            if i in (1, 10, 50, 100):
                used[f"after_{i}"] = _device_used()

    benchmark.pedantic(hundred, rounds=1, iterations=1)
    growth = used["after_100"] - used["before"]
    benchmark.group = f"memory over 100 syncs Qwen3-{size}"
    benchmark.extra_info.update(provider=f"redline {mode}, 512 MiB", growth_bytes=growth, syncs=100,
                                **{f"device_used_{k}": v for k, v in used.items()}, **_info(plan, 512))
    _assert_engine_has(engine, trainer)
    sender.release()
    assert growth <= 2 * MiB, f"device memory grew by {growth} bytes over 100 syncs: {used}"


@pytest.mark.parametrize("keep_contents", [True, False])
def test_trainer_pause_resume(gpu_bench, benchmark, model, keep_contents):
    """Params + grads (2x the model bytes) in PausableMemory: pause then resume, and the residual device memory
    of the whole GPU while paused (engine weights included; the engine stand-in does not release). The first
    cycle with contents pins the host buffers (timed apart); later cycles reuse them."""
    from redline.sync.memory import PausableMemory

    size, specs, _, stand_in = model
    stand_in.engine  # noqa: B018 - the engine's weights are part of the residual memory measured
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

    start = time.perf_counter()
    cycle()
    first = time.perf_counter() - start
    pinned = memory.stats()["host_allocations"]
    gpu_bench(cycle, group=f"trainer pause+resume Qwen3-{size} params+grads ({nbytes / 1e9:.1f} GB)",
              provider=f"PausableMemory {'keep contents (pinned host)' if keep_contents else 'discard'}",
              baseline=keep_contents, rounds=3, warmup=0, state_bytes=nbytes)
    residual["first_cycle_s"] = first
    residual["host_buffers_made_after_first_cycle"] = memory.stats()["host_allocations"] - pinned
    if keep_contents:
        residual["host_copy_gbps"] = 2 * nbytes / benchmark.stats.stats.median / 1e9  # D2H + H2D bytes / s
    benchmark.extra_info.update(residual)  # gpu_bench records into this same benchmark
    torch.cuda.synchronize()
    del state
    memory.release_host_memory()
    del memory  # a live pool keeps its blocks through empty_cache (and the next pause would pause them too)
    gc.collect()
    torch.cuda.empty_cache()
    assert residual["pool_mapped_while_paused"] == 0
    assert residual["host_buffers_made_after_first_cycle"] == 0


def _assert_engine_has(engine, trainer):
    """The benchmark's last sync left the trainer's exact bytes in the engine (a fast mode must be a correct one)."""
    torch.cuda.synchronize()
    for name, tensor in trainer.export:
        assert torch.equal(engine.weights[name], tensor), name


# -- colocated transition with the embedded engine in its own process ----------------------------------------
TRANSITION_SIZES = ["8B"]
ENGINE_ALLOCATORS = ["default", "expandable", "flat"]
TRANSITION_BUCKET_MIB = {"zero-copy": 2048, "pipelined": 512}
GEN_BATCH, GEN_PROMPT, GEN_NEW = 8, 32, 16
TRANSITION_ROUNDS = 3


def _name_checksums(named_tensors) -> dict[str, list[int]]:
    return {n: bucket_checksum(t.reshape(-1).view(torch.uint8), t.numel() * t.element_size()).tolist()
            for n, t in named_tensors}


def _embedded_engine_process(sync_conn, control_conn, size, allocator):
    """The embedded engine with random weights of a Qwen3 shape; a thread serves the redline sync protocol into
    its parameters (their HF slices; released weights are allocated bucket by bucket as they arrive), the main
    loop answers the colocated step's engine calls. ``allocator``: PyTorch's caching allocator as configured
    by default (release = cudaFree, resume = cudaMalloc, one per parameter storage), with
    ``expandable_segments`` (pages unmapped and mapped through the driver's virtual memory calls), or ``flat``:
    the default allocator with the engine's parameters in one storage (``flat_weights``: one cudaFree, one
    cudaMalloc)."""
    try:
        if allocator == "expandable":
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        from redline.rollout.embedded.engine import EmbeddedEngine
        from redline.sync.receiver import TargetLoader, receive_forever
        from redline.trainer.models import from_config

        model = from_config(qwen3_config(size), dtype=torch.bfloat16, device=DEVICE, seed=0)
        engine = EmbeddedEngine(model, None, max_batch_size=GEN_BATCH, max_seq_len=GEN_PROMPT + GEN_NEW,
                                eos_token_ids=(), flat_weights=allocator == "flat")
        targets = {name: tensor.narrow(0, offset, rows)
                   for name, (tensor, offset, rows) in engine.weights.slices.items()}
        loader = TargetLoader(targets, prepare=engine.weights.resume)
        threading.Thread(target=receive_forever, args=(sync_conn, make_transport(TRANSPORT), loader),
                         daemon=True).start()
    except Exception:  # noqa: BLE001 - reported to the benchmark, which raises it
        control_conn.send(("error", traceback.format_exc()))
        return
    control_conn.send(("ok", None))

    async def serve():
        while True:
            command, arg = await asyncio.to_thread(control_conn.recv)
            if command == "stop":
                return
            try:
                value = None
                if command == "release":
                    await engine.release_memory(arg)
                elif command == "resume":
                    await engine.resume_memory(arg)
                elif command == "generate":
                    value = [len(r.output_ids) for r in await engine.generate(arg)]
                elif command == "checksums":
                    value = _name_checksums(targets.items())
                _synchronize()  # the phase's device work is charged to the phase
                control_conn.send(("ok", value))
            except Exception:  # noqa: BLE001 - reported to the benchmark, which raises it
                control_conn.send(("error", traceback.format_exc()))

    asyncio.run(serve())
    asyncio.run(engine.shutdown())


class EmbeddedEngineProcess:
    """The trainer's handle on ``_embedded_engine_process``: the ``Engine`` calls the colocated step makes, and
    a sync channel for ``WeightSender``."""

    def __init__(self, size, allocator):
        ctx = mp.get_context("spawn")
        self.sync_conn, sync_child = ctx.Pipe()
        self.control, control_child = ctx.Pipe()
        self.proc = ctx.Process(target=_embedded_engine_process, args=(sync_child, control_child, size, allocator),
                                daemon=True)
        self.proc.start()
        sync_child.close()
        control_child.close()
        self._expect()

    def _expect(self):
        if not self.control.poll(TIMEOUT_S):
            raise RuntimeError("the embedded engine process did not answer")
        status, value = self.control.recv()
        if status != "ok":
            raise RuntimeError(f"the embedded engine process failed:\n{value}")
        return value

    def call(self, command, arg=None):
        self.control.send((command, arg))
        return self._expect()

    async def release_memory(self, tags):
        self.call("release", set(tags))

    async def resume_memory(self, tags):
        self.call("resume", set(tags))

    async def generate(self, requests):
        return self.call("generate", requests)

    def close(self):
        self.sync_conn.send(("close", 0, {}))
        self.control.send(("stop", None))
        self.proc.join(TIMEOUT_S)


class TrainState:
    """The trainer's state that colocation pauses (gradients / optimizer state stand-in: 2x the model bytes in
    PausableMemory, one tensor per parameter and kind): ``discard`` (released, contents dropped), ``keep``
    (contents kept in pinned host memory) or ``none`` (no state: the transition's engine-side floor)."""

    def __init__(self, specs, kind: str):
        from redline.sync.memory import PausableMemory

        self.kind, self.memory, self.tensors = kind, None, []
        if kind != "none":
            self.memory = PausableMemory()
            with self.memory.region():
                self.tensors = [torch.zeros(s.shape, dtype=s.dtype, device=DEVICE) for s in specs for _ in range(2)]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)

    def pause(self):
        if self.memory is not None:
            self.memory.pause(keep_contents=self.kind == "keep")

    def resume(self):
        if self.memory is not None:
            self.memory.resume()

    def free(self):
        torch.cuda.synchronize()
        self.tensors = []
        if self.memory is not None:
            self.memory.release_host_memory()
            self.memory = None  # the pool goes with its last tensor
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="class", params=[(s, a) for s in TRANSITION_SIZES for a in ENGINE_ALLOCATORS],
                ids=[f"{s}-{a}" for s in TRANSITION_SIZES for a in ENGINE_ALLOCATORS])
def colocated(request):
    StandIn.stop_all()  # the GPU's memory goes to the embedded engine, the trainer and its paused state
    size, allocator = request.param
    specs, tied = qwen3_specs(size)
    engine = EmbeddedEngineProcess(size, allocator)
    yield size, allocator, specs, tied, engine
    engine.close()
    torch.cuda.empty_cache()


def colocated_transition(benchmark, colocated, mode, train_state):
    """One colocated step per round, every phase timed; ``transition`` (all but train and generate) against
    the same sync run alone into the same engine process."""
    from redline.rollout.types import GenerateRequest, SamplingParams
    from redline.sync.colocate import PHASES, colocated_step

    size, allocator, specs, tied, engine = colocated
    gc.collect()
    torch.cuda.empty_cache()  # earlier tests' cached blocks would starve the engine
    bucket_mib = TRANSITION_BUCKET_MIB[mode]
    plan = _plan(specs, tied, bucket_mib)
    trainer = Trainer(specs, plan)
    sender = WeightSender(engine.sync_conn, make_transport(TRANSPORT), plan, timeout=TIMEOUT_S,
                          alive=engine.proc.is_alive)
    sync = (lambda: sender.sync(trainer.export)) if mode == "pipelined" else (lambda: sender.sync_flat(trainer.flats))
    state = TrainState(specs, train_state)
    requests = [GenerateRequest([1 + (i * 7 + j) % 1000 for j in range(GEN_PROMPT)],
                                SamplingParams(temperature=0.0, max_new_tokens=GEN_NEW)) for i in range(GEN_BATCH)]
    loop = asyncio.new_event_loop()

    def sync_only():
        _synchronize()
        start = time.perf_counter()
        sync()
        _synchronize()
        return time.perf_counter() - start

    def step():
        def train():
            for t in state.tensors[::97]:  # the optimizer step writes the state (a stand-in touch)
                t.add_(1)

        async def generate():
            return await engine.generate(requests)

        _, generated, report = loop.run_until_complete(colocated_step(
            train=train, trainer_memory=state, engine=engine, sync=sync, generate=generate))
        assert generated == [GEN_NEW] * GEN_BATCH
        return report

    try:
        for _ in range(3):
            sync_only()  # warm-up: staging, mappings, kernels
        sync_alone = statistics.median(sync_only() for _ in range(ROUNDS))
        loop.run_until_complete(engine.release_memory({"weights", "kv_cache"}))  # colocated_step's entry state
        reports = [step()]  # warm-up: pins the host buffers (keep), captures the engine's CUDA graph
        benchmark.pedantic(lambda: reports.append(step()), rounds=TRANSITION_ROUNDS, iterations=1)
        loop.run_until_complete(engine.resume_memory({"weights", "kv_cache"}))  # resumed weights are undefined:
        sync()  # sync once more, then check what the engine holds
        assert engine.call("checksums") == _name_checksums(trainer.export)
        timed = reports[1:]
        phases = {p: statistics.median(r.seconds[p] for r in timed) for p in PHASES}
        transition = statistics.median(r.transition for r in timed)
        benchmark.group = f"colocated transition Qwen3-{size} ({plan.nbytes / 1e9:.2f} GB), embedded engine process"
        benchmark.extra_info.update(
            provider=f"{mode} {bucket_mib} MiB, train state {train_state} ({state.nbytes / 1e9:.1f} GB), engine "
                     f"allocator {allocator}",
            sync_only_s=sync_alone, transition_s=transition, transition_over_sync=transition / sync_alone,
            meets_2x_target=transition <= 2 * sync_alone, first_step_phases_s=reports[0].seconds,
            paused_device_used_bytes=timed[-1].paused_device_used_bytes,
            **{f"phase_{p}_s": s for p, s in phases.items()}, **_info(plan, bucket_mib))
        print(f"\n{benchmark.group} [{benchmark.extra_info['provider']}]: transition {transition * 1e3:.1f} ms = "
              f"{transition / sync_alone:.2f}x sync-only {sync_alone * 1e3:.1f} ms; phases (ms) "
              + ", ".join(f"{p} {s * 1e3:.1f}" for p, s in phases.items()))
    finally:
        loop.close()
        sender.release()
        state.free()


class TestColocatedTransition:
    """Class scope: the embedded engine process (and its GPU memory) lives for these tests only."""

    @pytest.mark.parametrize(("mode", "train_state"), [("zero-copy", "none"), ("zero-copy", "discard"),
                                                        ("zero-copy", "keep"), ("pipelined", "discard")])
    def test_colocated_transition(self, benchmark, colocated, mode, train_state):
        colocated_transition(benchmark, colocated, mode, train_state)


# -- SGLang as the receiver --------------------------------------------------------------------------------
SGLANG_SIZES = ["0.6B", "1.7B"]
SGLANG_ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16", "--mem-fraction-static",
               "0.3", "--disable-cuda-graph"]


@pytest.fixture(scope="class", params=SGLANG_SIZES, ids=[f"sglang_qwen3_{s.replace('.', '_')}" for s in SGLANG_SIZES])
def sglang_server(request, tmp_path_factory):
    from redline.rollout.sglang.server import launch_server

    StandIn.stop_all()
    size = request.param
    path = tmp_path_factory.mktemp(f"qwen3-{size}-config")
    qwen3_config(size).save_pretrained(path)  # config only: the server makes dummy weights
    server = launch_server(path, enable_memory_saver=False, extra_args=SGLANG_ARGS, log_dir=path / "logs")
    yield size, server
    server.stop()


def _sglang_group(size, plan):
    return f"SGLang receiver Qwen3-{size} ({plan.nbytes / 1e9:.2f} GB), {SLIME_BUCKET_MIB} MiB buckets"


def sglang_reference_one_copy(gpu_bench, sglang_server):
    size, _ = sglang_server
    specs, tied = qwen3_specs(size)
    plan = _plan(specs, tied, SLIME_BUCKET_MIB)
    trainer = Trainer(specs, plan)
    copies = [torch.empty_like(f) for f in trainer.flats]
    gpu_bench(lambda: torch._foreach_copy_(copies, trainer.flats), group=_sglang_group(size, plan),
              provider="one D2D copy of the bytes (reference)", baseline=True, rounds=ROUNDS, warmup=WARMUP,
              **_info(plan, SLIME_BUCKET_MIB))


def sglang_receiver(benchmark, sglang_server):
    """slime's colocated path into a live server: per bucket, FlattenedTensorBucket (a new buffer) + serialize
    (ours), then POST /update_weights_from_tensor (the server's: HTTP, scheduler, unpickle, IPC open, load, its
    synchronisation), ipc_collect; end: flush. SGLang's share = server round trips / total; the control floor
    is a 1-tensor update's round trip, so (round trips - buckets x floor) / total is its load's share."""
    from redline.rollout.sglang.client import SGLangClient
    from redline.rollout.sglang.payload import serialize_bucket
    from redline.rollout.sglang.weight_check import compare_checksums, expected_checksums

    size, server = sglang_server
    specs, tied = qwen3_specs(size)
    plan = _plan(specs, tied, SLIME_BUCKET_MIB)
    trainer = Trainer(specs, plan)
    tensors = dict(trainer.export)
    client = SGLangClient(server.url)
    loop = asyncio.new_event_loop()
    times = {"ours": [], "server": [], "finalize": []}

    def post(named, version):
        start = time.perf_counter()
        payload = serialize_bucket(named)
        torch.cuda.synchronize()
        packed = time.perf_counter()
        loop.run_until_complete(client.update_weights_from_tensor(payload.per_rank, payload.load_format, version))
        del payload
        torch.cuda.ipc_collect()
        return packed - start, time.perf_counter() - packed

    def one_sync(version="1"):
        ours = server_side = 0.0
        loop.run_until_complete(client.begin_weight_update())
        for bucket in plan.buckets:
            a, b = post([(n, tensors[n]) for n in bucket.names], version)
            ours, server_side = ours + a, server_side + b
        start = time.perf_counter()
        loop.run_until_complete(client.end_weight_update())
        times["ours"].append(ours)
        times["server"].append(server_side)
        times["finalize"].append(time.perf_counter() - start)

    try:
        one_sync()  # warm-up
        for values in times.values():
            values.clear()
        benchmark.pedantic(one_sync, rounds=3, iterations=1)
        loop.run_until_complete(client.begin_weight_update())
        floor = statistics.median(post([("model.norm.weight", tensors["model.norm.weight"])], "1")[1]
                                  for _ in range(10))
        loop.run_until_complete(client.end_weight_update())
        total = benchmark.stats.stats.median
        ours, server_side = statistics.median(times["ours"]), statistics.median(times["server"])
        load_only = server_side - len(plan.buckets) * floor
        benchmark.group = _sglang_group(size, plan)
        benchmark.extra_info.update(
            provider="slime-style into SGLang (flatten + serialize, POST per bucket, flush)",
            ours_s=ours, server_round_trips_s=server_side, finalize_s=statistics.median(times["finalize"]),
            control_floor_per_bucket_s=floor, sglang_share=server_side / total,
            sglang_load_share_beyond_control=load_only / total, **_info(plan, SLIME_BUCKET_MIB))
        print(f"\n{benchmark.group}: total {total * 1e3:.1f} ms; ours {ours * 1e3:.1f} ms; server round trips "
              f"{server_side * 1e3:.1f} ms ({server_side / total:.0%}); control floor {floor * 1e3:.2f} ms/bucket; "
              f"SGLang load beyond control {load_only / total:.0%}")
        # checked after the timings are recorded, so a mismatch fails the benchmark without losing its numbers
        # (SGLang's /get_weights_by_name does not serve Qwen models; /weights_checker hashes every parameter)
        start = time.perf_counter()
        try:
            compare_checksums(expected_checksums(tensors.items()),
                              loop.run_until_complete(client.weight_checksums()), server.url)
        except Exception as error:  # the server's side of it (at 0.6B it once dropped the connection)
            tail = server.log.read_text(errors="replace")[-4000:] if server.log.exists() else "(no log)"
            raise AssertionError(f"the weights check failed: {error!r}\nserver log {server.log}:\n{tail}") from error
        benchmark.extra_info["weights_check_s"] = time.perf_counter() - start  # what WeightSync adds per push
    finally:
        loop.run_until_complete(client.close())
        loop.close()


@pytest.mark.sglang
class TestSGLangReceiver:
    """Class scope: the SGLang server lives for these tests only."""

    def test_reference_one_copy(self, gpu_bench, sglang_server):
        sglang_reference_one_copy(gpu_bench, sglang_server)

    def test_sglang_receiver(self, benchmark, sglang_server):
        sglang_receiver(benchmark, sglang_server)


# -- disaggregated: 2x / 4x GPUs -------------------------------------------------------------------------------
BROADCAST_SIZES = ["1.7B", "8B"]
BROADCAST_BUCKET_MIB = 512


def _broadcast_rank(rank, world, ports, specs, tied, commands, results):
    """One GPU of the weight-update group: rank 0 is the trainer, the others engine GPUs owning the weights.
    Sender / receiver objects live for all rounds (their buffers are allocated once)."""
    import torch.distributed as dist

    from redline.sync.broadcast import BroadcastReceiver, BroadcastSender, init_weight_update_group
    from redline.sync.receiver import TargetLoader

    try:
        on_gpu = DEVICE == "cuda"
        if on_gpu:
            torch.cuda.set_device(rank)
        device = torch.device("cuda", rank) if on_gpu else torch.device(DEVICE)
        plan = _plan(specs, tied, BROADCAST_BUCKET_MIB)
        trainer = Trainer(specs, plan) if rank == 0 else None
        loader = None if rank == 0 else TargetLoader({s.name: torch.empty(s.shape, dtype=s.dtype, device=device)
                                                      for s in specs})
        groups, runs = {}, {}
        for high_priority, port in zip((True, False), ports):  # the default, and NCCL at normal priority
            group = init_weight_update_group("127.0.0.1", port, rank, world,
                                             f"redline-bench-pp0-{high_priority}",
                                             backend="nccl" if on_gpu else "gloo", high_priority=high_priority)
            groups[high_priority] = group
            if rank == 0:
                runs[high_priority] = functools.partial(BroadcastSender(group, plan, device).sync, trainer.export)
            else:
                runs[high_priority] = functools.partial(BroadcastReceiver(group, plan, device).sync, loader)
        raw = torch.empty(plan.capacity, dtype=torch.uint8, device=device)

        def nccl_only():  # the same bytes in the same chunks, no packing, loading or checks
            for bucket in plan.buckets:
                dist.broadcast(raw[:bucket.nbytes], group_src=0, group=groups[False])

        commands_to_runs = {"sync": runs[True], "sync-normal-priority": runs[False], "nccl": nccl_only}
        while (command := commands.get()) != "stop":
            _synchronize()
            start = time.perf_counter()
            commands_to_runs[command]()
            _synchronize()
            results.put((rank, time.perf_counter() - start))
    except Exception:  # noqa: BLE001 - reported to the benchmark, which raises it
        results.put((rank, traceback.format_exc()))


@pytest.fixture(scope="module", params=BROADCAST_SIZES)
def broadcast_group(request):
    """One process per visible GPU, joined in two weight-update groups (NCCL stream at high and at normal
    priority), kept for every mode of a shape."""
    world = torch.cuda.device_count()
    size = request.param
    specs, tied = qwen3_specs(size)
    ports = (free_port(), free_port())  # one rendezvous per weight-update group
    ctx = mp.get_context("spawn")
    commands = [ctx.Queue() for _ in range(world)]
    results = ctx.Queue()
    procs = [ctx.Process(target=_broadcast_rank, args=(r, world, ports, specs, tied, commands[r], results),
                         daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()

    def one_round(command):
        for queue in commands:
            queue.put(command)
        answers = [results.get(timeout=TIMEOUT_S)[1] for _ in range(world)]
        failed = [a for a in answers if isinstance(a, str)]
        if failed:
            raise RuntimeError(f"a rank failed:\n{failed[0]}")
        return max(answers)

    for command in ("nccl", "sync", "sync-normal-priority"):  # warm-up: communicators, buffers, kernels
        one_round(command)
    yield size, _plan(specs, tied, BROADCAST_BUCKET_MIB), world, one_round
    for queue in commands:
        queue.put("stop")
    for proc in procs:
        proc.join(TIMEOUT_S)


BROADCAST_MODES = {"nccl broadcast of the same bytes (reference)": "nccl",
                   "redline broadcast sync": "sync",
                   "redline broadcast sync, NCCL stream at normal priority": "sync-normal-priority"}


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", BROADCAST_MODES)
def test_disaggregated_broadcast(benchmark, broadcast_group, mode):
    size, plan, world, one_round = broadcast_group
    command = BROADCAST_MODES[mode]
    seconds = []
    benchmark.pedantic(lambda: seconds.append(one_round(command)), rounds=ROUNDS, iterations=1)
    benchmark.group = f"disaggregated Qwen3-{size} ({plan.nbytes / 1e9:.2f} GB) to {world - 1} GPUs"
    info = dict(provider=mode, baseline=command == "nccl", gpus=world,
                gbps=plan.nbytes / statistics.median(seconds) / 1e9, **_info(plan, BROADCAST_BUCKET_MIB))
    if command != "nccl":
        # the reference measured by the same processes, alternating with redline rounds
        nccl, ours = [], []
        for _ in range(ROUNDS):
            nccl.append(one_round("nccl"))
            ours.append(one_round(command))
        info.update(nccl_alternating_s=statistics.median(nccl), redline_alternating_s=statistics.median(ours),
                    fraction_of_nccl_bandwidth=statistics.median(nccl) / statistics.median(ours))
        print(f"\n{benchmark.group}: redline {statistics.median(ours) * 1e3:.1f} ms vs NCCL "
              f"{statistics.median(nccl) * 1e3:.1f} ms = {info['fraction_of_nccl_bandwidth']:.0%} of its bandwidth")
    benchmark.extra_info.update(info)
