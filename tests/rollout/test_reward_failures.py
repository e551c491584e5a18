"""Rewards that fail: a custom reward that raises, hangs or returns NaN/inf, a remote RM that refuses connections,
answers garbage or hangs. Each is reported naming the reward and the sample (or scored 0 with --reward-error
zero), bounded by --rm-timeout / --rm-max-retries, and leaves no asyncio noise at exit (issue 22, item 12)."""

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from redline.rollout.rewards import RewardError, build_reward
from redline.rollout.rewards.remote import RemoteRewardError, check_reachable
from redline.rollout.types import Sample

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"
NOISE = ("Task was destroyed", "Unclosed client session", "Task exception was never retrieved", "Traceback")


def samples(n=3):
    return [Sample(prompt=f"{i}+1=", tokens=[1], response=str(i + 1), label=str(i + 1), index=10 + i)
            for i in range(n)]


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(textwrap.dedent("""
        import asyncio

        async def raises(sample):
            if sample.index == 11:
                raise ZeroDivisionError("division by zero")
            return 1.0

        async def hangs(sample):
            await asyncio.sleep(3600)

        async def nan(sample):
            return float("nan") if sample.index == 12 else 1.0

        async def inf(sample):
            return float("inf")

        async def too_few(samples):
            return [1.0]

        async def group_nan(samples):
            return [1.0, float("nan"), 2.0]

        async def needs_an_extra(sample):
            from redline.extras import require
            require("no_such_package_for_redline_tests", "this reward")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "bad_rewards"
    sys.modules.pop("bad_rewards", None)


def score(reward, group):
    return asyncio.run(reward(group))


def test_a_raising_reward_names_itself_and_the_sample(user_rewards):
    reward = build_reward(custom_rm_path=f"{user_rewards}:raises")
    with pytest.raises(RewardError, match=rf"reward --custom-rm-path {user_rewards}:raises raised "
                                          r"ZeroDivisionError: division by zero on sample 11 \(prompt '1\+1='"):
        score(reward, samples())


def test_a_hanging_reward_times_out(user_rewards):
    reward = build_reward(custom_rm_path=f"{user_rewards}:hangs", timeout=0.2)
    began = time.perf_counter()
    with pytest.raises(RewardError, match=r"took longer than --rm-timeout 0.2 s on sample 10"):
        score(reward, samples())
    assert time.perf_counter() - began < 5


@pytest.mark.parametrize("name,index,value", [("nan", 12, "nan"), ("inf", 10, "inf")])
def test_nan_or_inf_is_refused_naming_the_sample(user_rewards, name, index, value):
    with pytest.raises(RewardError, match=rf"returned {value}, not a finite number, on sample {index}"):
        score(build_reward(custom_rm_path=f"{user_rewards}:{name}"), samples())


def test_a_group_reward_with_the_wrong_count_is_refused(user_rewards):
    reward = build_reward(custom_rm_path=f"{user_rewards}:too_few", group_rm=True)
    with pytest.raises(RewardError, match=r"returned \[1.0\] for 3 samples, the group of sample 10"):
        score(reward, samples())


def test_reward_error_zero_scores_failed_samples_zero_and_counts_them(user_rewards):
    reward = build_reward(custom_rm_path=f"{user_rewards}:nan", on_error="zero")
    assert score(reward, samples()) == [1.0, 1.0, 0.0]
    reward = build_reward(custom_rm_path=f"{user_rewards}:hangs", timeout=0.1, on_error="zero")
    assert score(reward, samples()) == [0.0, 0.0, 0.0]
    assert reward.errors == 3


def test_reward_error_zero_scores_a_failed_member_of_a_group_zero(user_rewards):
    """A group reward's non-finite value becomes a float 0, like the rest of the group's floats."""
    reward = build_reward(custom_rm_path=f"{user_rewards}:group_nan", group_rm=True, on_error="zero")
    assert score(reward, samples()) == [1.0, 0.0, 2.0]
    assert reward.errors == 1


def test_a_missing_optional_package_is_not_blamed_on_a_sample(user_rewards):
    from redline.extras import MissingExtraError

    reward = build_reward(custom_rm_path=f"{user_rewards}:needs_an_extra", on_error="zero")
    with pytest.raises(MissingExtraError, match="no_such_package_for_redline_tests"):
        score(reward, samples())
    assert reward.errors == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An HTTP server on 127.0.0.1 answering every POST with ``body`` after ``delay`` seconds."""

    def __init__(self, body: bytes = b"<html>busy</html>", delay: float = 0.0):
        server = self
        self.body, self.delay = body, delay

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(server.delay)
                self.send_response(200)
                self.send_header("Content-Length", str(len(server.body)))
                self.end_headers()
                try:
                    self.wfile.write(server.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_health_check_names_a_url_where_nothing_answers():
    url = f"http://127.0.0.1:{free_port()}/reward"
    with pytest.raises(RemoteRewardError, match=rf"--rm-url {url}: no reward server answers there"):
        check_reachable(url, timeout=2.0)


def test_health_check_accepts_a_server_that_refuses_get():
    with Server() as server:
        check_reachable(server.url, timeout=2.0)  # 501 to a GET: up all the same


def remote(url, **options):
    reward = build_reward("remote_rm", rm_url=url, **options)

    async def run():
        try:
            return await reward(samples(1))
        finally:
            await reward.close()
    return run


def test_remote_garbage_is_reported_with_the_sample():
    with Server(body=b"<html>busy</html>") as server:
        expected = (rf"reward --rm-type remote_rm \({server.url}\) raised RemoteRewardError"
                    r".*'<html>busy</html>', which is not JSON on sample 10")
        with pytest.raises(RewardError, match=expected):
            asyncio.run(remote(server.url)())


def test_a_hanging_remote_rm_gives_up_after_its_retries():
    with Server(body=b"1.0", delay=2.0) as server:
        began = time.perf_counter()
        with pytest.raises(RewardError, match=r"failed 2 times \(--rm-max-retries 1, --rm-timeout 0.2 s\)"):
            asyncio.run(remote(server.url, timeout=0.2, max_retries=1)())
        assert time.perf_counter() - began < 10


def run_cli(*flags, cwd: Path):
    """``redline train`` of one quickstart step in its own process; ``cwd`` is also on its Python path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "redline.cli", "train", str(QUICKSTART), "--num-rollout", "1",
                           "--sft-steps", "0", "--eval-interval", "100", "--output-dir", str(cwd / "run"), *flags],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env=env, check=False)


def test_a_remote_rm_that_refuses_connections_stops_the_start(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/reward"
    done = run_cli("--rm-type", "remote_rm", "--rm-url", url, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"error: --rm-url {url}: no reward server answers there" in done.stdout + done.stderr
    assert not any(noise in done.stderr for noise in NOISE), done.stderr


def test_a_remote_rm_answering_garbage_mid_run_exits_cleanly(tmp_path):
    with Server(body=b"<html>busy</html>") as server:
        done = run_cli("--rm-type", "remote_rm", "--rm-url", server.url, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "which is not JSON on sample" in errors[0], done.stderr
    assert not any(noise in done.stderr for noise in NOISE), done.stderr


def test_a_raising_custom_reward_mid_run_exits_cleanly(tmp_path, user_rewards):
    done = run_cli("--custom-rm-path", f"{user_rewards}:raises", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "raised ZeroDivisionError: division by zero on sample 11" in done.stderr
    assert not any(noise in done.stderr for noise in NOISE), done.stderr
