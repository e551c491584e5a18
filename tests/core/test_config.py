"""The typed TOML config: loading, rejection of unknown keys and bad types, CLI overrides."""

import textwrap

import pytest
from click.testing import CliRunner

from redline.cli import main
from redline.config import RunConfig
from redline.configfile import ConfigError, apply_overrides, from_mapping, load_toml, to_mapping


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_toml_values_land_in_their_sections(tmp_path):
    path = write(tmp_path, """
        [rollout]
        rollout_batch_size = 16
        n_samples_per_prompt = 8
        [algo]
        eps_clip_high = 0.28
        advantage_estimator = "gspo"
    """)
    config = load_toml(RunConfig, path)
    assert config.rollout.rollout_batch_size == 16
    assert config.rollout.n_samples_per_prompt == 8
    assert config.algo.eps_clip_high == 0.28
    assert config.algo.advantage_estimator == "gspo"
    assert config.train.global_batch_size == RunConfig().train.global_batch_size


def test_unknown_key_names_file_line_and_key(tmp_path):
    path = write(tmp_path, """
        [algo]
        eps_clip = 0.2
        eps_clipp = 0.3
    """)
    with pytest.raises(ConfigError, match=rf"{path}:4: \[algo\] eps_clipp: unknown key"):
        load_toml(RunConfig, path)


def test_unknown_section_is_rejected(tmp_path):
    path = write(tmp_path, "[optimiser]\nlr = 1.0\n")
    with pytest.raises(ConfigError, match=r"unknown section \[optimiser\]"):
        load_toml(RunConfig, path)


@pytest.mark.parametrize("line,expected", [
    ('rollout_batch_size = "many"', "expected an integer"),
    ("rollout_batch_size = 1.5", "expected an integer"),
    ("rollout_batch_size = true", "expected an integer"),
    ('rollout_batch_size = "25"', "expected an integer, got str '25'"),
    ('rollout_batch_size = "25x"', "expected an integer, got str '25x'"),
    ('rollout_temperature = "0.5"', "expected a number, got str '0.5'"),
    ('partial_rollout = "true"', "expected true/false"),
    ("rollout_temperature = \"hot\"", "expected a number"),
    ("partial_rollout = 1", "expected true/false"),
    ('rollout_engine = "vllm"', "'vllm' is not one of"),
])
def test_type_errors_name_the_key(tmp_path, line, expected):
    path = write(tmp_path, f"[rollout]\n{line}\n")
    key = line.split(" ")[0]
    with pytest.raises(ConfigError, match=rf"{path}:2: \[rollout\] {key}: {expected}"):
        load_toml(RunConfig, path)


def test_int_is_accepted_for_a_float_field(tmp_path):
    config = load_toml(RunConfig, write(tmp_path, "[train]\nlr = 1\n"))
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)


def test_missing_file_is_reported():
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(RunConfig, "/nonexistent/run.toml")


def test_overrides_are_typed_and_named():
    config = apply_overrides(RunConfig(), {"global_batch_size": "64", "use_kl_loss": "true",
                                           "rollout_stop": "</s>,\n\n"})
    assert config.train.global_batch_size == 64
    assert config.algo.use_kl_loss is True
    assert config.rollout.rollout_stop == ["</s>", "\n\n"]
    with pytest.raises(ConfigError, match="--global-batch-size: 'lots' is not a valid integer"):
        apply_overrides(RunConfig(), {"global_batch_size": "lots"})
    with pytest.raises(ConfigError, match="unknown option --not-a-flag"):
        apply_overrides(RunConfig(), {"not_a_flag": "1"})


def test_mapping_round_trip():
    config = apply_overrides(RunConfig(), {"kl_loss_coef": "0.01", "hf_checkpoint": "/models/x"})
    assert from_mapping(RunConfig, to_mapping(config)) == config


def test_cli_exposes_slime_flag_names():
    help_text = CliRunner().invoke(main, ["train", "--help"]).output
    for flag in ["--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size", "--advantage-estimator",
                 "--eps-clip", "--eps-clip-high", "--kl-loss-coef", "--kl-loss-type", "--use-kl-loss",
                 "--no-use-kl-loss", "--kl-coef", "--entropy-coef", "--num-rollout", "--save-interval", "--load"]:
        assert flag in help_text


def test_cli_rejects_bad_flag_value_before_anything_runs(tmp_path):
    path = write(tmp_path, "[rollout]\nrollout_batch_size = 4\n")
    result = CliRunner().invoke(main, ["train", str(path), "--eps-clip", "wide"])
    assert result.exit_code == 2
    assert "'--eps-clip': 'wide' is not a valid float" in result.output


def test_cli_names_the_file_for_bad_toml(tmp_path):
    path = write(tmp_path, "[rollout\nrollout_batch_size = 4\n")
    result = CliRunner().invoke(main, ["train", str(path)])
    assert result.exit_code == 2
    assert f"{path}: not valid TOML" in result.output


def test_cli_help_types_the_flags_and_groups_them_by_section():
    help_text = CliRunner().invoke(main, ["train", "--help"], terminal_width=200).output
    sections = ["[model]", "[parallel]", "[data]", "[rollout]", "[algo]", "[train]", "[sync]", "[checkpoint]", "[profile]"]
    positions = [help_text.index(f"{s}:") for s in sections]
    assert positions == sorted(positions)
    rollout = help_text[help_text.index("[rollout]:"):help_text.index("[algo]:")]
    assert "--rollout-batch-size INTEGER" in rollout and "--global-batch-size" not in rollout
    assert "--rollout-temperature FLOAT" in rollout
    assert "--advantage-estimator [grpo|dr_grpo|rloo|" in help_text
    assert "--kl-loss-type [k1|k2|k3|low_var_kl]" in help_text
    assert "--dtype [bfloat16|float32|float16]" in help_text
    assert "--loss-agg-mode [token-mean|" in help_text
    assert "--reward-error [fail|zero]" in help_text
    assert "--debug" in help_text


def test_cli_refuses_a_mistyped_flag_by_its_type(tmp_path):
    path = write(tmp_path, "[rollout]\nrollout_batch_size = 4\n")
    result = CliRunner().invoke(main, ["train", str(path), "--advantage-estimator", "grpoo"])
    assert result.exit_code == 2
    assert "'grpoo' is not one of 'grpo', 'dr_grpo'" in result.output
    result = CliRunner().invoke(main, ["train", str(path), "--num-rollout", "2.5"])
    assert result.exit_code == 2
    assert "'2.5' is not a valid integer" in result.output
