"""Whole-configuration checks that run before any model loads; each failure names the flag or file."""

import json
from pathlib import Path

from redline.configfile import ConfigError
from redline.extras import available


def loss_config(config):
    """The ``redline.kernels.LossConfig`` the run's algorithm settings describe."""
    from redline.kernels import LossConfig
    from redline.loop.async_schedule import off_policy_correction

    algo = config.algo
    estimator = {"gspo": "gspo", "cispo": "cispo"}.get(algo.advantage_estimator, "ppo")
    agg, constant = algo.loss_agg_mode, algo.loss_agg_constant
    if algo.advantage_estimator == "dr_grpo" and agg == "token-mean":
        # Dr.GRPO's aggregation: Σ m·x / (S · C), C = the generation budget
        agg, constant = "seq-mean-token-sum-norm", constant or float(config.rollout.rollout_max_response_len)
    return LossConfig(estimator=estimator, eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high,
                      eps_clip_c=algo.eps_clip_c, kl_type=algo.kl_loss_type,
                      kl_coef=algo.kl_loss_coef if algo.use_kl_loss else 0.0, entropy_coef=algo.entropy_coef,
                      tis=off_policy_correction(config), tis_clip_low=algo.tis_clip_low,
                      tis_clip=algo.tis_clip, agg=agg, agg_constant=constant)


def _ranges(config) -> list[tuple[str, object, str]]:
    """(flag, value, rule) of every numeric setting with a range; None values (unset options) are skipped."""
    r, t, a, d, c = config.rollout, config.train, config.algo, config.data, config.checkpoint
    at_least_1 = [("--rollout-batch-size", r.rollout_batch_size), ("--n-samples-per-prompt", r.n_samples_per_prompt),
                  ("--num-rollout", r.num_rollout), ("--global-batch-size", t.global_batch_size),
                  ("--num-steps-per-rollout", t.num_steps_per_rollout), ("--max-tokens-per-gpu", t.max_tokens_per_gpu),
                  ("--rollout-max-response-len", r.rollout_max_response_len),
                  ("--over-sampling-batch-size", r.over_sampling_batch_size),
                  ("--n-samples-per-eval-prompt", r.n_samples_per_eval_prompt),
                  ("--eval-max-response-len", r.eval_max_response_len),
                  ("--rollout-max-prompt-len", d.rollout_max_prompt_len), ("--kl-horizon", a.kl_horizon)]
    at_least_0 = [("--save-interval", c.save_interval), ("--eval-interval", c.eval_interval),  # 0: never
                  ("--sft-steps", t.sft_steps), ("--lr-warmup-iters", t.lr_warmup_iters),
                  ("--max-bad-steps", t.max_bad_steps), ("--rm-max-retries", r.rm_max_retries),
                  ("--rollout-temperature", r.rollout_temperature), ("--eval-temperature", r.eval_temperature),
                  ("--weight-decay", t.weight_decay), ("--clip-grad", t.clip_grad), ("--min-lr", t.min_lr),
                  ("--kl-loss-coef", a.kl_loss_coef), ("--kl-coef", a.kl_coef), ("--entropy-coef", a.entropy_coef)]
    above_0 = [("--lr", t.lr), ("--sft-lr", t.sft_lr), ("--critic-lr", a.critic_lr), ("--rm-timeout", r.rm_timeout),
               ("--eps-clip", a.eps_clip)]
    probability = [("--rollout-top-p", r.rollout_top_p), ("--eval-top-p", r.eval_top_p),
                   ("--adam-beta1", t.adam_beta1), ("--adam-beta2", t.adam_beta2)]
    return ([(f, v, ">= 1") for f, v in at_least_1] + [(f, v, ">= 0") for f, v in at_least_0]
            + [(f, v, "> 0") for f, v in above_0] + [(f, v, "in (0, 1]") for f, v in probability])


RULES = {">= 1": lambda v: v >= 1, ">= 0": lambda v: v >= 0, "> 0": lambda v: v > 0,
         "in (0, 1]": lambda v: 0 < v <= 1}


