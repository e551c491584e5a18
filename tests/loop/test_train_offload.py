"""--offload-train: the trainer's state in pausable memory, paused by its plan and resumed unchanged.

Runs on the native allocator's host imitation of the driver (``PausableMemory.host_imitation``): the same
bookkeeping as on a GPU, with host memory mapped and unmapped in place of device memory."""

import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from redline.configfile import ConfigError
from redline.loop.train_offload import TrainOffload
from redline.sync.memory import (
    NativeLibraryMissing,
    PausableMemory,
    native_library_path,
)
from redline.trainer.mixed_precision import MasterWeights, MixedPrecisionAdamW
from redline.trainer.models import from_config

PAGE = 4096  # the imitation's allocation granularity
STEPS = 3


@pytest.fixture
def memory(tmp_path):
    """A private copy of the native library (its own allocations) on its host imitation of the driver."""
    try:
        library = native_library_path()
    except NativeLibraryMissing as exc:
        pytest.skip(f"the native library is not built here: {exc}")
    copy = tmp_path / "libredline_native_offload.so"
    shutil.copy(library, copy)
    return PausableMemory.host_imitation(copy)


@pytest.fixture
def process_memory(memory, monkeypatch):
    """``memory`` as the process's pausable memory: the loop's own ``train_offload`` lookups build their
    ``TrainOffload`` over it (the real driver's ``PausableMemory`` needs a GPU)."""
    from redline.loop import train_offload
    from redline.sync import memory as memory_module

    train_offload._train_offload.cache_clear()
    monkeypatch.setattr(memory_module, "PausableMemory", lambda device: memory)
    yield memory
    train_offload._train_offload.cache_clear()


def bf16_model(seed=0):
    config = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False)
    return from_config(config, dtype=torch.bfloat16, seed=seed, device="cpu")


def trainer(offload: TrainOffload | None, *, cpu_offload: bool = False):
    """A bf16 model with fp32 master weights and AdamW, its device buffers from ``offload`` when given."""
    model = bf16_model()
    master = MasterWeights(model, offload=cpu_offload, allocate=offload.allocate if offload else None)
    if offload:
        offload.track(master)
    return model, master, MixedPrecisionAdamW(master, lr=1e-3, weight_decay=0.1)


