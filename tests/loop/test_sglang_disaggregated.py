"""``--no-colocate`` with SGLang: the trainer broadcasts each step's weights to attached servers, announcing every
bucket with ``/update_weights_from_distributed`` just before its broadcast. The stand-in servers (each in a process
of its own) join the weight-update group over gloo, receive every announced bucket by broadcast and report the
hashes of what they received, which ``--check-sglang-weights`` compares with the trainer's tensors after each push.
"""

import asyncio

import pytest
from rich.console import Console

pytest.importorskip("aiohttp", reason="the SGLang client needs aiohttp")

from redline.configfile import apply_overrides  # noqa: E402
from redline.loop.builtin import materialize  # noqa: E402
from redline.loop.step import rl_step  # noqa: E402
from redline.loop.train import build, shutdown  # noqa: E402
from redline.rollout.sglang import weight_check  # noqa: E402
from redline.rollout.sglang.client import SGLangClient  # noqa: E402
from redline.rollout.sglang.weight_check import WeightsMismatch  # noqa: E402

from tests.rollout.fake_sglang import fake_sglang_process  # noqa: E402
from tests.rollout.test_sglang_weight_check import byte_hash  # noqa: E402

from .test_train import small_config  # noqa: E402
from .test_weight_sync import BUCKET_BYTES  # noqa: E402


def built(tmp_path, *urls):
    config = small_config(tmp_path, colocate="false", sft_steps="0", rollout_engine="sglang",
                          sglang_server_urls=",".join(urls), check_sglang_weights="true",
                          update_weight_buffer_size=str(BUCKET_BYTES), distributed_timeout_minutes="0.5")
    config = apply_overrides(config, materialize(config, tmp_path / "builtin"))
    return build(config, Console(quiet=True))[0]


def received_paths(url):
    """The fake server's calls, asked on a loop of its own (``shutdown`` closes the run's)."""
    _, paths = asyncio.run(SGLangClient(url).request("GET", "/fake/calls"))
    return [p for p in paths if p not in ("/server_info", "/get_server_info", "/health", "/fake/calls")]


@pytest.mark.slow  # two server processes and a gloo group
@pytest.mark.parametrize("version,session", [("0.5.17", False), ("0.5.23", True)])
def test_two_steps_broadcast_every_bucket_into_two_attached_servers(tmp_path, monkeypatch, version, session):
    monkeypatch.setattr(weight_check, "sglang_tensor_hash", lambda: byte_hash)
    with (fake_sglang_process(version, hash_fn=byte_hash) as first,
          fake_sglang_process(version, hash_fn=byte_hash) as second):
        state = built(tmp_path, first, second)
        try:
            sync = state.weight_sync
            assert sync.backend == "gloo" and not sync.compare_checksums and len(sync.verifiers) == 1
            assert len(sync.plan.buckets) > 2
            for rollout_id in range(2):
                # each push ends with verify_weights: the servers' hashes of what they received must equal the
                # trainer's tensors, or the step raises WeightsMismatch
                metrics = rl_step(state, rollout_id)
                assert metrics["perf/update_weights_time"] > 0
            calls = {url: received_paths(url) for url in (first, second)}
        finally:
            shutdown(state)
        left = {url: received_paths(url)[-1] for url in (first, second)}

    announced = ["/update_weights_from_distributed"] * len(sync.plan.buckets)
    if session:  # >= 0.5.21 takes updates only inside a begin/end session
        announced = ["/begin_weight_update", *announced, "/end_weight_update"]
    push = [*announced, "/flush_cache", "/weights_checker"]
    for paths in calls.values():
        assert paths[0] == "/init_weights_update_group"
        updates = [p for p in paths[1:] if p != "/generate"]
        assert updates == push * 2
    assert set(left.values()) == {"/destroy_weights_update_group"}


@pytest.mark.slow
def test_a_bucket_corrupted_on_arrival_fails_the_push(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_check, "sglang_tensor_hash", lambda: byte_hash)
    with fake_sglang_process(hash_fn=byte_hash, corrupt_bucket=1) as url:
        state = built(tmp_path, url)
        try:
            with pytest.raises(WeightsMismatch, match="1 parameter"):
                rl_step(state, 0)
        finally:
            shutdown(state)
