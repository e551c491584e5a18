"""The decode-step attention kernel against the masked-SDPA definition (``cached_attention`` on CPU), run by
Triton's interpreter on CPU tensors: GQA groups of 1, 2 and 4, rows at different positions, padding rows,
cache lengths that are not a multiple of the kernel's block."""

import pytest
import torch

from redline.extras import importable
from redline.trainer.models.attention import cached_attention

pytestmark = pytest.mark.skipif(not importable("triton"), reason="triton is not installed")


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_decode_kernel_matches_masked_sdpa(heads, kv_heads):
    from redline.trainer.models.decode_attention import decode_attention

    torch.manual_seed(0)
    batch, slots, head_dim = 3, 70, 16
    q = torch.randn(batch, 1, heads, head_dim)
    k_cache = torch.randn(batch, kv_heads, slots, head_dim)
    v_cache = torch.randn(batch, kv_heads, slots, head_dim)
    positions = torch.tensor([[0], [66], [-1]])
    expected = cached_attention(q, k_cache, v_cache, positions, 0.25)
    got = decode_attention(q[:, 0], k_cache, v_cache, positions[:, 0], 0.25)
    torch.testing.assert_close(got[:2], expected[:2, 0], atol=1e-5, rtol=1e-5)  # row 2 is padding
    assert torch.isfinite(got[2]).all()


def test_decode_kernel_reads_a_layer_view_of_the_stacked_cache():
    from redline.trainer.models.decode_attention import decode_attention

    torch.manual_seed(1)
    cache = torch.randn(2, 2, 2, 33, 16)  # [layers, B, h_kv, slots, d], as KVCache stores it
    q = torch.randn(2, 1, 2, 16)
    positions = torch.tensor([[5], [31]])
    expected = cached_attention(q, cache[1], cache[0], positions, 0.25)
    got = decode_attention(q[:, 0], cache[1], cache[0], positions[:, 0], 0.25)
    torch.testing.assert_close(got, expected[:, 0], atol=1e-5, rtol=1e-5)


def test_decode_kernel_rejects_caches_that_do_not_fit():
    from redline.trainer.models.decode_attention import decode_attention

    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(torch.randn(1, 3, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16),
                         torch.tensor([0]), 1.0)
