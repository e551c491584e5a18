"""The run configuration: one dataclass per subsystem, each a TOML table, each field a CLI flag.

Flag names follow slime where slime has the concept (``--rollout-batch-size``, ``--eps-clip-high`` ...).
Cross-field checks that need the data or the model live in ``redline.loop.validate``.
"""

from dataclasses import dataclass, field
from typing import Literal

from redline.configfile import option


@dataclass
class ModelConfig:
    hf_checkpoint: str | None = option(None, "local HF model directory (config.json + safetensors + tokenizer)")
    backend: Literal["auto", "bf16", "native", "te"] = option(
        "auto", "layer backend: te (TransformerEngine FP8), native (torch._scaled_mm FP8), bf16 (no FP8); "
        "auto picks te, then native, then bf16")
    dtype: Literal["bfloat16", "float32", "float16"] = option("bfloat16", "parameter/activation dtype")
    fp8_recipe: Literal["delayed", "current", "block", "mxfp8"] = option("current", "TE FP8 recipe (backend te)")
    fp8_scaling: Literal["tensorwise", "rowwise"] = option("tensorwise", "native FP8 scaling (backend native)")
    recompute: Literal["none", "selective", "full"] = option("none", "activation recompute")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = option(1, "tensor-parallel size (TP)")
    pipeline_model_parallel_size: int = option(1, "pipeline-parallel size (PP)")
    decoder_first_pipeline_num_layers: int | None = option(
        None, "decoder layers on the first pipeline stage (Megatron's flag); unset: the stages are balanced with "
        "the LM head's cost counted on the last stage (redline.trainer.parallel.stages)")
    decoder_last_pipeline_num_layers: int | None = option(
        None, "decoder layers on the last pipeline stage, which also runs the LM head; unset: balanced as above")
    sequence_parallel: bool = option(False, "sequence parallelism with TP")
    tp_comm_overlap: bool = option(False, "under --sequence-parallel, run SP's token all-gather / reduce-scatter "
                                   "micro-pipelined with the GEMMs beside them (async TP: PyTorch's symmetric-memory "
                                   "fused ops, bf16 backend, NCCL; elsewhere plain collectives). Off by default: in "
                                   "the loop on H200s its barriers cost more than the overlap saved (TP=2 train phase "
                                   "1.7 percent slower than with NCCL collectives; at TP=4 slower than at TP=2)")
    colocate: bool = option(True, "trainer and engines share the same GPUs")
    rollout_num_gpus: int = option(1, "--no-colocate: GPUs for the rollout engines, one engine per "
                                   "--rollout-num-gpus-per-engine of them (an embedded engine process, or an SGLang "
                                   "server launched there; cuda:1 ...; the trainer takes cuda:0); on a CPU machine, "
                                   "embedded engine processes on the CPU")
    rollout_num_gpus_per_engine: int = option(1, "GPUs per rollout engine: an SGLang server with this tensor-"
                                              "parallel size (--tp-size); colocated, the trainer ranks on those "
                                              "GPUs (consecutive ranks of one node) each feed their engine TP rank "
                                              "its own copy of every weight bucket; the embedded engine takes 1")
    distributed_timeout_minutes: float = option(10.0, "how long a collective may wait before failing: under "
                                                "torchrun, a rank waiting for the others (their rollouts "
                                                "included); with --no-colocate, the weight-update group's "
                                                "setup, each broadcast sync and its checks")
    ray_address: str | None = option(None, "place the run on Ray: auto (the running cluster), local (start a Ray "
                                     "runtime on this machine) or ADDRESS; trainer ranks become Ray actors in "
                                     "one placement group (redline.loop.ray_launch)")
    rollout_manager: Literal["actor", "rank"] = option(
        "actor", "--ray-address: where a generating rank's rollout manager (data, rewards, filters) runs: actor (one "
        "Ray actor of the run holds every rank's, beside rank 0, and reaches each rank's engine through the rank) "
        "or rank (in the rank's process, as without Ray: a colocated engine's answers reach it without crossing "
        "processes; benchmarks/results/loop/ray-cpu/README.md)")
    actor_num_nodes: int = option(1, "--ray-address: nodes of trainer ranks")
    actor_num_gpus_per_node: int = option(1, "--ray-address: trainer ranks per node, one GPU each (a CPU bundle "
                                          "on a machine without GPUs)")


