"""RolloutManager with the embedded engine: groups, dynamic filter, partial rollout, custom generate, eval."""

import asyncio
import json

import pytest
import torch
from redline.rollout.data import DataSource, PromptDataset
from redline.rollout.embedded.engine import EmbeddedEngine
from redline.rollout.evaluation import EvalSet, evaluate, pass_at_k
from redline.rollout.functions import load_function
from redline.rollout.generate import generate_sample
from redline.rollout.manager import RolloutManager
from redline.rollout.rewards import Reward
from redline.rollout.types import GenerateRequest, SamplingParams, Status


@pytest.fixture
def dataset(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}", "label": str(i)}) + "\n" for i in range(8)))
    return PromptDataset(path, tokenizer)


def rewards_of(fn):
    async def score(samples):
        return [fn(s) for s in samples]
    return Reward(score)


def run_manager(model_dir, dataset, coro_fn, max_seq_len=64, max_batch_size=8, **kwargs):
    async def main():
        engine = EmbeddedEngine.from_pretrained(model_dir, dtype=torch.float32, max_batch_size=max_batch_size,
                                                max_seq_len=max_seq_len)
        kwargs.setdefault("reward", rewards_of(lambda s: 1.0))
        kwargs.setdefault("params", SamplingParams(max_new_tokens=6, seed=None))
        manager = RolloutManager(engine, engine.tokenizer, DataSource(dataset, shuffle=False), **kwargs)
        try:
            return await coro_fn(manager)
        finally:
            await engine.shutdown()
    return asyncio.run(main())


def test_rollout_returns_scored_groups_of_finished_samples(model_dir, dataset):
    out = run_manager(model_dir, dataset, lambda m: m.generate_rollout(), rollout_batch_size=3,
                      n_samples_per_prompt=2, reward=rewards_of(lambda s: float(s.index)))
    assert len(out.groups) == 3 and all(len(g) == 2 for g in out.groups)
    for group in out.groups:
        assert len({s.group_index for s in group}) == 1
        for s in group:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED)
            assert s.reward == float(s.index)
            assert s.tokens[:s.prompt_length] == dataset.samples[s.group_index].tokens
            assert len(s.loss_mask) == len(s.rollout_logp) == s.response_length > 0
            assert s.weight_versions == ["0"]
    samples = [s for g in out.groups for s in g]
    assert out.metrics["rollout/reward_mean"] == pytest.approx(sum(s.index for s in samples) / 6)


def test_dynamic_filter_by_path_drops_groups_whose_rewards_agree(model_dir, dataset):
    # Even groups get identical rewards (dropped); odd groups get differing ones (kept).
    reward = rewards_of(lambda s: float(s.index % 2) if s.group_index % 2 else 1.0)
    keep = load_function("redline.rollout.filters:reward_std_nonzero", what="--dynamic-sampling-filter-path")
    out = run_manager(model_dir, dataset, lambda m: m.generate_rollout(), rollout_batch_size=2,
                      n_samples_per_prompt=2, over_sampling_batch_size=2, reward=reward, dynamic_filter=keep)
    assert sorted(g[0].group_index for g in out.groups) == [1, 3]
    assert out.metrics["rollout/dropped_groups"] == 2


async def fast_first_group(engine, tokenizer, sample, params):
    """Group 0 finishes after 2 tokens; the others run long enough to be in flight when it does."""
    return await generate_sample(engine, tokenizer, sample,
                                 params.replace(max_new_tokens=2) if sample.group_index == 0 else params)


async def eight_more_tokens(engine, tokenizer, sample, params):
    """A continuation of ``sample`` by 8 tokens, whatever its budget: keeps the test's second rollout short."""
    return await generate_sample(engine, tokenizer, sample, params.replace(max_new_tokens=sample.response_length + 8))