def check_ranges(config) -> None:
    """Each numeric setting on its own (finite, in its range), before any constraint between settings: a
    negative batch size is reported as such, not as a product that does not add up."""
    import math

    for flag, value, rule in _ranges(config):
        if value is not None and not (math.isfinite(value) and RULES[rule](value)):
            raise ConfigError(f"{flag} must be {rule}, got {value}")
    top_k = config.rollout.rollout_top_k
    if top_k != -1 and top_k < 1:
        raise ConfigError(f"--rollout-top-k must be -1 (off) or >= 1, got {top_k}")


def check_batch_arithmetic(config) -> None:
    r, t = config.rollout, config.train
    produced = r.rollout_batch_size * r.n_samples_per_prompt
    consumed = t.global_batch_size * t.num_steps_per_rollout
    if produced != consumed:
        raise ConfigError(
            f"--rollout-batch-size ({r.rollout_batch_size}) × --n-samples-per-prompt ({r.n_samples_per_prompt}) = "
            f"{produced} samples per rollout, but --global-batch-size ({t.global_batch_size}) × "
            f"--num-steps-per-rollout ({t.num_steps_per_rollout}) = {consumed}; they must be equal")
    if r.n_samples_per_prompt < 2 and config.algo.advantage_estimator in ("grpo", "dr_grpo", "rloo", "gspo", "cispo"):
        raise ConfigError(f"--advantage-estimator {config.algo.advantage_estimator} compares samples within a "
                          f"group: --n-samples-per-prompt must be >= 2")


def check_output_dir(path: str | None) -> None:
    if path and Path(path).exists() and not Path(path).is_dir():
        raise ConfigError(f"--output-dir {path}: a file is there; the run folder must be a folder (or not exist)")


def check_safetensors(path: Path) -> None:
    """A safetensors file holds its whole header and every tensor's bytes (a truncated download does not)."""
    import struct

    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"--hf-checkpoint {path}: truncated safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ConfigError(f"--hf-checkpoint {path}: truncated safetensors file (its header needs "
                              f"{header_len} bytes, the file has {size})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(f"--hf-checkpoint {path}: corrupt safetensors header") from None
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise ConfigError(f"--hf-checkpoint {path}: truncated safetensors file ({size} bytes, its tensors need "
                          f"{8 + header_len + end})")


def check_model_dir(path: str | None) -> None:
    if not path:
        raise ConfigError("--hf-checkpoint is required (a local HF model directory)")
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"--hf-checkpoint {folder}: not a directory")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--hf-checkpoint {folder}: config.json is missing")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise ConfigError(f"--hf-checkpoint {folder}: shards listed in {index.name} are missing: {missing}")
    elif not any(folder.glob("*.safetensors")):
        raise ConfigError(f"--hf-checkpoint {folder}: no *.safetensors weights")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise ConfigError(f"--hf-checkpoint {folder}: no tokenizer (tokenizer.json / tokenizer_config.json)")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            try:
                json.loads((folder / name).read_bytes())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"--hf-checkpoint {folder / name}: corrupt JSON ({exc})") from None
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - the Rust parser's errors have no common Python type
            raise ConfigError(f"--hf-checkpoint {folder / 'tokenizer.json'}: not a tokenizer the tokenizers "
                              f"library reads ({exc})") from None
    for weights in sorted(folder.glob("*.safetensors")):
        check_safetensors(weights)


def check_data(path: str | None, flag: str, config, needs_label: bool) -> None:
    """The file exists and every record has the keys the run reads (with ``--skip-bad-records``: at least one
    does); the first bad record is named by file and line. Prompt lengths need the tokenizer: the dataset
    checks them when it loads (``PromptDataset``)."""
    from redline.rollout.data import DataError, check_record, read_records

    if not path:
        raise ConfigError(f"{flag} is required")
    if not Path(path).is_file():
        raise ConfigError(f"{flag} {path}: file not found")
    d = config.data
    good = 0
    for location, record in read_records(path):
        try:
            check_record(location, record, input_key=d.input_key, label_key=d.label_key,
                         metadata_key=d.metadata_key, require_label=needs_label)
        except DataError as exc:
            if not d.skip_bad_records:
                raise ConfigError(f"{exc} (--skip-bad-records skips and counts such records)") from None
            continue
        good += 1
    if not good:
        raise ConfigError(f"{flag} {path}: the file holds no usable records")


