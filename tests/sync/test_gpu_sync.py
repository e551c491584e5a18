"""CUDA IPC sync into an engine process on the same GPU, and pausable trainer memory (GPU only)."""

import multiprocessing as mp

import pytest
import torch
from sync_export import layer_bytes, qwen3_export

from redline.sync.memory import PausableMemory
from redline.sync.plan import plan_for
from redline.sync.protocol import WeightSender
from redline.sync.receiver import target_process
from redline.sync.transport import CudaIpcTransport

pytestmark = pytest.mark.gpu
TIMEOUT_S = 120.0
MiB = 1 << 20


def gpu_export(seed, num_layers=4):
    return [(n, t.cuda()) for n, t in qwen3_export(num_layers=num_layers, seed=seed)]


@pytest.fixture
def engine_process():
    """``(sender_conn, proc, engine_weights)``: an engine process whose weights the test can read over IPC."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    specs = [(n, tuple(t.shape), t.dtype) for n, t in qwen3_export(num_layers=4)]
    proc = ctx.Process(target=target_process, args=(child, specs, "cuda-ipc", True), daemon=True)
    proc.start()
    child.close()
    assert parent.poll(TIMEOUT_S), "the engine process did not start"
    weights = parent.recv()
    yield parent, proc, weights
    if proc.is_alive():
        parent.send(("close", 0, {}))
        proc.join(TIMEOUT_S)


@pytest.mark.parametrize("num_slots", [1, 2])
def test_ipc_sync_leaves_bit_exact_engine_weights_after_20_syncs(engine_process, num_slots):
    conn, proc, weights = engine_process
    plan = plan_for(gpu_export(0), bucket_bytes=layer_bytes())
    sender = WeightSender(conn, CudaIpcTransport(), plan, num_slots=num_slots, timeout=TIMEOUT_S,
                          alive=proc.is_alive)
    for step in range(20):
        export = gpu_export(step)
        sender.sync(export)
        for name, tensor in export:
            assert torch.equal(weights[name], tensor), (step, name)


def test_zero_copy_ipc_sync_reads_the_trainers_flat_storage(engine_process):
    conn, proc, weights = engine_process
    export = gpu_export(3)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    flats = [torch.empty(b.nbytes, dtype=torch.uint8, device="cuda") for b in plan.buckets]
    for bucket, flat in zip(plan.buckets, flats):
        for name, view in bucket.views(flat):
            view.copy_(dict(export)[name])
    WeightSender(conn, CudaIpcTransport(), plan, timeout=TIMEOUT_S, alive=proc.is_alive).sync_flat(flats)
    for name, tensor in export:
        assert torch.equal(weights[name], tensor), name


def test_pause_resume_keeps_contents_and_addresses():
    memory = PausableMemory()
    with memory.region():
        x = torch.randn(16 * MiB, device="cuda")  # 64 MiB
    expected, address = x.clone(), x.data_ptr()  # the clone lives outside the pool
    free_before = torch.cuda.mem_get_info()[0]
    memory.pause(keep_contents=True)
    assert memory.stats()["mapped_bytes"] == 0
    assert torch.cuda.mem_get_info()[0] - free_before >= 64 * MiB
    memory.resume()
    assert x.data_ptr() == address
    assert torch.equal(x, expected)


def test_pause_without_contents_frees_memory_and_resume_gives_usable_memory():
    memory = PausableMemory()
    with memory.region():
        x = torch.empty(16 * MiB, device="cuda")
    host_before = memory.stats()["host_backup_bytes"]  # buffers kept by earlier tests' pauses, if any
    memory.pause(keep_contents=False)
    assert memory.stats()["host_backup_bytes"] == host_before  # nothing pinned for a pause that drops contents
    memory.resume()
    x.fill_(3.0)
    assert torch.equal(x, torch.full_like(x, 3.0))


def test_training_state_survives_a_pause():
    """Parameters, gradients and AdamW state in the pool, paused and resumed between steps, end equal to a
    model trained outside the pool without pauses."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(256, 256, device="cuda")
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    memory = PausableMemory()
    with memory.region():
        model = torch.nn.Linear(256, 256, device="cuda")
        model.load_state_dict(reference.state_dict())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randn(32, 256, device="cuda")
    for _ in range(3):
        reference(batch).square().mean().backward()
        reference_opt.step()
        reference_opt.zero_grad()
        with memory.region():
            model(batch).square().mean().backward()
            opt.step()
            opt.zero_grad()
        memory.pause(keep_contents=True)
        memory.resume()
    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)


def test_fused_copy_kernel_matches_the_checksum_definition_on_the_gpu(cuda):
    from redline.sync.bucket_copy import BucketCopier
    from redline.sync.checksum import bucket_checksum, fold, new_accumulator

    export = gpu_export(7)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    slot = torch.empty(plan.capacity, dtype=torch.uint8, device=cuda)
    copier, tensors = BucketCopier("triton"), dict(export)
    for layout in plan.buckets:
        for row_stride in (1, 3):
            acc = new_accumulator(1, cuda)
            copier.pack(slot, layout.nbytes, [(t.start_idx, t.end_idx) for t in layout.tensors],
                        [tensors[n] for n in layout.names], acc[0], row_stride)
            assert torch.equal(fold(acc)[0], bucket_checksum(slot, layout.nbytes, row_stride))


def test_device_memory_stays_flat_over_syncs(engine_process):
    conn, proc, _ = engine_process
    plan = plan_for(gpu_export(0), bucket_bytes=layer_bytes())
    sender = WeightSender(conn, CudaIpcTransport(), plan, timeout=TIMEOUT_S, alive=proc.is_alive)
    flats = [torch.zeros(b.nbytes, dtype=torch.uint8, device="cuda") for b in plan.buckets]
    export = gpu_export(1)
    for _ in range(3):  # warm-up: staging, mappings, kernel tables
        sender.sync(export)
        sender.sync_flat(flats)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    for _ in range(30):
        sender.sync(export)
        sender.sync_flat(flats)
    torch.cuda.synchronize()
    assert free_before - torch.cuda.mem_get_info()[0] <= 2 * MiB  # whole GPU: both processes


def test_pauses_reuse_their_pinned_host_buffers():
    memory = PausableMemory()
    with memory.region():
        x = torch.randn(4 * MiB, device="cuda")
    memory.pause(keep_contents=True)  # pins a host buffer for every live pausable allocation
    memory.resume()
    made = memory.stats()["host_allocations"]
    for step in range(3):
        x.fill_(step)
        memory.pause(keep_contents=True)
        memory.resume()
        assert torch.equal(x, torch.full_like(x, step))
    assert memory.stats()["host_allocations"] == made  # later pauses pin nothing
    assert memory.release_host_memory() >= 16 * MiB