def train_step(model, master, optimizer, step: int) -> float:
    generator = torch.Generator().manual_seed(step)
    device = next(model.parameters()).device
    input_ids = torch.randint(0, model.hf_config.vocab_size, (12,), generator=generator).to(device)
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    optimizer.zero_grad()
    loss = F.cross_entropy(model.logits(input_ids, cu_seqlens).float()[:-1], input_ids[1:])
    loss.backward()
    master.reduce_and_clip(1.0)
    optimizer.step()
    return loss.item()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor`` (a bit-exact comparison, NaN payloads and signed zeros included)."""
    return tensor.detach().contiguous().view(torch.uint8).clone()


def state_bits(master, optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, g in enumerate(master.groups):
        state = optimizer.state[g.master]
        out.update({f"{i}.compute": bits(g.compute), f"{i}.master": bits(g.master),
                    f"{i}.exp_avg": bits(state["exp_avg"]), f"{i}.exp_avg_sq": bits(state["exp_avg_sq"])})
    return out


def pause_and_resume(offload: TrainOffload) -> None:
    offload.pause_state()
    offload.pause_weights()
    offload.resume()


def test_after_resume_weights_masters_and_moments_are_bit_exact_at_the_same_addresses_and_grads_zero(memory):
    offload = TrainOffload(memory)
    model, master, optimizer = trainer(offload)
    train_step(model, master, optimizer, 0)
    before = state_bits(master, optimizer)
    addresses = [p.data_ptr() for p in model.parameters()]
    assert any(bool(g.main_grad.any()) for g in master.groups)  # the step left gradients behind
    pause_and_resume(offload)
    assert state_bits(master, optimizer).keys() == before.keys()
    for name, value in state_bits(master, optimizer).items():
        assert torch.equal(value, before[name]), name
    assert [p.data_ptr() for p in model.parameters()] == addresses
    assert all(not g.main_grad.any() for g in master.groups)
    assert not offload.paused


def test_training_continues_identically_to_a_run_without_offload(memory):
    offload = TrainOffload(memory)
    plain, paused = trainer(None), trainer(offload)
    for step in range(STEPS):
        assert train_step(*paused, step) == train_step(*plain, step)
        pause_and_resume(offload)
    expected, got = state_bits(*plain[1:]), state_bits(*paused[1:])
    for name, value in got.items():
        assert torch.equal(value, expected[name]), name


def test_the_plan_drops_gradients_rebuilds_compute_weights_and_keeps_masters_and_moments(memory):
    offload = TrainOffload(memory)
    _, master, _ = trainer(offload)
    plan = offload.make_plan()
    assert [(g.name, g.action, g.stage) for g in plan.groups] == [
        ("gradients (fp32 main grad)", "zeros", "state"), ("master weights (fp32)", "host", "state"),
        ("Adam moments (fp32)", "host", "state"), ("compute weights", "rebuild", "weights")]
    (group,) = master.groups
    numel, shard = group.numel, group.master.numel()
    rounded = lambda nbytes: -(-nbytes // PAGE) * PAGE
    expected_device = {"gradients (fp32 main grad)": rounded(4 * numel), "master weights (fp32)": rounded(4 * shard),
                       "Adam moments (fp32)": 2 * rounded(4 * shard), "compute weights": rounded(2 * numel)}
    expected_host = {"master weights (fp32)": 4 * shard, "Adam moments (fp32)": 8 * shard}
    for g in plan.groups:
        assert g.device_bytes == expected_device[g.name], g.name
        assert g.host_bytes == expected_host.get(g.name, 0), g.name
    assert plan.device_bytes == sum(expected_device.values()) and plan.host_bytes == 12 * shard
    table = plan.table()
    assert len(table) == 2 + len(plan.groups) + 1 and "rebuilt from the fp32 master weights" in table[-2]


def test_each_stage_releases_what_the_plan_says_and_the_paused_trainer_holds_nothing_pausable(memory):
    offload = TrainOffload(memory)
    _model, _master, _optimizer = trainer(offload)  # kept alive: the offload tracks them weakly
    plan = offload.make_plan()
    mapped = memory.stats()["mapped_bytes"]
    assert mapped == plan.device_bytes  # everything the trainer allocated is in the plan
    offload.pause_state()
    state = sum(g.device_bytes for g in plan.stage("state"))
    assert memory.stats()["mapped_bytes"] == mapped - state
    assert memory.stats()["host_backup_bytes"] == plan.host_bytes
    offload.pause_weights()
    assert memory.stats()["mapped_bytes"] == 0 and offload.residual_bytes() == 0
    offload.resume()
    assert memory.stats()["mapped_bytes"] == mapped


def test_with_optimizer_cpu_offload_the_compute_weights_go_to_pinned_host_memory(memory):
    offload = TrainOffload(memory)
    model, master, optimizer = trainer(offload, cpu_offload=True)
    plan = offload.make_plan()
    assert [(g.name, g.action) for g in plan.groups] == [("gradients (fp32 main grad)", "zeros"),
                                                         ("compute weights", "host")]
    train_step(model, master, optimizer, 0)
    before = state_bits(master, optimizer)
    pause_and_resume(offload)
    for name, value in state_bits(master, optimizer).items():
        assert torch.equal(value, before[name]), name


def test_with_the_optimizer_resident_masters_and_moments_stay_mapped_and_training_is_unchanged(memory):
    offload = TrainOffload(memory)
    offload.optimizer_resident = True
    plain, paused = trainer(None), trainer(offload)
    plan = offload.make_plan()
    assert [(g.key, g.action, g.device_bytes, g.host_bytes) for g in plan.groups if g.action == "stay"] == [
        ("masters", "stay", 0, 0), ("moments", "stay", 0, 0)]
    staying = sum(memory.allocation_bytes(t) for g in plan.groups if g.action == "stay" for t in g.tensors)
    for step in range(STEPS):
        assert train_step(*paused, step) == train_step(*plain, step)
        offload.pause_state()
        offload.pause_weights()
        assert memory.stats()["mapped_bytes"] == staying and memory.stats()["host_backup_bytes"] == 0
        assert "perf/pause_train_masters_time" not in offload.timings
        offload.resume()
    expected, got = state_bits(*plain[1:]), state_bits(*paused[1:])
    for name, value in got.items():
        assert torch.equal(value, expected[name]), name


# ----- --offload-train-optimizer auto: the start-up choice ---------------------------------------------------

GIB = 2**30


def resident_then_placed(memory, monkeypatch, *, free: int, engine_bytes: int):
    """A trainer after one step, paused with its optimizer state resident as the loop starts it, then placed
    against ``engine_bytes`` with the GPU's free memory stubbed to ``free``; returns (offload, before, state)."""
    from redline.loop import train_offload

    monkeypatch.setattr(train_offload, "device_memory", lambda device: (free, 80 * GIB))
    offload = TrainOffload(memory)
    model, master, optimizer = trainer(offload)
    train_step(model, master, optimizer, 0)
    before = state_bits(master, optimizer)
    offload.optimizer_resident = True
    offload.pause()
    placement = offload.place_optimizer(engine_bytes, "stub parts")
    return offload, before, (model, master, optimizer), placement


