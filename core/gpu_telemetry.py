"""GPU telemetry of a run: NVML read in a background thread, summarised per step into ``perf/gpu_*`` metrics.

The sampling thread calls NVML only (no CUDA call, so no host sync and nothing queued on a stream); the step
marks where its window starts (``begin``) and each phase of it (``phase``), and takes the summary of the readings
since then (``summary``): the step's figures and the utilisation of each phase, so an idle GPU can be charged to
the phase that left it idle.
NVML's utilisation is the share of its last sample period (1/6 s to 1 s depending on the board) in which a
kernel ran, so a window shorter than that is smeared over its neighbours.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

INTERVAL_S = 0.1  # ~40 µs of NVML calls per GPU per reading: invisible next to a step


class GpuReading(NamedTuple):
    """One GPU at one instant."""

    util_pct: float  # share of NVML's last sample period with a kernel running, 0..100
    mem_bytes: float  # device memory used, every process on the GPU counted
    power_w: float
    sm_clock_mhz: float


class ReadingSource(Protocol):
    def read(self) -> list[GpuReading]:
        """One reading per GPU, in a fixed order."""

    def close(self) -> None: ...


def summarize_phases(samples: Sequence[tuple[str | None, Sequence[GpuReading]]]) -> dict[str, float]:
    """``perf/gpu_util/<phase>``: the mean utilisation (%, over readings and GPUs) of the readings taken while each
    named phase ran; readings before the first phase mark count for none."""
    utils: dict[str, list[float]] = {}
    for phase, readings in samples:
        if phase is not None:
            utils.setdefault(phase, []).extend(r.util_pct for r in readings)
    return {f"perf/gpu_util/{phase}": sum(values) / len(values) for phase, values in utils.items()}


def summarize(samples: Sequence[Sequence[GpuReading]]) -> dict[str, float]:
    """Per-step metrics from ``samples`` (each one reading per GPU, same GPUs in the same order):

    ``perf/gpu_util`` (mean %, over readings and GPUs), ``perf/gpu_mem_gb`` (the most memory any GPU used at any
    reading, 1e9 bytes), ``perf/gpu_power_w`` (mean watts per GPU), ``perf/gpu_sm_clock_mhz`` (mean); with more
    than one GPU also ``perf/gpu<i>_util`` / ``_mem_gb`` / ``_power_w`` / ``_sm_clock_mhz`` for the ``i``-th
    GPU. Empty when there are no samples."""
    if not samples:
        return {}
    per_gpu = list(zip(*samples))  # [gpu][reading]
    mean = lambda values: sum(values) / len(values)

    def of(readings, prefix: str) -> dict[str, float]:
        return {f"{prefix}_util": mean([r.util_pct for r in readings]),
                f"{prefix}_mem_gb": max(r.mem_bytes for r in readings) / 1e9,
                f"{prefix}_power_w": mean([r.power_w for r in readings]),
                f"{prefix}_sm_clock_mhz": mean([r.sm_clock_mhz for r in readings])}

    out = of([r for gpu in per_gpu for r in gpu], "perf/gpu")
    if len(per_gpu) > 1:
        for i, readings in enumerate(per_gpu):
            out.update(of(readings, f"perf/gpu{i}"))
    return out


class GpuTelemetry:
    """Background readings of ``source`` every ``interval_s``; ``GpuTelemetry(None)`` is off (no thread, empty
    summaries). Use as a context manager, or ``start`` / ``stop``."""

    def __init__(self, source: ReadingSource | None, interval_s: float = INTERVAL_S):
        self.source = source
        self.interval_s = interval_s
        self._samples: list[tuple[str | None, list[GpuReading]]] = []  # (phase running, one reading per GPU)
        self._phase: str | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.source is not None

    def start(self) -> GpuTelemetry:
        if self.enabled and self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._sample, name="redline-gpu-telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and release NVML; idempotent."""
        if self._thread is not None:
            self._stopping.set()
            self._thread.join()
            self._thread = None
        if self.source is not None:
            self.source.close()
            self.source = None

    def __enter__(self) -> GpuTelemetry:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _sample(self) -> None:
        while True:
            readings = self.source.read()
            with self._lock:
                self._samples.append((self._phase, readings))
            if self._stopping.wait(self.interval_s):
                return

    def begin(self) -> None:
        """Start a new window: readings taken before now are dropped."""
        with self._lock:
            self._samples = []
            self._phase = None

    def phase(self, name: str) -> None:
        """Readings from now on belong to phase ``name`` (until the next ``phase`` or ``begin``); one is taken now
        (NVML only, ~40 µs a GPU), so every phase entered has a reading however short it is, and every rank of a
        run reports the same ``perf/gpu_util/<phase>`` keys."""
        if not self.enabled:
            return
        reading = self.source.read()
        with self._lock:
            self._phase = name
            self._samples.append((name, reading))

    def summary(self) -> dict[str, float]:
        """``summarize`` and ``summarize_phases`` of the readings since ``begin`` (one taken now when the window
        holds none yet); ``{}`` when off. Starts the next window."""
        if not self.enabled:
            return {}
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            return summarize([self.source.read()])
        return summarize([readings for _, readings in samples]) | summarize_phases(samples)


class NvmlSource:
    """NVML readings of the given CUDA devices (torch numbering; found by UUID, so ``CUDA_VISIBLE_DEVICES``
    renumbering is respected). A sensor the board does not expose reads as NaN."""

    def __init__(self, pynvml, device_indices: Sequence[int]):
        import torch

        self.nvml = pynvml
        pynvml.nvmlInit()
        try:
            self.handles = [pynvml.nvmlDeviceGetHandleByUUID(_nvml_uuid(torch.cuda.get_device_properties(i)))
                            for i in device_indices]
        except BaseException:
            pynvml.nvmlShutdown()
            raise

    def read(self) -> list[GpuReading]:
        return [self._read(handle) for handle in self.handles]

    def _read(self, handle) -> GpuReading:
        nvml = self.nvml
        return GpuReading(self._get(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                          self._get(lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used),
                          self._get(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
                          self._get(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)))

    def _get(self, read: Callable[[], float]) -> float:
        try:
            return float(read())
        except self.nvml.NVMLError:
            return float("nan")

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def _nvml_uuid(props) -> str:
    text = str(props.uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def open_gpu_telemetry(devices, note: Callable[[str], None], interval_s: float = INTERVAL_S) -> GpuTelemetry:
    """Telemetry of the CUDA devices among ``devices`` (``torch.device``s), not yet started; one line to ``note``
    says what it samples. Off, silently, when none is a CUDA device; off with a line saying why when
    nvidia-ml-py is missing or NVML does not start."""
    indices = sorted({_index(d) for d in devices if d.type == "cuda"})
    if not indices:
        return GpuTelemetry(None)
    from redline.extras import available

    if not available("pynvml"):
        note("GPU telemetry off: nvidia-ml-py is missing (pip install 'redline[gpu]')")
        return GpuTelemetry(None)
    import pynvml

    try:
        source = NvmlSource(pynvml, indices)
    except pynvml.NVMLError as exc:
        note(f"GPU telemetry off: NVML unavailable ({exc})")
        return GpuTelemetry(None)
    note(f"GPU telemetry: NVML every {interval_s:g} s on cuda:{', cuda:'.join(map(str, indices))} (perf/gpu_*)")
    return GpuTelemetry(source, interval_s)


def _index(device) -> int:
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()
