"""``redline train``: build the run (validate → model → engine → rollout → worker), warm up, loop, report."""

import asyncio
import dataclasses
import time
from datetime import datetime
from pathlib import Path

import torch
from rich.console import Console

from redline.configfile import ConfigError, apply_overrides, to_mapping
from redline.gpu_telemetry import open_gpu_telemetry
from redline.long_lived import freeze_engine_servers, long_lived_frozen
from redline.loop import checkpoint, faults, interrupt, run_folder
from redline.loop.advantages import AdaptiveKLController
from redline.loop.builtin import materialize
from redline.loop.critic import CriticWorker
from redline.loop.data_parallel import SINGLE_PROCESS, DataParallel, init_data_parallel
from redline.loop.dealt_rollout import ReplicaWeightSync, deals_rollouts, evaluation
from redline.loop.determinism import deterministic_algorithms
from redline.loop.sft import sft_rollout, sft_warmup
from redline.loop.health import RunHealth
from redline.loop.progress import RunProgress, summary
from redline.loop.profiling import StepProfiler
from redline.loop.step import RunState, rl_step
from redline.loop.train_offload import ensure_resident, trainer_resident
from redline.loop.training_memory import memory_table
from redline.loop.validate import check_distributed_timeout, loss_config, validate
from redline.loop.warmup import CompileClock, settle_step, warm_up, warmup_enabled
from redline.loop.worker import TrainerWorker

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def output_dir_for(config) -> Path:
    if config.checkpoint.output_dir:
        return Path(config.checkpoint.output_dir)
    return Path("runs") / f"{config.checkpoint.run_name}-{datetime.now():%Y%m%d-%H%M%S}"


def resolve_backend(config) -> str:
    from redline.backends import select_backends

    if config.model.backend != "auto":
        return config.model.backend
    fp8 = select_backends().fp8
    return {"te": "te", "native": "native"}.get(fp8, "bf16")


def layer_backend_for(config, name: str):
    """The ``redline.trainer`` layer backend the model config asks for."""
    from redline.trainer.layers import layer_backend

    options = {"te": {"recipe": config.model.fp8_recipe}, "native": {"scaling": config.model.fp8_scaling}}
    return layer_backend(name, **options.get(name, {}))


