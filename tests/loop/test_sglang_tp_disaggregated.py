"""``--no-colocate`` with an SGLang server of two GPUs (``--rollout-num-gpus-per-engine 2``): the weight-update group
is the trainer (rank 0) and both of the server's TP ranks (1 and 2), and every step's broadcast reaches each of
them. The stand-in server's TP ranks are processes of their own on gloo, as SGLang's schedulers are."""

import asyncio

import pytest
from rich.console import Console

pytest.importorskip("aiohttp", reason="the SGLang client needs aiohttp")

from redline.configfile import apply_overrides
from redline.loop.builtin import materialize
from redline.loop.step import rl_step
from redline.loop.train import build, shutdown
from redline.rollout.sglang.client import SGLangClient
from redline.rollout.sglang.weight_check import expected_checksums

from tests.rollout.fake_sglang import fake_sglang_process
from tests.rollout.fake_sglang_tp import FakeTPSGLang
from tests.rollout.test_sglang_weight_check import byte_hash

from .test_train import small_config
from .test_weight_sync import BUCKET_BYTES


def rank_checksums(url):
    _, answer = asyncio.run(SGLangClient(url).request("GET", "/fake/rank_checksums"))
    return answer


@pytest.mark.slow  # a server with two rank processes and a gloo group
@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_every_tp_rank_of_the_server_receives_each_steps_weights(tmp_path, version):
    with fake_sglang_process(version, server_cls=FakeTPSGLang, tp_size=2, hash_fn=byte_hash) as url:
        config = small_config(tmp_path, colocate="false", sft_steps="0", rollout_engine="sglang",
                              sglang_server_urls=url, rollout_num_gpus_per_engine="2",
                              update_weight_buffer_size=str(BUCKET_BYTES), distributed_timeout_minutes="0.5")
        config = apply_overrides(config, materialize(config, tmp_path / "builtin"))
        state = build(config, Console(quiet=True))[0]
        try:
            sync = state.weight_sync
            assert state.engine.tp_size == 2 and sync.describe().count("on 2 device(s)") == 1
            for rollout_id in range(2):
                rl_step(state, rollout_id)
                expected = expected_checksums(sync.model.export_hf(), byte_hash)
                received = rank_checksums(url)
                assert len(received) == 2  # TP ranks 0 and 1 of the one server
                for rank in received:
                    assert rank == expected  # this step's weights, every tensor, on every rank
        finally:
            shutdown(state)
