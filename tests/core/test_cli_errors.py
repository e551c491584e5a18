"""``redline train``: every user error is one ``error: ...`` line naming the flag, file or line, exit status 2;
a traceback only with ``--debug`` (issue 22, item 8)."""

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from redline.cli import main
from redline.loop.builtin import tiny_model

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"
SMALL = ["--num-rollout", "1", "--rollout-batch-size", "5", "--n-samples-per-prompt", "4",
         "--global-batch-size", "20", "--sft-steps", "0", "--eval-interval", "100"]


def train(*flags):
    return CliRunner().invoke(main, ["train", str(QUICKSTART), *SMALL, *flags])


def assert_one_error_line(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def broken_model(model_dir, tmp_path):
    """A copy of the tiny model's folder to damage."""
    folder = tmp_path / "model"
    folder.mkdir()
    for path in model_dir.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return folder


def test_negative_learning_rate(tmp_path):
    assert_one_error_line(train("--lr", "-1", "--output-dir", str(tmp_path / "run")), "--lr must be > 0, got -1")


def test_range_checks_come_before_the_batch_product(tmp_path):
    out = str(tmp_path / "run")
    assert_one_error_line(train("--global-batch-size", "-200", "--num-steps-per-rollout", "-1", "--output-dir", out),
                          "--global-batch-size must be >= 1, got -200")
    assert_one_error_line(train("--rollout-batch-size", "-25", "--output-dir", out),
                          "--rollout-batch-size must be >= 1, got -25")


def test_output_dir_naming_a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    assert_one_error_line(train("--output-dir", str(path)), f"--output-dir {path}")
    assert path.read_text() == "x"


@pytest.mark.parametrize("bad_line,expected", [
    ("{not json", "not valid JSON"),
    (json.dumps({"question": "2+2=", "label": "4"}), "no key 'prompt' (--input-key)"),
    (json.dumps({"prompt": "2+2="}), "no label under 'label' (--label-key)"),
])
def test_a_bad_record_after_the_first_names_file_and_line(tmp_path, bad_line, expected):
    data = tmp_path / "prompts.jsonl"
    good = json.dumps({"prompt": "1+1=", "label": "2"})
    data.write_text(f"{good}\n{good}\n{bad_line}\n")
    assert_one_error_line(train("--prompt-data", str(data), "--output-dir", str(tmp_path / "run")),
                          f"{data}:3: {expected}")


def test_corrupt_tokenizer_json(broken_model, tmp_path):
    text = (broken_model / "tokenizer.json").read_text()
    (broken_model / "tokenizer.json").write_text(text[: len(text) // 2])
    assert_one_error_line(train("--hf-checkpoint", str(broken_model), "--output-dir", str(tmp_path / "run")),
                          f"--hf-checkpoint {broken_model / 'tokenizer.json'}: corrupt JSON")


def test_tokenizer_json_that_is_json_but_no_tokenizer(broken_model, tmp_path):
    (broken_model / "tokenizer.json").write_text(json.dumps({"model": {"type": "Nonsense"}}))
    assert_one_error_line(train("--hf-checkpoint", str(broken_model), "--output-dir", str(tmp_path / "run")),
                          f"--hf-checkpoint {broken_model / 'tokenizer.json'}: not a tokenizer the tokenizers "
                          "library reads")


def test_truncated_safetensors(broken_model, tmp_path):
    weights = broken_model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    assert_one_error_line(train("--hf-checkpoint", str(broken_model), "--output-dir", str(tmp_path / "run")),
                          f"--hf-checkpoint {weights}: truncated safetensors file")


@pytest.fixture
def failing_reward(tmp_path, monkeypatch):
    (tmp_path / "failing_reward.py").write_text(textwrap.dedent("""
        async def reward(sample):
            raise KeyError("score")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "failing_reward:reward"


def test_an_error_during_the_run_is_one_line_too(failing_reward, tmp_path):
    assert_one_error_line(train("--custom-rm-path", failing_reward, "--output-dir", str(tmp_path / "run")),
                                 f"reward --custom-rm-path {failing_reward} raised KeyError", "on sample ")


def test_debug_shows_the_traceback(failing_reward, tmp_path):
    from redline.rollout.rewards import RewardError

    result = train("--custom-rm-path", failing_reward, "--output-dir", str(tmp_path / "run"), "--debug")
    assert isinstance(result.exception, RewardError)  # raised through, so Python prints its traceback


@pytest.mark.parametrize("flags,expected", [
    (["--custom-rm-path", "no_such_module:reward"], "--custom-rm-path: cannot import module 'no_such_module'"),
    (["--custom-rm-path", "json"], "--custom-rm-path: 'json' is not of the form 'package.module:function'"),
    (["--dynamic-sampling-filter-path", "json:nope"], "--dynamic-sampling-filter-path: module 'json' has no "
                                                       "attribute 'nope'"),
    (["--rm-type", "mathh"], "--rm-type mathh: unknown; built-ins are math, exact_match, f1, remote_rm"),
])
def test_user_function_paths_are_checked_at_start_up(tmp_path, flags, expected):
    assert_one_error_line(train(*flags, "--output-dir", str(tmp_path / "run")), expected)
