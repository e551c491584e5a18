"""The SGLang engine's wire protocol against a stand-in server: generation, both weight-update contracts,
two-stage memory tags, routing, pass-through arguments."""


import pytest

pytest.importorskip("aiohttp", reason="the SGLang client needs aiohttp")

from redline.rollout import sglang as _sglang_pkg  # noqa: F401 - the package imports without SGLang
from redline.rollout.engine import SerializedBucket
from redline.rollout.sglang import client as client_module
from redline.rollout.sglang.engine import SGLangEngine
from redline.rollout.sglang.server import passthrough_args, start_waves
from redline.rollout.types import FinishReason, GenerateRequest, SamplingParams

from .fake_sglang import FakeSGLang
from .engine_runner import run


@pytest.fixture(autouse=True)
def fast_flush_retry(monkeypatch):
    async def no_wait(_):
        return None
    monkeypatch.setattr(client_module.asyncio, "sleep", no_wait)



def test_generate_sends_ids_and_parses_logprobs():
    with FakeSGLang() as server:
        engine = SGLangEngine([server.url])
        params = SamplingParams(temperature=0.5, max_new_tokens=2, stop=["\n"], seed=3)
        [res] = run(engine, lambda e: e.generate([GenerateRequest([1, 2, 3], params)]))
    assert res.output_ids == [3, 2] and res.logp == [-0.5, -0.5]
    # a server that has had no update reports SGLang's "default": the engine's start-up version stands for it
    assert res.finish_reason == FinishReason.LENGTH and res.weight_version == "0"
    [(_, body)] = [c for c in server.calls if c[0] == "/generate"]
    assert body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True
    sp = body["sampling_params"]
    assert (sp["temperature"], sp["max_new_tokens"], sp["stop"], sp["sampling_seed"], sp["no_stop_trim"]) == \
        (0.5, 2, ["\n"], 3, True)


def test_every_request_of_a_large_rollout_reaches_the_server_at_once():
    # aiohttp caps a session at 100 connections unless told otherwise: 300 requests must all be running together
    with FakeSGLang(delay=1.0) as server:
        engine = SGLangEngine([server.url])
        params = SamplingParams(max_new_tokens=1)
        results = run(engine, lambda e: e.generate([GenerateRequest([i + 1], params) for i in range(300)]))
    assert [r.output_ids for r in results] == [[i + 1] for i in range(300)]
    assert server.most_generating == 300


def test_an_answer_aborted_before_prefill_has_no_tokens_and_other_answers_need_the_log_prob_list():
    # SGLang's answer to a request a pause aborted while it was still queued: no output_token_logprobs
    aborted = {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "Abort before prefill"},
                                         "prompt_tokens": 0, "completion_tokens": 0}}
    result = client_module.parse_generate(aborted, "3")
    assert (result.output_ids, result.logp, result.finish_reason, result.weight_version) == \
        ([], [], FinishReason.ABORT, "3")
    with pytest.raises(client_module.SGLangError, match="lacks 'output_token_logprobs'"):
        client_module.parse_generate({"meta_info": {"finish_reason": {"type": "length"}}}, "3")


def bucket():
    return SerializedBucket(per_rank=("payload",))


@pytest.mark.parametrize("version,session", [("0.5.17", False), ("0.5.23", True)])
def test_update_weights_follows_the_servers_contract(version, session):
    with FakeSGLang(version=version) as server:
        engine = SGLangEngine([server.url])

        async def update_then_generate(e):
            await e.update_weights([bucket(), bucket()], version="7")
            return await e.generate([GenerateRequest([1], SamplingParams(max_new_tokens=1))])
        [res] = run(engine, update_then_generate)
    updates = ["/update_weights_from_tensor"] * 2
    tail = ["/flush_cache", "/flush_cache"]  # the first flush is refused as busy, then retried
    expected = (["/begin_weight_update"] + updates + ["/end_weight_update"] if session else updates) + tail
    assert server.paths()[:len(expected)] == expected
    assert res.weight_version == "7"
    sent = next(b for p, b in server.calls if p == "/update_weights_from_tensor")
    assert sent["serialized_named_tensors"] == ["payload"] and sent["load_format"] == "flattened_bucket"
    assert sent["weight_version"] == "7"


def test_refused_update_raises_with_the_servers_message():
    with FakeSGLang(version="0.5.23") as server:
        engine = SGLangEngine([server.url])
        with pytest.raises(client_module.SGLangError, match="must run between begin_weight_update"):
            run(engine, lambda e: e.workers[0].update_weights_from_tensor(("p",), "flattened_bucket", "1"))


def test_bucket_must_carry_one_payload_per_tp_rank():
    with FakeSGLang() as server:
        engine = SGLangEngine([server.url], tp_size=2)
        with pytest.raises(ValueError, match="carries 1 payloads; the servers have tp_size=2"):
            run(engine, lambda e: e.update_weights([bucket()], version="1"))


