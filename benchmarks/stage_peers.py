"""Stage the end-to-end benchmark's peer trainers (issue 20) for the offline GPU machine.

    python3 benchmarks/stage_peers.py trl     # TRL 1.16.0 + datasets (+ accelerate where the image lacks it)
    python3 benchmarks/stage_peers.py vllm    # vLLM 0.26.0, installed into its own venv on the device
    python3 benchmarks/stage_peers.py trl sglang --out /tmp/stage-out

A thin layer over the shared staging tool (``../shared/device/stage.py``, loaded read-only): it adds this
benchmark's bundles to the tool's ``BUNDLES`` and runs the tool's ``main``, so it writes ``.stage/<bundle>/part..``
and ``install.sh`` and prints the upload steps exactly as the tool does; every bundle of the tool can be named
too. Parts are 45 MiB unless ``--chunk-mib`` says otherwise.

vLLM 0.26.0 and SGLang 0.5.17 pin different flashinfer, apache-tvm-ffi, tilelang, numba and torchcodec
releases (../shared/reference/e2e.md), so the ``vllm`` bundle goes into a venv of its own (``VLLM_VENV``) that
sees the image's packages after its own (torch and its CUDA libraries, TRL, redline): its ``install.sh`` creates
the venv and runs the tool's install with the venv's ``python3`` first on ``PATH``. The benchmark runs
``trl-vllm`` with ``--trl-vllm-python /tmp/venv-vllm/bin/python3``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

STAGE_TOOL = (Path(__file__).resolve().parents[1] / "../shared/device/stage.py").resolve()
CHUNK_MIB = 45
VLLM_VENV = "/tmp/venv-vllm"  # /tmp outlives uploads of the working tree on the device, as /tmp/stage does

# Beside vllm, what makes the shared tool's resolver (newest release of each name, first requirement wins, no
# extras) land on pip's own resolution of vllm==0.26.0 beyond the image (checked 2026-11-24 by resolving with pip):
VLLM_PINS = [  # the newest releases need cutlass-dsl >= 4.7 or apache-tvm-ffi >= 0.1.11; vllm pins 4.6.0 and 0.1.10
    "nvidia-cutlass-dsl-libs-cu13==4.6.0", "nvidia-cudnn-frontend==1.28.0", "quack-kernels==0.6.3",
    "xgrammar==0.2.7"]
VLLM_EXTRAS = [  # what fastapi[standard], uvicorn[standard], pyjwt[crypto] and pydantic-extra-types[pycountry] add
    "fastapi-cli", "fastapi-cloud-cli", "fastar", "email-validator", "pydantic-settings", "httptools", "websockets",
    "cryptography", "pycountry"]
# Left out: humming-kernels[cu13]'s nvidia-cuda-nvcc, -cccl, -crt and nvidia-nvvm (121 MiB, CUDA 13.5), the
# toolkit its JIT-built quantised kernels need; this benchmark runs bf16 weights, and the image has nvcc 13.0.

VLLM_REQUIREMENTS_CHECK = r"""
python3 - <<'EOF'
# vLLM's own pins against what this venv sees (its wheels over the image's): a line per unmet one
from importlib.metadata import PackageNotFoundError, requires, version
from packaging.requirements import Requirement
for line in requires("vllm"):
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    try:
        found = version(r.name)
    except PackageNotFoundError:
        found = None
    if found is None or not r.specifier.contains(found, prereleases=True):
        print(f"vllm needs {r}, the venv has {found or 'nothing'}")
EOF
"""

BUNDLES = {
    "trl": {
        "about": "TRL 1.16.0 with accelerate and datasets (pure Python), for the e2e benchmark's trl trainers",
        "wheels": ["trl==1.16.0", "accelerate", "datasets"],
        "sdists": [],
        "post": 'python3 -c "import trl, accelerate, datasets; print(\'trl\', trl.__version__)"',
    },
    "vllm": {
        "about": f"vLLM 0.26.0 (torch==2.11.0, CUDA 13 wheels) in its own venv {VLLM_VENV}, for the trl-vllm trainer",
        "wheels": ["vllm==0.26.0", *VLLM_PINS, *VLLM_EXTRAS],
        "sdists": [],
        "venv": VLLM_VENV,
        "post": VLLM_REQUIREMENTS_CHECK + (
            'python3 -c "import sys, vllm; print(\'vllm\', vllm.__version__, \'in\', sys.prefix)"\n'
            f'echo "run the trl-vllm trainer with: --trl-vllm-python {VLLM_VENV}/bin/python3"'),
    },
}


def load_stage_tool(path: Path = STAGE_TOOL):
    """The shared staging tool as a module (it is a script, not a package)."""
    if not path.is_file():
        raise FileNotFoundError(f"the shared staging tool is not at {path} (expected ../shared/device/stage.py "
                                "beside the repository)")
    spec = importlib.util.spec_from_file_location("shared_stage", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install_into_venv(install_sh: Path, venv: str) -> None:
    """Make ``install_sh`` (written by the shared tool) create ``venv`` and install into it: the tool installs with
    ``python3 -m pip``, so the venv's ``python3`` goes first on ``PATH``.

    The image's ``python3`` is itself a venv (``/opt/torch/.venv``), and ``--system-site-packages`` reaches only
    its base interpreter's packages: a ``.pth`` file adds the image's site-packages (torch, TRL, the editable
    redline; their own ``.pth`` files too) after the new venv's own, so the venv's wheels win where both have a
    package. The venv has no pip of its own (``--without-pip`` needs no ``ensurepip``); the image's pip, run by the
    venv's interpreter, installs into the venv."""
    anchor = "set -euo pipefail\n"
    text = install_sh.read_text()
    if anchor not in text:
        raise RuntimeError(f"{install_sh}: no '{anchor.strip()}' line to put the venv after; the shared stage.py "
                           "changed its install.sh, update stage_peers.install_into_venv")
    prelude = (f'python3 -m venv --without-pip --system-site-packages "{venv}"\n'
               "python3 -c 'import site; print(\"import site; \" + \"; \".join(f\"site.addsitedir({p!r})\" "
               "for p in site.getsitepackages()))' "
               f'> "$("{venv}/bin/python3" -c "import sysconfig; print(sysconfig.get_paths()[\'purelib\'])")'
               '/image-site-packages.pth"\n'
               f'export PATH="{venv}/bin:$PATH"\n')
    install_sh.write_text(text.replace(anchor, anchor + prelude, 1))


def main(argv: list[str] | None = None) -> None:
    stage = load_stage_tool()
    stage.BUNDLES.update(BUNDLES)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+", choices=sorted(stage.BUNDLES))
    ap.add_argument("--out", type=Path, default=Path(".stage"))
    ap.add_argument("--chunk-mib", type=int, default=CHUNK_MIB)
    args = ap.parse_args(argv)
    sys.argv = [str(STAGE_TOOL), *args.bundles, "--out", str(args.out), "--chunk-mib", str(args.chunk_mib)]
    stage.main()
    for name in args.bundles:
        venv = stage.BUNDLES[name].get("venv")
        if venv:
            install_into_venv(args.out / name / "install.sh", venv)


if __name__ == "__main__":
    main()
