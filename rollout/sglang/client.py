"""HTTP client for one SGLang server: generation, weight updates (both wire contracts), memory, control.

Wire facts this follows (``shared/reference/sync.md`` §1): ``/generate`` with ``input_ids`` and
``return_logprob`` answers ``meta_info.output_token_logprobs = [[logprob, token_id, text], ...]`` and
``meta_info.finish_reason.type``; ``/update_weights_from_tensor`` takes one serialized payload per TP rank;
servers >= 0.5.21 refuse updates outside ``/begin_weight_update`` ... ``/end_weight_update`` (older ones
answer those routes with 404); ``/flush_cache`` answers 400 while requests are in flight.
"""

from __future__ import annotations

import asyncio
import json

from packaging.version import Version
from redline.extras import require
from redline.rollout.types import FinishReason, GenerateRequest, GenerateResult

SESSION_API_VERSION = Version("0.5.21")
# SGLang serves HTTP with uvicorn, which closes a keep-alive connection after 5 s idle; aiohttp would keep it
# pooled for 15 s, and a request sent on it just as the server closes it fails with ServerDisconnectedError
# (NVIDIA-NeMo/Gym#1555; the likely cause of the ServerDisconnectedError the 0.6B sync benchmark met on
# /weights_checker, sent after seconds spent hashing on the trainer's side). Idle connections are dropped here
# first.
KEEPALIVE_SECONDS = 3.0
FLUSH_RETRIES = 60  # slime and NeMo-RL retry a busy flush for about a minute
# SGLang's ``--weight-version`` default, reported until an update names a version: the weights the server started
# with, which redline counts as the engine's version before its first push (policy version "0").
SERVER_START_VERSION = "default"


class SGLangError(RuntimeError):
    """An SGLang server refused a request or answered something unexpected."""


def sampling_payload(request: GenerateRequest) -> dict:
    """SGLang ``sampling_params`` for a request. Stop strings stay in the output (``no_stop_trim``) so the
    token ids and their log-probs cover the whole response, as the trainer sees it."""
    p = request.params
    payload = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "max_new_tokens": p.max_new_tokens,
               "stop": list(p.stop), "stop_token_ids": list(p.stop_token_ids), "no_stop_trim": True,
               "skip_special_tokens": False, "ignore_eos": p.ignore_eos}
    if p.seed is not None:
        payload["sampling_seed"] = p.seed
    return payload


def parse_generate(body: dict, fallback_version: str) -> GenerateResult:
    """A ``GenerateResult`` from one ``/generate`` answer (tokens and log-probs both from the log-prob list);
    its weight version is the server's, or ``fallback_version`` (the engine's) where the server reports none or
    still its start-up ``SERVER_START_VERSION`` (async rollout counts staleness in integer policy versions)."""
    try:
        meta = body["meta_info"]
        reason = meta["finish_reason"]
        # a request aborted before its prefill (a pause caught it queued) answers without a log-prob list
        aborted_early = isinstance(reason, dict) and reason.get("type") == FinishReason.ABORT.value
        pairs = meta.get("output_token_logprobs", []) if aborted_early else meta["output_token_logprobs"]
    except (KeyError, TypeError) as exc:
        raise SGLangError(f"/generate answer lacks {exc}; was return_logprob honoured? got keys "
                          f"{sorted(body) if isinstance(body, dict) else type(body).__name__}") from exc
    kind = reason.get("type") if isinstance(reason, dict) else reason
    try:
        finish = FinishReason(kind)
    except ValueError as exc:
        raise SGLangError(f"/generate answered an unknown finish reason {reason!r}") from exc
    reported = meta.get("weight_version")
    version = fallback_version if reported in (None, "", SERVER_START_VERSION) else str(reported)
    return GenerateResult(output_ids=[int(p[1]) for p in pairs], logp=[float(p[0]) for p in pairs],
                          finish_reason=finish, weight_version=version)