def optimizer_bytes(memory, offload) -> int:
    return sum(memory.allocation_bytes(t) for g in offload.make_plan().groups if g.key in ("masters", "moments")
               for t in g.tensors)


def test_auto_keeps_the_optimizer_state_on_the_gpu_when_the_engine_fits_beside_it(memory, monkeypatch):
    offload, before, state, placement = resident_then_placed(memory, monkeypatch, free=10 * GIB,
                                                              engine_bytes=10 * GIB)
    assert placement.resident and offload.optimizer_resident and offload.placement is placement
    assert memory.stats()["mapped_bytes"] == optimizer_bytes(memory, offload) > 0
    assert memory.stats()["host_backup_bytes"] == 0
    assert placement.line() == ("master weights (fp32) and Adam moments (fp32) stay on the GPU while the engine "
                                "generates (--offload-train-optimizer auto): the engine needs 10.00 GiB (stub parts), which "
                                "fits in the 10.00 GiB free with the rest paused")
    offload.resume()
    assert state_bits(*state[1:]).keys() == before.keys()
    for name, value in state_bits(*state[1:]).items():
        assert torch.equal(value, before[name]), name


def test_auto_sends_the_optimizer_state_to_pinned_host_memory_when_the_engine_needs_its_room(memory, monkeypatch):
    offload, before, state, placement = resident_then_placed(memory, monkeypatch, free=10 * GIB,
                                                              engine_bytes=10 * GIB + 1)
    assert not placement.resident and not offload.optimizer_resident
    assert memory.stats()["mapped_bytes"] == 0  # nothing of the trainer's state left on the GPU
    assert memory.stats()["host_backup_bytes"] == offload.plan.host_bytes > 0
    assert [g.action for g in offload.plan.groups if g.key in ("masters", "moments")] == ["host", "host"]
    assert placement.line() == ("master weights (fp32) and Adam moments (fp32) go to pinned host memory while the "
                                "engine generates (--offload-train-optimizer auto): the engine needs 10.00 GiB (stub parts), which "
                                "does not fit in the 10.00 GiB free with the rest paused")
    offload.resume()
    for name, value in state_bits(*state[1:]).items():
        assert torch.equal(value, before[name]), name
    offload.pause()  # later pauses follow the choice: the optimizer state leaves again
    assert memory.stats()["mapped_bytes"] == 0 and "perf/pause_train_moments_time" in offload.timings


