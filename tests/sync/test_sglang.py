"""SGLang request bodies per version, and the flattened-bucket payload through SGLang's own unpickler."""

import pytest
import torch
from sync_export import layer_bytes, qwen3_export

from redline.rollout.engine import SerializedBucket
from redline.sync.plan import plan_for
from redline.sync.sglang import (needs_update_session, parse_version, serialize_bucket, update_from_distributed_body,
                                 update_from_tensor_body, update_session)


@pytest.mark.parametrize("version, needed", [("0.5.17", False), ("0.5.20", False), ("0.5.21", True),
                                             ("0.5.23.post1", True), ("0.6.0", True)])
def test_update_session_is_needed_from_0_5_21(version, needed):
    assert needs_update_session(version) is needed


def test_unreadable_version_is_named():
    with pytest.raises(ValueError, match="'nightly'"):
        parse_version("nightly")


def test_old_servers_get_the_updates_only():
    calls = list(update_session("0.5.17", [("/update_weights_from_tensor", {"x": 1})]))
    assert [endpoint for endpoint, _ in calls] == ["/update_weights_from_tensor"]


def test_new_servers_get_the_updates_inside_a_session():
    updates = [("/update_weights_from_tensor", {"x": 1}), ("/update_weights_from_tensor", {"x": 2})]
    calls = list(update_session("0.5.21", updates))
    assert [endpoint for endpoint, _ in calls] == ["/begin_weight_update", "/update_weights_from_tensor",
                                                   "/update_weights_from_tensor", "/end_weight_update"]


def test_tensor_body_carries_one_payload_per_rank():
    body = update_from_tensor_body(SerializedBucket(per_rank=("a", "b")), weight_version="7")
    assert body == {"serialized_named_tensors": ["a", "b"], "load_format": "flattened_bucket",
                    "flush_cache": False, "weight_version": "7"}


def test_distributed_body_lists_the_bucket_in_layout_order():
    export = qwen3_export(num_layers=1)
    layout = plan_for(export, bucket_bytes=layer_bytes()).buckets[1]
    body = update_from_distributed_body(layout, group_name="redline-pp0")
    assert body["names"] == layout.names
    assert body["dtypes"] == ["bfloat16"] * len(layout.names)
    assert body["shapes"] == [list(dict(export)[n].shape) for n in layout.names]
    assert body["load_format"] == "flattened_bucket" and body["group_name"] == "redline-pp0"


@pytest.mark.sglang
def test_payload_round_trips_through_sglangs_safe_unpickler():
    import sglang
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    if needs_update_session(sglang.__version__):
        pytest.skip("SGLang >= 0.5.21 unpickles CUDA tensors only (exact allow-list); this CPU round trip "
                    "covers the <= 0.5.20 unpickler")

    export = qwen3_export(num_layers=1)
    layout = plan_for(export).buckets[0]
    bucket = torch.cat([dict(export)[n].flatten().view(torch.uint8) for n in layout.names]).share_memory_()
    data = MultiprocessingSerializer.deserialize(serialize_bucket(layout, bucket))
    rebuilt = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    for name, tensor in rebuilt.reconstruct_tensors():
        assert torch.equal(tensor, dict(export)[name])