class SGLangClient:
    """One server at ``url`` (``http://host:port``). Methods are coroutines on the caller's event loop."""

    def __init__(self, url: str, *, timeout: float = 14400.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.in_flight = 0  # generate calls running through this client, kept by the engine's router
        self.version: Version | None = None
        self._info: dict | None = None
        self._session = None

    def _http(self):
        aiohttp = require("aiohttp", "the SGLang engine client")
        if self._session is None or self._session.closed:
            # limit=0: no cap on open connections. aiohttp's default (100) held a 512-request rollout to 100
            # running requests at the server; the rollout manager's max_inflight is the one bound
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS)
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                                  connector=connector)
        return self._session

    async def request(self, method: str, path: str, body: dict | None = None, *, ok=(200,)):
        """``(status, parsed JSON or text)``; raises SGLangError for a status outside ``ok``."""
        async with self._http().request(method, self.url + path, json=body) as reply:
            text = await reply.text()
            if reply.status not in ok:
                raise SGLangError(f"{method} {self.url}{path} answered HTTP {reply.status}: {text[:300]}")
            try:
                return reply.status, json.loads(text) if text else None
            except ValueError:
                return reply.status, text

    async def server_info(self) -> dict:
        """The server's ``/server_info`` (``/get_server_info`` on older servers): its version and arguments."""
        if self._info is None:
            for path in ("/server_info", "/get_server_info"):
                status, info = await self.request("GET", path, ok=(200, 404))
                if status == 200 and isinstance(info, dict) and "version" in info:
                    self._info = info
                    break
            else:
                raise SGLangError(f"{self.url}: neither /server_info nor /get_server_info reports a version")
        return self._info

    async def server_version(self) -> Version:
        """The server's SGLang version."""
        if self.version is None:
            self.version = Version((await self.server_info())["version"])
        return self.version

    async def weight_loaders(self) -> list[str]:
        """The custom weight loaders the server accepts as a ``load_format`` (``--custom-weight-loader``)."""
        return list((await self.server_info()).get("custom_weight_loader") or [])

    async def generate(self, request: GenerateRequest, fallback_version: str) -> GenerateResult:
        _, body = await self.request("POST", "/generate", {
            "input_ids": request.input_ids, "sampling_params": sampling_payload(request), "return_logprob": True})
        return parse_generate(body, fallback_version)

    async def _check(self, path: str, body: dict) -> None:
        """POST a control request whose answer is ``{"success": bool, "message": str}``."""
        _, answer = await self.request("POST", path, body, ok=(200, 400))
        if not (isinstance(answer, dict) and answer.get("success")):
            raise SGLangError(f"{self.url}{path} failed: {answer}")

    async def begin_weight_update(self) -> None:
        if await self.server_version() >= SESSION_API_VERSION:
            await self._check("/begin_weight_update", {})

    async def end_weight_update(self) -> None:
        if await self.server_version() >= SESSION_API_VERSION:
            await self._check("/end_weight_update", {})
        await self.flush_cache()

    async def update_weights_from_tensor(self, per_rank: tuple[str, ...], load_format: str, version: str) -> None:
        """Load one bucket; every bucket carries the new ``weight_version`` (what slime does), so the server
        reports it from the first updated tensor on, without a separate version call."""
        await self._check("/update_weights_from_tensor", {
            "serialized_named_tensors": list(per_rank), "load_format": load_format, "flush_cache": False,
            "weight_version": version})

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        """Join the trainer's weight-update group, this server's TP rank r as ``rank_offset + r``. SGLang answers
        once the group is built, which needs every member: send it while the trainer joins."""
        await self._check("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, body: dict) -> None:
        """Announce one broadcast bucket (``redline.sync.sglang.update_from_distributed_body``); SGLang posts the
        receive, and answers once the bucket has arrived and is loaded."""
        await self._check("/update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._check("/destroy_weights_update_group", {"group_name": group_name})

    async def weight_checksums(self) -> dict:
        """``/weights_checker`` ``checksum``: ``{"ranks": [{"checksums": {name: hash}, ...}], ...}``."""
        _, answer = await self.request("POST", "/weights_checker", {"action": "checksum"})
        return answer

    async def flush_cache(self) -> None:
        for _ in range(FLUSH_RETRIES):
            status, _ = await self.request("POST", "/flush_cache", ok=(200, 400))
            if status == 200:
                return
            await asyncio.sleep(1.0)
        raise SGLangError(f"{self.url}/flush_cache stayed busy for {FLUSH_RETRIES} s")

    async def release_memory(self, tags: list[str]) -> None:
        await self.request("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str]) -> None:
        await self.request("POST", "/resume_memory_occupation", {"tags": tags})

    async def pause(self) -> None:
        await self.request("POST", "/pause_generation", {"mode": "abort"})

    async def resume(self) -> None:
        await self.request("POST", "/continue_generation", {})

    async def freeze_gc(self) -> bool:
        """``/freeze_gc``: the server's processes (tokenizer manager, scheduler, detokenizer) move the objects they
        hold now out of Python's garbage collector's generations, as ``redline.long_lived`` does for redline's own.
        False where the server has no such route."""
        status, _ = await self.request("POST", "/freeze_gc", ok=(200, 404))
        return status == 200

    async def health(self) -> bool:
        try:
            status, _ = await self.request("GET", "/health", ok=(200, 503))
        except (TimeoutError, SGLangError, OSError):
            return False
        return status == 200

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