@dataclass
class DataConfig:
    prompt_data: str | None = option(None, "prompt dataset (JSONL or Parquet), or 'builtin:<task>'")
    input_key: str = option("prompt", "record key holding the prompt")
    label_key: str | None = option("label", "record key holding the label")
    metadata_key: str | None = option(None, "record key holding per-sample metadata")
    apply_chat_template: bool = option(False, "wrap prompts in the tokenizer's chat template")
    rollout_max_prompt_len: int | None = option(None, "drop (and count) prompts longer than this many tokens")
    rollout_shuffle: bool = option(True, "shuffle prompts each epoch")
    skip_bad_records: bool = option(False, "skip and count malformed records (bad JSON or UTF-8, missing keys or "
                                    "label) instead of failing (data/skipped_records)")
    eval_prompt_data: str | None = option(None, "eval dataset (JSONL or Parquet)")
    sft_prompt_data: str | None = option(None, "labelled data of the SFT warm-up (default: --prompt-data)")


@dataclass
class RolloutConfig:
    rollout_engine: Literal["auto", "embedded", "sglang"] = option(
        "auto", "rollout engine; auto: sglang when it is installed and a CUDA GPU is visible, else embedded")
    num_rollout: int = option(10, "number of rollout steps to run")
    rollout_batch_size: int = option(8, "prompts per rollout step")
    n_samples_per_prompt: int = option(4, "responses sampled per prompt (group size)")
    over_sampling_batch_size: int | None = option(None, "prompts drawn per round when a dynamic filter drops groups")
    rollout_max_response_len: int = option(256, "max new tokens per response")
    rollout_temperature: float = option(1.0, "sampling temperature; 0: greedy decoding (log-probs for the loss "
                                        "are then taken at temperature 1)")
    rollout_top_p: float = option(1.0, "nucleus sampling p")
    rollout_top_k: int = option(-1, "top-k sampling (-1: off)")
    rollout_stop: list[str] = option([], "stop strings")
    rollout_stop_token_ids: list[int] = option([], "stop token ids (besides EOS)")
    rollout_ignore_eos: bool = option(False, "no token id ends a response (neither EOS nor --rollout-stop-token-ids; "
                                      "SGLang's ignore_eos): every response runs to --rollout-max-response-len "
                                      "unless a stop string ends it; evaluation still stops at EOS")
    rm_type: str | None = option(None, "built-in reward: math, exact_match, f1, remote_rm")
    custom_rm_path: str | None = option(None, "reward function 'module:function'")
    group_rm: bool = option(False, "the custom reward scores a whole group at once")
    rm_url: str | None = option(None, "URL of the remote reward model (--rm-type remote_rm)")
    rm_timeout: float = option(60.0, "seconds a reward may take: a custom reward's call, a remote RM's request")
    rm_max_retries: int = option(3, "retries of a remote RM request that failed (connection, timeout, HTTP 5xx)")
    reward_error: Literal["fail", "zero"] = option(
        "fail", "a reward that raises, times out or returns NaN/inf: fail (stop, naming the sample and the "
        "reward) or zero (score it 0, counted in rollout/reward_errors)")
    dynamic_sampling_filter_path: str | None = option(None, "group filter 'module:function'")
    custom_generate_function_path: str | None = option(None, "custom generate 'module:function' (multi-turn, tools)")
    partial_rollout: bool = option(False, "return unfinished groups to the buffer")
    async_rollout: Literal["off", "one-step", "full"] = option(
        "off", "overlap rollout and training (--no-colocate; on one GPU, an --embedded-engine-process): one-step "
        "(the engines generate rollout k+1 while the trainer trains on k) or full (a generation stream keeps "
        "--max-inflight trajectories in flight across weight updates, which interrupt them: they continue with the "
        "new weights); redline.loop.async_schedule")
    max_inflight: int | None = option(None, "--async-rollout full: trajectories generated and not yet taken by the "
                                      "trainer, at most (default: one rollout batch, rollout_batch_size x "
                                      "n_samples_per_prompt)")
    max_staleness: int | None = option(None, "async rollout: no trained sample's oldest token was generated more "
                                       "than N policy versions before the weights it trains; older samples are "
                                       "dropped and regenerated (rollout/stale_dropped); default: no bound")
    sglang_args: list[str] = option([], "extra SGLang server arguments, passed through")
    sglang_mem_fraction_static: float | None = option(
        None, "share SGLang takes for its weights and KV cache of the GPU memory free when it starts (SGLang's "
        "--mem-fraction-static); default: 0.7 beside a trainer paused by --offload-train, 0.5 beside a resident "
        "trainer, SGLang's own on GPUs of its own (redline.loop.rollout_setup.sglang_mem_fraction)")
    sglang_server_urls: list[str] = option([], "attach to running SGLang servers (http://host:port) on this host "
                                           "instead of launching one")
    embedded_engine_process: bool = option(False, "run the embedded engine in its own process (weights cross by "
                                           "shared memory on CPU, CUDA IPC on GPU)")
    eval_temperature: float = option(1.0, "sampling temperature of evaluation")
    eval_top_p: float = option(1.0, "nucleus p of evaluation")
    eval_max_response_len: int | None = option(None, "max new tokens in evaluation (default: the rollout's)")
    n_samples_per_eval_prompt: int = option(1, "responses per eval prompt (pass@k for k up to this)")
    use_fault_tolerance: bool | None = option(None, "watch the engine processes: a dead or hung one is restarted "
                                              "with the current weights and its requests retried (default: on "
                                              "under --ray-address)")
    rollout_health_check_interval: float = option(30.0, "seconds between engine health checks")
    rollout_health_check_timeout: float = option(30.0, "seconds a health check may take before the engine counts "
                                                 "as hung")
    rollout_health_check_first_wait: float = option(0.0, "seconds after an engine (re)starts before its first "
                                                    "health check")