def test_the_choice_is_made_only_while_paused_with_the_optimizer_state_resident(memory):
    offload = TrainOffload(memory)
    _state = trainer(offload)  # kept alive: the offload tracks it weakly
    with pytest.raises(RuntimeError, match="pause with the optimizer state resident first"):
        offload.place_optimizer(GIB, "stub parts")
    offload.pause()  # optimizer_resident False: the state has left already
    with pytest.raises(RuntimeError, match="pause with the optimizer state resident first"):
        offload.place_optimizer(GIB, "stub parts")


def test_sglangs_need_is_its_static_share_of_the_gpu_plus_headroom(tmp_path, monkeypatch):
    from redline.loop import rollout_setup
    from redline.loop.train_offload import ENGINE_HEADROOM, engine_memory

    monkeypatch.setattr(rollout_setup, "resolve_engine", lambda config: "sglang")
    config = offload_config(tmp_path, sglang_mem_fraction_static="0.25")
    need, how = engine_memory(config, bf16_model().hf_config, torch.bfloat16, 80 * GIB)
    assert need == 20 * GIB + ENGINE_HEADROOM
    assert how == "--sglang-mem-fraction-static 0.25 × 80.00 GiB + 1.00 GiB headroom"
    # unset: the default beside the trainer --offload-train pauses
    config = offload_config(tmp_path, offload_train="true")
    need, how = engine_memory(config, bf16_model().hf_config, torch.bfloat16, 80 * GIB)
    assert need == 56 * GIB + ENGINE_HEADROOM
    assert how == "--sglang-mem-fraction-static 0.7 (its default here) × 80.00 GiB + 1.00 GiB headroom"


def test_the_embedded_engines_need_is_its_weights_and_its_kv_cache_plus_headroom(tmp_path):
    from redline.loop.rollout_setup import engine_rows, engine_seq_len
    from redline.loop.train_offload import ENGINE_HEADROOM, engine_memory

    config = offload_config(tmp_path)
    model = bf16_model()
    rows = engine_rows(config)
    slots = engine_seq_len(config, model.hf_config.max_position_embeddings)
    cache = model.make_kv_cache(rows, slots)  # what the engine allocates, measured on a real model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = cache.k.nbytes + cache.v.nbytes
    need, how = engine_memory(config, model.hf_config, torch.bfloat16, 80 * GIB)
    assert need == weights + kv + ENGINE_HEADROOM
    assert f"({rows} rows × {slots} slots) + 1.00 GiB headroom" in how and how.startswith("weights ")


@pytest.mark.parametrize("fits", [True, False], ids=["stays", "leaves"])
def test_in_the_loop_auto_is_the_default_and_the_start_up_plan_says_what_it_chose_and_why(
        tmp_path, monkeypatch, process_memory, fits):
    from redline.configfile import apply_overrides
    from redline.loop import train_offload
    from redline.loop.builtin import materialize
    from redline.loop.train import build
    from rich.console import Console

    free = 5 * GIB
    monkeypatch.setattr(train_offload, "device_memory", lambda device: (free, 80 * GIB))
    monkeypatch.setattr(train_offload, "engine_memory",
                        lambda config, hf_config, dtype, total: (free if fits else free + 1, f"of {total} bytes"))
    config = offload_config(tmp_path, sft_steps="0", offload_train="true", offload_rollout="true", dtype="bfloat16")
    assert config.train.offload_train_optimizer == "auto"
    config = apply_overrides(config, materialize(config, tmp_path / "builtin"))
    console = Console(record=True, width=100)
    state, _ = build(config, console)
    try:
        offload, master = state.weight_sync.train, state.worker.master
        assert offload.paused and offload.optimizer_resident is fits
        state_bytes = {what: nbytes for what, _, nbytes, _ in master.memory_rows()}
        optimizer = state_bytes["master weights (fp32)"] + state_bytes["Adam moments (fp32 × 2)"]
        mapped = process_memory.stats()["mapped_bytes"]
        assert (optimizer <= mapped < optimizer + 3 * PAGE) if fits else mapped == 0
        lines = console.export_text().splitlines()
        table_end = lines.index("--offload-train, while the engine generates:") + len(offload.plan.table()) + 1
        where = "stay on the GPU" if fits else "go to pinned host memory"
        verb = "fits in" if fits else "does not fit in"
        assert lines[table_end] == (f"master weights (fp32) and Adam moments (fp32) {where} while the engine "
                                    f"generates (--offload-train-optimizer auto): the engine needs "
                                    f"{(free + (not fits)) / GIB:.2f} GiB (of {80 * GIB} bytes), which {verb} the "
                                    f"5.00 GiB free with the rest paused")
    finally:
        state.loop.run_until_complete(state.engine.shutdown())


