"""The remote reward model against a tiny local HTTP server on 127.0.0.1: retries, timeout, concurrency."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("aiohttp", reason="the remote reward model needs aiohttp")

from redline.rollout.rewards.remote import RemoteRewardError, RemoteRewardModel


class RewardServer:
    """Answers len(response) as {"reward": x}; fails the first ``fail_first`` requests with ``fail_status``,
    sleeps ``delay`` seconds per request and records the peak number of requests in flight."""

    def __init__(self, fail_first=0, fail_status=503, delay=0.0, body=None):
        self.fail_first, self.fail_status, self.delay, self.body = fail_first, fail_status, delay, body
        self.requests = 0
        self.in_flight = 0
        self.peak = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests += 1
                    n = server.requests
                    server.in_flight += 1
                    server.peak = max(server.peak, server.in_flight)
                time.sleep(server.delay)
                with server.lock:
                    server.in_flight -= 1
                if n <= server.fail_first:
                    self.send_response(server.fail_status)
                    self.end_headers()
                    return
                body = server.body if server.body is not None else {"reward": len(payload["response"])}
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and hung up (the timeout test does this on purpose)

        class Server(ThreadingHTTPServer):
            request_queue_size = 512  # many clients connect at once (socketserver's default backlog is 5)

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


async def score_all(model, responses):
    try:
        return await asyncio.gather(*(model.score("p", r, None) for r in responses))
    finally:
        await model.close()


def test_reward_read_from_json_object():
    with RewardServer() as server:
        assert asyncio.run(score_all(RemoteRewardModel(server.url), ["abc", "x"])) == [3.0, 1.0]


def test_server_errors_are_retried():
    with RewardServer(fail_first=2) as server:
        model = RemoteRewardModel(server.url, retries=3, backoff=0.01)
        assert asyncio.run(score_all(model, ["abcd"])) == [4.0]
        assert server.requests == 3


def test_gives_up_after_retries():
    with RewardServer(fail_first=100) as server:
        model = RemoteRewardModel(server.url, retries=2, backoff=0.01)
        with pytest.raises(RemoteRewardError,
                           match=r"failed 3 times \(--rm-max-retries 2, --rm-timeout 120 s\); last error: HTTP 503"):
            asyncio.run(score_all(model, ["a"]))
        assert server.requests == 3


def test_client_error_is_not_retried():
    with RewardServer(fail_first=100, fail_status=400) as server:
        with pytest.raises(RemoteRewardError, match="HTTP 400"):
            asyncio.run(score_all(RemoteRewardModel(server.url, retries=5, backoff=0.01), ["a"]))
        assert server.requests == 1


def test_timeout_is_retried_then_reported():
    with RewardServer(delay=0.5) as server:
        model = RemoteRewardModel(server.url, timeout=0.1, retries=1, backoff=0.0)
        with pytest.raises(RemoteRewardError, match="TimeoutError"):
            asyncio.run(score_all(model, ["a"]))


def test_concurrency_limit_caps_requests_in_flight():
    with RewardServer(delay=0.05) as server:
        model = RemoteRewardModel(server.url, max_concurrency=2)
        assert asyncio.run(score_all(model, ["a"] * 8)) == [1.0] * 8
        assert server.peak == 2


def test_concurrency_above_a_hundred_is_not_capped_by_the_http_client():
    with RewardServer(delay=1.0) as server:
        model = RemoteRewardModel(server.url, max_concurrency=150)
        assert asyncio.run(score_all(model, ["a"] * 150)) == [1.0] * 150
        assert server.peak == 150


def test_non_numeric_answer_raises():
    with RewardServer(body={"score": "high"}) as server, \
            pytest.raises(RemoteRewardError, match="expected a number or an object with a numeric 'reward'"):
        asyncio.run(score_all(RemoteRewardModel(server.url), ["a"]))