@dataclass
class AlgoConfig:
    loss_type: Literal["policy_loss", "sft"] = option("policy_loss", "policy_loss (RL) or sft")
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                 "gspo", "cispo", "ppo"] = option("grpo", "advantage estimator / algorithm")
    normalize_advantages_by_std: bool = option(True, "divide group-centred rewards by the group std (grpo)")
    eps_clip: float = option(0.2, "PPO clip range (lower)")
    eps_clip_high: float | None = option(None, "PPO clip range (upper, clip-higher); defaults to eps_clip")
    eps_clip_c: float | None = option(None, "dual-clip constant (> 1)")
    use_kl_loss: bool = option(False, "add KL to the reference policy as a loss term")
    kl_loss_coef: float = option(0.0, "KL loss coefficient")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = option("low_var_kl", "KL estimator for the loss")
    kl_coef: float = option(0.0, "KL penalty folded into the reward")
    kl_target: float | None = option(None, "target KL for the adaptive KL controller")
    kl_horizon: int = option(10000, "samples over which the adaptive KL controller reacts")
    entropy_coef: float = option(0.0, "entropy bonus coefficient")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                           "seq-mean-token-sum-norm"] = option("token-mean", "loss aggregation")
    loss_agg_constant: float | None = option(None, "normaliser for seq-mean-token-sum-norm (Dr.GRPO)")
    use_tis: bool = option(False, "truncated importance sampling against the engine's log-probs")
    tis_mode: Literal["truncate", "icepop"] = option("truncate", "TIS: truncate or icepop")
    tis: Literal["auto", "none", "truncate", "icepop"] = option(
        "auto", "off-policy correction against the engine's log-probs: truncate (TIS) or icepop; none turns it "
        "off; auto: --use-tis with --tis-mode, and in async rollout (--async-rollout) --tis-mode's even without "
        "--use-tis")
    tis_clip_low: float = option(0.0, "TIS lower bound")
    tis_clip: float = option(2.0, "TIS upper bound")
    value_clip: float = option(0.2, "PPO critic: clip range of the value update")
    critic_lr: float | None = option(None, "PPO critic learning rate (default: --lr)")
    gamma: float = option(1.0, "discount (reinforce++, ppo)")
    lambd: float = option(1.0, "GAE lambda (ppo)")


