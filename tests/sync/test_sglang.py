"""The disaggregated SGLang request body, and the plan's buckets in the form engines take."""

import torch
from sync_export import layer_bytes, qwen3_export

from redline.sync.plan import named_buckets, plan_for
from redline.sync.sglang import update_from_distributed_body


def test_distributed_body_lists_the_bucket_in_layout_order():
    export = qwen3_export(num_layers=1)
    layout = plan_for(export, bucket_bytes=layer_bytes()).buckets[1]
    body = update_from_distributed_body(layout, group_name="redline-weights-pp0", weight_version="3")
    assert body["names"] == layout.names
    assert body["dtypes"] == ["bfloat16"] * len(layout.names)
    assert body["shapes"] == [list(dict(export)[n].shape) for n in layout.names]
    assert body["load_format"] == "flattened_bucket" and body["group_name"] == "redline-weights-pp0"
    assert body["weight_version"] == "3" and body["flush_cache"] is False


def test_named_buckets_flatten_to_the_plans_layout():
    # what an engine does with a named bucket (FlattenedTensorBucket: cat of the uint8 views) must give the
    # bytes the plan's layout describes, so SGLang's loader sees the planned grouping
    export = qwen3_export(num_layers=2)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    for layout, bucket in zip(plan.buckets, named_buckets(plan, export)):
        flat = torch.cat([t.flatten().view(torch.uint8) for _, t in bucket])
        assert [n for n, _ in bucket] == layout.names
        for name, view in layout.views(flat):
            assert torch.equal(view, dict(export)[name])