def needs_label(config) -> bool:
    """Whether each record must carry a label: a built-in reward grades against it, SFT imitates it."""
    return config.rollout.rm_type is not None or config.train.sft_steps > 0 or config.algo.loss_type == "sft"


def check_reward(config) -> None:
    """The reward and the other user functions import and have the right shape; a remote reward model answers at
    ``--rm-url`` (the start-up health check)."""
    from redline.rollout.functions import load_function
    from redline.rollout.rewards import BUILTIN_REWARDS

    r = config.rollout
    for flag, path, must_be_async in (("--custom-rm-path", r.custom_rm_path, True),
                                      ("--custom-generate-function-path", r.custom_generate_function_path, True),
                                      ("--dynamic-sampling-filter-path", r.dynamic_sampling_filter_path, False)):
        if path:
            try:
                load_function(path, what=flag, must_be_async=must_be_async)
            except (ImportError, AttributeError, TypeError, ValueError) as exc:
                raise ConfigError(str(exc)) from None
    if r.rm_type is not None and not r.custom_rm_path and r.rm_type not in BUILTIN_REWARDS:
        raise ConfigError(f"--rm-type {r.rm_type}: unknown; built-ins are {', '.join(BUILTIN_REWARDS)}")
    if r.rm_type == "remote_rm" and not r.custom_rm_path:
        if not r.rm_url:
            raise ConfigError("--rm-type remote_rm needs --rm-url")
        from redline.rollout.rewards.remote import RemoteRewardError, check_reachable

        try:
            check_reachable(r.rm_url, r.rm_timeout)
        except RemoteRewardError as exc:
            raise ConfigError(str(exc)) from None


def check_backends(config) -> None:
    import torch

    backend = config.model.backend
    if backend == "te" and not available("transformer_engine"):
        raise ConfigError("--backend te needs TransformerEngine: pip install 'redline[te]'")
    if backend in ("te", "native") and not torch.cuda.is_available():
        raise ConfigError(f"--backend {backend} is FP8 and needs a CUDA GPU; use --backend bf16 on this machine")
    if config.model.dtype == "float16":
        raise ConfigError("--dtype float16 is not supported for training (use bfloat16 or float32)")


def check_engine(config) -> None:
    """The rollout engine can run here and its options fit it."""
    import torch

    from redline.loop.rollout_setup import resolve_engine

    r = config.rollout
    if resolve_engine(config) != "sglang":
        if config.sync.check_sglang_weights:
            raise ConfigError(f"--check-sglang-weights checks SGLang servers, but the rollout engine is "
                              f"{resolve_engine(config)}: add --rollout-engine sglang")
        if r.sglang_server_urls:
            raise ConfigError(f"--sglang-server-urls attaches SGLang servers, but the rollout engine is "
                              f"{resolve_engine(config)}: add --rollout-engine sglang")
        return
    if r.embedded_engine_process:
        raise ConfigError("--embedded-engine-process applies to the embedded engine; with --rollout-engine sglang "
                          "the engine already runs in its own process")
    if not available("sglang"):
        raise ConfigError("--rollout-engine sglang needs SGLang, which is not installed: pip install "
                          "'redline[sglang]' (or use --rollout-engine embedded)")
    if not available("aiohttp"):
        raise ConfigError("--rollout-engine sglang needs aiohttp for its HTTP client: pip install 'redline[sglang]'")
    if not torch.cuda.is_available():
        raise ConfigError("--rollout-engine sglang needs a CUDA GPU (SGLang serves on GPUs and receives weights "
                          "by CUDA IPC); none is visible. Use --rollout-engine embedded on this machine")
    if r.sglang_mem_fraction_static is not None and not 0 < r.sglang_mem_fraction_static < 1:
        raise ConfigError(f"--sglang-mem-fraction-static must be between 0 and 1, got {r.sglang_mem_fraction_static}")
    for arg in r.sglang_args:
        if arg.split("=", 1)[0] in ("--mem-fraction-static", "--sglang-mem-fraction-static"):
            raise ConfigError(f"--sglang-args {arg}: set the memory fraction with --sglang-mem-fraction-static")


