"""Attention reads a packed stream's ``cu_seqlens`` from the device at most once per tensor, and not at all when
the loop recorded the host values as it moved the batch (``redline.trainer.models.seq_bounds``)."""

import pytest
import torch

from redline.loop.batching import MicroBatch
from redline.loop.model_parallel import padded_stream
from redline.trainer.models import from_config
from redline.trainer.models.seq_bounds import host_bounds, max_length, remember


def test_recorded_values_are_used_without_reading_the_tensor():
    cu_seqlens = torch.tensor([0, 3, 9], dtype=torch.int32)
    remember(cu_seqlens, [0, 3, 9])
    cu_seqlens.tolist = None  # a read would fail: the recorded copy must answer
    assert host_bounds(cu_seqlens) == [0, 3, 9]
    assert max_length(cu_seqlens) == 6


def test_an_unrecorded_tensor_is_read_once_and_a_modified_one_again():
    cu_seqlens = torch.tensor([0, 4, 5], dtype=torch.int32)
    assert host_bounds(cu_seqlens) == [0, 4, 5]
    cu_seqlens[-1] += 3  # in place: the version moves on, the old copy is stale
    assert host_bounds(cu_seqlens) == [0, 4, 8]
    assert max_length(torch.tensor([0], dtype=torch.int32)) == 0


def micro_batch(lengths) -> MicroBatch:
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return MicroBatch(input_ids=torch.arange(total) % 7, targets=torch.zeros(total, dtype=torch.long),
                      cu_seqlens=cu, loss_mask=torch.ones(total, dtype=torch.bool), sample_ids=list(range(len(lengths))))


def test_moving_a_batch_records_its_bounds_and_padding_extends_them(config_of, monkeypatch):
    import redline.loop.model_parallel as model_parallel

    moved = micro_batch((5, 2, 6)).to("cpu")
    assert host_bounds(moved.cu_seqlens) == [0, 5, 7, 13]
    model = from_config(config_of("qwen3"), dtype=torch.float32, seed=0)
    monkeypatch.setattr(model_parallel, "token_multiple", lambda model: 8)  # 13 tokens to 16, as FP8 or SP pad
    input_ids, cu_seqlens = padded_stream(model, moved)
    assert input_ids.shape[0] == 16
    assert cu_seqlens.tolist() == host_bounds(cu_seqlens) == [0, 5, 7, 16]


@pytest.mark.gpu
def test_a_packed_forward_and_backward_never_wait_for_the_gpu(cuda, config_of, monkeypatch):
    import redline.trainer.models.attention as attention

    monkeypatch.setattr(attention, "MASKED_SDPA_MAX_TOKENS", 8)  # the per-length path, which needs every bound
    model = from_config(config_of("qwen3"), dtype=torch.bfloat16, device=cuda, seed=0)
    batch = micro_batch((40, 40, 17)).to(cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host read raises
    try:
        hidden = model(batch.input_ids, batch.cu_seqlens)
        hidden.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(hidden).all()