def test_memory_tags_map_and_resume_in_two_stages():
    with FakeSGLang() as server:
        async def cycle(e):
            await e.release_memory({"weights", "kv_cache"})
            await e.resume_memory({"kv_cache", "weights"})
        run(SGLangEngine([server.url]), cycle)
    calls = [(p, b["tags"]) for p, b in server.calls if "memory" in p]
    assert calls == [("/release_memory_occupation", ["kv_cache", "cuda_graph", "weights"]),
                     ("/resume_memory_occupation", ["weights"]),
                     ("/resume_memory_occupation", ["kv_cache", "cuda_graph"])]


def test_without_router_requests_go_to_least_loaded_server():
    with FakeSGLang(delay=0.2) as a, FakeSGLang(delay=0.2) as b:
        engine = SGLangEngine([a.url, b.url])
        run(engine, lambda e: e.generate([GenerateRequest([i + 1], SamplingParams(max_new_tokens=1))
                                          for i in range(4)]))
    assert len(a.paths()) == len(b.paths()) == 2


def test_control_calls_reach_every_server():
    with FakeSGLang() as a, FakeSGLang() as b:
        async def pause_resume(e):
            await e.pause()
            await e.resume()
        run(SGLangEngine([a.url, b.url]), pause_resume)
    for server in (a, b):
        assert server.paths() == ["/pause_generation", "/continue_generation"]
        assert server.calls[0][1] == {"mode": "abort"}


def test_freeze_gc_reaches_every_server_and_names_those_without_the_route():
    with FakeSGLang() as a, FakeSGLang(version="0.4.6", freeze_gc=False) as b:
        missing = run(SGLangEngine([a.url, b.url]), lambda e: e.freeze_gc())
    assert missing == [b.url]
    assert a.paths() == b.paths() == ["/freeze_gc"]


def test_health_false_when_server_unreachable():
    with FakeSGLang() as server:
        url = server.url
    assert run(SGLangEngine([url]), lambda e: e.health()) is False


def test_passthrough_strips_prefix_and_rejects_owned_flags():
    assert passthrough_args(["--sglang-mem-fraction-static", "0.5", "--disable-cuda-graph"]) == \
        ["--mem-fraction-static", "0.5", "--disable-cuda-graph"]
    with pytest.raises(ValueError, match="'--port' is set by redline"):
        passthrough_args(["--sglang-port", "30000"])


def test_servers_on_disjoint_gpus_start_together_and_sharing_ones_one_after_another():
    assert start_waves([0, 1, 2, 3], tp_size=1) == [[0, 1, 2, 3]]
    assert start_waves([0, 2, 4, 6], tp_size=2) == [[0, 1, 2, 3]]
    assert start_waves([0, 0], tp_size=1) == [[0], [1]]  # two small servers on one GPU (the live router test)
    # GPUs {0,1}, {1,2}, {0,1}, {2,3}: each after the last earlier server it shares a GPU with
    assert start_waves([0, 1, 0, 2], tp_size=2) == [[0], [1], [2, 3]]


def test_requests_while_paused_return_aborted_without_reaching_the_server():
    with FakeSGLang() as server:
        async def paused_generate(e):
            await e.pause()
            [res] = await e.generate([GenerateRequest([1, 2], SamplingParams(max_new_tokens=2))])
            await e.resume()
            return res
        res = run(SGLangEngine([server.url]), paused_generate)
    assert res.finish_reason == FinishReason.ABORT and res.output_ids == []
    assert "/generate" not in server.paths()


def test_servers_launched_together_get_distinct_ports_and_keep_given_ones(monkeypatch, tmp_path):
    from redline.rollout.sglang import server as server_module

    commands = []

    class Started:
        pid = 0

        def poll(self):
            return 0

    def spawn(cmd, log, env=None):
        commands.append(cmd)
        return Started()

    monkeypatch.setattr(server_module, "require", lambda *a: None)
    monkeypatch.setattr(server_module, "_spawn", spawn)
    monkeypatch.setattr(server_module, "wait_until_healthy", lambda *a: None)
    servers = server_module.launch_servers("model", [0, 1, 2, 3], ports=[None, 31234, None, None], log_dir=tmp_path)
    ports = [int(cmd[cmd.index("--port") + 1]) for cmd in commands]
    assert ports[1] == 31234 and len(set(ports)) == 4
    assert [s.url for s in servers] == [f"http://127.0.0.1:{p}" for p in ports]



def test_a_server_started_from_a_torchrun_rank_builds_its_own_process_group(tmp_path, monkeypatch):
    """torchrun's TORCHELASTIC_USE_AGENT_STORE is not passed on: the child's rank 0 serves its group's store (with
    it, rendezvous makes rank 0 a client of a store nobody serves and the group never forms)."""
    import sys

    from redline.ports import free_port
    from redline.rollout.sglang.server import _spawn

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    group = ("import datetime, torch.distributed as dist; "
             f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1, "
             "timeout=datetime.timedelta(seconds=20)); print('group of', dist.get_world_size())")
    child = _spawn([sys.executable, "-c", group], tmp_path / "server.log")
    assert child.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()
    assert "group of 1" in (tmp_path / "server.log").read_text()