def test_a_dropped_optimizers_moments_leave_the_plan(memory):
    offload = TrainOffload(memory)
    _, master, _ = trainer(offload)
    warm_up = MixedPrecisionAdamW(master, lr=1e-3)  # the SFT warm-up's own moments
    moments = lambda: next(g for g in offload.make_plan().groups if g.name == "Adam moments (fp32)")
    assert len(moments().tensors) == 4
    del warm_up
    assert len(moments().tensors) == 2


def test_pause_weights_needs_the_state_paused_first(memory):
    offload = TrainOffload(memory)
    trainer(offload)
    with pytest.raises(RuntimeError, match="state must be paused first"):
        offload.pause_weights()


# ----- the flag ---------------------------------------------------------------------------------------------

def offload_config(tmp_path, **overrides):
    from .test_train import small_config

    return small_config(tmp_path, **overrides)


def test_the_flag_is_off_by_default_with_the_embedded_engine_and_on_with_colocated_sglang_on_a_gpu(tmp_path, monkeypatch):
    from redline.loop import rollout_setup
    from redline.loop.train_offload import offload_train_enabled

    assert not offload_train_enabled(offload_config(tmp_path))
    assert offload_train_enabled(offload_config(tmp_path, offload_train="true"))
    monkeypatch.setattr(rollout_setup, "resolve_engine", lambda config: "sglang")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not offload_train_enabled(offload_config(tmp_path))  # a stand-in SGLang server on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert offload_train_enabled(offload_config(tmp_path))
    assert not offload_train_enabled(offload_config(tmp_path, offload_train="false"))
    assert not offload_train_enabled(offload_config(tmp_path, colocate="false"))


def test_start_up_refuses_it_without_a_gpu_naming_the_flag(tmp_path):
    from redline.loop.validate import check_offload_train

    with pytest.raises(ConfigError, match="--offload-train: .*needs a CUDA GPU"):
        check_offload_train(offload_config(tmp_path, offload_train="true"))


def test_start_up_refuses_it_without_the_native_library_saying_how_to_build_it(tmp_path, monkeypatch):
    from redline.loop import rollout_setup
    from redline.loop.validate import check_offload_train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("REDLINE_NATIVE_LIBRARY", str(tmp_path / "absent.so"))
    with pytest.raises(ConfigError, match="--offload-train: .*absent.so.*cmake"):
        check_offload_train(offload_config(tmp_path, offload_train="true"))
    monkeypatch.setattr(rollout_setup, "resolve_engine", lambda config: "sglang")  # on by default: says so
    with pytest.raises(ConfigError, match="--offload-train \\(on by default .*--no-offload-train"):
        check_offload_train(offload_config(tmp_path))


