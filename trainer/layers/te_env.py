"""Make TransformerEngine load the cuDNN, NVRTC and nvJitLink that torch loads, before TE is imported.

Why: pip torch (``torch 2.x+cu13x``) runs on the pip cuDNN (``nvidia/cudnn/lib``) and the pip CUDA libraries
(``nvidia/cu13/lib``: NVRTC, nvJitLink), while TE's loader (``transformer_engine/common/__init__.py``) looks
first in ``$CUDNN_HOME``, ``$CUDNN_PATH``, ``$CUDA_HOME``, ``/usr/local/cuda`` and then the linker path, so on
an image with its own cuDNN it brings a second cuDNN into the process. cuDNN 9 is a dispatcher
(``libcudnn.so.9``) that ``dlopen``s its sublibraries (graph, ops, engines ...) by soname at run time: with two
copies present the sublibraries of one are handed to the other. Seen on the H100 machine (torch 2.11+cu130,
pip cuDNN next to an image cuDNN 9.19): TE failed to import (``libcudnn_cnn.so.9: undefined symbol``) after torch
had used cuDNN; with only ``LD_LIBRARY_PATH`` pointing at the pip cuDNN it imported, but its fused attention
then failed with ``CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED`` and TE silently ran its unfused attention (4x slower
layer). cuDNN's runtime-compiled engines also ``dlopen`` NVRTC, which ``dlopen``s ``libnvrtc-builtins`` by
soname from the pip ``cu13/lib`` folder that no RUNPATH names.

The fix, in-process: point ``CUDNN_HOME``/``CUDNN_PATH``/``NVRTC_HOME`` at the copies torch uses (so TE's loader
picks the same files) and load them, every cuDNN sublibrary included, with ``RTLD_GLOBAL`` before TE is imported
(a later ``dlopen`` by soname then finds them already loaded). ``prepare_te_libraries()`` does this; the ``te``
layer backend calls it before its first TE import. For processes that import TE without redline (or to set the
linker path for children), print the same settings as shell exports:

    eval "$(python -m redline.trainer.layers.te_env)"

``REDLINE_TE_LIBS=off`` leaves the process untouched. ``benchmarks/diagnose_te_attention.py`` checks on a GPU
which setting makes TE's fused attention load, run and agree with SDPA.
"""

import ctypes
import functools
import importlib.util
import logging
import os
import re
import sys
from pathlib import Path

logger = logging.getLogger("redline.trainer.te")

OFF_VARIABLE = "REDLINE_TE_LIBS"
# Library name prefixes worth reporting from /proc/self/maps when diagnosing TE / cuDNN loading.
REPORTED_LIBRARIES = ("libcudnn", "libnvrtc", "libnvJitLink", "libcublas", "libcudart", "libtransformer_engine",
                      "transformer_engine_torch", "libflash", "libcuda.so")
# cuDNN: the dispatcher first, then the graph library the others link against; the rest in name order.
CUDNN_FIRST = ("libcudnn.so", "libcudnn_graph.so")