def build(config, console: Console, *, log_dir: Path = Path("logs"), dp: DataParallel = SINGLE_PROCESS):
    """``(RunState, tokenizer)`` for a validated config; engine server logs (SGLang) go to ``log_dir``. Under
    data parallelism each rank builds its own trainer (on ``dp.device``) and colocated engine; under TP/PP each
    rank its shard of the model, and each model-parallel group one engine, on its leader."""
    from transformers import AutoTokenizer

    from redline.loop.fault_tolerance import engine_sync
    from redline.loop.rollout_setup import build_rollout, engine_devices, resolve_engine, trainer_device
    from redline.loop.train_offload import device_memory, engine_memory, offload_train_enabled, train_offload
    from redline.loop.parallel_sync import ModelParallelBroadcastSync, ModelParallelWeightSync
    from redline.loop.weight_sync import BroadcastWeightSync, WeightSync, offload_tags
    from redline.trainer.models import from_pretrained
    from redline.trainer.parallel.recompute import apply_recompute

    device = dp.device if dp.processes > 1 else trainer_device(config)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dtype = DTYPES[config.model.dtype]
    backend = resolve_backend(config)
    console.print(f"model {config.model.hf_checkpoint} · backend {backend} · {dtype} · {device}")
    tokenizer = AutoTokenizer.from_pretrained(config.model.hf_checkpoint)
    model = from_pretrained(config.model.hf_checkpoint, backend=layer_backend_for(config, backend), dtype=dtype,
                            device=device, parallel=dp.state)
    apply_recompute(model, config.model.recompute)
    loss_cfg = loss_config(config)
    total_steps = config.rollout.num_rollout * config.train.num_steps_per_rollout
    train_cfg = dataclasses.replace(config.train, offload_train=offload_train_enabled(config))
    worker = TrainerWorker(model, train_cfg, total_steps=total_steps,
                           # greedy rollouts (temperature 0): log-probs at temperature 1, as the engine takes them
                           temperature=config.rollout.rollout_temperature or 1.0,
                           keep_reference=loss_cfg.kl_coef > 0 or config.algo.kl_coef > 0, dp=dp)
    kl_controller = (AdaptiveKLController(config.algo.kl_coef, config.algo.kl_target, config.algo.kl_horizon)
                     if config.algo.kl_target is not None else None)
    critic = None
    if config.algo.advantage_estimator == "ppo":
        decoder = from_pretrained(config.model.hf_checkpoint, backend=layer_backend_for(config, backend), dtype=dtype,
                                  device=device, parallel=dp.state)
        apply_recompute(decoder, config.model.recompute)
        critic = CriticWorker(decoder,
                              train_cfg, total_steps=total_steps, value_clip=config.algo.value_clip,
                              lr=config.algo.critic_lr, dp=dp)
    # the engine last: a failure while building the trainer leaves no launched server behind
    loop = asyncio.new_event_loop()
    engine_name = resolve_engine(config)
    if not config.parallel.colocate:
        engine_name += f" (own process on {', '.join(map(str, engine_devices(config)))}; trainer on {device})"
    elif engine_name == "embedded" and config.rollout.embedded_engine_process:
        engine_name += " (own process)"
    if config.parallel.rollout_num_gpus_per_engine > 1:
        engine_name += f" (TP={config.parallel.rollout_num_gpus_per_engine} per server)"
    elif deals_rollouts(config, dp):
        engine_name += (f" (driven by rank 0 for all {dp.world} data-parallel ranks: it generates each whole batch "
                        "and deals its groups out)")
    elif dp.world > 1:
        engine_name += f" (one per data-parallel rank, {dp.world} ranks)"
    if dp.model_parallel and config.parallel.rollout_num_gpus_per_engine == 1 and not deals_rollouts(config, dp):
        engine_name += (f" ({'on' if config.parallel.colocate else 'driven by'} TP rank 0 of the first pipeline "
                        f"stage of each model-parallel group, unsharded; TP={dp.state.tp} × PP={dp.state.pp} trainer)")
    console.print(f"rollout engine: {engine_name}")
    if train_cfg.offload_train:  # the engine starts beside a paused trainer, as it generates beside one
        offload = train_offload(device)
        offload.optimizer_resident = train_cfg.offload_train_optimizer != "host"
        offload.pause()
        if train_cfg.offload_train_optimizer == "auto":
            offload.place_optimizer(*engine_memory(config, model.hf_config, dtype, device_memory(offload.device)[1]))
    engine, rollout = build_rollout(config, tokenizer, device=device, dtype=dtype, log_dir=log_dir, dp=dp)
    if rollout.skipped_records:
        console.print(f"data: --skip-bad-records skipped {rollout.skipped_records} malformed record(s) "
                      f"(data/skipped_records)", markup=False, soft_wrap=True)
    if dp.model_parallel and config.parallel.colocate:  # with a seat: each rank hands its engine TP rank its parts
        weight_sync = ModelParallelWeightSync(
            model, engine, dp, seat=rollout.engine_seat, bucket_bytes=config.sync.update_weight_buffer_size,
            offload=config.sync.offload_rollout, device=device, check_weights=config.sync.check_weights,
            train_offload=train_offload(device) if train_cfg.offload_train else None,
            offload_tags=offload_tags(config.sync.offload_rollout_level))
    elif config.parallel.colocate:  # a watched engine (--use-fault-tolerance) gets a new WeightSync at each restart
        weight_sync = engine_sync(engine, lambda engine: WeightSync(
            model, engine, bucket_bytes=config.sync.update_weight_buffer_size, offload=config.sync.offload_rollout,
            device=device, check_weights=config.sync.check_weights, seat=rollout.engine_seat,
            train_offload=train_offload(device) if train_cfg.offload_train else None,
            share_weights=config.rollout.async_rollout == "off",  # async: the engine generates while we train
            offload_tags=offload_tags(config.sync.offload_rollout_level)))
    else:  # under TP/PP the group's leader broadcasts its gathered stream, the other ranks gather with it
        engines = [] if engine is None else getattr(engine, "engines", [engine])
        broadcast = {"bucket_bytes": config.sync.update_weight_buffer_size, "device": device,
                     "timeout_s": config.parallel.distributed_timeout_minutes * 60,
                     "verify": config.sync.check_sglang_weights or config.sync.check_weights}
        if deals_rollouts(config, dp) and dp.rank > 0:  # DP rank 0's group pushes the weights every replica holds
            weight_sync = ReplicaWeightSync(dp, checks=dp.holds_engine and broadcast["verify"]
                                            and resolve_engine(config) == "sglang")
        elif dp.model_parallel:
            weight_sync = ModelParallelBroadcastSync(model, engines, dp, **broadcast)
        else:
            weight_sync = BroadcastWeightSync(model, engines, **broadcast)
        try:
            loop.run_until_complete(weight_sync.connect())
        except BaseException:
            if engine is not None:  # a rank that drives no engine has none to stop
                loop.run_until_complete(engine.shutdown())
            raise
    console.print(weight_sync.describe())
    if dp.world > 1:
        console.print(f"data parallel: {dp.world} ranks, fp32 master weights and AdamW moments sharded over them "
                      "(ZeRO-1)")
    console.print("training state (this rank):\n" + "\n".join(training_memory(worker, critic)))
    if train_cfg.offload_train:
        placement = train_offload(device).placement
        console.print("--offload-train, while the engine generates:\n"
                      + "\n".join(train_offload(device).make_plan().table())
                      + (f"\n{placement.line()}" if placement else ""), markup=False, soft_wrap=True)
    return RunState(config=config, worker=worker, rollout=rollout, engine=engine, weight_sync=weight_sync,
                    loss_cfg=loss_cfg, kl_controller=kl_controller, loop=loop, critic=critic, dp=dp), tokenizer


