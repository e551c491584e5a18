"""Configuration checks that run before any model loads name the flag or file at fault."""

import dataclasses
import json

import pytest

from redline.config import RunConfig
from redline.configfile import ConfigError, apply_overrides
from redline.loop.builtin import tiny_model
from redline.loop.validate import loss_config, validate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    return path


def config_with(model_dir, data_file, **overrides):
    base = {"hf_checkpoint": str(model_dir), "prompt_data": str(data_file), "rm_type": "exact_match",
            "rollout_batch_size": "4", "n_samples_per_prompt": "4", "global_batch_size": "16"}
    return apply_overrides(RunConfig(), {**base, **overrides})


def test_a_consistent_config_passes(model_dir, data_file):
    validate(config_with(model_dir, data_file))


def test_batch_arithmetic_names_all_four_flags(model_dir, data_file):
    config = config_with(model_dir, data_file, global_batch_size="12")
    with pytest.raises(ConfigError, match=r"--rollout-batch-size \(4\) × --n-samples-per-prompt \(4\) = 16.*"
                                          r"--global-batch-size \(12\) × --num-steps-per-rollout \(1\) = 12"):
        validate(config)


def test_missing_model_files_are_named(tmp_path, data_file):
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match=r"--hf-checkpoint .*m: config.json is missing"):
        validate(config_with(tmp_path / "m", data_file))
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no \\*.safetensors weights"):
        validate(config_with(tmp_path / "m", data_file))


def test_missing_data_key_names_file_and_line(model_dir, data_file):
    with pytest.raises(ConfigError, match=rf"{data_file}:1: no key 'question' \(--input-key\)"):
        validate(config_with(model_dir, data_file, input_key="question"))
    with pytest.raises(ConfigError, match=r"--prompt-data /nope.jsonl: file not found"):
        validate(config_with(model_dir, "/nope.jsonl"))


def test_rl_without_a_reward_is_rejected(model_dir, data_file):
    config = config_with(model_dir, data_file)
    config = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, rm_type=None))
    with pytest.raises(ConfigError, match="RL needs a reward"):
        validate(config)


def test_group_estimators_need_groups(model_dir, data_file):
    config = config_with(model_dir, data_file, n_samples_per_prompt="1", rollout_batch_size="16")
    with pytest.raises(ConfigError, match="--n-samples-per-prompt must be >= 2"):
        validate(config)


def test_fp8_backend_needs_a_gpu_here(model_dir, data_file):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-machine error")
    with pytest.raises(ConfigError, match="--backend native is FP8 and needs a CUDA GPU"):
        validate(config_with(model_dir, data_file, backend="native"))


def test_invalid_loss_settings_surface_at_startup(model_dir, data_file):
    with pytest.raises(ConfigError, match="loss settings: eps_clip_high is required for estimator='cispo'"):
        validate(config_with(model_dir, data_file, advantage_estimator="cispo"))


def test_loss_config_mapping():
    config = apply_overrides(RunConfig(), {"advantage_estimator": "dr_grpo", "use_kl_loss": "true",
                                           "kl_loss_coef": "0.01", "kl_loss_type": "k3",
                                           "rollout_max_response_len": "128"})
    cfg = loss_config(config)
    assert (cfg.estimator, cfg.kl_coef, cfg.kl_type) == ("ppo", 0.01, "k3")
    assert (cfg.agg, cfg.agg_constant) == ("seq-mean-token-sum-norm", 128.0)
    assert loss_config(apply_overrides(RunConfig(), {"kl_loss_coef": "0.5"})).kl_coef == 0.0  # needs --use-kl-loss