def layout_of(config, world_size: int) -> dict:
    """The run's parallel layout ``{"dp", "tp", "pp"}`` for ``world_size`` processes; under PP also ``"stages"``,
    the decoder layers of each stage (``pipeline_stage_sizes``), when the model's config is readable."""
    tp, pp = config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size
    layout = {"dp": world_size // (tp * pp), "tp": tp, "pp": pp}
    spec = _model_spec(config.model.hf_checkpoint)
    if pp > 1 and spec is not None:
        layout["stages"] = pipeline_stage_sizes(config, spec)
    return layout


def pipeline_stage_sizes(config, spec) -> list[int]:
    """Decoder layers per pipeline stage for the model ``spec``, as the trainer will split it; ConfigError naming
    the flags when ``--decoder-first/last-pipeline-num-layers`` cannot be met."""
    from redline.trainer.parallel.stages import head_cost_layers, stage_sizes

    p = config.parallel
    try:
        return stage_sizes(spec.num_layers, p.pipeline_model_parallel_size, first=p.decoder_first_pipeline_num_layers,
                           last=p.decoder_last_pipeline_num_layers, head_layers=head_cost_layers(spec))
    except ValueError as exc:
        raise ConfigError(f"--decoder-first-pipeline-num-layers {p.decoder_first_pipeline_num_layers} / "
                          f"--decoder-last-pipeline-num-layers {p.decoder_last_pipeline_num_layers} with "
                          f"--pipeline-model-parallel-size {p.pipeline_model_parallel_size} and the model's "
                          f"{spec.num_layers} layers ({config.model.hf_checkpoint}/config.json): {exc}") from None


def describe_layout(layout: dict) -> str:
    stages = f" (layers {'+'.join(map(str, layout['stages']))})" if "stages" in layout else ""
    return f"DP={layout['dp']} × TP={layout['tp']} × PP={layout['pp']}{stages}"


def check_load(load, layout: dict[str, int]) -> None:
    """``--load``: a checkpoint exists there, saved at this run's parallel layout (each process resumes its own
    optimizer shard and data position from its ``rank<r>`` state; a checkpoint of another DP/TP/PP layout is
    refused, naming both, rather than resharded)."""
    from redline.loop.checkpoint import RANK_ORDER, resolve, saved_layout, saved_rank_order

    try:
        folder = resolve(load)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    saved = saved_layout(folder)
    if "stages" in layout and "stages" not in saved and saved["pp"] == layout["pp"]:
        # saved before the split was balanced: the layers split evenly, the earlier stages one longer
        layers, pp = sum(layout["stages"]), saved["pp"]
        saved["stages"] = [layers // pp + (s < layers % pp) for s in range(pp)]
    if saved != layout:
        raise ConfigError(f"--load {folder}: saved at layout {describe_layout(saved)}, this run is "
                          f"{describe_layout(layout)} (--tensor-model-parallel-size, "
                          f"--pipeline-model-parallel-size, --decoder-first/last-pipeline-num-layers, torchrun "
                          f"processes); resume at the saved layout: optimizer shards are not resharded")
    order = saved_rank_order(folder) if saved["dp"] > 1 and saved["pp"] > 1 else RANK_ORDER
    if order != RANK_ORDER:
        raise ConfigError(f"--load {folder}: saved at {describe_layout(saved)} with ranks ordered "
                          f"{order} (outermost first); redline now orders them {RANK_ORDER}, so "
                          f"each rank<r> state belongs to other mesh coordinates: resume it with the redline that "
                          f"saved it")


def check_data_parallel(config, world_size: int) -> None:
    """``world_size`` data-parallel ranks under ``torchrun``: batches that split evenly (one GPU per local rank is
    checked when the process group starts, ``init_data_parallel``), and with ``--no-colocate`` (rank 0 draws every
    rollout) SFT prompts of their own."""
    p, r, t = config.parallel, config.rollout, config.train
    sft_from_rollout_prompts = (t.sft_steps > 0 or config.algo.loss_type == "sft") and (
        config.data.sft_prompt_data in (None, config.data.prompt_data))
    if not p.colocate and world_size > 1 and sft_from_rollout_prompts:
        sft = f"--sft-steps {t.sft_steps}" if t.sft_steps > 0 else "--loss-type sft"
        raise ConfigError(f"--no-colocate with {world_size} data-parallel ranks: rank 0 draws every rollout from "
                          f"--prompt-data {config.data.prompt_data}, while each rank draws its SFT prompts ({sft}) "
                          "from a shard of its own, so with one file for both the run would not draw the prompts "
                          "one process draws: give --sft-prompt-data a file of its own")
    for flag, value in (("--rollout-batch-size", r.rollout_batch_size), ("--global-batch-size", t.global_batch_size),
                        ("--over-sampling-batch-size", r.over_sampling_batch_size or r.rollout_batch_size)):
        if value % world_size:
            raise ConfigError(f"{flag} {value} does not split over {world_size} data-parallel ranks: make it a "
                              f"multiple of {world_size}")


def check_world_size(world_size: int, tp: int, pp: int) -> None:
    """The processes split into DP × PP × TP: ``world_size`` a multiple of ``tp · pp``."""
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if world_size == 1 and tp * pp > 1:
        raise ConfigError(f"--tensor-model-parallel-size {tp} / --pipeline-model-parallel-size {pp} need "
                          f"{tp * pp} processes: launch with torchrun --nproc-per-node {tp * pp} (or a multiple)")
    if world_size % (tp * pp):
        raise ConfigError(f"--tensor-model-parallel-size {tp} × --pipeline-model-parallel-size {pp} = {tp * pp} "
                          f"processes per model replica, but torchrun started {world_size} (WORLD_SIZE): the world "
                          f"size must be data-parallel size × {tp * pp}")


def check_model_parallel(config, world_size: int) -> None:
    """TP / SP / PP fit the model and the run: heads, KV heads and vocabulary divide by TP, layers are at least
    PP, SP has a TP group to split over, and the features that do not run model-parallel yet are refused."""
    p = config.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if p.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel splits tokens over the tensor-parallel group: it needs "
                          "--tensor-model-parallel-size > 1 (got 1)")
    if p.tp_comm_overlap and not p.sequence_parallel:
        raise ConfigError("--tp-comm-overlap overlaps sequence parallelism's collectives with the GEMMs: it needs "
                          "--sequence-parallel")
    for flag, value in (("--decoder-first-pipeline-num-layers", p.decoder_first_pipeline_num_layers),
                        ("--decoder-last-pipeline-num-layers", p.decoder_last_pipeline_num_layers)):
        if value is not None and pp == 1:
            raise ConfigError(f"{flag} {value} places layers on pipeline stages: it needs "
                              "--pipeline-model-parallel-size > 1 (got 1)")
    if tp * pp == 1:
        return
    if pp > 1 and config.algo.advantage_estimator == "ppo":
        raise ConfigError(f"--advantage-estimator ppo: the critic runs under TP and DP, not yet under "
                          f"--pipeline-model-parallel-size {pp}; use 1, or a critic-free estimator (grpo ...)")
    if config.rollout.async_rollout != "off" and p.colocate:
        raise ConfigError(f"--async-rollout {config.rollout.async_rollout} with --tensor-model-parallel-size {tp} / "
                          f"--pipeline-model-parallel-size {pp} is not supported yet (a colocated engine generates "
                          "in step with its group); use --async-rollout off, or add --no-colocate")
    if config.train.optimizer_cpu_offload and pp > 1:
        raise ConfigError(f"--optimizer-cpu-offload with --pipeline-model-parallel-size {pp} is not supported yet")
    spec = _model_spec(config.model.hf_checkpoint)
    if spec is None:
        return  # check_model_dir reports the folder itself
    for what, value in (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads),
                        ("vocab_size", spec.vocab_size)):
        if value % tp:
            raise ConfigError(f"--tensor-model-parallel-size {tp} must divide the model's {what} ({value}, "
                              f"{config.model.hf_checkpoint}/config.json)")
    if spec.num_layers < pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} is more than the model's num_hidden_layers "
                          f"({spec.num_layers}): every stage needs a layer")
    if pp > 1:
        pipeline_stage_sizes(config, spec)