@pytest.mark.parametrize("fits", [True, False], ids=["fits", "does-not-fit"])
def test_with_optimizer_cpu_offload_auto_places_the_compute_weights_the_gpu_cannot_rebuild(memory, monkeypatch, fits):
    from redline.loop import train_offload

    monkeypatch.setattr(train_offload, "device_memory", lambda device: (10 * GIB, 80 * GIB))
    offload = TrainOffload(memory)
    model, master, optimizer = trainer(offload, cpu_offload=True)
    train_step(model, master, optimizer, 0)
    before = state_bits(master, optimizer)
    offload.optimizer_resident = True
    offload.pause()
    compute = sum(memory.allocation_bytes(g.compute) for g in master.groups)
    assert memory.stats()["mapped_bytes"] == compute > 0  # paused with them resident: only the gradients left
    placement = offload.place_optimizer(10 * GIB if fits else 10 * GIB + 1, "stub parts")
    assert placement.resident is fits and placement.kept == "compute weights"
    assert placement.line().startswith(f"compute weights {'stay on the GPU' if fits else 'go to pinned host memory'}")
    assert [(g.key, g.action) for g in offload.plan.groups] == [("grads", "zeros"),
                                                                ("compute", "stay" if fits else "host")]
    assert memory.stats()["mapped_bytes"] == (compute if fits else 0)
    assert memory.stats()["host_backup_bytes"] == (0 if fits else offload.plan.host_bytes)
    offload.resume()
    for name, value in state_bits(master, optimizer).items():
        assert torch.equal(value, before[name]), name


def test_the_cached_blocks_go_back_to_the_driver_only_when_the_engine_would_not_fit_beside_them(monkeypatch):
    from redline.loop import train_offload

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(train_offload, "device_memory", lambda device: (10 * GIB, 80 * GIB))
    gpu = torch.device("cuda", 0)
    assert not train_offload.make_room(gpu, 10 * GIB) and emptied == []
    assert train_offload.make_room(gpu, 10 * GIB + 1) and emptied == [True]
    assert train_offload.make_room(gpu, None) and len(emptied) == 2  # no measured need: always


def test_in_the_loop_the_resident_optimizer_stays_mapped_while_the_engine_generates(tmp_path, monkeypatch,
                                                                                   process_memory):
    state, _, metrics = loop_run(tmp_path, monkeypatch, process_memory, steps=1, offload_train_optimizer="gpu")
    offload, master = state.weight_sync.train, state.worker.master
    assert offload.paused and offload.optimizer_resident
    state_bytes = {what: nbytes for what, _, nbytes, _ in master.memory_rows()}
    resident = state_bytes["master weights (fp32)"] + state_bytes["Adam moments (fp32 × 2)"]
    assert resident <= process_memory.stats()["mapped_bytes"] < resident + 3 * PAGE
    assert "perf/pause_train_moments_time" not in metrics[0] and metrics[0]["perf/pause_train_grads_time"] > 0
    assert "stays on the GPU" in "\n".join(offload.plan.table())


def test_start_up_refuses_it_with_engines_on_other_gpus(tmp_path):
    from redline.loop.validate import check_offload_train

    with pytest.raises(ConfigError, match="--offload-train .*--no-colocate"):
        check_offload_train(offload_config(tmp_path, offload_train="true", colocate="false"))


# ----- in the loop ------------------------------------------------------------------------------------------

def loop_run(tmp_path, monkeypatch, memory, steps: int, **overrides):
    """``steps`` RL steps of the small run in bf16 (fp32 master weights with or without offload) with
    --offload-rollout (the recording engine of test_weight_sync); with --offload-train when ``memory`` (the
    process's, ``process_memory``) is given."""
    from .test_weight_sync import recorded_run

    if memory is not None:
        overrides["offload_train"] = "true"
    return recorded_run(tmp_path, monkeypatch, steps=steps, offload_rollout="true", dtype="bfloat16", **overrides)