def test_placements_the_loop_cannot_run_are_rejected(model_dir, data_file, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # engine processes on the CPU
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size"):
        validate(config_with(model_dir, data_file, tensor_model_parallel_size="2"))
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size"):
        validate(config_with(model_dir, data_file, colocate="false", pipeline_model_parallel_size="2"))
    validate(config_with(model_dir, data_file, colocate="false"))  # disaggregated: engines in their own processes


@pytest.fixture
def machine(monkeypatch):
    """Pretend which optional packages are installed and whether a GPU is visible."""
    import torch

    from redline import extras
    from redline.loop import validate as validate_module

    def pretend(*, installed=(), gpu=False):
        present = lambda module: module in installed  # noqa: E731
        monkeypatch.setattr(extras, "available", present)
        monkeypatch.setattr(validate_module, "available", present)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    return pretend


def test_sglang_engine_needs_sglang_installed(model_dir, data_file, machine):
    machine(installed=("aiohttp",), gpu=True)
    with pytest.raises(ConfigError, match=r"--rollout-engine sglang needs SGLang, which is not installed: "
                                          r"pip install 'redline\[sglang\]'"):
        validate(config_with(model_dir, data_file, rollout_engine="sglang"))


def test_sglang_engine_needs_a_gpu(model_dir, data_file, machine):
    machine(installed=("sglang", "aiohttp"), gpu=False)
    with pytest.raises(ConfigError, match="--rollout-engine sglang needs a CUDA GPU"):
        validate(config_with(model_dir, data_file, rollout_engine="sglang"))


def test_sglang_options_are_checked(model_dir, data_file, machine):
    machine(installed=("sglang", "aiohttp"), gpu=True)
    validate(config_with(model_dir, data_file, rollout_engine="sglang"))
    with pytest.raises(ConfigError, match="--sglang-mem-fraction-static must be between 0 and 1, got 1.5"):
        validate(config_with(model_dir, data_file, rollout_engine="sglang", sglang_mem_fraction_static="1.5"))
    with pytest.raises(ConfigError, match="set the memory fraction with --sglang-mem-fraction-static"):
        validate(config_with(model_dir, data_file, rollout_engine="sglang",
                             sglang_args="--mem-fraction-static=0.3"))
    with pytest.raises(ConfigError, match="--embedded-engine-process applies to the embedded engine"):
        validate(config_with(model_dir, data_file, rollout_engine="sglang", embedded_engine_process="true"))


def test_attaching_servers_needs_the_sglang_engine(model_dir, data_file, machine):
    machine(installed=(), gpu=False)
    with pytest.raises(ConfigError, match="--sglang-server-urls attaches SGLang servers, but the rollout engine is "
                                          "embedded: add --rollout-engine sglang"):
        validate(config_with(model_dir, data_file, sglang_server_urls="http://127.0.0.1:30000"))


def test_checking_sglang_weights_needs_the_sglang_engine(model_dir, data_file, machine):
    machine(installed=(), gpu=False)
    with pytest.raises(ConfigError, match="--check-sglang-weights checks SGLang servers, but the rollout engine is "
                                          "embedded: add --rollout-engine sglang"):
        validate(config_with(model_dir, data_file, check_sglang_weights="true"))


@pytest.mark.parametrize("installed,gpu,expected", [(("sglang",), True, "sglang"), (("sglang",), False, "embedded"),
                                                    ((), True, "embedded"), ((), False, "embedded")])
def test_auto_engine_is_sglang_only_where_it_can_run(machine, installed, gpu, expected):
    from redline.loop.rollout_setup import resolve_engine

    machine(installed=installed, gpu=gpu)
    assert resolve_engine(RunConfig()) == expected
    assert resolve_engine(apply_overrides(RunConfig(), {"rollout_engine": "embedded"})) == "embedded"


def test_weight_buffer_size_must_be_positive(model_dir, data_file):
    with pytest.raises(ConfigError, match="--update-weight-buffer-size must be >= 1 byte, got 0"):
        validate(config_with(model_dir, data_file, update_weight_buffer_size="0"))


def saved_checkpoint(root, ranks: int, layout: dict | None):
    """A checkpoint folder under ``root`` as ``checkpoint.save`` leaves it: state with its layout (None: a folder
    from before TP/PP, which recorded none) and one rank state per process."""
    from redline.loop import state_file

    folder = root / "checkpoints" / "rollout_3"
    folder.mkdir(parents=True)
    (root / "checkpoints" / "latest").write_text("rollout_3")
    state_file.save(folder / "state", {"rollout_id": 3, **({"layout": layout} if layout else {})})
    for rank in range(ranks):
        state_file.save(folder / f"rank{rank}", {})
    return folder


def test_load_needs_a_checkpoint_saved_by_as_many_ranks(model_dir, data_file, tmp_path):
    with pytest.raises(ConfigError, match="--load .*nowhere: no checkpoint there"):
        validate(config_with(model_dir, data_file, load=str(tmp_path / "nowhere")))
    saved_checkpoint(tmp_path, ranks=2, layout=None)  # data-parallel only: the rank states count the ranks
    with pytest.raises(ConfigError, match=r"saved at layout DP=2 × TP=1 × PP=1, this run is DP=1 × TP=1 × PP=1"):
        validate(config_with(model_dir, data_file, load=str(tmp_path)))
    validate(config_with(model_dir, data_file, load=str(tmp_path)), world_size=2)


@pytest.fixture(scope="module")
def even_vocab_model(tmp_path_factory):
    """The tiny model with its vocabulary padded to a multiple of 2 (the built-in model under TP=2)."""
    return tiny_model(tmp_path_factory.mktemp("model2"), vocab_multiple=2)


def test_model_parallel_layouts_that_fit_pass(even_vocab_model, data_file):
    """TP=2+SP on 2 processes, PP=2 on 2, DP=2 × TP=2 on 4: validation raises nothing."""
    layouts = [({"tensor_model_parallel_size": "2", "sequence_parallel": "true"}, 2),
               ({"pipeline_model_parallel_size": "2"}, 2), ({"tensor_model_parallel_size": "2"}, 4)]
    for flags, world_size in layouts:
        assert validate(config_with(even_vocab_model, data_file, **flags), world_size=world_size) is None


def test_world_size_must_be_dp_times_tp_times_pp(even_vocab_model, data_file):
    config = config_with(even_vocab_model, data_file, tensor_model_parallel_size="2",
                         pipeline_model_parallel_size="2")
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size 2 × --pipeline-model-parallel-size 2 = 4 "
                                          r"processes per model replica, but torchrun started 6"):
        validate(config, world_size=6)
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size 2 / --pipeline-model-parallel-size 2 need "
                                          r"4 processes: launch with torchrun --nproc-per-node 4"):
        validate(config, world_size=1)