def _model_spec(path: str | None):
    """The ``ModelSpec`` of the HF directory ``path``; None when it has no readable config.json."""
    from redline.trainer.models.spec import load_hf_config, spec_from_hf

    if not path or not (Path(path) / "config.json").is_file():
        return None
    try:
        return spec_from_hf(load_hf_config(path))
    except (ValueError, OSError):
        return None


def check_distributed_timeout(config) -> None:
    """Checked before the process group exists (``train.run``) as well as with the rest of the placement."""
    if config.parallel.distributed_timeout_minutes <= 0:
        raise ConfigError(f"--distributed-timeout-minutes must be > 0, got "
                          f"{config.parallel.distributed_timeout_minutes}")


def check_placement(config, world_size: int = 1) -> None:
    """One process; or ``world_size`` processes under ``torchrun``: DP × TP × PP (``check_world_size``,
    ``check_model_parallel``), each data-parallel rank with its colocated engine; or with ``--no-colocate`` engines
    on the GPUs after all of the trainer's (driven by rank 0; under DP > 1 ``loop/dealt_rollout.py``) — embedded
    engine processes (also on the CPU of a CPU machine) or SGLang servers, launched or attached — weights pushed
    by broadcast."""
    import torch

    from redline.loop.rollout_setup import resolve_engine

    check_distributed_timeout(config)
    p = config.parallel
    check_world_size(world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    check_model_parallel(config, world_size)
    if world_size > 1:
        check_data_parallel(config, world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size))
    if p.colocate:
        return
    if config.sync.offload_rollout:
        raise ConfigError("--offload-rollout frees the engine's memory for a trainer on the same GPU; with "
                          "--no-colocate the engines have their own GPUs: drop one of the two flags")
    if resolve_engine(config) == "sglang" and config.rollout.sglang_server_urls:
        return  # attached servers: they hold their GPUs already, --rollout-num-gpus launches nothing
    if p.rollout_num_gpus < 1:
        raise ConfigError(f"--rollout-num-gpus must be >= 1 with --no-colocate, got {p.rollout_num_gpus}")
    from redline.loop.ray_engines import engine_bundles
    from redline.loop.rollout_setup import trainer_gpus

    if torch.cuda.is_available() and engine_bundles() is None:  # under Ray the engines have bundles of their own
        trainer = trainer_gpus(world_size)
        needed, visible = trainer + p.rollout_num_gpus, torch.cuda.device_count()
        if visible < needed:
            takes, lower = "GPU 0", "--rollout-num-gpus"
            if trainer > 1:
                takes = f"GPUs 0-{trainer - 1} (one per torchrun process on this node)"
                lower += (f" or the torchrun processes (--nproc-per-node {trainer}: data-parallel size × "
                          f"--tensor-model-parallel-size {p.tensor_model_parallel_size} × "
                          f"--pipeline-model-parallel-size {p.pipeline_model_parallel_size})")
            raise ConfigError(f"--no-colocate --rollout-num-gpus {p.rollout_num_gpus}: the trainer takes {takes} and "
                              f"each engine one more GPU after them, {needed} in all, but {visible} "
                              f"{'is' if visible == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES); lower {lower}, "
                              f"or drop --no-colocate")


