"""The dense decoder (Llama-3, Qwen2/2.5, Qwen3) as plain ``nn.Module``s.

No parallelism and no precision branches live here: linear layers and core attention come from a layer
backend (``redline.trainer.layers``), and ``redline.trainer.parallel`` rewrites the built model for TP/SP/PP.

Shapes: ``T`` packed tokens, ``S`` sequences, ``H`` hidden size, ``B``/``L`` batch rows/new tokens per row in
the cached (inference) path, ``V`` vocabulary.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from redline.trainer.layers import LayerBackend
from redline.trainer.layers.torch_layers import RMSNorm, fused_swiglu
from redline.trainer.models.attention import cached_attention
from redline.trainer.models.export import export_hf, save_pretrained
from redline.trainer.models.kv_cache import KVCache
from redline.trainer.models.rope import RotaryEmbedding, apply_rope, packed_positions
from redline.trainer.models.spec import ModelSpec, spec_from_hf


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, backend: LayerBackend, dtype, device):
        super().__init__()
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv = backend.norm_linear(spec.hidden_size, (spec.q_dim, spec.kv_dim, spec.kv_dim),
                                       bias=spec.qkv_bias, eps=spec.rms_norm_eps, dtype=dtype, device=device)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype=dtype, device=device)
        else:
            self.q_norm = self.k_norm = None
        self.core = backend.attention(spec.num_heads, spec.num_kv_heads, spec.head_dim)
        self.o_proj = backend.linear(spec.q_dim, spec.hidden_size, bias=spec.o_bias, dtype=dtype, device=device)

    def heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [..., H]`` -> rotated ``q [..., h, d]`` and ``k, v [..., h_kv, d]`` (local heads under TP)."""
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in self.qkv(x).split(self.qkv.out_parts, dim=-1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):
        q, k, v = self.heads(x, cos, sin)
        out = self.core(q, k, v, cu_seqlens, max_seqlen)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def forward_cached(self, x, cos, sin, k_cache, v_cache, slots, positions):
        q, k, v = self.heads(x, cos, sin)
        rows = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(slots)
        k_cache[rows, :, slots] = k.to(k_cache.dtype)
        v_cache[rows, :, slots] = v.to(v_cache.dtype)
        out = cached_attention(q, k_cache, v_cache, positions, self.scale)
        return self.o_proj(out.flatten(-2).to(x.dtype))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused (and the pre-norm folded in)."""

    def __init__(self, spec: ModelSpec, backend: LayerBackend, dtype, device):
        super().__init__()
        self.gate_up = backend.norm_linear(spec.hidden_size, (spec.intermediate_size, spec.intermediate_size),
                                           bias=spec.mlp_bias, eps=spec.rms_norm_eps, dtype=dtype, device=device)
        self.down = backend.linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias, dtype=dtype,
                                   device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(fused_swiglu(self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: LayerBackend, dtype, device):
        super().__init__()
        self.self_attn = Attention(spec, backend, dtype, device)
        self.mlp = MLP(spec, backend, dtype, device)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):
        x = x + self.self_attn(x, cos, sin, cu_seqlens, max_seqlen)
        return x + self.mlp(x)

    def forward_cached(self, x, cos, sin, k_cache, v_cache, slots, positions):
        x = x + self.self_attn.forward_cached(x, cos, sin, k_cache, v_cache, slots, positions)
        return x + self.mlp(x)


class DecoderModel(nn.Module):
    """Token ids -> final hidden states. The LM head is applied outside (``redline.kernels``).

    ``layers`` is a ``ModuleDict`` keyed by the global layer index so a pipeline stage that keeps a slice of the
    layers keeps their names; ``embed_tokens`` / ``norm`` are None on stages that do not own them, and
    ``lm_head`` is None when the output projection is tied to ``embed_tokens``.
    """

    def __init__(self, hf_config: PretrainedConfig, backend: LayerBackend, *, dtype=torch.bfloat16, device="cpu"):
        super().__init__()
        self.hf_config = hf_config
        self.spec = spec = spec_from_hf(hf_config)
        self.backend = backend
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(spec, backend, dtype, device)
                                     for i in range(spec.num_layers)})
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = (None if spec.tie_word_embeddings else
                        nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype, device=device))
        self.rope = RotaryEmbedding(hf_config, spec.head_dim).to(device)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None = None, *,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [T] int64``, ``cu_seqlens [S+1] int32`` (packed, no padding) -> ``hidden [T, H]``.

        ``hidden`` replaces the embedding output on pipeline stages after the first; ``max_seqlen`` (longest
        sequence) spares flash attention a device-to-host read.
        """
        if hidden is None and self.embed_tokens is None:
            raise ValueError("this pipeline stage has no embedding: pass the previous stage's output as hidden=")
        positions = packed_positions(cu_seqlens, input_ids.shape[0])
        with self.backend.autocast():
            x = self.embed_tokens(input_ids) if hidden is None else hidden
            cos, sin = self.rope(positions, x.dtype)
            for layer in self.layers.values():
                x = layer(x, cos, sin, cu_seqlens, max_seqlen)
            return self.norm(x) if self.norm is not None else x

    def lm_head_weight(self) -> torch.Tensor:
        """The output projection ``[V, H]`` (the embedding matrix when tied; the local vocab shard under TP)."""
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    def logits(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Full ``[T, V]`` logits, for tests and debugging only; training applies the head in redline.kernels."""
        return self.forward(input_ids, cu_seqlens) @ self.lm_head_weight().t()

    def export_hf(self, *, stage_only: bool = False):
        """``(hf_name, tensor)`` pairs in HF naming/layout, the whole model even under PP unless ``stage_only``;
        see ``redline.trainer.models.export.export_hf``."""
        return export_hf(self, stage_only=stage_only)

    def save_pretrained(self, directory, **options) -> None:
        """Write a HF directory transformers loads; see ``redline.trainer.models.export.save_pretrained``."""
        save_pretrained(self, directory, **options)

    def make_kv_cache(self, batch_size: int, max_seq_len: int, dtype=None, device=None) -> KVCache:
        """A KV cache for ``forward_cached`` sized for this model's (local) layers and KV heads."""
        attn = next(iter(self.layers.values())).self_attn
        kv_heads = attn.qkv.out_parts[1] // self.spec.head_dim
        weight = self.embed_tokens.weight
        return KVCache(len(self.layers), batch_size, max_seq_len, kv_heads, self.spec.head_dim,
                       dtype=dtype or weight.dtype, device=device or weight.device)

    def forward_cached(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Incremental decoding: ``input_ids [B, L] int64``, ``positions [B, L] int64`` -> ``hidden [B, L, H]``.

        Writes each token's K/V to cache slot ``positions[b, j]`` and attends causally to slots
        ``0..positions[b, j]``. Position -1 marks padding: its K/V go to the cache's scratch slot and its output
        is unspecified. Prefill of different-length prompts is one call with right padding; decoding is L = 1.
        No host synchronisation, so a decode step can be captured in a CUDA graph.
        """
        slots = cache.slots(positions)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions.clamp(min=0), x.dtype)
        with self.backend.autocast():
            for index, layer in enumerate(self.layers.values()):
                x = layer.forward_cached(x, cos, sin, cache.k[index], cache.v[index], slots, positions)
            return self.norm(x)

