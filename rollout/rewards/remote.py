"""A reward model behind HTTP: POST ``{"prompt", "response", "label"}`` to a URL, read a number back.

The server answers a JSON number, or an object holding the number under ``reward_key`` (default "reward").
Transient failures (connection errors, timeouts, HTTP 5xx / 429) are retried with exponential backoff;
other HTTP errors and malformed answers raise at once, and each retry is logged (a failing server is never
waited on in silence). At most ``max_concurrency`` requests are in flight. ``check_reachable`` is the start-up
health check: is anything answering HTTP at the URL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request

from redline.extras import require


log = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """The reward server failed or answered something that is not a reward."""


def check_reachable(url: str, timeout: float) -> None:
    """Raise RemoteRewardError unless an HTTP server answers at ``url`` within ``timeout`` seconds (any status:
    a reward endpoint may refuse a GET and still be up)."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RemoteRewardError(f"--rm-url {url}: no reward server answers there ({reason}); start it, or fix "
                                f"--rm-url") from None


class RemoteRewardModel:
    def __init__(self, url: str, *, timeout: float = 120.0, retries: int = 10, max_concurrency: int = 64,
                 backoff: float = 0.5, reward_key: str = "reward"):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward url must start with http:// or https://, got '{url}'")
        if timeout <= 0 or retries < 0 or max_concurrency < 1 or backoff < 0:
            raise ValueError(f"remote reward: need timeout > 0, retries >= 0, max_concurrency >= 1, backoff >= 0; "
                             f"got {timeout}, {retries}, {max_concurrency}, {backoff}")
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff
        self.max_concurrency, self.reward_key = max_concurrency, reward_key
        self._session = None
        self._semaphore = None

    def _client(self):
        """The aiohttp session and semaphore, made inside the running event loop they belong to."""
        aiohttp = require("aiohttp", "the remote reward model")
        if self._session is None or self._session.closed:
            # limit=0: max_concurrency is the one bound (aiohttp's own default would hold it to 100 connections)
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                                  connector=aiohttp.TCPConnector(limit=0))
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return aiohttp, self._session, self._semaphore

    def _parse(self, body) -> float:
        value = body.get(self.reward_key) if isinstance(body, dict) else body
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RemoteRewardError(f"reward server {self.url} answered {body!r}; expected a number or an object "
                                    f"with a numeric '{self.reward_key}'")
        return float(value)

    async def score(self, prompt, response: str, label) -> float:
        aiohttp, session, semaphore = self._client()
        payload = {"prompt": prompt, "response": response, "label": label}
        last_error = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                async with semaphore, session.post(self.url, json=payload) as reply:
                    if reply.status >= 500 or reply.status == 429:
                        last_error = f"HTTP {reply.status}"
                        continue
                    if reply.status != 200:
                        raise RemoteRewardError(f"reward server {self.url} answered HTTP {reply.status}: "
                                                f"{(await reply.text())[:200]}")
                    text = await reply.text()
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                last_error = f"{type(exc).__name__}: {exc or f'no answer within {self.timeout:g} s'}"
                if attempt < self.retries:
                    log.warning("reward server %s: %s; retry %d of %d", self.url, last_error, attempt + 1,
                                self.retries)
                continue
            try:
                body = json.loads(text)
            except json.JSONDecodeError:
                raise RemoteRewardError(f"reward server {self.url} answered {text[:200]!r}, which is not "
                                        f"JSON") from None
            return self._parse(body)
        raise RemoteRewardError(f"reward server {self.url} failed {self.retries + 1} times (--rm-max-retries "
                                f"{self.retries}, --rm-timeout {self.timeout:g} s); last error: {last_error}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