def check_engine_gpus_here(config, world_size: int) -> None:
    """``--rollout-num-gpus-per-engine`` against this launch (``LOCAL_WORLD_SIZE``: torchrun's processes per node)."""
    from redline.loop.engine_placement import check_engine_gpus
    from redline.loop.rollout_setup import resolve_engine, trainer_gpus

    check_engine_gpus(config, engine=resolve_engine(config), world_size=world_size,
                      local_world_size=trainer_gpus(world_size))


def check_offload_train(config) -> None:
    """``--offload-train`` (set, or on by default with a colocated SGLang engine) needs a colocated engine, a CUDA
    GPU and redline's native library."""
    from redline.loop.train_offload import check_available, offload_train_enabled

    if not offload_train_enabled(config):
        return
    if not config.parallel.colocate:
        raise ConfigError("--offload-train pauses the trainer's memory while a colocated engine generates; with "
                          "--no-colocate the engines have their own GPUs: drop one of the two flags")
    try:
        check_available()
    except (RuntimeError, OSError) as exc:  # NativeLibraryMissing is a RuntimeError; OSError: a library not loadable
        default = ("" if config.train.offload_train else
                   " (on by default with a colocated SGLang engine; --no-offload-train turns it off)")
        raise ConfigError(f"--offload-train{default}: {exc}") from None


