"""`redline env`: software versions, GPUs as NVML reports them, and the backends redline will use."""

import platform
import subprocess
import sys
from pathlib import Path
from dataclasses import asdict

import torch

from redline import __version__
from redline.backends import select_backends
from redline.extras import available, import_error, version

PACKAGES = {
    "triton": "triton",
    "transformer_engine": "TransformerEngine",
    "sglang": "SGLang",
    "ray": "Ray",
    "flash_attn": "flash-attn",
    "quack": "QuACK",
    "transformers": "transformers",
}
# installed packages whose loading is checked too (cheap, and known to be installable but unloadable)
LOAD_CHECKED = {"flash_attn": "flash_attn.cute"}
SOURCE_TREE = Path(__file__).resolve().parents[1]  # the repository this redline runs from (an editable install)


def source_revision(abbrev: int = 12) -> str | None:
    """``git describe --always --dirty`` of the source tree (``-dirty``: it differs from the commit, e.g. a copy of
    a working tree carrying an older ``.git``); outside a git checkout, the commit a ``git archive`` of the tree
    wrote into ``core/REVISION`` (``export-subst``, ``.gitattributes``), cut to ``abbrev``; else None."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", f"--abbrev={abbrev}"], cwd=SOURCE_TREE,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        exported = (SOURCE_TREE / "core" / "REVISION").read_text().strip()
    except OSError:
        return None
    return exported[:abbrev] if exported and not exported.startswith("$Format") else None


def write_environment(folder: Path) -> Path:
    """``folder/environment.json``: the date (UTC), the source revision, the software versions and NVML's view of
    the GPUs of the run whose results the folder holds."""
    import datetime
    import json

    path = Path(folder) / "environment.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                "commit": source_revision(), "software": software(), "gpus": gpus()}, indent=1)
                    + "\n")
    return path


def software() -> dict:
    info = {
        "redline": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda (torch build)": torch.version.cuda or "none (CPU build)",
    }
    for module, label in PACKAGES.items():
        info[label] = version(module) if available(module) else "missing"
        error = import_error(LOAD_CHECKED[module]) if module in LOAD_CHECKED and available(module) else None
        if error is not None:
            info[label] = f"{info[label]} (installed, but {LOAD_CHECKED[module]} does not load: {error[:200]})"
    return info


def gpus() -> dict:
    """NVML view of every GPU: {"driver": str, "devices": [...]} or {"error": reason}."""
    if not available("pynvml"):
        return {"error": "nvidia-ml-py is missing (pip install 'redline[gpu]')"}
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"error": f"NVML unavailable: {exc}"}
    try:
        devices = [device_snapshot(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
        return {"driver": _text(pynvml.nvmlSystemGetDriverVersion()), "devices": devices}
    finally:
        pynvml.nvmlShutdown()


def device_snapshot(pynvml, index: int) -> dict:
    """Name, memory (MiB), clocks (MHz), power (W) and temperature (C) of one GPU; NVML must be initialised."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    snapshot = {
        "index": index,
        "name": _text(pynvml.nvmlDeviceGetName(handle)),
        "memory_used_mib": memory.used // 2**20,
        "memory_total_mib": memory.total // 2**20,
    }
    readings = {
        "sm_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
        "mem_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
        "max_sm_clock_mhz": lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
        "power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
        "power_limit_w": lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0,
        "temperature_c": lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
    }
    for key, read in readings.items():
        try:
            snapshot[key] = read()
        except pynvml.NVMLError:
            snapshot[key] = None  # not every board exposes every sensor
    return snapshot


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def collect() -> dict:
    return {
        "software": software(),
        "platform": {"system": platform.system(), "machine": platform.machine(), "executable": sys.executable},
        "gpus": gpus(),
        "backends": asdict(select_backends()),
    }


def render(report: dict, console) -> None:
    """Print the report as rich tables on ``console``."""
    from rich.table import Table

    table = Table(title="software", show_header=False)
    for key, value in report["software"].items():
        table.add_row(key, str(value), style="red" if value == "missing" else None)
    console.print(table)
    gpu_info = report["gpus"]
    if "error" in gpu_info:
        console.print(f"GPUs: none visible ({gpu_info['error']})", markup=False)
    else:
        gpu_table = Table(title=f"GPUs (driver {gpu_info['driver']})")
        columns = ["index", "name", "memory_used_mib", "memory_total_mib", "sm_clock_mhz", "max_sm_clock_mhz",
                   "power_w", "power_limit_w", "temperature_c"]
        for column in columns:
            gpu_table.add_column(column)
        for device in gpu_info["devices"]:
            gpu_table.add_row(*(str(device.get(c)) for c in columns))
        console.print(gpu_table)
    backend_table = Table(title="backends", show_header=False)
    for key, value in report["backends"].items():
        backend_table.add_row(key, value)
    console.print(backend_table)