@dataclass
class TrainConfig:
    global_batch_size: int = option(32, "samples per optimizer step")
    num_steps_per_rollout: int = option(1, "optimizer steps per rollout")
    max_tokens_per_gpu: int = option(8192, "token budget of one micro-batch")
    lr: float = option(1e-6, "peak learning rate")
    lr_warmup_iters: int = option(0, "linear warmup steps")
    lr_decay_style: Literal["constant", "cosine"] = option("constant", "schedule after warmup")
    min_lr: float = option(0.0, "floor of the cosine schedule")
    weight_decay: float = option(0.0, "AdamW weight decay")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.98, "AdamW beta2")
    clip_grad: float = option(1.0, "gradient-norm clip (0: off)")
    optimizer_cpu_offload: bool = option(False, "keep the fp32 master weights and Adam moments in pinned host "
                                         "memory; each step streams them through the GPU in chunks")
    offload_train: bool | None = option(None, "colocated: keep the compute weights, gradients, fp32 master weights "
                                        "and Adam moments in pausable GPU memory, released while the engine "
                                        "generates (gradients and compute weights rebuilt, masters and moments "
                                        "placed by --offload-train-optimizer) and restored before the "
                                        "log-probs; needs a CUDA GPU and redline's native library (default: on "
                                        "with a colocated SGLang engine, else off)")
    offload_train_optimizer: Literal["auto", "host", "gpu"] = option(
        "auto", "--offload-train: where the state the GPU cannot rebuild is while the engine generates, the fp32 "
        "master weights and Adam moments (with --optimizer-cpu-offload, whose masters are in host memory: the "
        "compute weights): auto (decided at start-up: it stays on the GPU when the engine's weights and KV cache "
        "fit in its free memory with the rest of the trainer paused, SGLang's being --sglang-mem-fraction-static "
        "of the GPU; else host), host (copied to pinned host memory and back every step; the copies are most of "
        "the pause and resume) or gpu (it stays resident: less memory for the engine, a transition of little "
        "more than dropping the gradients and, masters on the GPU, rebuilding the compute weights)")
    max_bad_steps: int = option(3, "stop after this many NaN/inf steps")
    sft_steps: int = option(0, "SFT warm-up optimizer steps before RL")
    sft_lr: float | None = option(None, "learning rate of the SFT warm-up (defaults to lr)")
    seed: int = option(1234, "random seed")


@dataclass
class SyncConfig:
    update_weights_interval: int = option(1, "--async-rollout: push the trainer's weights to the engines every N "
                                          "rollout steps")
    update_weight_buffer_size: int = option(512 * 2**20, "bytes per weight-sync bucket (dtype-homogeneous, a "
                                            "layer's tensors never split)")
    offload_rollout: bool = option(False, "colocated: the engine releases its weights and KV cache after each "
                                   "rollout and takes them back around the weight sync")
    offload_rollout_level: list[str] = option(
        ["kv_cache", "weight"], "with --offload-rollout: what the engine releases after each rollout, kv_cache "
        "and/or weight (slime's values; default both); kv_cache alone keeps the engine's weights on the GPU while "
        "the trainer works, so the push loads into them without resuming their memory first")
    check_weights: bool = option(False, "check every row of every weight-sync bucket on every push (default: "
                                 "every 16th row); with SGLang servers (--no-colocate) it also turns on "
                                 "--check-sglang-weights")
    check_sglang_weights: bool = option(False, "--no-colocate with SGLang servers: after each push, compare the "
                                        "servers' /weights_checker hashes of their parameters with the sent "
                                        "tensors (a mismatch stops the run); a colocated SGLang push is always "
                                        "checked this way (the only check SGLang offers)")


@dataclass
class CheckpointConfig:
    output_dir: str | None = option(None, "run folder (default runs/<name>-<time>/)")
    run_name: str = option("run", "name of the run")
    save_interval: int | None = option(None, "save every N rollouts")
    load: str | None = option(None, "resume from this checkpoint folder")
    overwrite: bool = option(False, "replace the previous run in --output-dir (its folder is emptied first); "
                             "without it a used folder is refused unless --load resumes from it")
    save_hf: str | None = option(None, "export an HF directory here at the end")
    eval_interval: int | None = option(None, "evaluate every N rollouts")
    use_wandb: bool = option(False, "also log to Weights & Biases")
    auto_resume: bool = option(False, "--ray-address: when a trainer rank dies, recreate the actors and continue "
                               "from the last checkpoint (from the start when none was saved)")
    max_restarts: int = option(3, "--auto-resume: restarts allowed before the run fails")


@dataclass
class ProfileConfig:
    use_pytorch_profiler: bool = option(False, "trace RL steps --profile-step-start .. --profile-step-end - 1 with "
                                        "torch.profiler (each phase a named range) into <run>/profile/: a Chrome "
                                        "trace per rank and what the GPU did in each phase (busy, idle, exposed "
                                        "communication, top kernels)")
    profile_step_start: int = option(3, "first profiled RL step, numbered as in metrics.jsonl (the default "
                                        "leaves out the first steps' one-time costs)")
    profile_step_end: int = option(4, "the profiled steps end before this one")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
