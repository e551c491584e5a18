"""The dz epilogue of ``redline.kernels.lm_head_cute_epilogues`` cut into parts, for ``tune_cute_lm_head.py``: timed
on the same block and launch configuration, the differences say which piece costs the time. Imports QuACK.

``DZ_PARTS``: name -> (EpiMod, the ``epi_args`` keys it takes).
"""

from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.library import identity_epi
from quack.epilogue.math import pexp2
from quack.epilogue.ops import ColVecLoad

from redline.kernels.lm_head_cute_epilogues import dz

_rows = {name: ColVecLoad(name) for name in ("lse_log2", "alpha", "beta")}


@gemm_epilogue(ops=_rows)
def _dz_without_select(acc, lse_log2, alpha, beta, scale_log2):
    return {"D": pexp2(acc * scale_log2 - lse_log2) * (alpha + beta * acc)}


@gemm_epilogue(ops={"lse_log2": _rows["lse_log2"]})
def _probability_only(acc, lse_log2, scale_log2):
    return {"D": pexp2(acc * scale_log2 - lse_log2)}


@gemm_epilogue()
def _scale_only(acc, scale_log2):
    return {"D": acc * scale_log2}


DZ_PARTS = {
    "dz (the kernel)": (dz, ("lse_log2", "alpha", "beta", "scale_log2", "target", "target_logit")),
    "dz without the target select": (_dz_without_select, ("lse_log2", "alpha", "beta", "scale_log2")),
    "p = exp2(acc·s − lse) only": (_probability_only, ("lse_log2", "scale_log2")),
    "acc·s only": (_scale_only, ("scale_log2",)),
    "plain GEMM": (identity_epi, ()),
}
