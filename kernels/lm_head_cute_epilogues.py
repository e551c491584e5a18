"""The two GEMM epilogues of ``lm_head_gemm_cute``, written with QuACK's ``@gemm_epilogue`` frontend (one function
per accumulator element; QuACK mints, compiles and caches the warp-specialised sm_90 kernels). Importing this
module imports QuACK and CUTLASS's DSL.

``stats``  prepass: each tile's max of the raw accumulator per row (``piece_max``, × log2(e)); epilogue:
           ``offset = (z − max)·log2(e)`` (≤ 0), per-(row, tile) sums of ``e = 2^offset`` and ``e·offset``, the
           target column's raw logit, and D = the offset in natural units when a D tensor is given.
           Operands: ``inv_temp`` (scalar). Outputs: ``piece_max_out``, ``sum_exp``, ``sum_exp_offset``
           ``[t, V / tile_N]`` fp32, ``target_logit [t]`` fp32.
``dz``     ``D = p·(α + β·acc)``, ``p = 2^(acc·scale_log2 − lse_log2)``, and the target column's raw logit.
           Operands: ``lse_log2``, ``alpha``, ``beta`` ``[1, t]`` fp32, ``scale_log2`` (scalar).
"""

from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import pexp2
from quack.epilogue.ops import ColVecLoad, ColVecReduce, ColVecSelect
from quack.epilogue.scaled_exp import MaxLog2

from .lm_head_gemm_cute import LN2, LOG2E

_piece_max = MaxLog2("piece_max", round_to_int=False)
_stats_target = ColVecLoad("target")


def _max_prepass(acc):
    return {"piece_max": acc}


@gemm_epilogue(ops={"piece_max": _piece_max}, prepass=_max_prepass, prepass_outs=("piece_max",),
               reduces={"sum_exp": ColVecReduce("sum_exp"),
                        "sum_exp_offset": ColVecReduce("sum_exp_offset", scaled=True)},
               outs={"target_logit": ColVecSelect("target_logit", idx_op=_stats_target)},
               extra_ops=(_piece_max.out("piece_max_out"), _stats_target))
def stats(acc, piece_max, inv_temp):
    offset = (acc * LOG2E - piece_max) * inv_temp
    e = pexp2(offset)
    return {"D": offset * LN2, "sum_exp": e, "sum_exp_offset": (e, offset), "target_logit": acc}


_dz_target = ColVecLoad("target")


# per-row operands pinned as column vectors: inferring them by shape is ambiguous when rows == columns
@gemm_epilogue(ops={name: ColVecLoad(name) for name in ("lse_log2", "alpha", "beta")},
               outs={"target_logit": ColVecSelect("target_logit", idx_op=_dz_target)}, extra_ops=(_dz_target,))
def dz(acc, lse_log2, alpha, beta, scale_log2):
    p = pexp2(acc * scale_log2 - lse_log2)
    return {"D": p * (alpha + beta * acc), "target_logit": acc}