def test_tp_must_divide_heads_kv_heads_and_vocab(model_dir, even_vocab_model, data_file):
    # the tiny model: 4 attention heads, 2 KV heads, a vocabulary of 19 (20 padded)
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size 2 must divide the model's vocab_size \(19"):
        validate(config_with(model_dir, data_file, tensor_model_parallel_size="2"), world_size=2)
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size 3 must divide the model's "
                                          r"num_attention_heads \(4"):
        validate(config_with(even_vocab_model, data_file, tensor_model_parallel_size="3"), world_size=3)
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size 4 must divide the model's "
                                          r"num_key_value_heads \(2"):
        validate(config_with(even_vocab_model, data_file, tensor_model_parallel_size="4"), world_size=4)


def test_pp_needs_a_layer_per_stage(even_vocab_model, data_file):
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-size 3 is more than the model's "
                                          r"num_hidden_layers \(2\)"):
        validate(config_with(even_vocab_model, data_file, pipeline_model_parallel_size="3"), world_size=3)


def test_offload_rollout_level_takes_slimes_values_with_offload_rollout(model_dir, data_file):
    with pytest.raises(ConfigError, match=r"--offload-rollout-level kv_cache weights: give one or both of kv_cache, "
                                          r"weight \(weights is not one\)"):
        validate(config_with(model_dir, data_file, offload_rollout="true", offload_rollout_level="kv_cache,weights"))
    with pytest.raises(ConfigError, match=r"--offload-rollout-level kv_cache says what --offload-rollout releases"):
        validate(config_with(model_dir, data_file, offload_rollout_level="kv_cache"))
    validate(config_with(model_dir, data_file, offload_rollout="true", offload_rollout_level="kv_cache"))
    validate(config_with(model_dir, data_file, offload_rollout_level="weight,kv_cache"))  # the default, reordered


