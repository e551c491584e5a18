"""The ``te`` layer backend: TransformerEngine modules under ``te.autocast`` with a chosen FP8 recipe.

QKV and gate/up are ``te.LayerNormLinear`` (RMSNorm fused into the FP8 cast), o_proj and down ``te.Linear``,
core attention ``te.DotProductAttention`` in THD layout (packed, ``padding_causal``) or redline's own varlen
attention (see below). Modules expose the parameter contract of ``torch_layers`` (``norm_weight``, ``weight``,
``bias``, ``out_parts``), so HF export and loading work unchanged. TransformerEngine is imported only when this
backend is built, after ``te_env.prepare_te_libraries()`` has made it load torch's cuDNN.

Core attention (``attention=``): ``"te"`` is ``te.DotProductAttention``; ``"redline"`` is the varlen attention of
the other backends (flash-attn-4 varlen when installed, else SDPA); ``"auto"`` (default) probes TE once per head
layout with a small THD forward + backward and takes TE's attention only when TE selected its FlashAttention or
FusedAttention (cuDNN) backend and the result matches the reference, else redline's. TE's third backend,
UnfusedDotProductAttention, materialises the scores and converts THD to BSHD and back (measured: a Llama-3-8B
layer 195 ms instead of ~40, H100), so it never runs silently: ``auto`` avoids it and ``te`` warns.

Under tensor parallelism ``redline.trainer.parallel`` rebuilds these modules with TE's own ``parallel_mode``,
``tp_group`` and ``sequence_parallel`` (``parallel`` keyword arguments below) and copies the shards in.
FP8 needs the packed token count to be a multiple of 16 (of 128 for ``block``).
"""

import functools
import importlib
import logging
import sys

import torch

from redline.extras import require
from redline.trainer.layers import LayerBackend
from redline.trainer.layers.te_env import prepare_te_libraries
from redline.trainer.models.seq_bounds import max_length

logger = logging.getLogger("redline.trainer.te")

RECIPES = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "block": "Float8BlockScaling",
           "mxfp8": "MXFP8BlockScaling"}
# Token-count multiple each recipe's quantisation needs (TE assert_dim_for_fp8_exec; MXFP8 32-element blocks;
# 128x128 / 1x128 blocks).
TOKEN_ALIGNMENT = {None: 1, "delayed": 16, "current": 16, "block": 128, "mxfp8": 32}
ATTENTION = ("auto", "te", "redline")
FAST_TE_ATTENTION = ("FlashAttention", "FusedAttention")
# Where TE keeps the backend its DotProductAttention selected last, across TE versions.
TE_BACKENDS_MODULES = ("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention",
                       "transformer_engine.pytorch.attention.dot_product_attention",
                       "transformer_engine.pytorch.attention")
PROBE_LENGTHS = (37, 128, 91)  # three sequences, unequal lengths, like an RL stream
PROBE_TOLERANCE = 3e-2  # max |TE - reference| of bf16 attention outputs/grads over max |reference|


@functools.cache
def _modules():
    """TE-derived module classes, defined on first use so importing redline never imports TE."""
    prepare_te_libraries()
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
                max_seqlen = max_length(cu_seqlens)
            return super().forward(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                   max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)

    return te, TENormLinear, TELinear, TEAttention


def selected_te_backend(backends: dict | None) -> str | None:
    """The name of the backend in TE's ``_attention_backends`` record: ``"FlashAttention"``,
    ``"FusedAttention"``, ``"UnfusedDotProductAttention"``, or None when nothing was selected."""
    if not backends:
        return None
    for key, name in (("use_flash_attention", "FlashAttention"), ("use_fused_attention", "FusedAttention"),
                      ("use_unfused_attention", "UnfusedDotProductAttention")):
        if backends.get(key):
            return name
    return None


def te_attention_record() -> dict | None:
    """TE's module-level record of the attention backend it selected last (None if this TE has none)."""
    for name in TE_BACKENDS_MODULES:
        module = sys.modules.get(name)
        if module is None:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
        record = getattr(module, "_attention_backends", None)
        if isinstance(record, dict) and "use_fused_attention" in record:
            return record
    return None


def choose_attention(requested: str, te_selected: str | None, problem: str | None) -> str:
    """``"te"`` or ``"redline"``: the core attention a ``te`` model gets. ``te_selected`` is the backend TE
    picked in the probe (``selected_te_backend``; None when not probed or the probe failed), ``problem`` what
    went wrong in the probe (None if TE's result matched the reference)."""
    if requested not in ATTENTION:
        raise ValueError(f"attention={requested!r} is unknown; expected one of {ATTENTION}")
    if requested != "auto":
        return requested
    return "te" if te_selected in FAST_TE_ATTENTION and problem is None else "redline"


