"""Autotuner choices that outlive the process: one JSON table per GPU model and software stack.

Triton's own on-disk autotune cache (``TRITON_CACHE_AUTOTUNING=1`` / ``cache_results=True``, Triton 3.6 and 3.9)
skips every kernel whose configs carry a ``pre_hook`` ("we can't serialize prehooks"), and the LM-head GEMMs'
configs need one (it sets the TMA descriptors' block shapes per config). So redline keeps the choices itself: a
tuned ``triton.autotune`` kernel's ``cache`` (its tuning key → the chosen ``Config``) is read out after tuning
(``harvest``) as ``{"kernel", "key", "config"}`` entries — the key exactly as the autotuner built it, the config as
its index in the kernel's config list plus its text — and put back into the autotuner of a later process
(``apply``) before any call, so the kernel never times its configs again. The same entries are what data-parallel
ranks receive from rank 0.

Where: ``<cache root>/autotune/<device>-<fingerprint>.json``; the root is ``$REDLINE_CACHE_DIR``, else
``$XDG_CACHE_HOME/redline``, else ``~/.cache/redline``. The fingerprint (``fingerprint_key``) hashes the device
name, compute capability, driver and CUDA versions, and the triton, torch and redline versions: a change to any of
them starts a new table. Pure file and dict work here; ``current_fingerprint`` alone asks the GPU.
"""

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import torch

CACHE_ENV = "REDLINE_CACHE_DIR"
TABLE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What a tuning result depends on besides the shapes in its key."""

    device: str  # torch.cuda.get_device_name
    capability: tuple[int, int]
    driver: str
    cuda: str
    triton: str
    torch: str
    redline: str


def fingerprint_key(fp: Fingerprint) -> str:
    """16 hex digits naming ``fp``: equal fingerprints give equal keys, any field changed gives another."""
    text = json.dumps(dataclasses.asdict(fp), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_root(env=None) -> Path:
    """``$REDLINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/redline``, else ``~/.cache/redline`` (``env``: a mapping
    standing in for ``os.environ``)."""
    env = os.environ if env is None else env
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV]).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "redline"


def table_path(fp: Fingerprint, root: Path | None = None) -> Path:
    """The table file of ``fp`` under ``root`` (default ``cache_root()``)."""
    device = re.sub(r"[^A-Za-z0-9]+", "-", fp.device).strip("-").lower() or "device"
    return (cache_root() if root is None else Path(root)) / "autotune" / f"{device}-{fingerprint_key(fp)}.json"


def current_fingerprint(device: torch.device) -> Fingerprint:
    """The fingerprint of the CUDA ``device`` this process runs on."""
    from importlib.metadata import version

    import triton

    return Fingerprint(device=torch.cuda.get_device_name(device),
                       capability=tuple(torch.cuda.get_device_capability(device)), driver=_driver_version(),
                       cuda=str(torch.version.cuda), triton=triton.__version__, torch=torch.__version__,
                       redline=version("redline"))


def _driver_version() -> str:
    """The driver's version string from NVML, else the CUDA driver API's version number (NVML can be absent or
    unusable in a container where CUDA itself works)."""
    try:
        import pynvml
    except ImportError:  # the gpu extra brings nvidia-ml-py
        return _driver_api_version()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return _driver_api_version()
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    return version.decode() if isinstance(version, bytes) else str(version)


def _driver_api_version(libcuda: str = "libcuda.so.1") -> str:
    """``cuDriverGetVersion`` of the driver library torch runs on, as ``cuda-driver-api N`` (N = 1000·major +
    10·minor)."""
    import ctypes

    version = ctypes.c_int()
    status = ctypes.CDLL(libcuda).cuDriverGetVersion(ctypes.byref(version))
    if status != 0:
        raise RuntimeError(f"cuDriverGetVersion in {libcuda} returned CUDA error {status}")
    return f"cuda-driver-api {version.value}"


def harvest(kernels: dict) -> list[dict]:
    """Every tuning result held by ``kernels`` (name → ``triton.autotune`` kernel) as JSON-able entries, sorted."""
    entries = []
    for name, kernel in kernels.items():
        for key, config in kernel.cache.items():
            index = kernel.configs.index(config)
            entries.append({"kernel": name, "key": list(key), "config": index, "text": str(config)})
    return sorted(entries, key=lambda e: (e["kernel"], json.dumps(e["key"])))


def apply(kernels: dict, entries: list[dict]) -> int:
    """Seed each autotuner's cache with ``entries`` (``harvest``'s form); returns how many were taken. An entry of
    an unknown kernel, or whose config index or text no longer matches the kernel's config list (the configs were
    edited), is skipped: that key is tuned again."""
    taken = 0
    for entry in entries:
        kernel = kernels.get(entry["kernel"])
        index = entry["config"]
        if kernel is None or not 0 <= index < len(kernel.configs) or str(kernel.configs[index]) != entry["text"]:
            continue
        kernel.cache[tuple(entry["key"])] = kernel.configs[index]
        taken += 1
    return taken


def load(path: Path, fp: Fingerprint) -> list[dict]:
    """The entries of the table at ``path`` made under ``fp``; none when the file is missing or was written by
    another fingerprint or table version. A file that is not a table raises ValueError naming it."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        table = json.loads(path.read_text())
        fields = table["fingerprint"], table["version"], table["entries"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a redline tuning table ({exc}); delete it to tune again") from exc
    if fields[0] != _jsonable(fp) or fields[1] != TABLE_VERSION:
        return []
    return fields[2]


def save(path: Path, fp: Fingerprint, entries: list[dict]) -> None:
    """Write ``entries`` to ``path`` atomically (a reader never sees half a table)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": TABLE_VERSION, "fingerprint": _jsonable(fp), "entries": entries},
                              indent=1))
    os.replace(tmp, path)


def _jsonable(fp: Fingerprint) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(fp)))  # the tuple as the list JSON reads back