def test_the_loop_pauses_the_trainer_around_generation_and_trains_as_without_offload(tmp_path, monkeypatch,
                                                                                      process_memory):
    memory = process_memory
    state, _, metrics = loop_run(tmp_path / "offload", monkeypatch, memory, steps=2)
    _, _, plain = loop_run(tmp_path / "plain", monkeypatch, None, steps=2)
    offload = state.weight_sync.train
    assert offload.paused and memory.stats()["mapped_bytes"] == 0  # the next rollout generates beside nothing
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "rollout/reward_mean"):
        assert [m[key] for m in metrics] == [m[key] for m in plain], key
    for m in metrics:
        assert m["perf/pause_train_time"] > 0 and m["perf/trainer_paused_bytes"] == 0
    assert "perf/resume_train_time" in metrics[1]  # resumed at step 2's release, before its log-probs
    assert offload.masters() == [state.worker.master]


def test_the_loop_and_the_parameters_get_one_offload_whatever_name_the_device_is_given(process_memory):
    """The loop names a colocated GPU ``cuda``, the parameters report ``cuda:0`` (here ``cpu:0`` and ``cpu``)."""
    from redline.loop.train_offload import train_offload

    assert train_offload(torch.device("cpu", 0)) is train_offload(torch.device("cpu"))


def test_a_plan_with_no_training_state_tracked_is_an_error(memory):
    with pytest.raises(RuntimeError, match="no MasterWeights tracked"):
        TrainOffload(memory).make_plan()


def test_in_the_loop_every_buffer_of_the_training_state_is_paused_by_the_plan_and_the_start_up_line_says_so(
        tmp_path, monkeypatch, process_memory):
    """After real optimizer steps, with the loop naming the device unlike the parameters: compute weights, fp32
    gradients, masters and both moments all lie in allocations the pause released; the plan's bytes are the whole
    training state's, the start-up line states them, and each group's pause is timed."""
    from redline.loop import rollout_setup

    monkeypatch.setattr(rollout_setup, "trainer_device", lambda config: torch.device("cpu", 0))
    state, _, metrics = loop_run(tmp_path, monkeypatch, process_memory, steps=2)
    offload, master = state.weight_sync.train, state.worker.master
    assert offload.paused and process_memory.stats()["mapped_bytes"] == 0
    planned = {t.untyped_storage().data_ptr() for g in offload.plan.groups for t in g.tensors}
    moments = state.worker.optimizer.state
    for g in master.groups:
        for name, tensor in (("compute", g.compute), ("main_grad", g.main_grad), ("master", g.master),
                             ("exp_avg", moments[g.master]["exp_avg"]),
                             ("exp_avg_sq", moments[g.master]["exp_avg_sq"])):
            assert tensor.untyped_storage().data_ptr() in planned, name
    state_bytes = {what: nbytes for what, _, nbytes, _ in master.memory_rows()}
    host = state_bytes["master weights (fp32)"] + state_bytes["Adam moments (fp32 × 2)"]
    assert offload.plan.host_bytes == host
    assert offload.plan.device_bytes >= sum(state_bytes.values())
    assert (f"offload train: {offload.plan.device_bytes / 2**30:.2f} GiB released while the engine generates, "
            f"{host / 2**30:.2f} GiB of it kept in pinned host memory") in state.weight_sync.describe()
    for m in metrics:
        parts = [m[f"perf/pause_train_{key}_time"] for key in ("grads", "masters", "moments", "compute")]
        assert all(t > 0 for t in parts) and sum(parts) <= m["perf/pause_train_time"]
    assert 0 < metrics[1]["perf/resume_train_map_time"] + metrics[1]["perf/resume_train_rebuild_time"] <= \
        metrics[1]["perf/resume_train_time"]


def test_a_checkpoint_reads_the_resumed_trainer_and_the_engine_gets_its_weights_back(tmp_path, monkeypatch,
                                                                                      process_memory):
    memory = process_memory
    from redline.loop.train_offload import trainer_resident

    state, engine, _ = loop_run(tmp_path, monkeypatch, memory, steps=1)
    master = state.worker.master
    calls = len(engine.calls)
    with trainer_resident(state, "1"):
        assert not state.weight_sync.train.paused
        saved = state.worker.optimizer.state_dict()
    assert state.weight_sync.train.paused
    # the engine gave its memory up for the checkpoint and got it back around a push of the same weights
    assert [c[0] for c in engine.calls[calls:]] == ["release_memory", "resume_memory", "update_weights",
                                                     "resume_memory"]
    state.loop.run_until_complete(state.weight_sync.release())
    assert torch.equal(saved["shards"][0]["master"], master.groups[0].master)


