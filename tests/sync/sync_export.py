"""A tiny Qwen3-shaped HF export shared by the sync tests."""

import torch

LAYER_TENSORS = {  # HF name suffix -> shape, for hidden 16, 2 query heads, 1 kv head of dim 8, ffn 24
    "self_attn.q_proj.weight": (16, 16),
    "self_attn.k_proj.weight": (8, 16),
    "self_attn.v_proj.weight": (8, 16),
    "self_attn.o_proj.weight": (16, 16),
    "self_attn.q_norm.weight": (8,),
    "self_attn.k_norm.weight": (8,),
    "mlp.gate_proj.weight": (24, 16),
    "mlp.up_proj.weight": (24, 16),
    "mlp.down_proj.weight": (16, 24),
    "input_layernorm.weight": (16,),
    "post_attention_layernorm.weight": (16,),
}
VOCAB, HIDDEN = 32, 16


def qwen3_export(num_layers=3, dtype=torch.bfloat16, seed=0, norm_dtype=None, lm_head=True):
    """``[(hf_name, tensor)]`` in HF export order: embedding, layers, final norm, lm_head."""
    gen = torch.Generator().manual_seed(seed)

    def rand(shape, dt):
        return torch.randn(shape, generator=gen).to(dt)

    out = [("model.embed_tokens.weight", rand((VOCAB, HIDDEN), dtype))]
    for i in range(num_layers):
        for suffix, shape in LAYER_TENSORS.items():
            dt = norm_dtype if norm_dtype is not None and "norm" in suffix else dtype
            out.append((f"model.layers.{i}.{suffix}", rand(shape, dt)))
    out.append(("model.norm.weight", rand((HIDDEN,), norm_dtype or dtype)))
    if lm_head:
        out.append(("lm_head.weight", rand((VOCAB, HIDDEN), dtype)))
    return out


def layer_bytes(dtype=torch.bfloat16):
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(torch.Size(s).numel() for s in LAYER_TENSORS.values()) * itemsize