def test_partial_rollout_returns_unfinished_groups_and_continues_them(model_dir, dataset):
    async def two_steps(manager):
        first = await manager.generate_rollout()
        buffered = {g[0].group_index: [(list(s.tokens), s.status) for s in g] for g in manager.data_source.buffer}
        manager.generate_fn = eight_more_tokens
        manager.rollout_batch_size = manager.over_sampling_batch_size = 2  # exactly the two buffered groups
        second = await manager.generate_rollout()
        return first, buffered, second
    # no sample of groups 1, 2 may end on its own before group 0's 2 tokens end the first rollout, however late the
    # event loop sees that (a loaded CI machine once let 300 tokens finish first)
    params = SamplingParams(max_new_tokens=5000, ignore_eos=True)
    first, buffered, second = run_manager(
        model_dir, dataset, two_steps, max_seq_len=5100, max_batch_size=4, rollout_batch_size=1,
        n_samples_per_prompt=2,
        over_sampling_batch_size=3, partial_rollout=True, params=params, generate_fn=fast_first_group)
    assert [g[0].group_index for g in first.groups] == [0]
    assert sorted(buffered) == [1, 2]  # 6 samples through 4 rows: two were still queued at the abort
    statuses = [status for g in buffered.values() for _, status in g]
    assert all(status == Status.ABORTED for status in statuses), statuses
    assert first.metrics["rollout/returned_groups"] == 2
    assert sorted(g[0].group_index for g in second.groups) == [1, 2]
    for group in second.groups:
        for sample, (tokens_before, _) in zip(group, buffered[group[0].group_index]):
            assert sample.tokens[:len(tokens_before)] == tokens_before  # partial response kept, then extended
            had_partial = len(tokens_before) > sample.prompt_length
            assert len(sample.weight_versions) == (2 if had_partial else 1)  # one per call that produced tokens
            assert len(sample.tokens) == len(tokens_before) + 8


def test_without_partial_rollout_unfinished_groups_are_discarded(model_dir, dataset):
    async def step(manager):
        out = await manager.generate_rollout()
        return out, len(manager.data_source.buffer)
    out, buffered = run_manager(model_dir, dataset, step, max_seq_len=400, rollout_batch_size=1,
                                n_samples_per_prompt=1, over_sampling_batch_size=3,
                                params=SamplingParams(max_new_tokens=300), generate_fn=fast_first_group)
    assert buffered == 0 and out.metrics["rollout/discarded_groups"] == 2


TOOL_OUTPUT = [5, 6, 7]


async def tool_use(engine, tokenizer, sample, params):
    """Two policy turns with a tool result between them (masked out of the loss)."""
    for turn in range(2):
        [result] = await engine.generate([GenerateRequest(sample.tokens, params.replace(max_new_tokens=3))])
        sample.add_generation(result)
        if turn == 0:
            sample.append_response(TOOL_OUTPUT, None, trainable=False)
    sample.response = tokenizer.decode(sample.response_ids)
    return sample


def test_custom_generate_masks_tool_tokens(model_dir, dataset):
    out = run_manager(model_dir, dataset, lambda m: m.generate_rollout(), rollout_batch_size=1,
                      n_samples_per_prompt=1, generate_fn=tool_use,
                      params=SamplingParams(max_new_tokens=3, stop_token_ids=()))
    [[sample]] = out.groups
    first = sample.loss_mask.index(0)
    assert sample.response_ids[first:first + 3] == TOOL_OUTPUT
    assert sample.loss_mask == [1] * first + [0, 0, 0] + [1] * (sample.response_length - first - 3)
    assert sample.rollout_logp[first:first + 3] == [0.0, 0.0, 0.0]
    assert all(lp < 0 for i, lp in enumerate(sample.rollout_logp) if sample.loss_mask[i])


def test_pass_at_k_estimator():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0


def test_evaluate_reports_mean_reward_and_pass_at_k(model_dir, dataset):
    # Prompt i gets reward 1 on sample j < (i % 3): prompts have 0, 1 or 2 correct answers out of 4.
    async def score(samples):
        i = int(samples[0].label)
        return [1.0 if j < i % 3 else 0.0 for j in range(len(samples))]

    async def main():
        engine = EmbeddedEngine.from_pretrained(model_dir, dtype=torch.float32, max_batch_size=8, max_seq_len=64)
        try:
            eval_set = EvalSet("toy", dataset, SamplingParams(max_new_tokens=2), n_samples_per_prompt=4)
            return await evaluate(engine, engine.tokenizer, eval_set, Reward(score))
        finally:
            await engine.shutdown()
    metrics = asyncio.run(main())
    correct = [i % 3 for i in range(8)]
    assert metrics["eval/toy/reward_mean"] == pytest.approx(sum(correct) / 32)
    for k in (1, 2, 4):
        assert metrics[f"eval/toy/pass@{k}"] == pytest.approx(sum(pass_at_k(4, c, k) for c in correct) / 8)


@pytest.mark.parametrize("shard", [(0, 0), (2, 2), (-1, 2)])
def test_evaluate_rejects_a_shard_outside_its_world(dataset, shard):
    eval_set = EvalSet("toy", dataset, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=r"shard=\(rank, world\) needs 0 <= rank < world"):
        asyncio.run(evaluate(None, None, eval_set, Reward(lambda samples: [0.0] * len(samples)), shard=shard))