# ----- on a GPU (the real driver; the Triton AdamW writes the compute weights the rebuild must reproduce) ------

@pytest.mark.gpu
@pytest.mark.parametrize("cpu_offload, resident", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["masters-on-gpu", "optimizer-cpu-offload", "optimizer-resident",
                              "optimizer-cpu-offload-compute-resident"])
def test_on_a_gpu_the_paused_trainer_frees_its_state_and_resumes_bit_exact(cpu_offload, resident):
    """Each step's state (the compute weights the Triton AdamW wrote, masters, moments) survives the pause: the
    rebuilt compute weights round the masters exactly as the update did."""
    from redline.loop.train_offload import train_offload

    device = torch.device("cuda", torch.cuda.current_device())
    offload = train_offload("cuda")  # the process's one (the native allocator is per process), as the loop names it
    assert train_offload(device) is offload  # as MasterWeights names it: cuda:0
    offload.optimizer_resident = resident
    model = bf16_model().to(device)
    master = offload.track(MasterWeights(model, offload=cpu_offload, allocate=offload.allocate))
    optimizer = MixedPrecisionAdamW(master, lr=1e-3, weight_decay=0.1)
    for step in range(STEPS):
        train_step(model, master, optimizer, step)
        before = state_bits(master, optimizer)
        plan = offload.make_plan()
        mapped = offload.memory.stats()["mapped_bytes"]
        free = torch.cuda.mem_get_info(device)[0]
        offload.pause()
        assert offload.memory.stats()["mapped_bytes"] == mapped - plan.device_bytes
        assert torch.cuda.mem_get_info(device)[0] - free >= plan.device_bytes
        offload.resume()
        assert all(not g.main_grad.any() for g in master.groups)
        for name, value in state_bits(master, optimizer).items():
            assert torch.equal(value, before[name]), f"step {step}: {name}"


def test_the_engine_starts_beside_a_paused_trainer_and_an_sft_warm_up_resumes_it(tmp_path, monkeypatch,
                                                                                  process_memory):
    from redline.configfile import apply_overrides
    from redline.loop.builtin import materialize
    from redline.loop.sft import sft_warmup
    from redline.loop.train import build
    from rich.console import Console

    memory = process_memory
    config = offload_config(tmp_path, sft_steps="2", offload_train="true", offload_rollout="true", dtype="bfloat16")
    config = apply_overrides(config, materialize(config, tmp_path / "builtin"))
    state, tokenizer = build(config, Console(quiet=True))
    offload = state.weight_sync.train
    try:
        assert offload.paused and memory.stats()["mapped_bytes"] == 0
        warm = sft_warmup(state, tokenizer)
        assert warm["sft/steps"] == 2
        assert offload.paused  # the warm-up's push paused it again for the engine
    finally:
        state.loop.run_until_complete(state.engine.shutdown())


def test_the_report_plots_the_paused_trainers_memory_and_the_kv_headroom(tmp_path):
    from redline.loop.metrics import MetricsLog

    log = MetricsLog(tmp_path)
    for step, paused in ((1, 3 * 2**30), (2, 2 * 2**30)):
        log.log(step, {"perf/trainer_paused_bytes": paused, "perf/kv_headroom_bytes": 60 * 2**30})
    report = log.report("run", []).read_text()
    log.close()
    assert (tmp_path / "colocated_memory.png").is_file() and "colocated_memory.png" in report
    assert "| perf/trainer_paused_bytes | 3.221e+09 | 2.147e+09 |" in report
