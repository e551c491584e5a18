"""Which library setting makes TransformerEngine's attention load, run fast and agree with SDPA (GPU + TE).

    python benchmarks/diagnose_te_attention.py --out $OUT/te-attention [--variants NAME,...]

Runs one child process per library-path variant (the loader state is fixed at process start, so each variant
needs a fresh process) and writes ``OUT/te-attention.json``, ``OUT/te-attention.md`` and each child's full log
``OUT/<variant>.log``. Every child runs with ``NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2`` (TE's backend-selection log) and
``CUDNN_LOGERR_DBG=1`` (cuDNN's reason for a failure) and reports:

* versions: torch, cuDNN as torch sees it, cuDNN as TE sees it, TE, flash-attn;
* the CUDA libraries mapped into the process (``/proc/self/maps``: cuDNN and its sublibraries, NVRTC,
  nvJitLink, cuBLAS, TE) and whether two different cuDNN dispatchers got loaded;
* for TE's attention with each backend allowed alone (``default`` = TE's own choice, ``flash``, ``fused``,
  ``unfused``, via ``NVTE_FLASH_ATTN``/``NVTE_FUSED_ATTN``/``NVTE_UNFUSED_ATTN``): the backend TE selected,
  parity of output and q/k/v gradients against per-sequence fp32 SDPA on a THD batch with ``padding_causal``,
  GQA and unequal lengths, and the fwd+bwd time at the Llama-3-8B layer shape (4 x 4096 tokens, 32/8 heads,
  head_dim 128) with TFLOP/s;
* redline's own varlen attention (flash-attn-4 varlen or SDPA) on the same cases;
* what the ``te`` layer backend's ``attention="auto"`` picks in that process.

Variants (``--variants`` picks some), in the order they run so that a cut-off run still says the most:
``redline`` (in-process ``prepare_te_libraries()`` after torch used cuDNN: the default path now), ``ld-cudnn``
(LD_LIBRARY_PATH = torch's pip cuDNN: last session's setting), ``plain`` (inherited environment),
``redline-te-first`` (as ``redline``, TE imported before torch touches cuDNN), ``system-cudnn`` (the image's
cuDNN first on LD_LIBRARY_PATH and CUDNN_HOME), ``ld-pip-all`` (every pip ``nvidia/*/lib``), ``redline-env``
(``te_library_env()`` exported + prepare), ``redline-fused-1`` (``redline`` with ``NVTE_FUSED_ATTN_BACKEND=1``,
cuDNN's arbitrary-seqlen kernels).
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

LLAMA = dict(sequences=4, length=4096, heads=32, kv_heads=8, head_dim=128)
PARITY_LENGTHS = (37, 256, 1, 130, 64)
PARITY = dict(heads=8, kv_heads=2, head_dim=128)
LONG_LENGTHS = (4096, 2500, 1596)  # parity at the benchmark's sequence length too (the fp32 reference is big)
MODES = {  # TE attention backends allowed in each mode
    "default": {},
    "flash": {"NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    "fused": {"NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    "unfused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0"},
}
DEBUG_ENV = {"NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2", "CUDNN_LOGERR_DBG": "1", "CUDNN_LOGDEST_DBG": "stderr",
             "PYTHONUNBUFFERED": "1"}
LOG_KEYS = ("DotProductAttention", "cudnn", "CUDNN", "Error", "error", "undefined symbol", "Unable to load")


# ---- the parent: variants, child processes, report ------------------------------------------------------------

def system_cudnn_dir() -> str | None:
    """A folder holding the image's own cuDNN (not a pip one), or None."""
    patterns = ["/usr/lib/x86_64-linux-gnu/libcudnn.so.9*", "/usr/local/cuda*/lib64/libcudnn.so.9*",
                "/usr/local/cuda*/targets/x86_64-linux/lib/libcudnn.so.9*", "/usr/lib64/libcudnn.so.9*"]
    for pattern in patterns:
        hits = [h for h in glob.glob(pattern) if "site-packages" not in h]
        if hits:
            return os.path.dirname(hits[0])
    return None


