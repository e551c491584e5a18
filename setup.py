"""Packaging for redline.

The repository keeps one folder per subsystem at its root (kernels/, trainer/, rollout/, sync/, loop/)
and the top-level package in core/; this file maps them onto the import names ``redline``,
``redline.kernels`` ... so nothing lands at the top level of site-packages but ``redline``.

The native library (CMakeLists.txt) is built when a CUDA toolkit is found and skipped otherwise.
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()
SUBSYSTEMS = {"kernels": "kernels", "trainer": "trainer", "rollout": "rollout", "sync": "sync", "loop": "loop"}
NATIVE_LIBRARY = "libredline_native.so"
NATIVE_PACKAGE_DIR = "sync"  # the library's only user is redline.sync (colocation memory)


def package_layout():
    packages = ["redline"] + [f"redline.{p}" for p in find_packages(where="core")]
    package_dir = {"redline": "core"}
    for name, folder in SUBSYSTEMS.items():
        package_dir[f"redline.{name}"] = folder
        packages.append(f"redline.{name}")
        for sub in find_packages(where=folder):
            packages.append(f"redline.{name}.{sub}")
            package_dir[f"redline.{name}.{sub}"] = os.path.join(folder, *sub.split("."))
    return packages, package_dir


def cuda_toolkit():
    """Path of nvcc when a CUDA toolkit is installed, else None."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [Path(home, "bin", "nvcc")] if home else []
    found = shutil.which("nvcc")
    if found:
        candidates.append(Path(found))
    return next((str(c) for c in candidates if c.exists()), None)


class BuildPyWithNative(build_py):
    """build_py that also builds the CUDA native library with CMake when nvcc is present."""

    def run(self):
        super().run()
        nvcc = cuda_toolkit()
        if nvcc is None or shutil.which("cmake") is None or os.environ.get("REDLINE_SKIP_NATIVE") == "1":
            print("redline: no CUDA toolkit (nvcc) or cmake found; skipping the native library")
            return
        build_dir = ROOT / "build" / "native"
        build_dir.mkdir(parents=True, exist_ok=True)
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_dir), f"-DCMAKE_CUDA_COMPILER={nvcc}",
                               "-DCMAKE_BUILD_TYPE=Release"])
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2)])
        built = build_dir / NATIVE_LIBRARY
        if not built.exists():
            return  # CMakeLists defines no native target yet
        if getattr(self, "editable_mode", False):
            target = ROOT / NATIVE_PACKAGE_DIR / NATIVE_LIBRARY
        else:
            target = Path(self.build_lib, "redline", NATIVE_PACKAGE_DIR, NATIVE_LIBRARY)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)


packages, package_dir = package_layout()

setup(
    name="redline",
    version="0.1.0",
    description="Reinforcement-learning post-training for LLMs at the speed of the hardware (PyTorch only)",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8") if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=packages,
    package_dir=package_dir,
    package_data={"redline.sync": [NATIVE_LIBRARY], "redline": ["py.typed"]},
    install_requires=[
        "torch>=2.6",
        "numpy",
        "safetensors",
        "transformers>=4.50",
        "tokenizers",
        "rich",
        "tensorboard",
        "matplotlib",
        "click>=8.1",
        "packaging",
    ],
    extras_require={
        # quack-kernels: the CuTe-DSL LM-head GEMMs (redline.kernels.lm_head_gemm_cute) on sm_90
        "gpu": ["triton>=3.2", "nvidia-ml-py", "flash-attn-4; platform_system == 'Linux'",
                "quack-kernels>=0.6.5,<0.7; platform_system == 'Linux'"],
        "te": ["transformer_engine[pytorch]"],
        "sglang": ["sglang", "sglang-router", "aiohttp"],
        "ray": ["ray[default]>=2.40"],
        "data": ["pyarrow", "sympy", "math-verify", "aiohttp"],
        "wandb": ["wandb"],
        "trl": ["trl>=1.12,<1.17"],  # redline.kernels.integrations.trl replaces GRPOTrainer methods of these releases
        "test": ["pytest>=8", "pytest-benchmark", "triton>=3.2", "hypothesis", "pyarrow", "sympy", "math-verify",
                 "nvidia-ml-py", "aiohttp", "wandb", "trl>=1.12,<1.17",
                 "ray[default]>=2.40"],  # the Ray tests read actor placement through the state API (its dashboard)
    },
    entry_points={"console_scripts": ["redline=redline.cli:main"]},
    cmdclass={"build_py": BuildPyWithNative},
)