@functools.cache
def probe_te_attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                       device_index: int | None = None) -> tuple[str | None, str | None]:
    """Run ``te.DotProductAttention`` (THD, ``padding_causal``, GQA) forward + backward once on three small
    sequences; returns ``(backend TE selected, problem)`` where ``problem`` is None when output and input
    gradients match redline's varlen attention (``PROBE_TOLERANCE``), else what failed."""
    from redline.trainer.models.attention import varlen_causal_attention

    if not torch.cuda.is_available():
        return None, "no CUDA device"
    te, _, _, attention_cls = _modules()
    device = torch.device("cuda", torch.cuda.current_device() if device_index is None else device_index)
    generator = torch.Generator(device=device).manual_seed(0)
    total, longest = sum(PROBE_LENGTHS), max(PROBE_LENGTHS)
    cu_seqlens = torch.tensor([0, *torch.tensor(PROBE_LENGTHS).cumsum(0).tolist()], dtype=torch.int32,
                              device=device)
    inputs = [torch.randn(total, heads, head_dim, device=device, dtype=dtype, generator=generator)
              for heads in (num_heads, num_kv_heads, num_kv_heads)]
    grad = torch.randn(total, num_heads, head_dim, device=device, dtype=dtype, generator=generator)
    record = te_attention_record()
    if record is not None:
        record["backend_selection_requires_update"] = True
    try:
        with torch.inference_mode(False), torch.enable_grad():
            te_inputs = [t.clone().requires_grad_() for t in inputs]
            out = attention_cls(num_heads, num_kv_heads, head_dim)(*te_inputs, cu_seqlens, longest)
            out.view_as(grad).backward(grad)
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - any TE/cuDNN failure means: do not use TE's attention
        return selected_te_backend(te_attention_record()), f"{type(exc).__name__}: {exc}"[:500]
    selected = selected_te_backend(te_attention_record())
    with torch.inference_mode(False), torch.enable_grad():
        ref_inputs = [t.float().requires_grad_() for t in inputs]
        ref = varlen_causal_attention(*ref_inputs, cu_seqlens, longest, head_dim ** -0.5)
        ref.backward(grad.float())
    for name, got, want in [("output", out.view_as(grad), ref)] + [
            (f"d{n}", t.grad, r.grad) for n, t, r in zip("qkv", te_inputs, ref_inputs)]:
        error = (got.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        if not error <= PROBE_TOLERANCE:
            return selected, f"{name} differs from the reference by {error:.3g} of its max (THD, padding_causal)"
    return selected, None


class TEBackend(LayerBackend):
    """``recipe``: ``delayed`` | ``current`` | ``block`` | ``mxfp8`` (Blackwell), or None for TE modules
    without FP8; ``attention``: ``auto`` | ``te`` | ``redline`` (module docstring); ``recipe_options`` go to the
    TE recipe dataclass (e.g. ``amax_history_len``)."""

    name = "te"

    def __init__(self, recipe: str | None = "current", attention: str = "auto", **recipe_options):
        if recipe is not None and recipe not in RECIPES:
            raise ValueError(f"recipe={recipe!r} is unknown; expected one of {sorted(RECIPES)} or None")
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r} is unknown; expected one of {ATTENTION}")
        super().__init__()
        self.te, self._norm_linear, self._linear, self._attention = _modules()
        recipes = require("transformer_engine.common.recipe", "the 'te' layer backend")
        self.recipe = getattr(recipes, RECIPES[recipe])(**recipe_options) if recipe else None
        self.token_alignment = TOKEN_ALIGNMENT[recipe]
        self.attention_request = attention
        self.attention_impl = None  # what the last built attention runs, e.g. "te:FusedAttention"
        self._decided = {}  # (heads, kv heads, head_dim) -> (choice, description), logged once each

    def norm_linear(self, in_features, out_parts, *, bias, eps, dtype=None, device=None, **parallel):
        """``parallel``: TE's ``parallel_mode``, ``tp_group``, ``sequence_parallel`` (set by parallelize)."""
        return self._norm_linear(in_features, out_parts, bias=bias, eps=eps, dtype=dtype, device=device, **parallel)

    def linear(self, in_features, out_features, *, bias, dtype=None, device=None, **parallel):
        return self._linear(in_features, out_features, bias=bias, dtype=dtype, device=device, **parallel)

    def attention(self, num_heads, num_kv_heads, head_dim):
        choice, self.attention_impl = self._decide_attention(num_heads, num_kv_heads, head_dim)
        if choice == "te":
            return self._attention(num_heads, num_kv_heads, head_dim)
        return super().attention(num_heads, num_kv_heads, head_dim)

    def _decide_attention(self, num_heads, num_kv_heads, head_dim) -> tuple[str, str]:
        key = (num_heads, num_kv_heads, head_dim)
        if key in self._decided:
            return self._decided[key]
        from redline.trainer.models.attention import varlen_attention_impl

        selected, problem = (None, None)
        if self.attention_request != "redline":
            selected, problem = probe_te_attention(num_heads, num_kv_heads, head_dim)
        choice = choose_attention(self.attention_request, selected, problem)
        redline_impl = varlen_attention_impl("cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16)
        described = f"te:{selected}" if choice == "te" else f"redline:{redline_impl}"
        found = f"TE selected {selected or 'no backend'}" + (f" ({problem})" if problem else "")
        if self.attention_request == "auto" and choice == "redline":
            logger.warning("te backend: TransformerEngine attention is not usable fast here (%s); core attention "
                           "runs redline's %s next to TE's linear layers (attention='te' forces TE's)",
                           found, redline_impl)
        elif choice == "te" and (selected not in FAST_TE_ATTENTION or problem):
            logger.warning("te backend: attention='te' while %s: expect a slow or wrong attention "
                           "(attention='auto' would use redline's %s)", found, redline_impl)
        else:
            logger.info("te backend: core attention %s (%d heads, %d KV heads, head_dim %d)", described,
                        num_heads, num_kv_heads, head_dim)
        self._decided[key] = (choice, described)
        return self._decided[key]

    def autocast(self):
        enabled = self.recipe is not None
        if hasattr(self.te, "autocast"):  # TE >= 2.8; fp8_autocast is its deprecated alias
            return self.te.autocast(enabled=enabled, recipe=self.recipe)
        return self.te.fp8_autocast(enabled=enabled, fp8_recipe=self.recipe)