def test_pipeline_stage_layer_counts_are_checked_at_start_up(even_vocab_model, data_file):
    with pytest.raises(ConfigError, match=r"--decoder-last-pipeline-num-layers 1 places layers on pipeline stages: it "
                                          r"needs --pipeline-model-parallel-size > 1 \(got 1\)"):
        validate(config_with(even_vocab_model, data_file, decoder_last_pipeline_num_layers="1"))
    config = config_with(even_vocab_model, data_file, pipeline_model_parallel_size="2",
                         decoder_first_pipeline_num_layers="2")
    with pytest.raises(ConfigError, match=r"--decoder-first-pipeline-num-layers 2 / --decoder-last-pipeline-num-layers "
                                          r"None with --pipeline-model-parallel-size 2 and the model's 2 layers .*"
                                          r"every stage needs at least one layer"):
        validate(config, world_size=2)
    validate(config_with(even_vocab_model, data_file, pipeline_model_parallel_size="2",
                         decoder_first_pipeline_num_layers="1"), world_size=2)


def test_sequence_parallel_needs_tp(even_vocab_model, data_file):
    with pytest.raises(ConfigError, match=r"--sequence-parallel .* needs --tensor-model-parallel-size > 1 \(got 1\)"):
        validate(config_with(even_vocab_model, data_file, sequence_parallel="true"), world_size=2)
    with pytest.raises(ConfigError, match=r"--tp-comm-overlap overlaps .* it needs --sequence-parallel"):
        validate(config_with(even_vocab_model, data_file, tensor_model_parallel_size="2", tp_comm_overlap="true"),
                 world_size=2)
    validate(config_with(even_vocab_model, data_file, tensor_model_parallel_size="2", sequence_parallel="true",
                         tp_comm_overlap="true"), world_size=2)


def test_batch_sizes_split_over_the_data_parallel_ranks_only(even_vocab_model, data_file):
    # 4 processes at TP=2 are 2 data-parallel ranks: 6 prompts split over them (not over 4 processes), 3 do not
    validate(config_with(even_vocab_model, data_file, tensor_model_parallel_size="2", rollout_batch_size="6",
                         global_batch_size="24"), world_size=4)
    config = config_with(even_vocab_model, data_file, tensor_model_parallel_size="2", rollout_batch_size="3",
                         global_batch_size="12")
    with pytest.raises(ConfigError, match="--rollout-batch-size 3 does not split over 2 data-parallel ranks"):
        validate(config, world_size=4)


def test_ppo_critic_is_refused_under_pp(even_vocab_model, data_file):
    with pytest.raises(ConfigError, match=r"--advantage-estimator ppo: .* --pipeline-model-parallel-size 2"):
        validate(config_with(even_vocab_model, data_file, pipeline_model_parallel_size="2",
                             advantage_estimator="ppo"), world_size=2)


def test_load_at_another_layout_is_refused_naming_both(even_vocab_model, data_file, tmp_path):
    saved_checkpoint(tmp_path, ranks=2, layout={"dp": 1, "tp": 1, "pp": 2})
    config = config_with(even_vocab_model, data_file, tensor_model_parallel_size="2", load=str(tmp_path))
    with pytest.raises(ConfigError, match=r"saved at layout DP=1 × TP=1 × PP=2, this run is DP=1 × TP=2 × PP=1"):
        validate(config, world_size=2)
    # saved before stage splits were recorded: the even split (1 + 1 here), which this run's split equals
    validate(config_with(even_vocab_model, data_file, pipeline_model_parallel_size="2", load=str(tmp_path)),
             world_size=2)


def test_load_with_another_pipeline_split_is_refused_naming_both(even_vocab_model, data_file, tmp_path):
    saved_checkpoint(tmp_path, ranks=2, layout={"dp": 1, "tp": 1, "pp": 2, "stages": [2, 1]})
    config = config_with(even_vocab_model, data_file, pipeline_model_parallel_size="2", load=str(tmp_path))
    with pytest.raises(ConfigError, match=r"saved at layout DP=1 × TP=1 × PP=2 \(layers 2\+1\), this run is "
                                          r"DP=1 × TP=1 × PP=2 \(layers 1\+1\) .*--decoder-first/last-pipeline"):
        validate(config, world_size=2)