def variants() -> dict[str, dict]:
    """name -> {"env": variables to set, "prepare": call prepare_te_libraries, "torch_cudnn_first": bool}."""
    from redline.trainer.layers.te_env import nvidia_roots, pip_library_dirs, te_library_env

    base_ld = os.environ.get("LD_LIBRARY_PATH", "")
    roots = nvidia_roots()
    pip = pip_library_dirs(roots)
    all_pip = sorted({str(Path(p).parent) for root in roots for p in glob.glob(str(root / "*" / "lib" / "*.so*"))})
    off = {"REDLINE_TE_LIBS": "off"}
    found = {
        "plain": {"env": dict(off), "prepare": False, "torch_cudnn_first": True},
        "redline": {"env": {}, "prepare": True, "torch_cudnn_first": True},
        "redline-te-first": {"env": {}, "prepare": True, "torch_cudnn_first": False},
        "redline-env": {"env": te_library_env(), "prepare": True, "torch_cudnn_first": True},
        "redline-fused-1": {"env": {"NVTE_FUSED_ATTN_BACKEND": "1"}, "prepare": True, "torch_cudnn_first": True},
    }
    if "cudnn" in pip:
        found["ld-cudnn"] = {"env": {**off, "LD_LIBRARY_PATH": f"{pip['cudnn']}:{base_ld}"}, "prepare": False,
                             "torch_cudnn_first": True}
    if all_pip:
        found["ld-pip-all"] = {"env": {**off, "LD_LIBRARY_PATH": ":".join(all_pip + [base_ld])}, "prepare": False,
                               "torch_cudnn_first": True}
    system = system_cudnn_dir()
    if system:
        found["system-cudnn"] = {"env": {**off, "LD_LIBRARY_PATH": f"{system}:{base_ld}", "CUDNN_HOME": system,
                                         "CUDNN_PATH": system}, "prepare": False, "torch_cudnn_first": False}
    # the path redline takes now first, then last session's failing setting, so a cut-off run still tells most
    order = ["redline", "ld-cudnn", "plain", "redline-te-first", "system-cudnn", "ld-pip-all", "redline-env",
             "redline-fused-1"]
    return {name: found[name] for name in order if name in found}