def nvidia_roots() -> list[Path]:
    """Folders of the ``nvidia`` namespace package (pip CUDA libraries); empty when there is none."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])]


def _first_dir(candidates, pattern: str) -> Path | None:
    return next((d for d in candidates if d.is_dir() and any(d.glob(pattern))), None)


def pip_library_dirs(roots: list[Path]) -> dict[str, Path]:
    """``{"cudnn" | "nvrtc" | "nvjitlink": lib folder}`` of the pip NVIDIA packages under ``roots`` (CUDA 13
    packages share ``nvidia/cu13/lib``; CUDA 12 ones have a folder each)."""
    found = {}
    cudnn = _first_dir([r / "cudnn" / "lib" for r in roots], "libcudnn.so*")
    if cudnn is not None:
        found["cudnn"] = cudnn
    layouts = {"nvrtc": ("cu13/lib", "cu12/lib", "cuda_nvrtc/lib"), "nvjitlink": ("cu13/lib", "cu12/lib",
                                                                                  "nvjitlink/lib")}
    patterns = {"nvrtc": "libnvrtc.so*", "nvjitlink": "libnvJitLink.so*"}
    for name, subdirs in layouts.items():
        folder = _first_dir([r / sub for sub in subdirs for r in roots], patterns[name])
        if folder is not None:
            found[name] = folder
    return found


def loaded_libraries(maps_text: str | None = None, prefixes=REPORTED_LIBRARIES) -> list[str]:
    """Paths of the shared libraries mapped into this process whose file name starts with one of
    ``prefixes`` (from ``/proc/self/maps``; ``maps_text`` replaces it in tests), in first-mapped order."""
    if maps_text is None:
        try:
            maps_text = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    paths = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            path = fields[5].strip()
            if os.path.basename(path).startswith(prefixes) and path not in paths:
                paths.append(path)
    return paths


def loaded_cudnn_dirs(maps_text: str | None = None) -> list[str]:
    """Folders from which a cuDNN dispatcher (``libcudnn.so*``) is mapped; more than one means two cuDNNs."""
    dirs = []
    for path in loaded_libraries(maps_text, ("libcudnn.so",)):
        folder = os.path.dirname(path)
        if folder not in dirs:
            dirs.append(folder)
    return dirs


def _prepend_path(value: str | None, folders: list[str]) -> str:
    existing = [p for p in (value or "").split(os.pathsep) if p]
    return os.pathsep.join(list(dict.fromkeys(folders + existing)))


def te_library_env(environ=None, roots: list[Path] | None = None, cudnn_dir: Path | None = None) -> dict[str, str]:
    """Variables that make TE load torch's pip cuDNN / NVRTC / nvJitLink: ``LD_LIBRARY_PATH`` (their folders
    first, for child processes and ``dlopen`` by soname), ``CUDNN_HOME``/``CUDNN_PATH`` and ``NVRTC_HOME`` (read
    by TE's loader). ``cudnn_dir`` overrides the cuDNN folder (the one torch already loaded). Empty when no pip
    NVIDIA libraries are installed (a system CUDA install needs nothing)."""
    environ = os.environ if environ is None else environ
    dirs = pip_library_dirs(nvidia_roots() if roots is None else roots)
    if cudnn_dir is not None:
        dirs["cudnn"] = Path(cudnn_dir)
    if not dirs:
        return {}
    env = {"LD_LIBRARY_PATH": _prepend_path(environ.get("LD_LIBRARY_PATH"),
                                            [str(d) for d in dict.fromkeys(dirs.values())])}
    if "cudnn" in dirs:
        env["CUDNN_HOME"] = env["CUDNN_PATH"] = str(dirs["cudnn"].parent)
    if "nvrtc" in dirs:
        env["NVRTC_HOME"] = str(dirs["nvrtc"].parent)
    return env


def _version_key(path: Path):
    return [int(n) if n.isdigit() else n for n in re.split(r"(\d+)", path.name)]


def preload_order(dirs: dict[str, Path]) -> list[Path]:
    """The files to load, in order: nvJitLink, NVRTC and its builtins (cuDNN's runtime-compiled engines need
    them), then the cuDNN dispatcher, its graph library and every other sublibrary. One file per soname."""
    wanted = [("nvjitlink", "libnvJitLink.so.*"), ("nvrtc", "libnvrtc.so.*"), ("nvrtc", "libnvrtc-builtins.so.*"),
              ("cudnn", "libcudnn*.so.*")]
    files = []
    for key, pattern in wanted:
        folder = dirs.get(key)
        if folder is None:
            continue
        by_soname = {}
        for path in sorted(folder.glob(pattern), key=_version_key):
            soname = re.sub(r"(\.so\.\d+).*$", r"\1", path.name)  # libcudnn_ops.so.9.8.0 -> libcudnn_ops.so.9
            if "alt" not in path.name.split("."):  # libnvrtc.alt.so.*: NVRTC's static-builtins variant
                by_soname.setdefault(soname, path)
        chosen = list(by_soname.values())
        if key == "cudnn":
            rank = {name: i for i, name in enumerate(CUDNN_FIRST)}
            chosen.sort(key=lambda p: (rank.get(p.name.split(".so")[0] + ".so", len(rank)), p.name))
        files += [f for f in chosen if f not in files]
    return files


def _under_any(folder: Path, roots: list[Path]) -> bool:
    resolved = folder.resolve()
    return any(root.resolve() in resolved.parents for root in roots)


@functools.cache
def prepare_te_libraries() -> dict:
    """Set the variables of ``te_library_env`` in this process and load torch's cuDNN (all sublibraries), NVRTC
    and nvJitLink with ``RTLD_GLOBAL``, so the TE imported next uses them. Call before the first
    ``import transformer_engine``; once per process. Returns what it did (for logs and diagnostics)."""
    report = {"loaded": [], "failed": {}, "env": {}}
    if os.environ.get(OFF_VARIABLE, "").lower() in ("0", "off", "false", "no"):
        report["skipped"] = f"{OFF_VARIABLE}={os.environ[OFF_VARIABLE]}"
        return report
    if "transformer_engine" in sys.modules:
        report["skipped"] = "TransformerEngine was imported before; its libraries are already chosen"
        logger.warning("prepare_te_libraries: %s", report["skipped"])
        return report
    roots = nvidia_roots()
    torch_cudnn = loaded_cudnn_dirs()
    pip_dirs = pip_library_dirs(roots)
    cudnn_dir = Path(torch_cudnn[0]) if torch_cudnn else pip_dirs.get("cudnn")
    if cudnn_dir is not None and not _under_any(cudnn_dir, roots):
        cudnn_dir = None  # torch runs on a system cuDNN: TE's own search finds that one too
        pip_dirs.pop("cudnn", None)
    else:
        pip_dirs["cudnn"] = cudnn_dir
    env = te_library_env(roots=roots, cudnn_dir=cudnn_dir)
    if cudnn_dir is None:
        for key in ("CUDNN_HOME", "CUDNN_PATH"):
            env.pop(key, None)
    os.environ.update(env)
    report["env"] = env
    for path in preload_order({k: v for k, v in pip_dirs.items() if v is not None}):
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            report["loaded"].append(str(path))
        except OSError as exc:
            report["failed"][str(path)] = str(exc)
    if report["failed"]:
        logger.warning("prepare_te_libraries: could not load %s", report["failed"])
    return report


def main() -> None:
    """Print the variables as ``export`` lines: ``eval "$(python -m redline.trainer.layers.te_env)"``."""
    import shlex

    for key, value in te_library_env().items():
        print(f"export {key}={shlex.quote(value)}")


if __name__ == "__main__":
    main()
