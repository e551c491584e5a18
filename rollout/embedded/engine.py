"""The embedded engine: batched generation with redline's own decoder (``redline.trainer.models``).

Runs where SGLang does not (CPU, laptops, CI) and wherever train/rollout log-prob parity matters: the forward
is the trainer's, so log-probs agree with the trainer's up to the kernels' rounding.

Design (gpt-fast style): one preallocated KV cache of ``max_batch_size`` rows x ``max_seq_len`` slots;
a scheduler thread admits queued requests into free rows as soon as rows free up (continuous batching),
prefills them in a side cache that is copied into their rows, then advances every busy row by one token per
decode step. On CUDA the decode step (forward + LM head) is one captured CUDA graph over static buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field

import torch
from redline.devices import on_device
from redline.rollout.embedded.sampling import lm_head_logits, sample
from redline.rollout.embedded.stops import StopChecker
from redline.rollout.embedded.weights import WeightLoader
from redline.rollout.engine import WeightBuckets, check_tags, iterate_buckets
from redline.rollout.types import FinishReason, GenerateRequest, GenerateResult


class EngineMemoryReleased(RuntimeError):
    """Generation was asked for while the weights or the KV cache are released."""


@dataclass
class _Job:
    request: GenerateRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    stop: StopChecker
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Tokens in the context so far (prompt + output)."""
        return len(self.request.input_ids) + len(self.output_ids)