def check_offload_level(config) -> None:
    """``--offload-rollout-level``: one or both of slime's values, and only with ``--offload-rollout``."""
    from redline.loop.weight_sync import OFFLOAD_LEVELS

    level, default = config.sync.offload_rollout_level, ["kv_cache", "weight"]
    unknown = [value for value in level if value not in OFFLOAD_LEVELS]
    if unknown or not level:
        raise ConfigError(f"--offload-rollout-level {' '.join(level) or '(empty)'}: give one or both of "
                          f"{', '.join(OFFLOAD_LEVELS)}" + (f" ({', '.join(unknown)} is not one)" if unknown else ""))
    if sorted(level) != sorted(default) and not config.sync.offload_rollout:
        raise ConfigError(f"--offload-rollout-level {' '.join(level)} says what --offload-rollout releases: add "
                          "--offload-rollout, or drop the level")


def check_env_switches() -> None:
    """The run's on/off environment switches (the weight sync's ``REDLINE_SYNC_SHARE``, ``REDLINE_SYNC_ZERO_COPY``,
    the loop's ``REDLINE_GC_FREEZE``), before an engine starts."""
    from redline.long_lived import FREEZE_ENV
    from redline.loop.weight_sync import SHARE_ENV, ZERO_COPY_ENV
    from redline.switches import env_switch

    for name in (SHARE_ENV, ZERO_COPY_ENV, FREEZE_ENV):
        try:
            env_switch(name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


def check_profile(config) -> None:
    """``--profile-step-start`` / ``--profile-step-end``: set only with ``--use-pytorch-profiler``, a non-empty
    range of the run's steps."""
    from redline.config import ProfileConfig

    p, last = config.profile, config.rollout.num_rollout
    if not p.use_pytorch_profiler:
        default = ProfileConfig()
        if (p.profile_step_start, p.profile_step_end) != (default.profile_step_start, default.profile_step_end):
            raise ConfigError("--profile-step-start / --profile-step-end apply to --use-pytorch-profiler, which "
                              "is off")
        return
    if p.profile_step_start < 1:
        raise ConfigError(f"--profile-step-start must be >= 1 (steps count from 1), got {p.profile_step_start}")
    if p.profile_step_end <= p.profile_step_start:
        raise ConfigError(f"--profile-step-end ({p.profile_step_end}) must be after --profile-step-start "
                          f"({p.profile_step_start}): the profiled steps are start .. end - 1")
    if p.profile_step_end > last + 1:
        raise ConfigError(f"--profile-step-end {p.profile_step_end} is past the run's end: its last step is {last} "
                          f"(--num-rollout {last}), so at most {last + 1}")


def validate(config, world_size: int = 1) -> None:
    """Every check that can fail before a model loads; raises ConfigError naming the flag or file.
    ``world_size``: the ``torchrun`` processes of the run (DP × TP × PP)."""
    check_ranges(config)
    check_batch_arithmetic(config)
    check_output_dir(config.checkpoint.output_dir)
    check_model_dir(config.model.hf_checkpoint)
    check_data(config.data.prompt_data, "--prompt-data", config, needs_label(config))
    if config.data.sft_prompt_data:
        check_data(config.data.sft_prompt_data, "--sft-prompt-data", config, needs_label=True)
    if config.data.eval_prompt_data:
        check_data(config.data.eval_prompt_data, "--eval-prompt-data", config, needs_label(config))
    if config.rollout.rm_type is None and config.rollout.custom_rm_path is None and config.algo.loss_type != "sft":
        raise ConfigError("RL needs a reward: set --rm-type or --custom-rm-path")
    if config.algo.kl_target is not None and config.algo.kl_coef <= 0:
        raise ConfigError("--kl-target adapts --kl-coef, which must then be > 0")
    check_reward(config)
    check_backends(config)
    check_engine(config)
    check_placement(config, world_size)
    from redline.loop.async_schedule import check_async

    check_async(config, world_size)
    check_offload_train(config)
    check_engine_gpus_here(config, world_size)
    if config.checkpoint.load:
        check_load(config.checkpoint.load, layout_of(config, world_size))
    if config.sync.update_weight_buffer_size < 1:
        raise ConfigError(f"--update-weight-buffer-size must be >= 1 byte, got {config.sync.update_weight_buffer_size}")
    check_env_switches()
    check_offload_level(config)
    check_profile(config)
    try:
        loss_config(config)
    except ValueError as exc:
        raise ConfigError(f"loss settings: {exc}") from exc