def run_variant(name: str, variant: dict, out_dir: Path, timeout: int) -> dict:
    env = {**os.environ, **DEBUG_ENV, **variant["env"]}
    command = [sys.executable, __file__, "--child", json.dumps({"name": name, **variant})]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, code = exc.stdout or "", exc.stderr or "", "timeout"
        stdout, stderr = (s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr))
    (out_dir / f"{name}.log").write_text(f"$ {' '.join(command)}\n# env: {json.dumps(variant['env'])}\n"
                                         f"# exit: {code}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    result = {"variant": name, "env": variant["env"], "exit": code, "seconds": time.perf_counter() - start}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[len("RESULT "):]))
    keep = [line for line in stderr.splitlines() if any(key in line for key in LOG_KEYS)]
    result["log_excerpt"] = list(dict.fromkeys(keep))[:40]
    return result


def _cell(mode: dict | None, key: str, spec: str = "") -> str:
    if not mode:
        return "—"
    if mode.get("error"):
        return "error"
    value = mode.get(key)
    return "—" if value is None else format(value, spec)


def markdown(results: list[dict]) -> str:
    lines = ["# TransformerEngine attention diagnosis", "",
             "fwd+bwd at 4 x 4096 tokens, 32/8 heads, head_dim 128 (bf16); parity = max |err| / max |ref| over "
             "output and dq/dk/dv vs fp32 SDPA (THD, padding_causal, GQA), on short sequences (8/2 heads) and on "
             "4096 + 2500 + 1596 tokens at 32/8 heads (parity 4k).", "",
             "| variant | TE import | cuDNN torch / TE | cuDNN copies | TE default backend | parity | parity 4k | ms | "
             "TE fused ms | TE flash ms | TE unfused ms | redline attention | redline ms | auto picks |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for r in results:
        modes = r.get("te_modes", {})
        default = modes.get("default")
        redline = r.get("redline_attention", {})
        cudnn = f"{r.get('cudnn_torch', '?')} / {r.get('cudnn_te', '?')}"
        lines.append(
            f"| {r['variant']} | {'ok' if r.get('te_import') == 'ok' else r.get('te_import', r['exit'])} | {cudnn} | "
            f"{len(r.get('cudnn_dirs', []))} | {_cell(default, 'selected')} | {_cell(default, 'parity', '.2e')} | "
            f"{_cell(default, 'parity_long', '.2e')} | "
            f"{_cell(default, 'ms', '.2f')} | {_cell(modes.get('fused'), 'ms', '.2f')} | "
            f"{_cell(modes.get('flash'), 'ms', '.2f')} | {_cell(modes.get('unfused'), 'ms', '.2f')} | "
            f"{redline.get('impl', '—')} | {_cell(redline, 'ms', '.2f')} | {r.get('auto_choice', '—')} |")
    lines.append("")
    for r in results:
        lines += [f"## {r['variant']}", "", f"env: `{json.dumps(r['env'])}`; exit {r['exit']}; "
                  f"{r.get('seconds', 0):.0f} s", ""]
        if r.get("prepare_report"):
            lines.append(f"prepare_te_libraries: {json.dumps(r['prepare_report'])[:1500]}")
        lines.append(f"cuDNN dispatchers mapped from: {r.get('cudnn_dirs')}")
        lines.append("libraries mapped: " + ", ".join(r.get("libraries", [])))
        for mode, info in r.get("te_modes", {}).items():
            lines.append(f"- TE {mode}: {json.dumps(info)[:600]}")
        if r.get("errors"):
            lines.append(f"errors: {json.dumps(r['errors'])[:1500]}")
        lines += ["", "```"] + r.get("log_excerpt", []) + ["```", ""]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="output folder")
    parser.add_argument("--variants", help="comma-separated subset of the variants")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per child process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if not args.out:
        parser.error("--out is required")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    chosen = variants()
    if args.variants:
        unknown = set(args.variants.split(",")) - set(chosen)
        if unknown:
            parser.error(f"unknown or unavailable variants {sorted(unknown)}; available: {list(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in args.variants.split(",")}
    results = []
    for name, variant in chosen.items():
        print(f"== {name}: {json.dumps(variant)}", flush=True)
        result = run_variant(name, variant, out_dir, args.timeout)
        modes = result.get("te_modes", {})
        print(f"   exit {result['exit']}, TE import {result.get('te_import')}, cuDNN dirs "
              f"{result.get('cudnn_dirs')}, default {modes.get('default')}, auto {result.get('auto_choice')}",
              flush=True)
        results.append(result)
        (out_dir / "te-attention.json").write_text(json.dumps(results, indent=2) + "\n")
        (out_dir / "te-attention.md").write_text(markdown(results))
    print((out_dir / "te-attention.md").read_text())


# ---- the child: one variant, in its own process ---------------------------------------------------------------

def child(variant: dict) -> None:
    import torch

    result = {"errors": {}}

    def attempt(key, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a diagnostic records every failure and goes on
            result["errors"][key] = f"{type(exc).__name__}: {exc}"[:2000]
            traceback.print_exc()
            return None

    result["torch"] = torch.__version__
    if variant["torch_cudnn_first"]:
        attempt("torch_sdpa_cudnn", torch_cudnn_attention)
    result["cudnn_torch"] = attempt("cudnn_torch", lambda: torch.backends.cudnn.version())
    if variant["prepare"]:
        from redline.trainer.layers.te_env import prepare_te_libraries

        result["prepare_report"] = attempt("prepare", prepare_te_libraries)
    te = attempt("te_import", lambda: __import__("transformer_engine.pytorch", fromlist=["pytorch"]))
    result["te_import"] = "ok" if te is not None else result["errors"].get("te_import", "failed")[:300]
    if te is not None:
        import transformer_engine

        result["te"] = getattr(transformer_engine, "__version__", "?")
        result["cudnn_te"] = attempt("cudnn_te", te_cudnn_version)
        result["te_modes"] = {mode: te_mode(te, env) for mode, env in MODES.items()}
        for key in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            os.environ.pop(key, None)
        result["auto_choice"] = attempt("auto_choice", auto_choice)
    result["redline_attention"] = attempt("redline_attention", redline_attention) or {}
    from redline.trainer.layers.te_env import loaded_cudnn_dirs, loaded_libraries

    result["libraries"] = loaded_libraries()
    result["cudnn_dirs"] = loaded_cudnn_dirs()
    try:
        import flash_attn

        result["flash_attn"] = getattr(flash_attn, "__version__", "installed")
    except ImportError:
        result["flash_attn"] = None
    print("RESULT " + json.dumps(result, default=str), flush=True)


def torch_cudnn_attention():
    """Make torch load its cuDNN the way a bf16 model does before TE is imported (SDPA on the cuDNN backend)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 8, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    torch.cuda.synchronize()
    return "ok"


def te_cudnn_version():
    from transformer_engine.pytorch import utils

    return ".".join(map(str, utils.get_cudnn_version()))


def thd_inputs(lengths, heads, kv_heads, head_dim, seed=0):
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
               for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    return q, k, v, grad, cu_seqlens


def reference(q, k, v, grad, cu_seqlens):
    """Per-sequence causal attention in fp32 (math kernel) and its q/k/v gradients."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    bounds = cu_seqlens.tolist()
    groups = q.shape[1] // k.shape[1]
    outs = []
    with sdpa_kernel([SDPBackend.MATH]):
        for start, end in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
            ks, vs = (t.repeat_interleave(groups, dim=1) for t in (ks, vs))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1))
    out = torch.cat(outs)
    out.backward(grad.float())
    return out.detach(), q.grad, k.grad, v.grad


_REFERENCES = {}


def parity(attention, lengths=PARITY_LENGTHS, **shape) -> float:
    """max |got - ref| / max |ref| over output, dq, dk, dv of ``attention(q, k, v, cu_seqlens, max_seqlen)``."""
    shape = shape or PARITY
    q, k, v, grad, cu_seqlens = thd_inputs(lengths, shape["heads"], shape["kv_heads"], shape["head_dim"])
    key = (tuple(lengths), tuple(sorted(shape.items())))
    if key not in _REFERENCES:  # the same inputs for every backend tried in this process
        _REFERENCES[key] = reference(q, k, v, grad, cu_seqlens)
    want = _REFERENCES[key]
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*inputs, cu_seqlens, max(lengths)).view_as(grad)
    out.backward(grad)
    got = [out.detach()] + [t.grad for t in inputs]
    return max(((g.float() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item() for g, w in zip(got, want))


def timing(attention) -> tuple[float, float]:
    """fwd+bwd ms (median of 10 after 3) at the Llama-3-8B shape, and TFLOP/s (causal, x3.5 for fwd+bwd)."""
    import torch

    s = LLAMA
    q, k, v, grad, cu_seqlens = thd_inputs([s["length"]] * s["sequences"], s["heads"], s["kv_heads"], s["head_dim"])
    inputs = [t.requires_grad_() for t in (q, k, v)]

    def step():
        attention(*inputs, cu_seqlens, s["length"]).view_as(grad).backward(grad)

    for _ in range(3):
        step()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    flops = 3.5 * s["sequences"] * 2 * s["length"] ** 2 * s["heads"] * s["head_dim"]
    return ms, flops / ms / 1e9


def te_attention_fn(te, heads, kv_heads, head_dim):
    dpa = te.DotProductAttention(heads, head_dim, num_gqa_groups=kv_heads, qkv_format="thd",
                                 attn_mask_type="padding_causal")

    def run(q, k, v, cu_seqlens, max_seqlen):
        return dpa(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_seqlen,
                   max_seqlen_kv=max_seqlen)
    return run


def te_mode(te, env: dict) -> dict:
    """TE's attention with only the backends of ``env`` allowed: selected backend, parity, time."""
    from redline.trainer.layers.te_layers import selected_te_backend, te_attention_record

    for key in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(key, None)
    os.environ.update(env)
    info = {}
    record = te_attention_record()
    try:
        if record is not None:
            record["backend_selection_requires_update"] = True
            record["attention_params"] = None
        info["parity"] = parity(te_attention_fn(te, **PARITY))
        info["selected"] = selected_te_backend(te_attention_record())
        if (te_attention_record() or {}).get("fused_attention_backend") is not None:
            info["fused_sub_backend"] = str(te_attention_record()["fused_attention_backend"])
        llama = te_attention_fn(te, LLAMA["heads"], LLAMA["kv_heads"], LLAMA["head_dim"])
        info["ms"], info["tflops"] = timing(llama)
        info["selected_at_llama_shape"] = selected_te_backend(te_attention_record())
        info["parity_long"] = parity(llama, LONG_LENGTHS, heads=LLAMA["heads"], kv_heads=LLAMA["kv_heads"],
                                     head_dim=LLAMA["head_dim"])
    except Exception as exc:  # noqa: BLE001
        info["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        info.setdefault("selected", selected_te_backend(te_attention_record()))
        traceback.print_exc()
    return info


def redline_attention() -> dict:
    from redline.trainer.models.attention import varlen_attention_impl, varlen_causal_attention

    def run(q, k, v, cu_seqlens, max_seqlen):
        return varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, q.shape[-1] ** -0.5)

    import torch

    info = {"impl": varlen_attention_impl("cuda", torch.bfloat16), "parity": parity(run)}
    info["ms"], info["tflops"] = timing(run)
    info["parity_long"] = parity(run, LONG_LENGTHS, heads=LLAMA["heads"], kv_heads=LLAMA["kv_heads"],
                                 head_dim=LLAMA["head_dim"])
    return info


def auto_choice() -> str:
    from redline.trainer.layers import layer_backend

    backend = layer_backend("te", recipe=None)
    backend.attention(LLAMA["heads"], LLAMA["kv_heads"], LLAMA["head_dim"])
    return backend.attention_impl


if __name__ == "__main__":
    main()
