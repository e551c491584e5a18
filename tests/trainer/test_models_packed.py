"""Packed (THD) forward: sequences in one stream do not see each other."""

import pytest
import torch

from redline.trainer.models import from_config
from redline.trainer.models.attention import varlen_causal_attention
from redline.trainer.models.rope import packed_positions


def test_packed_forward_equals_separate_forwards(hf_config, batch_of):
    model = from_config(hf_config, dtype=torch.float32, seed=0)
    input_ids, cu_seqlens = batch_of((6, 1, 11), hf_config.vocab_size)
    with torch.no_grad():
        packed = model(input_ids, cu_seqlens)
        bounds = cu_seqlens.tolist()
        separate = torch.cat([model(input_ids[s:e], torch.tensor([0, e - s], dtype=torch.int32))
                              for s, e in zip(bounds[:-1], bounds[1:])])
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-6)


def test_packed_positions_restart_at_each_sequence():
    cu_seqlens = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert packed_positions(cu_seqlens, 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_long_packed_stream_takes_the_per_sequence_path_with_the_same_result(monkeypatch):
    import redline.trainer.models.attention as attention

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(20, 4, 8, generator=generator)
    k, v = torch.randn(2, 20, 2, 8, generator=generator)
    cu_seqlens = torch.tensor([0, 7, 20], dtype=torch.int32)
    masked = varlen_causal_attention(q, k, v, cu_seqlens, None, 8 ** -0.5)
    monkeypatch.setattr(attention, "MASKED_SDPA_MAX_TOKENS", 4)
    looped = varlen_causal_attention(q, k, v, cu_seqlens, None, 8 ** -0.5)
    torch.testing.assert_close(masked, looped, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lengths", [(6, 6, 6, 6), (6, 3, 6, 0, 3, 9)], ids=["equal", "mixed-with-empty"])
def test_per_length_attention_batches_sequences_with_the_masked_result_and_gradients(monkeypatch, lengths):
    """Long streams run one SDPA call per distinct length (equal lengths stacked into a batch, GQA); the output
    and gradients equal the block-diagonal-mask path's."""
    import redline.trainer.models.attention as attention

    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, 4, 8, generator=generator)
    k, v = torch.randn(2, total, 2, 8, generator=generator)
    grad = torch.randn(total, 4, 8, generator=generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    def run():
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = varlen_causal_attention(*inputs, cu_seqlens, None, 8 ** -0.5)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in inputs]

    masked = run()
    monkeypatch.setattr(attention, "MASKED_SDPA_MAX_TOKENS", 4)
    calls = []
    sdpa = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    per_length = run()
    assert len(calls) == len({n for n in lengths if n})
    for got, want in zip(per_length, masked):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [96, 4096], ids=["masked", "per-length"])
def test_packed_attention_on_cuda_never_runs_cudnn_sdpa(num_tokens):
    """cuDNN's SDPA plans every new shape (>100 ms each on an H100): RL batches would pay it inside steps."""
    from torch.profiler import ProfilerActivity, profile

    lengths = [num_tokens // 4 - 3, num_tokens // 4 + 1, num_tokens // 4 + 2, num_tokens // 4]
    cu_seqlens = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(num_tokens, heads, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads in (8, 2, 2))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        varlen_causal_attention(q, k, v, cu_seqlens, None, 0.125).sum().backward()
        torch.cuda.synchronize()
    names = [event.key.lower() for event in trace.key_averages()]
    assert any("attention" in name for name in names)
    assert not [name for name in names if "cudnn" in name]
