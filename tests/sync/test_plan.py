"""The bucket planner: grouping, sizes, ordering, tied embeddings, and the byte layout SGLang expects."""

import pytest
import torch
from sync_export import LAYER_TENSORS, layer_bytes, qwen3_export

from redline.sync.plan import LM_HEAD_NAME, TensorSpec, bucketize, layer_group, plan_buckets, plan_for


def test_layer_group_keys_layers_and_leaves_other_names_alone():
    assert layer_group("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert layer_group("model.language_model.layers.0.mlp.up_proj.weight") == "model.language_model.layers.0"
    assert layer_group("model.embed_tokens.weight") == "model.embed_tokens.weight"


def test_a_layer_never_straddles_two_buckets():
    export = qwen3_export(num_layers=4)
    plan = plan_for(export, bucket_bytes=int(layer_bytes() * 1.5))  # room for one layer, not two
    bucket_of = {name: b.index for b in plan.buckets for name in b.names}
    for i in range(4):
        assert len({bucket_of[f"model.layers.{i}.{s}"] for s in LAYER_TENSORS}) == 1


def test_buckets_stay_within_the_size_unless_one_group_is_larger():
    export = qwen3_export(num_layers=4)
    size = int(layer_bytes() * 2.5)
    plan = plan_for(export, bucket_bytes=size)
    assert all(b.nbytes <= size for b in plan.buckets)
    assert sum(b.nbytes for b in plan.buckets) == sum(t.numel() * t.element_size() for _, t in export)


def test_a_group_larger_than_the_size_gets_a_bucket_of_its_own():
    plan = plan_for(qwen3_export(num_layers=2), bucket_bytes=layer_bytes() // 3)
    layer_buckets = [b for b in plan.buckets if b.names[0].startswith("model.layers.")]
    assert [b.nbytes for b in layer_buckets] == [layer_bytes(), layer_bytes()]
    assert plan.capacity == layer_bytes()


def test_buckets_hold_one_dtype_and_fp32_norms_travel_separately():
    export = qwen3_export(num_layers=3, norm_dtype=torch.float32)
    plan = plan_for(export, bucket_bytes=1 << 20)
    for bucket in plan.buckets:
        assert {dict(export)[n].dtype for n in bucket.names} == {bucket.dtype}
    assert {b.dtype for b in plan.buckets} == {torch.bfloat16, torch.float32} and len(plan.buckets) == 2


def test_export_order_is_kept_within_each_dtype():
    export = qwen3_export(num_layers=3)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    assert plan.names() == [n for n, _ in export]


def test_offsets_reproduce_sglang_flattened_tensor_bucket_bytes():
    # FlattenedTensorBucket concatenates t.flatten().view(uint8) with no padding; rebuild that independently.
    export = qwen3_export(num_layers=2)
    plan = plan_for(export, bucket_bytes=layer_bytes() * 2)
    tensors = dict(export)
    for bucket in plan.buckets:
        expected = torch.cat([tensors[n].flatten().view(torch.uint8) for n in bucket.names])
        packed = torch.empty(bucket.nbytes, dtype=torch.uint8)
        for name, view in bucket.views(packed):
            view.copy_(tensors[name])
        assert torch.equal(packed, expected)
        for meta in bucket.tensors:
            assert meta.start_idx % meta.dtype.itemsize == 0
            assert meta.numel == meta.end_idx - meta.start_idx


def test_tied_embeddings_drop_lm_head_and_record_the_alias():
    plan = plan_for(qwen3_export(num_layers=1), tie_word_embeddings=True)
    assert LM_HEAD_NAME not in plan.names()
    assert plan.aliases == {LM_HEAD_NAME: "model.embed_tokens.weight"}


def test_untied_embeddings_keep_lm_head():
    plan = plan_for(qwen3_export(num_layers=1), tie_word_embeddings=False)
    assert LM_HEAD_NAME in plan.names() and plan.aliases == {}


def test_repeated_names_are_rejected():
    spec = TensorSpec("model.norm.weight", (4,), torch.float32)
    with pytest.raises(ValueError, match="model.norm.weight"):
        plan_buckets([spec, spec])


def test_bucketize_yields_each_bucket_with_its_tensors_in_layout_order():
    export = qwen3_export(num_layers=3, norm_dtype=torch.float32)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    out = list(bucketize(plan, export))
    assert [layout.index for layout, _ in out] == list(range(len(plan.buckets)))
    tensors = dict(export)
    for layout, got in out:
        assert all(t is tensors[n] for n, t in zip(layout.names, got))


def test_bucketize_skips_aliases():
    export = qwen3_export(num_layers=1)
    plan = plan_for(export, tie_word_embeddings=True)
    names = [n for layout, _ in bucketize(plan, export) for n in layout.names]
    assert LM_HEAD_NAME not in names


def test_bucketize_names_a_tensor_whose_shape_changed():
    export = qwen3_export(num_layers=1)
    plan = plan_for(export)
    export[1] = (export[1][0], torch.zeros(3, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=export[1][0]):
        list(bucketize(plan, export))


def test_bucketize_names_tensors_missing_at_the_end():
    export = qwen3_export(num_layers=1)
    plan = plan_for(export)
    with pytest.raises(ValueError, match="model.norm.weight"):
        list(bucketize(plan, [kv for kv in export if kv[0] != "model.norm.weight"]))