def test_async_rollout_is_refused_under_model_parallelism(even_vocab_model, data_file):
    with pytest.raises(ConfigError, match=r"--async-rollout one-step with --tensor-model-parallel-size 2 / "
                                          r"--pipeline-model-parallel-size 1 is not supported yet"):
        validate(config_with(even_vocab_model, data_file, tensor_model_parallel_size="2", async_rollout="one-step"),
                 world_size=2)


def test_no_colocate_beside_model_and_data_parallelism(even_vocab_model, data_file, monkeypatch):
    """TP=2 + SP or PP=2 on 2 processes with --no-colocate pass (engine processes on the CPU here), also with
    --async-rollout one-step and full; so does data parallelism beside them (DP=2 × TP=2 on 4 processes, DP=2 on 2),
    also with --async-rollout one-step, not full (refused, naming the flags and sizes); --async-rollout with a
    colocated engine is refused, with data parallelism too."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for flags in ({"tensor_model_parallel_size": "2", "sequence_parallel": "true"},
                  {"pipeline_model_parallel_size": "2"}):
        assert validate(config_with(even_vocab_model, data_file, colocate="false", **flags), world_size=2) is None
    dp2_tp2 = config_with(even_vocab_model, data_file, colocate="false", tensor_model_parallel_size="2",
                          rollout_batch_size="8", global_batch_size="32")
    assert validate(dp2_tp2, world_size=4) is None
    assert validate(apply_overrides(dp2_tp2, {"tensor_model_parallel_size": "1"}), world_size=2) is None
    assert validate(apply_overrides(dp2_tp2, {"async_rollout": "one-step"}), world_size=4) is None
    with pytest.raises(ConfigError, match=r"--async-rollout full with --no-colocate runs the trainer in one process .* "
                                          r"not 4 torchrun processes = 2 data-parallel ranks × "
                                          r"--tensor-model-parallel-size 2 × --pipeline-model-parallel-size 1: use "
                                          r"--async-rollout one-step with data parallelism"):
        validate(apply_overrides(dp2_tp2, {"async_rollout": "full"}), world_size=4)
    colocated_dp = apply_overrides(dp2_tp2, {"colocate": "true", "tensor_model_parallel_size": "1",
                                             "rollout_engine": "embedded", "embedded_engine_process": "true",
                                             "async_rollout": "one-step"})
    with pytest.raises(ConfigError, match=r"--async-rollout one-step with data parallelism \(2 torchrun processes\) "
                                          r"needs --no-colocate"):
        validate(colocated_dp, world_size=2)
    for mode in ("one-step", "full"):
        validate(config_with(even_vocab_model, data_file, colocate="false", tensor_model_parallel_size="2",
                             async_rollout=mode), world_size=2)
    with pytest.raises(ConfigError, match=r"--async-rollout full with --tensor-model-parallel-size 2 .* use "
                                          r"--async-rollout off, or add --no-colocate"):
        validate(config_with(even_vocab_model, data_file, tensor_model_parallel_size="2", async_rollout="full"),
                 world_size=2)


def test_no_colocate_engine_gpus_come_after_the_trainers(even_vocab_model, data_file, monkeypatch):
    import torch

    from redline.loop.rollout_setup import engine_devices
    from redline.loop.validate import check_placement

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's processes on this node: the TP=2 trainer
    config = config_with(even_vocab_model, data_file, colocate="false", tensor_model_parallel_size="2",
                         rollout_num_gpus="2")
    with pytest.raises(ConfigError, match=r"the trainer takes GPUs 0-1 \(one per torchrun process on this node\) "
                                          r"and each engine one more GPU after them, 4 in all, but 3 are visible "
                                          r".*lower --rollout-num-gpus or the torchrun processes "
                                          r"\(--nproc-per-node 2: data-parallel size × --tensor-model-parallel-size "
                                          r"2 × --pipeline-model-parallel-size 1\), or drop --no-colocate"):
        check_placement(config, world_size=2)
    fits = apply_overrides(config, {"rollout_num_gpus": "1"})
    check_placement(fits, world_size=2)
    assert engine_devices(fits) == [torch.device("cuda", 2)]
