"""Compile the fused LM-head GEMM kernels' autotuner configs for Hopper (sm_90) ahead of time and print, as JSON,
each config's shared memory (bytes per block) and register spills (stack bytes per thread).

Run in a process of its own without TRITON_INTERPRET: a process that has set up Triton's interpreter cannot
compile. ``tests/kernels/test_lm_head_gemm_compile.py`` runs it.
"""

import json
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from redline.kernels import lm_head_gemm_triton as gemm

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
COMMON = {"n_rows": "i32", "n_cols": "i32", "width": "i32", "inv_temp": "fp32", "rows_key": "i32", "cols_key": "i32"}


def stack_bytes(compiled) -> int:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                                check=True).stdout
    return int(dict(f.split(":") for f in report.split() if f.startswith("STACK:"))["STACK"])


def compile_config(kernel, signature: dict, constexprs: dict, config) -> dict:
    jit = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel  # an autotuner wraps the kernel
    source = ASTSource(fn=jit, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                       constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    return {"config": str(config), "shared": compiled.metadata.shared, "stack": stack_bytes(compiled)}


def dz_configs() -> list[dict]:
    out = []
    for config in gemm._gemm_dz_kernel.configs:
        m, n, k = (config.kwargs[f"BLOCK_{x}"] for x in "MNK")
        signature = {"h_desc": f"tensordesc<bf16[{m}, {k}]>", "w_desc": f"tensordesc<bf16[{n}, {k}]>",
                     "dz_desc": f"tensordesc<bf16[{m}, {n}]>", "y_ptr": "*i64", "col0": "i32", "lse_ptr": "*fp32",
                     "ent_ptr": "*fp32", "glp_ptr": "*fp32", "gent_ptr": "*fp32", **COMMON}
        out.append(compile_config(gemm._gemm_dz_kernel, signature, {
            "NUM_PROGRAMS": 132, "HAS_GENT": True, "PRECISION": "tf32", "UPCAST": False, **config.kwargs}, config))
    return out


def stats_configs(keep_offsets: bool) -> list[dict]:
    """The forward's statistics kernel; ``keep_offsets``: the one-pass variant that also stores fp16 offsets."""
    out = []
    for config in gemm._gemm_stats_kernel.configs:
        m, k, n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_K"], gemm.STATS_BLOCK_N
        signature = {"h_desc": f"tensordesc<bf16[{m}, {k}]>", "w_desc": f"tensordesc<bf16[{n}, {k}]>",
                     "off_desc": f"tensordesc<fp16[{m}, {n}]>" if keep_offsets else f"tensordesc<bf16[{n}, {k}]>",
                     "y_ptr": "*i64", **{f"{x}_ptr": "*fp32" for x in ("m", "s", "w_out", "zy", "hit")}, **COMMON}
        out.append(compile_config(gemm._gemm_stats_kernel, signature, {
            "NUM_PROGRAMS": 132, "PRECISION": "tf32", "UPCAST": False, "KEEP_OFFSETS": keep_offsets,
            "BLOCK_N": n, **config.kwargs}, config))
    return out


def dz_from_offsets_config() -> list[dict]:
    """The one-pass dz kernel (elementwise, one launch shape)."""
    signature = {"off_ptr": "*fp16", "stride_off": "i32", "m_ptr": "*fp32", "n_pieces": "i32", "dz_ptr": "*bf16",
                 "y_ptr": "*i64", "col0": "i32", "lse_ptr": "*fp32", "ent_ptr": "*fp32", "glp_ptr": "*fp32",
                 "gent_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "inv_temp": "fp32"}
    tile_r, tile_v = gemm.OFFSETS_TILE
    config = triton.Config({}, num_warps=4, num_stages=1)
    return [compile_config(gemm._dz_from_offsets_kernel, signature, {
        "PIECE": gemm.STATS_BLOCK_N, "HAS_GENT": True, "TILE_R": tile_r, "TILE_V": tile_v}, config)]


def cute_glue_configs() -> list[dict]:
    """The CuTe path's two row kernels around its dz GEMM (``lm_head_gemm_cute``)."""
    from redline.kernels import lm_head_gemm_cute as cute

    rows = {"lse_ptr": "*fp32", "ent_ptr": "*fp32", "glp_ptr": "*fp32", "gent_ptr": "*fp32"}
    config = triton.Config({}, num_warps=4, num_stages=1)
    constexprs = {"HAS_GENT": True, "BLOCK": cute.ROWS_BLOCK}
    terms = compile_config(cute._dz_rows_kernel, {**rows, "out_ptr": "*fp32", "stride_out": "i32", "n_rows": "i32",
                                                    "inv_temp": "fp32"},
                           constexprs, config)
    fix = compile_config(cute._fix_target_kernel, {"dz_ptr": "*bf16", "stride_dz": "i32", "n_rows": "i32",
                                                   "n_cols": "i32", "y_ptr": "*i64", "col0": "i32", "zy_ptr": "*fp32",
                                                   **rows, "inv_temp": "fp32"}, constexprs, config)
    return [terms, fix]


if __name__ == "__main__":
    print(json.dumps({"dz": dz_configs(), "stats": stats_configs(False), "stats+offsets": stats_configs(True),
                      "dz-from-offsets": dz_from_offsets_config(), "cute-glue": cute_glue_configs()}))
