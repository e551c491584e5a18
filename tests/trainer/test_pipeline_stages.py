"""The pipeline's layer split (``redline.trainer.parallel.stages``): Megatron's first/last-stage counts, and the
default that balances the stages with the LM head counted on the last one."""

import pytest

from redline.trainer.models.spec import ModelSpec
from redline.trainer.parallel.stages import head_cost_layers, stage_layers, stage_sizes


def qwen3_8b() -> ModelSpec:
    return ModelSpec(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, qkv_bias=False, o_bias=False, mlp_bias=False,
                     qk_norm=True, tie_word_embeddings=False)


def test_head_cost_is_the_gemm_flop_ratio():
    spec = qwen3_8b()
    layer_gemm = 4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 12288  # q, o, k, v; gate, up, down
    assert head_cost_layers(spec) == pytest.approx(151936 * 4096 / layer_gemm)
    assert 3.1 < head_cost_layers(spec) < 3.3


def test_qwen3_8b_splits_give_the_head_stage_fewer_layers():
    head = head_cost_layers(qwen3_8b())
    assert stage_sizes(8, 2, head_layers=head) == [6, 2]  # the 8-layer slice of issue 17's scaling runs
    assert stage_sizes(36, 2, head_layers=head) == [20, 16]
    assert stage_sizes(36, 4, head_layers=head) == [10, 10, 10, 6]


@pytest.mark.parametrize("layers, pp, head, expected", [
    (8, 2, 0.0, [4, 4]),  # no head: even
    (8, 2, 1.6, [5, 3]),  # the last stage gives up a layer to its head: max(5, 3 + 1.6) < 4 + 1.6
    (36, 2, 1.6, [19, 17]),
    (36, 4, 1.6, [10, 9, 9, 8]),
    (8, 2, 10.0, [7, 1]),  # every stage keeps a layer however heavy the head
    (3, 3, 1.6, [1, 1, 1]),
])
def test_default_split_makes_the_slowest_stage_fastest(layers, pp, head, expected):
    sizes = stage_sizes(layers, pp, head_layers=head)
    assert sizes == expected
    cost = lambda s: max(max(s[:-1]), s[-1] + head)
    for last in range(1, layers - pp + 2):  # no other last-stage count does better
        assert cost(sizes) <= cost(stage_sizes(layers, pp, last=last))


@pytest.mark.parametrize("kwargs, expected", [
    (dict(first=4), [4, 2, 2, 2]),
    (dict(last=1), [3, 3, 3, 1]),
    (dict(first=1, last=1), [1, 4, 4, 1]),
    (dict(first=3, last=4), [3, 2, 1, 4]),  # the rest: the earlier middle stage one longer
])
def test_megatron_first_and_last_stage_counts(kwargs, expected):
    assert stage_sizes(10, 4, head_layers=1.6, **kwargs) == expected


@pytest.mark.parametrize("kwargs", [dict(first=8), dict(last=0), dict(first=5, last=4), dict(first=2, last=1)])
def test_impossible_counts_are_refused(kwargs):
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        stage_sizes(8, 2, **kwargs)


def test_stage_layers_are_contiguous_and_cover_the_model():
    sizes = [3, 2, 1, 4]
    ranges = [stage_layers(sizes, s) for s in range(4)]
    assert [list(r) for r in ranges] == [[0, 1, 2], [3, 4], [5], [6, 7, 8, 9]]


def test_fewer_layers_than_stages_is_refused():
    with pytest.raises(ValueError, match="less than pp"):
        stage_sizes(2, 3)
