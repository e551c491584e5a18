"""The ``te`` layer backend: TransformerEngine modules under ``te.autocast`` with a chosen FP8 recipe.

QKV and gate/up are ``te.LayerNormLinear`` (RMSNorm fused into the FP8 cast), o_proj and down ``te.Linear``,
core attention ``te.DotProductAttention`` in THD layout (packed, ``padding_causal``). Modules expose the
parameter contract of ``torch_layers`` (``norm_weight``, ``weight``, ``bias``, ``out_parts``), so HF export and
loading work unchanged. TransformerEngine is imported only when this backend is built.

Under tensor parallelism ``redline.trainer.parallel`` rebuilds these modules with TE's own ``parallel_mode``,
``tp_group`` and ``sequence_parallel`` (``parallel`` keyword arguments below) and copies the shards in.
FP8 needs the packed token count to be a multiple of 16 (of 128 for ``block``).
"""

import functools

from redline.extras import require
from redline.trainer.layers import LayerBackend

RECIPES = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "block": "Float8BlockScaling",
           "mxfp8": "MXFP8BlockScaling"}
# Token-count multiple each recipe's quantisation needs (TE assert_dim_for_fp8_exec; MXFP8 32-element blocks;
# 128x128 / 1x128 blocks).
TOKEN_ALIGNMENT = {None: 1, "delayed": 16, "current": 16, "block": 128, "mxfp8": 32}


@functools.cache
def _modules():
    """TE-derived module classes, defined on first use so importing redline never imports TE."""
    te = require("transformer_engine.pytorch", "the 'te' layer backend")

    class TENormLinear(te.LayerNormLinear):
        def __init__(self, in_features, out_parts, *, bias, eps, dtype, device, **parallel):
            super().__init__(in_features, sum(out_parts), eps=eps, bias=bias, normalization="RMSNorm",
                             params_dtype=dtype, device=device, **parallel)
            tp = parallel["tp_group"].size() if parallel.get("tp_group") is not None else 1
            self.out_parts = tuple(p // tp for p in out_parts)
            self.build_args = dict(in_features=in_features, out_parts=tuple(out_parts), bias=bias, eps=eps,
                                   dtype=dtype, device=device)

        @property
        def norm_weight(self):
            return self.layer_norm_weight

    class TELinear(te.Linear):
        def __init__(self, in_features, out_features, *, bias, dtype, device, **parallel):
            super().__init__(in_features, out_features, bias=bias, params_dtype=dtype, device=device, **parallel)
            self.build_args = dict(in_features=in_features, out_features=out_features, bias=bias, dtype=dtype,
                                   device=device)

    class TEAttention(te.DotProductAttention):
        def __init__(self, num_heads, num_kv_heads, head_dim):
            super().__init__(num_heads, head_dim, num_gqa_groups=num_kv_heads, qkv_format="thd",
                             attn_mask_type="padding_causal")

        def forward(self, q, k, v, cu_seqlens, max_seqlen=None):
            if max_seqlen is None:
                max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            return super().forward(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                   max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)

    return te, TENormLinear, TELinear, TEAttention


class TEBackend(LayerBackend):
    """``recipe``: ``delayed`` | ``current`` | ``block`` | ``mxfp8`` (Blackwell), or None for TE modules
    without FP8; ``recipe_options`` go to the TE recipe dataclass (e.g. ``amax_history_len``)."""

    name = "te"

    def __init__(self, recipe: str | None = "current", **recipe_options):
        if recipe is not None and recipe not in RECIPES:
            raise ValueError(f"recipe={recipe!r} is unknown; expected one of {sorted(RECIPES)} or None")
        super().__init__()
        self.te, self._norm_linear, self._linear, self._attention = _modules()
        recipes = require("transformer_engine.common.recipe", "the 'te' layer backend")
        self.recipe = getattr(recipes, RECIPES[recipe])(**recipe_options) if recipe else None
        self.token_alignment = TOKEN_ALIGNMENT[recipe]

    def norm_linear(self, in_features, out_parts, *, bias, eps, dtype=None, device=None, **parallel):
        """``parallel``: TE's ``parallel_mode``, ``tp_group``, ``sequence_parallel`` (set by parallelize)."""
        return self._norm_linear(in_features, out_parts, bias=bias, eps=eps, dtype=dtype, device=device, **parallel)

    def linear(self, in_features, out_features, *, bias, dtype=None, device=None, **parallel):
        return self._linear(in_features, out_features, bias=bias, dtype=dtype, device=device, **parallel)

    def attention(self, num_heads, num_kv_heads, head_dim):
        return self._attention(num_heads, num_kv_heads, head_dim)

    def autocast(self):
        enabled = self.recipe is not None
        if hasattr(self.te, "autocast"):  # TE >= 2.8; fp8_autocast is its deprecated alias
            return self.te.autocast(enabled=enabled, recipe=self.recipe)
        return self.te.fp8_autocast(enabled=enabled, fp8_recipe=self.recipe)
