"""Launching SGLang servers (one per GPU group) and the sglang-router in front of several.

Extra server options pass through slime-style: ``--sglang-mem-fraction-static 0.7`` becomes the server's
``--mem-fraction-static 0.7`` (plain ``--mem-fraction-static`` is accepted too). The options redline sets
itself (model path, host, port, TP size, GPU, memory saver) may not be passed through.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from redline.extras import require
from redline.ports import free_port, free_ports

OWNED_FLAGS = {"--model-path", "--host", "--port", "--tp-size", "--base-gpu-id", "--enable-memory-saver"}


def passthrough_args(args: list[str]) -> list[str]:
    """``--sglang-x`` → ``--x``; rejects the flags redline owns (it sets them from its own config)."""
    out = []
    for arg in args:
        if arg.startswith("--sglang-"):
            arg = "--" + arg[len("--sglang-"):]
        if arg.split("=", 1)[0] in OWNED_FLAGS:
            raise ValueError(f"sglang argument '{arg}' is set by redline itself; remove it from sglang_args")
        out.append(arg)
    return out


def wait_until_healthy(url: str, process: subprocess.Popen | None, timeout: float, log: Path | None) -> None:
    """Poll ``url/health`` until 200; raise with the log's tail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"server for {url} exited with code {process.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s (log: {log})")


@dataclass
class ManagedProcess:
    """A server process redline started; ``stop`` ends its whole process group (workers included)."""

    url: str
    process: subprocess.Popen
    log: Path
    extra: dict = field(default_factory=dict)

    def stop(self, grace: float = 15.0) -> None:
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


# torchrun's switch to its launcher's store: inherited by a server started from a torchrun rank, it makes the
# server's own rank 0 a client of a store nobody serves (torch.distributed.rendezvous), so its group never forms
TORCHRUN_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def _spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """``cmd`` in a session of its own, output to ``log``, with this process's environment (less
    ``TORCHRUN_STORE_ENV``) and ``env``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    inherited = {k: v for k, v in os.environ.items() if k != TORCHRUN_STORE_ENV}
    with log.open("w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**inherited, **(env or {})})


def launch_server(model_path: str | Path, *, base_gpu_id: int = 0, tp_size: int = 1, port: int | None = None,
                  enable_memory_saver: bool = True, extra_args: list[str] = (), log_dir: str | Path = "logs",
                  timeout: float = 600.0) -> ManagedProcess:
    """Start ``python -m sglang.launch_server`` on GPUs ``base_gpu_id .. base_gpu_id + tp_size - 1`` and wait
    until it is healthy. Memory saver on by default: colocated training needs release/resume."""
    [server] = launch_servers(model_path, [base_gpu_id], tp_size=tp_size, ports=[port],
                              enable_memory_saver=enable_memory_saver, extra_args=extra_args, log_dir=log_dir,
                              timeout=timeout)
    return server


def launch_servers(model_path: str | Path, base_gpu_ids: list[int], *, tp_size: int = 1,
                   ports: list[int | None] | None = None, enable_memory_saver: bool = True,
                   extra_args: list[str] = (), log_dir: str | Path = "logs", timeout: float = 600.0,
                   weight_loaders: list[str] = ()) -> list[ManagedProcess]:
    """One server per entry of ``base_gpu_ids``, healthy on return (all stopped again if one fails). Servers on
    disjoint GPUs start together (start-up is ~35 s each); a server sharing a GPU with an earlier one starts
    after it is up, since SGLang sizes its memory from what is free when it starts. ``weight_loaders``: import
    paths the servers accept as a ``load_format`` (``--custom-weight-loader``, added to any the caller gives)."""
    require("sglang", "launching SGLang servers")
    extra = with_weight_loaders(passthrough_args(list(extra_args)), list(weight_loaders))
    ports = list(ports or [None] * len(base_gpu_ids))
    picked = iter(free_ports(ports.count(None)))  # distinct: two servers of one wave never share a pick
    ports = [port or next(picked) for port in ports]
    started: list[ManagedProcess | None] = [None] * len(base_gpu_ids)
    try:
        for wave in start_waves(base_gpu_ids, tp_size):
            for i in wave:
                port = ports[i]
                cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
                       "--host", "127.0.0.1", "--port", str(port), "--tp-size", str(tp_size),
                       "--base-gpu-id", str(base_gpu_ids[i]), *(["--enable-memory-saver"] if enable_memory_saver
                                                              else []), *extra]
                log = Path(log_dir) / f"sglang-{port}.log"
                started[i] = ManagedProcess(f"http://127.0.0.1:{port}", _spawn(cmd, log), log)
            for i in wave:
                wait_until_healthy(started[i].url, started[i].process, timeout, started[i].log)
    except BaseException:
        for server in started:
            if server is not None:
                server.stop()
        raise
    return started


def with_weight_loaders(args: list[str], loaders: list[str]) -> list[str]:
    """``args`` with ``loaders`` added to its ``--custom-weight-loader`` list (one is added where it has none)."""
    if not loaders:
        return args
    flag = "--custom-weight-loader"
    args = [part for arg in args for part in (arg.split("=", 1) if arg.startswith(flag + "=") else [arg])]
    if flag not in args:
        return [*args, flag, *loaders]
    at = args.index(flag) + 1
    return [*args[:at], *loaders, *args[at:]]


def start_waves(base_gpu_ids: list[int], tp_size: int) -> list[list[int]]:
    """Server indices grouped into start-up waves: server ``i`` goes one wave after the last earlier server whose
    GPUs ``base .. base + tp_size - 1`` overlap its own."""
    gpus = [set(range(base, base + tp_size)) for base in base_gpu_ids]
    wave_of: list[int] = []
    for i, mine in enumerate(gpus):
        wave_of.append(1 + max((wave_of[j] for j in range(i) if gpus[j] & mine), default=-1))
    return [[i for i, w in enumerate(wave_of) if w == wave] for wave in range(max(wave_of, default=-1) + 1)]


def launch_router(worker_urls: list[str], *, port: int | None = None, log_dir: str | Path = "logs",
                  extra_args: list[str] = (), timeout: float = 120.0) -> ManagedProcess:
    """Start sglang-router in front of ``worker_urls`` and wait until it answers."""
    require("sglang_router", "routing across SGLang servers")
    port = port or free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *worker_urls, *extra_args]
    return _start_healthy(cmd, port, Path(log_dir) / f"sglang-router-{port}.log", timeout)


def _start_healthy(cmd: list[str], port: int, log: Path, timeout: float) -> ManagedProcess:
    """Spawn ``cmd`` (logging to ``log``) and wait until it answers on ``port``; stopped again on failure."""
    process = ManagedProcess(f"http://127.0.0.1:{port}", _spawn(cmd, log), log)
    try:
        wait_until_healthy(process.url, process.process, timeout, log)
    except BaseException:
        process.stop()
        raise
    return process
