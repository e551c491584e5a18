"""Rewards: answer extraction, math equivalence (with timeout), exact match, F1, custom functions."""

import asyncio
import sys
import textwrap

import pytest
from redline.rollout.rewards import build_reward
from redline.rollout.rewards.math_answer import MathGrader, _math_verify_equal, extract_answer, last_boxed
from redline.rollout.rewards.text import exact_match, f1_score
from redline.rollout.types import Sample


def test_last_boxed_matches_nested_braces():
    assert last_boxed(r"first \boxed{1}, then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"


def test_unclosed_boxed_is_ignored():
    assert last_boxed(r"\boxed{3} and \boxed{\frac{1}{2}") == "3"


def test_final_answer_phrase_used_without_boxed():
    assert extract_answer("We add them.\nThe final answer is $42$.") == "42"
    assert extract_answer("work...\n#### 17") == "17"


def test_no_answer_found():
    assert extract_answer("I am not sure.") is None


@pytest.fixture(scope="module")
def grader():
    g = MathGrader(timeout=20.0)
    yield g
    g.close()


@pytest.mark.parametrize("answer,label", [
    (r"\frac{1}{2}", "0.5"),
    (r"\dfrac{3}{6}", r"\frac{1}{2}"),
    (r"2\sqrt{2}", r"\sqrt{8}"),
    (r"\left(x+1\right)^2", "x^2+2x+1"),
    ("1,000", "1000"),
    (r"90^\circ", "90"),
    (r"\sqrt[3]{8}", "2"),
    ("x^2-1", "(x-1)(x+1)"),
    ("(x+1)**2", "x^2+2*x+1"),
    (r"\pi/2", r"\frac{\pi}{2}"),
    ("-4", "-4.0"),
])
def test_math_equivalent_answers(grader, answer, label):
    assert asyncio.run(grader.equal(answer, label))


@pytest.mark.parametrize("answer,label", [(r"\frac{1}{3}", "0.33"), ("x+1", "x-1"), ("hello", "5")])
def test_math_different_answers(grader, answer, label):
    assert not asyncio.run(grader.equal(answer, label))


PAYLOAD = "__import__('os').system('id>{path}')"


def test_math_grading_never_executes_a_response(tmp_path):
    """Issue 22: a response ``\\boxed{__import__('os').system('id>FILE')}`` wrote FILE through sympy's
    parse_expr. Neither the parser (called here in this process, no worker in between) nor the grader runs it."""
    target = tmp_path / "FILE"
    assert not _math_verify_equal(PAYLOAD.format(path=target), "0")
    grader = MathGrader(timeout=20.0)
    try:
        assert asyncio.run(grader.score(r"\boxed{" + PAYLOAD.format(path=target) + "}", "0")) == 0.0
    finally:
        grader.close()
    assert not target.exists()


def test_math_grading_never_executes_a_label(tmp_path, monkeypatch):
    """Issue 22: a label ``open('b','w')`` created the file ``b`` (relative to the grader's working folder)."""
    monkeypatch.chdir(tmp_path)
    assert not _math_verify_equal("1", "open('b','w')")
    grader = MathGrader(timeout=20.0)  # spawned after the chdir: its worker runs in tmp_path too
    try:
        assert not asyncio.run(grader.equal("1", "open('b','w')"))
    finally:
        grader.close()
    assert list(tmp_path.iterdir()) == []


def test_math_timeout_counts_as_wrong_and_recovers():
    grader = MathGrader(timeout=0.05)  # shorter than a spawned worker needs to import sympy
    try:
        assert not asyncio.run(grader.equal("x**2", "y"))
        grader.timeout = 20.0
        assert asyncio.run(grader.equal("(x+1)**2", "x^2+2*x+1"))
    finally:
        grader.close()


def test_exact_match_normalises_case_articles_punctuation():
    assert exact_match("The  Eiffel Tower!", "eiffel tower") == 1.0
    assert exact_match("Eiffel", "eiffel tower") == 0.0


def test_f1_counts_token_overlap():
    # pred tokens {paris, france, city}, gold {paris, france}: p = 2/3, r = 1, F1 = 0.8
    assert f1_score("Paris, France city", "paris france") == pytest.approx(0.8)
    assert f1_score("london", "paris") == 0.0


def samples(*pairs):
    return [Sample(prompt="q", response=r, label=l) for r, l in pairs]


def test_builtin_math_reward_scores_group():
    reward = build_reward("math")
    try:
        rewards = asyncio.run(reward(samples((r"so \boxed{4}", "4"), ("no idea", "4"), (r"\boxed{5}", "4"))))
    finally:
        asyncio.run(reward.close())
    assert rewards == [1.0, 0.0, 0.0]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        async def by_length(sample):
            return len(sample.response)

        async def rank_in_group(samples):
            order = sorted(range(len(samples)), key=lambda i: samples[i].response)
            return [float(order.index(i)) for i in range(len(samples))]

        def not_async(sample):
            return 1.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_custom_per_sample_reward(user_module):
    reward = build_reward(custom_rm_path=f"{user_module}:by_length")
    assert asyncio.run(reward(samples(("ab", None), ("abcd", None)))) == [2.0, 4.0]


def test_custom_group_reward(user_module):
    reward = build_reward(custom_rm_path=f"{user_module}:rank_in_group", group_rm=True)
    assert asyncio.run(reward(samples(("b", None), ("a", None), ("c", None)))) == [1.0, 0.0, 2.0]


def test_custom_reward_must_be_async(user_module):
    with pytest.raises(TypeError, match="--custom-rm-path.*must be an 'async def'"):
        build_reward(custom_rm_path=f"{user_module}:not_async")


def test_custom_reward_path_errors_name_the_flag(user_module):
    with pytest.raises(ValueError, match="--custom-rm-path: 'nocolon'"):
        build_reward(custom_rm_path="nocolon")
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        build_reward(custom_rm_path=f"{user_module}:missing")


def test_unknown_rm_type_lists_builtins():
    with pytest.raises(ValueError, match="'nope' is unknown; built-ins are math"):
        build_reward("nope")