def training_memory(worker, critic) -> list[str]:
    """The memory table of the policy's (and the critic's) training state."""
    models = {"policy": (worker.model, worker.master)}
    if critic is not None:
        models["critic"] = (critic.model, critic.master)
    return memory_table(models)


def shutdown(state: RunState) -> None:
    """Leave the weight-update group (``--no-colocate``), stop the engine, release the reward's process or HTTP
    session, then cancel whatever a failure left running on the loop and close it (no "Task was destroyed" or
    "Unclosed client session" at exit)."""
    try:
        close = getattr(state.weight_sync, "close", None)
        if close is not None:
            state.loop.run_until_complete(close())
    finally:
        try:
            if state.engine is not None:  # a model-parallel group's other ranks hold none
                state.loop.run_until_complete(state.engine.shutdown())
        finally:
            state.loop.run_until_complete(state.rollout.close())
            state.loop.run_until_complete(_cancel_others())
            state.loop.close()


async def _cancel_others() -> None:
    """Cancel every other task of the running loop and wait for them to finish."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def trainer_state(state: RunState) -> tuple[dict, dict]:
    """``(shared, this rank's)`` checkpoint state: the controllers and the critic's weights are the same on every
    rank (written once; under TP the critic's weights are each rank's shard, kept with its own state); the
    optimizers (each rank's shard of the fp32 master weights and moments) and the data position are each rank's
    own."""
    critic = state.critic.state_dict() if state.critic else None
    shared = {"kl_controller": state.kl_controller.state_dict() if state.kl_controller else None,
              "critic_model": critic.pop("model") if critic and not state.dp.model_parallel else None}
    return shared, {"rollout": state.rollout.state_dict(), "worker": state.worker.state_dict(), "critic": critic}


def restore(state: RunState, folder: Path) -> int:
    """Load a checkpoint's weights and state into the run; returns the next rollout id."""
    from redline.trainer.models.load import load_hf_weights

    ensure_resident(state)  # --offload-train: paused since the engine started
    saved, mine = checkpoint.load_state(folder, state.dp)
    if not state.dp.model_parallel:  # a sharded model takes its weights from its fp32 master shards below
        load_hf_weights(state.worker.model, folder / "model")
    state.worker.load_state_dict(mine["worker"])
    state.rollout.load_state_dict(mine["rollout"])
    if state.kl_controller and saved["kl_controller"]:
        state.kl_controller.load_state_dict(saved["kl_controller"])
    if state.critic and mine.get("critic"):
        state.critic.load_state_dict({"model": saved["critic_model"], **mine["critic"]})
    checkpoint.set_rng_state(mine["rng"])
    state.loop.run_until_complete(state.weight_sync.push(str(saved["rollout_id"] + 1)))
    return saved["rollout_id"] + 1


def run(config, config_path=None) -> int:
    """One process, or every rank of a ``torchrun`` launch (DP × TP × PP): rank 0 picks the output folder,
    builds the built-in data/model and writes every file; each data-parallel rank trains and rolls out its
    shard."""
    check_distributed_timeout(config)
    p = config.parallel
    dp = init_data_parallel(p.distributed_timeout_minutes, p.tensor_model_parallel_size,
                            p.pipeline_model_parallel_size, p.sequence_parallel,
                            first_stage_layers=p.decoder_first_pipeline_num_layers,
                            last_stage_layers=p.decoder_last_pipeline_num_layers,
                            tp_overlap="auto" if p.tp_comm_overlap else "off")
    console = Console(quiet=not dp.is_main)
    try:
        with deterministic_algorithms():  # same seed, same result on a CPU machine (loop/determinism.py)
            return _run(config, config_path, dp, console)
    finally:
        dp.close()


def _run(config, config_path, dp: DataParallel, console: Console) -> int:
    out, before = None, None
    try:
        out = Path(dp.from_main(lambda: str(output_dir_for(config))))
        before = dp.from_main(lambda: run_folder.contents(out))
        replaced = dp.from_main(lambda: run_folder.previous_run(out, config.checkpoint.load,
                                                                config.checkpoint.overwrite))
        config = apply_overrides(config, dp.from_main(lambda: _materialize(config, out)), source="built-in")
        validate(config, world_size=dp.processes)
    except (ConfigError, ValueError) as exc:
        if out is not None and dp.is_main:
            run_folder.undo_start(out, before)  # a failed start leaves no run folder behind
        console.print(f"error: {exc}", style="red", markup=False, highlight=False, soft_wrap=True)
        return 2
    torch.manual_seed(config.train.seed)
    metrics = None
    if dp.is_main:
        run_folder.discard(out, replaced)
        _write_config(config, out)
        from redline.loop.metrics import MetricsLog

        resume_step = (checkpoint.saved_rollout(checkpoint.resolve(config.checkpoint.load)) + 1
                       if config.checkpoint.load else None)
        metrics = MetricsLog(out, use_wandb=config.checkpoint.use_wandb, run_name=config.checkpoint.run_name,
                             config=to_mapping(config), resume_step=resume_step)
    log_dir = out / "logs" / (f"rank{dp.process_rank}" if dp.processes > 1 else "")
    try:
        state, tokenizer = build(config, console, log_dir=log_dir, dp=dp)
    except BaseException:  # a start that fails while building (data, tokenizer, engine) leaves the folder as found
        if metrics:
            metrics.close()
        if dp.is_main:
            run_folder.undo_start(out, before)
        raise
    stop = interrupt.GracefulStop(lambda line: console.print(line, markup=False))
    try:
        state.telemetry = open_gpu_telemetry(_run_devices(state), lambda line: console.print(line, markup=False))
        state.telemetry.start()
        state.profiler = StepProfiler.for_run(config.profile, out, dp.process_rank)
        with stop, RunProgress(console, config.rollout.num_rollout) as progress:
            report = _train(state, tokenizer, metrics, out, console, config_path, stop, progress)
    finally:
        state.telemetry.stop()
        if metrics:
            metrics.close()
        shutdown(state)
        try:  # what a run that failed while tracing traced is written all the same, if it can be
            state.profiler.close()
        except Exception as exc:  # noqa: BLE001 -- the run's own outcome stands; the profile is a by-product
            console.print(f"warning: the profile could not be written: {exc!r}", markup=False)
    console.print(f"report: {report}")
    if stop.stopped_at is not None:
        console.print(f"stopped by Ctrl-C after step {stop.stopped_at}; resume with:\n"
                      f"  {run_folder.resume_command(out, dp.processes)}", markup=False, soft_wrap=True)
        return interrupt.EXIT_CODE
    return 0


def _run_devices(state: RunState) -> list[torch.device]:
    """The devices this process's run uses: its trainer's, and with ``--no-colocate`` the engines'."""
    from redline.loop.rollout_setup import engine_devices

    trainer = next(state.worker.model.parameters()).device
    return [trainer] + ([] if state.config.parallel.colocate else engine_devices(state.config))


def _materialize(config, out: Path) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    return materialize(config, out / "builtin")


def _train(state: RunState, tokenizer, metrics, out: Path, console: Console, config_path,
           stop: interrupt.GracefulStop, progress: RunProgress) -> Path | None:
    """Warm-up or resume, the rollout loop, eval, checkpoints; returns the report's path (None off rank 0, which
    gets no ``metrics``: it alone writes files). A Ctrl-C (``stop``) ends the loop after the step in flight, with
    a checkpoint of it, and skips the ``--save-hf`` export."""
    config, dp = state.config, state.dp
    log = metrics.log if metrics else lambda step, values: None
    state.on_phase = progress.phase
    health = RunHealth(state.worker.model.hf_config.vocab_size)
    start = 0
    if config.checkpoint.load:
        folder = checkpoint.resolve(config.checkpoint.load)
        start = restore(state, folder)
        console.print(f"resumed from {folder} at rollout {start}")
    else:
        if config.train.sft_steps:
            progress.phase("SFT warm-up")
            warm = sft_warmup(state, tokenizer)
            log(0, warm)
            console.print(f"SFT warm-up: {config.train.sft_steps} steps, loss {warm['sft/loss']:.3f}, "
                          f"eval reward {warm.get('eval/reward_mean', float('nan')):.3f}")
    progress.begin(start)
    began = time.perf_counter()
    sft_only = config.algo.loss_type == "sft"
    compile_clock, startup = None, {}
    # CPU: PyTorch kernels, no Triton; under TP/PP every rank warms up (the synthetic passes are collectives)
    if state.worker.device.type == "cuda" and not sft_only and warmup_enabled():
        compile_clock = CompileClock().install()
        state.on_phase = compile_clock.tracking(state.on_phase)  # a step's compilations named with their phase
        startup = warm_up(state, console, compile_clock, version=str(start))  # the engine's weights: start's
    if state.engine is not None:  # after the warm-up: its compiled graphs and caches are long-lived too
        for url in freeze_engine_servers(state.engine, state.loop):
            console.print(f"SGLang server {url} has no /freeze_gc: its processes keep collecting what they hold "
                          f"since start-up in every full collection")
    with long_lived_frozen():  # the start-up's objects stay out of the loop's full collections
        for rollout_id in range(start, config.rollout.num_rollout):
            step = rollout_id + 1
            state.profiler.begin_step(step)
            step_metrics = sft_rollout(state, tokenizer, rollout_id) if sft_only else rl_step(state, rollout_id)
            step_metrics.update(state.profiler.end_step(step))
            if compile_clock:  # what this step still paid in Triton compilation; the first also the start-up's cost
                paid, stalls = settle_step(compile_clock, step, dp)  # on any rank
                for stall in stalls:
                    progress.warn(stall)
                step_metrics.update(paid, **startup)
                startup = {}
            if config.checkpoint.eval_interval and step % config.checkpoint.eval_interval == 0:
                progress.phase("eval")
                step_metrics.update(evaluation(state, rollout_id))
                progress.evaluation(step, step_metrics)
            log(step, step_metrics)
            faults.after_step(dp.rank, step)  # REDLINE_FAULT=kill-trainer:RANK@step:S (tests of --auto-resume)
            progress.step(_progress_line(step, config.rollout.num_rollout, step_metrics, sft_only))
            for warning in health.observe(step, step_metrics):
                progress.warn(warning)
            stopping = dp.any_process(stop.requested)  # every rank stops after the same step
            if stopping or (config.checkpoint.save_interval and step % config.checkpoint.save_interval == 0):
                with trainer_resident(state, str(step)):  # --offload-train paused it after the step's push
                    checkpoint.save(out / "checkpoints", rollout_id, state.worker.model,
                                    Path(config.model.hf_checkpoint), *trainer_state(state), dp=dp)
            if stopping:
                stop.stopped_at = step
                break
    if config.checkpoint.save_hf and stop.stopped_at is None:
        # the engine is done: its memory goes, the trainer's state comes back (--offload-train), on every rank
        state.loop.run_until_complete(state.weight_sync.release())
    if config.checkpoint.save_hf and (dp.is_main or dp.model_parallel) and stop.stopped_at is None:
        # under TP/PP every rank gathers (the collectives of the export), rank 0 writes the HF layout
        state.worker.model.save_pretrained(config.checkpoint.save_hf, write=dp.is_main)
    if config.checkpoint.save_hf and dp.is_main and stop.stopped_at is None:
        checkpoint.copy_tokenizer(Path(config.model.hf_checkpoint), Path(config.checkpoint.save_hf))
    state.profiler.finish()  # a run stopped inside the profiled steps: its trace, before the report points to it
    dp.barrier()
    if not metrics:
        return None
    last = stop.stopped_at or config.rollout.num_rollout
    stopped = [f"stopped by Ctrl-C after step {last}"] if stop.stopped_at else []
    seconds = time.perf_counter() - began
    report = metrics.report(f"redline run {config.checkpoint.run_name}", [
        *(f"**WARNING** {w}" for w in health.warnings), f"config: {config_path}", f"output: {out}",
        f"RL steps: {last - start} in {seconds:.1f} s"
        + (f" on {dp.world} data-parallel ranks" if dp.world > 1 else ""),
        *stopped, *state.profiler.report_lines(out), "", "Training state of rank 0:", "",
        *training_memory(state.worker, state.critic)])
    progress.print(summary(metrics.records, last - start, seconds, report), "bold")
    return report


def _progress_line(step: int, total: int, m: dict, sft_only: bool) -> str:
    if sft_only:
        return f"[{step}/{total}] sft loss {m['train/sft_loss']:.4f} · grad norm {m['train/grad_norm']:.3f}"
    return (f"[{step}/{total}] reward {m['rollout/reward_mean']:.3f} · len {m['rollout/response_len_mean']:.1f} · "
            f"pg {m['train/pg_loss']:+.4f} · kl {m['train/kl']:.4f} · ent {m['train/entropy']:.3f} · "
            f"rollout {m['perf/rollout_time']:.2f}s train {m['perf/train_time']:.2f}s "
            f"sync {m['perf/update_weights_time'] * 1e3:.0f}ms idle {m['perf/idle_time'] * 1e3:.0f}ms")


def _write_config(config, out: Path) -> None:
    lines = []
    for section, values in to_mapping(config).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    (out / "config.toml").write_text("\n".join(lines))


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