class EmbeddedEngine:
    """Implements ``redline.rollout.engine.Engine`` in-process. ``model`` is a ``redline.trainer.models``
    decoder (its device and dtype are the engine's); ``tokenizer`` is needed for stop strings only.
    ``flat_weights``: keep the parameters in one storage per dtype, so that releasing and resuming the weights
    is one free and one allocation (``weights.flatten_parameters``; costs one transient copy at construction).
    None (default): on CUDA, where it shortens the colocated transition (8B on an H100: 39.2 ms with flat
    weights, 48.5 ms with one storage per parameter; ``benchmarks/results/sync/sync-h100-transition-flat.md``)."""

    def __init__(self, model, tokenizer=None, *, max_batch_size: int = 64, max_seq_len: int = 4096,
                 cuda_graph: bool = True, eos_token_ids: tuple[int, ...] | None = None, seed: int = 0,
                 weight_version: str = "0", flat_weights: bool | None = None):
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"need max_batch_size >= 1 and max_seq_len >= 2, got {max_batch_size}, {max_seq_len}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.device = model.embed_tokens.weight.device
        self.use_cuda_graph = cuda_graph and self.device.type == "cuda"
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else _eos_ids(model, tokenizer))
        self.weight_version = weight_version
        self.weights = WeightLoader(model, flat=self.device.type == "cuda" if flat_weights is None else flat_weights)
        self._default_generator = torch.Generator(device=self.device).manual_seed(seed)

        self._lock = threading.Lock()  # held by every step and every weight / memory operation
        self._wake = threading.Condition()
        self._pending: list[_Job] = []
        self._arriving: dict[asyncio.AbstractEventLoop, list[_Job]] = {}  # per caller loop, see _queue_arrivals
        self._slots: list[_Job | None] = [None] * max_batch_size
        self._paused = False
        self._stopping = False
        self._released: set[str] = set()
        self._cache = self._graph = None
        self._make_cache()
        self._thread = threading.Thread(target=self._serve, name="embedded-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path, *, dtype=torch.bfloat16, device="cpu", backend="bf16", **kwargs):
        """Load a local HF directory with the trainer's loader and transformers' tokenizer."""
        from redline.trainer.models import from_pretrained
        from transformers import AutoTokenizer

        model = from_pretrained(path, backend=backend, dtype=dtype, device=device)
        return cls(model, AutoTokenizer.from_pretrained(path), **kwargs)

    # ----- protocol ---------------------------------------------------------------------------------------

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        if self._stopping:
            raise RuntimeError("the embedded engine is shut down")
        loop = asyncio.get_running_loop()
        jobs = [self._job(i, request, loop) for i, request in enumerate(requests)]
        arriving = self._arriving.setdefault(loop, [])
        if not arriving:
            loop.call_soon(self._queue_arrivals, loop)
        arriving.extend(jobs)
        return list(await asyncio.gather(*(j.future for j in jobs)))

    def _queue_arrivals(self, loop) -> None:
        """Queue every request that arrived in one turn of ``loop`` (one ``generate`` call per sample, all made
        together by the rollout) at once, so the scheduler thread admits them into one prefill whatever the
        timing of its steps. Same seed, same results: a CPU GEMM rounds a row differently with the number of
        rows beside it, so a prefill batch that depended on thread timing would change the samples."""
        jobs = self._arriving.pop(loop)
        with self._wake:
            for job in jobs:
                if job.future.done():  # its caller was cancelled meanwhile
                    continue
                if self._stopping:
                    job.future.set_exception(RuntimeError("the embedded engine is shut down"))
                elif self._paused or job.stop.token_budget == 0:
                    job.future.set_result(GenerateResult([], [], FinishReason.ABORT if self._paused
                                                         else FinishReason.LENGTH, self.weight_version))
                else:
                    self._pending.append(job)
            self._wake.notify()

    async def update_weights(self, buckets: WeightBuckets, version: str) -> None:
        async for bucket in iterate_buckets(buckets):
            await asyncio.to_thread(on_device, self.device, self.load_weights, bucket)
        self.weight_version = str(version)

    def load_weights(self, named_tensors, wait: bool = True) -> None:
        """Copy HF-named tensors into the model (fused QKV / gate-up slices included); blocks until copied
        unless ``wait`` is False (``WeightLoader.load``; weights shared with the trainer become the engine's own
        copy first)."""
        with self.loading_weights() as weights:
            shared = weights.shared
            weights.load(named_tensors, wait)
            if shared:
                self.weights_moved()

    @contextlib.contextmanager
    def loading_weights(self):
        """The ``WeightLoader``, with no decode step or memory operation running until the block ends (weight
        receivers write the parameters inside it). EngineMemoryReleased while the weights are released."""
        if "weights" in self._released:
            raise EngineMemoryReleased("resume_memory({'weights'}) before loading weights")
        with self.between_steps():
            yield self.weights

    @contextlib.contextmanager
    def between_steps(self):
        """No decode step or memory operation runs until the block ends (the weights may be released)."""
        with self._lock:
            yield

    def weights_moved(self) -> None:
        """The parameters were re-pointed (``WeightLoader.share`` / ``unshare``; call inside ``between_steps``):
        the decode graph, which captured their addresses, is captured again at the next step."""
        self._graph = None

    async def release_memory(self, tags) -> None:
        tags = check_tags(tags)
        await asyncio.to_thread(on_device, self.device, self._release, tags)

    async def resume_memory(self, tags) -> None:
        tags = check_tags(tags)
        await asyncio.to_thread(on_device, self.device, self._resume, tags)

    async def flush_cache(self) -> None:
        """Nothing to do: the engine keeps no prefix cache across requests."""

    async def pause(self) -> None:
        with self._wake:
            self._paused = True
            queued, self._pending = self._pending, []
        for job in queued:
            self._finish(job, FinishReason.ABORT)
        await asyncio.to_thread(self._abort_running)

    async def resume(self) -> None:
        with self._wake:
            self._paused = False
            self._wake.notify()

    async def health(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        await asyncio.to_thread(self._thread.join)

    # ----- requests ---------------------------------------------------------------------------------------

    def _job(self, index: int, request: GenerateRequest, loop) -> _Job:
        room = self.max_seq_len - len(request.input_ids)
        if room < 1:
            raise ValueError(f"request {index}: prompt of {len(request.input_ids)} tokens leaves no room in "
                             f"max_seq_len={self.max_seq_len}")
        params = request.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        stop = StopChecker(params, self.eos_token_ids, min(params.max_new_tokens, room), self.tokenizer)
        return _Job(request, loop.create_future(), loop, stop, generator)

    def _finish(self, job: _Job, reason: FinishReason) -> None:
        result = GenerateResult(job.output_ids, job.logp, reason, self.weight_version)

        def resolve():
            if not job.future.done():
                job.future.set_result(result)
        job.loop.call_soon_threadsafe(resolve)

    def _abort_running(self) -> None:
        with self._lock:
            for row, job in enumerate(self._slots):
                if job is not None:
                    self._finish(job, FinishReason.ABORT)
                    self._slots[row] = None

    # ----- scheduler thread -------------------------------------------------------------------------------

    def _serve(self) -> None:
        on_device(self.device, self._serve_loop)

    def _serve_loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and (self._paused or not self._pending) and not any(self._slots):
                    self._wake.wait()
                if self._stopping:
                    break
                free = [r for r, job in enumerate(self._slots) if job is None]
                admitted = [] if self._paused else self._pending[:len(free)]
                del self._pending[:len(admitted)]
            with self._lock, torch.inference_mode():
                try:
                    if self._released:
                        raise EngineMemoryReleased(f"memory released for {sorted(self._released)}; "
                                                   f"resume_memory before generating")
                    self.weights.resume()  # storages no load claimed since resume_memory (none after a sync)
                    if admitted:
                        self._prefill(list(zip(free, admitted)))
                    if any(self._slots):
                        self._decode_step()
                except Exception as exc:  # noqa: BLE001 - the error belongs to the callers, not this thread
                    self._fail_all(admitted, exc)
        with self._lock:
            for job in self._pending + [j for j in self._slots if j is not None]:
                self._finish(job, FinishReason.ABORT)
            self._pending.clear()
            self._slots = [None] * self.max_batch_size

    def _fail_all(self, admitted: list[_Job], exc: Exception) -> None:
        jobs = {id(j): j for j in admitted + [j for j in self._slots if j is not None]}
        self._slots = [None] * self.max_batch_size
        for job in jobs.values():
            job.loop.call_soon_threadsafe(lambda f=job.future: f.done() or f.set_exception(exc))

    def _sample_and_advance(self, rows: list[int], logits: torch.Tensor) -> None:
        """Sample one token for each of ``rows`` from ``logits [len(rows), V]``; retire finished rows."""
        jobs = [self._slots[r] for r in rows]
        params = [j.request.params for j in jobs]
        tokens, logp = sample(
            logits,
            torch.tensor([p.temperature for p in params], device=self.device),
            torch.tensor([p.top_k for p in params], device=self.device),
            torch.tensor([p.top_p for p in params], device=self.device),
            [j.generator for j in jobs], self._default_generator,
            truncate=any(p.top_k > 0 or p.top_p < 1 for p in params))
        for row, job, token, lp in zip(rows, jobs, tokens.tolist(), logp.tolist()):
            job.output_ids.append(token)
            job.logp.append(lp)
            reason = job.stop.finished(job.output_ids)
            if reason is not None:
                self._finish(job, reason)
                self._slots[row] = None

    def _prefill(self, placed: list[tuple[int, _Job]]) -> None:
        """Run the prompts of newly admitted jobs and sample their first tokens.

        The prompts go through a side cache sized for them alone (prefill cost scales with the new prompts,
        not with the whole batch), whose K/V are then copied into the jobs' rows of the main cache."""
        rows = [r for r, _ in placed]
        lengths = [len(j.request.input_ids) for _, j in placed]
        width = max(lengths)
        ids = torch.zeros(len(placed), width, dtype=torch.long)
        positions = torch.full((len(placed), width), -1, dtype=torch.long)
        for i, (_, job) in enumerate(placed):
            ids[i, :lengths[i]] = torch.tensor(job.request.input_ids)
            positions[i, :lengths[i]] = torch.arange(lengths[i])
        side = self.model.make_kv_cache(len(placed), width, dtype=self._cache.k.dtype, device=self.device)
        hidden = self.model.forward_cached(ids.to(self.device), positions.to(self.device), side)
        index = torch.tensor(rows, device=self.device)
        self._cache.k[:, index, :, :width] = side.k[:, :, :, :width]
        self._cache.v[:, index, :, :width] = side.v[:, :, :, :width]
        last = hidden[torch.arange(len(placed)), torch.tensor(lengths) - 1]
        for row, job in placed:
            self._slots[row] = job
        self._sample_and_advance(rows, lm_head_logits(last, self.model.lm_head_weight()))

    def _decode_step(self) -> None:
        """Feed every busy row its last token at its next position; idle rows feed padding (position -1)."""
        ids = torch.zeros(self.max_batch_size, 1, dtype=torch.long)
        positions = torch.full((self.max_batch_size, 1), -1, dtype=torch.long)
        rows = [r for r, job in enumerate(self._slots) if job is not None]
        for r in rows:
            job = self._slots[r]
            ids[r, 0] = job.output_ids[-1]
            positions[r, 0] = job.length - 1
        logits = self._decode_logits(ids.to(self.device, non_blocking=True),
                                     positions.to(self.device, non_blocking=True))
        if len(rows) < self.max_batch_size:
            logits = logits[torch.tensor(rows, device=self.device)]
        self._sample_and_advance(rows, logits)

    def _decode_logits(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[B, V] fp32`` next-token logits for the whole batch (CUDA graph replay when enabled)."""
        if not self.use_cuda_graph:
            return self._decode_forward(ids, positions)
        if self._graph is None:
            self._capture()
        self._graph_ids.copy_(ids)
        self._graph_positions.copy_(positions)
        self._graph.replay()
        return self._graph_logits

    def _decode_forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.model.forward_cached(ids, positions, self._cache)
        return lm_head_logits(hidden[:, 0], self.model.lm_head_weight())

    def _capture(self) -> None:
        """Capture one decode step over static buffers. Idle rows write only the scratch slot, so replays
        with any mix of busy/idle rows are valid; warm-up on a side stream, as CUDA graphs require."""
        self._graph_ids = torch.zeros(self.max_batch_size, 1, dtype=torch.long, device=self.device)
        self._graph_positions = torch.full((self.max_batch_size, 1), -1, dtype=torch.long, device=self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._decode_forward(self._graph_ids, self._graph_positions)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # our own stream: torch.cuda.graph's default is one stream per process, made on the device that was
        # current at the first capture, and entering it switches to that device (a second engine on another
        # GPU in the same process would capture nothing and launch on the wrong GPU)
        with torch.cuda.graph(graph, stream=stream):
            self._graph_logits = self._decode_forward(self._graph_ids, self._graph_positions)
        self._graph = graph

    # ----- memory -----------------------------------------------------------------------------------------

    def _make_cache(self) -> None:
        self._cache = self.model.make_kv_cache(self.max_batch_size, self.max_seq_len, device=self.device)

    def _check_idle(self, what: str) -> None:
        if any(self._slots):
            raise RuntimeError(f"{what} while requests are running; pause() the engine first")

    def _release(self, tags: frozenset[str]) -> None:
        with self._lock:
            self._check_idle("release_memory")
            self._graph = None  # captured addresses die with the memory
            if "kv_cache" in tags and "kv_cache" not in self._released:
                self._cache = None
            if "weights" in tags and "weights" not in self._released:
                self.weights.release()
            self._released |= tags
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _resume(self, tags: frozenset[str]) -> None:
        """Resuming the weights alone defers their allocation to the loads of the sync that follows (each
        bucket's parameters as it arrives, overlapping the copies); whatever no load claimed is allocated
        before the KV cache and before generating."""
        with self._lock:
            if "kv_cache" in tags and "kv_cache" in self._released:
                self.weights.resume()
                self._make_cache()
            self._released -= tags
        with self._wake:
            self._wake.notify()


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    eos = getattr(model.hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
