"""Rollout engines of several GPUs (``--rollout-num-gpus-per-engine``): where they sit, the start-up checks, the
URL a seat's leader shares, the launch arguments, and the colocated per-rank weight push through a seat (gloo
processes and a stand-in SGLang server on the CPU)."""

import asyncio
import multiprocessing as mp

import pytest

from redline.config import RunConfig
from redline.configfile import ConfigError, apply_overrides
from redline.loop import rollout_setup
from redline.loop.engine_placement import (
    EngineSeat,
    check_engine_gpus,
    colocated_seat,
    disaggregated_base_gpus,
)
from tests.gloo_ranks import run_ranks
from redline.sync.broadcast import rank_offsets

from tests.loop import engine_seat_procs  # importable by the spawned ranks

CTX = mp.get_context("spawn")  # not fork: the test process may hold threads (HTTP, gloo) of earlier tests
TIMEOUT_S = 120


def test_colocated_engines_take_consecutive_ranks():
    assert colocated_seat(0, 4, 2) == EngineSeat(engine=0, engine_rank=0, ranks=(0, 1))
    assert colocated_seat(3, 4, 2) == EngineSeat(engine=1, engine_rank=1, ranks=(2, 3))
    seat = colocated_seat(5, 8, 4)
    assert (seat.engine, seat.engine_rank, seat.ranks, seat.leader, seat.is_leader) == (1, 1, (4, 5, 6, 7), 4, False)
    assert colocated_seat(2, 4, 1) == EngineSeat(engine=2, engine_rank=0, ranks=(2,))


def test_a_seat_size_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(ValueError, match="--rollout-num-gpus-per-engine 3 does not divide the 4 trainer rank"):
        colocated_seat(0, 4, 3)


def test_disaggregated_engines_start_n_gpus_apart_after_the_trainer():
    assert disaggregated_base_gpus(4, 2) == [1, 3]
    assert disaggregated_base_gpus(6, 3, first_gpu=2) == [2, 5]
    assert disaggregated_base_gpus(3, 1) == [1, 2, 3]
    with pytest.raises(ValueError, match="does not divide --rollout-num-gpus 3"):
        disaggregated_base_gpus(3, 2)


def test_weight_group_ranks_of_multi_gpu_engines_follow_slime():
    # trainer = rank 0; engine e's TP rank r joins at offset_e + r (SGLang's rank_offset + tp_rank)
    offsets, world = rank_offsets([2, 2])
    assert (offsets, world) == ([1, 3], 5)
    assert sorted(o + r for o in offsets for r in range(2)) == [1, 2, 3, 4]


def config(**overrides):
    return apply_overrides(RunConfig(), {k: str(v) for k, v in overrides.items()})


def engine_of(c):
    """The engine the run resolves to (``auto`` is the embedded engine on this GPU-less machine)."""
    return "sglang" if c.rollout.rollout_engine == "sglang" else "embedded"


@pytest.mark.parametrize("overrides,world,local,message", [
    ({"rollout_num_gpus_per_engine": 0}, 1, 1, "--rollout-num-gpus-per-engine must be >= 1, got 0"),
    ({"rollout_num_gpus_per_engine": 2}, 4, 4, "only SGLang shards an engine.*the embedded engine"),
    ({"rollout_num_gpus_per_engine": 2, "rollout_engine": "sglang"}, 3, 3,
     "3 rank\\(s\\), 3 on this node.*a multiple of 2 processes per node"),
    ({"rollout_num_gpus_per_engine": 4, "rollout_engine": "sglang"}, 8, 2, "8 rank\\(s\\), 2 on this node"),
    ({"rollout_num_gpus_per_engine": 2, "rollout_engine": "sglang"}, 1, 1, "1 rank\\(s\\)"),
    ({"rollout_num_gpus_per_engine": 2, "rollout_engine": "sglang", "sglang_server_urls": "http://h:1"}, 2, 2,
     "drop --sglang-server-urls"),
    ({"rollout_num_gpus_per_engine": 2, "rollout_engine": "sglang", "check_weights": "true"}, 2, 2,
     "--check-weights compares .* TP shards"),
    ({"rollout_num_gpus_per_engine": 2, "rollout_engine": "sglang", "use_fault_tolerance": "true"}, 2, 2,
     "--use-fault-tolerance restarts"),
    ({"rollout_num_gpus_per_engine": 2, "rollout_engine": "sglang", "colocate": "false", "rollout_num_gpus": 3}, 1, 1,
     "--rollout-num-gpus-per-engine 2 must divide --rollout-num-gpus 3"),
])
def test_start_up_refusals_name_the_flags(overrides, world, local, message):
    c = config(**overrides)
    with pytest.raises(ConfigError, match=message):
        check_engine_gpus(c, engine=engine_of(c), world_size=world, local_world_size=local)


@pytest.mark.parametrize("overrides,world", [
    ({"rollout_num_gpus_per_engine": 2, "rollout_engine": "sglang"}, 4),
    ({"rollout_num_gpus_per_engine": 2, "rollout_engine": "sglang", "colocate": "false", "rollout_num_gpus": 4}, 1),
    ({"rollout_num_gpus_per_engine": 4, "rollout_engine": "sglang", "colocate": "false",
      "sglang_server_urls": "http://h:1"}, 1),
    ({"rollout_num_gpus_per_engine": 1}, 3),
])
def test_layouts_that_fit_pass(overrides, world):
    c = config(**overrides)
    check_engine_gpus(c, engine=engine_of(c), world_size=world, local_world_size=world)


class LaunchRecorder:
    def __init__(self, monkeypatch):
        from redline.rollout.sglang.engine import SGLangEngine

        self.calls = []

        def launch(cls, model_path, **kwargs):
            self.calls.append(kwargs)
            return "launched"

        monkeypatch.setattr(SGLangEngine, "launch", classmethod(launch))


def test_disaggregated_sglang_engines_launch_with_tp_size_n_on_their_base_gpus(monkeypatch, tmp_path):
    recorder = LaunchRecorder(monkeypatch)
    import torch

    monkeypatch.setattr(rollout_setup, "engine_devices",
                        lambda c: [torch.device("cuda", 1 + i) for i in range(c.parallel.rollout_num_gpus)])
    c = config(rollout_engine="sglang", colocate="false", rollout_num_gpus=4, rollout_num_gpus_per_engine=2,
               hf_checkpoint=str(tmp_path))
    assert rollout_setup.build_engine(c, None, device="cuda:0", dtype=None, log_dir=tmp_path) == "launched"
    [call] = recorder.calls
    assert (call["num_engines"], call["tp_size"], call["base_gpu_ids"]) == (2, 2, [1, 3])


def test_launched_sglang_captures_cuda_graphs_up_to_each_servers_share_of_the_rollout(monkeypatch, tmp_path):
    recorder = LaunchRecorder(monkeypatch)
    import torch

    monkeypatch.setattr(rollout_setup, "engine_devices",
                        lambda c: [torch.device("cuda", 1 + i) for i in range(c.parallel.rollout_num_gpus)])
    common = dict(rollout_engine="sglang", colocate="false", hf_checkpoint=str(tmp_path), rollout_batch_size="64",
                  n_samples_per_prompt="8")
    for extra, expected in [({}, "256"), ({"rollout_num_gpus": "1"}, "512"),
                            ({"rollout_num_gpus": "1", "over_sampling_batch_size": "96"}, "768"),
                            ({"rollout_num_gpus": "1", "n_samples_per_prompt": "32"}, "1024"),
                            ({"rollout_num_gpus": "1", "sglang_args": "--cuda-graph-max-bs=64"}, None),
                            ({"rollout_num_gpus": "1", "sglang_args": "--sglang-disable-cuda-graph"}, None)]:
        recorder.calls.clear()
        rollout_setup.build_engine(config(**(common | {"rollout_num_gpus": "2"} | extra)), None, device="cuda:0",
                                   dtype=None, log_dir=tmp_path)
        args = recorder.calls[0]["sglang_args"]
        bounds = [args[i + 1] for i, a in enumerate(args) if a == "--cuda-graph-max-bs"]
        assert bounds == ([expected] if expected else []), (extra, args)


def test_the_launched_servers_memory_fraction(monkeypatch, tmp_path):
    """--sglang-mem-fraction-static as given; otherwise SGLang's own default on GPUs of their own, 0.5 beside a
    resident trainer and 0.7 beside a trainer paused by --offload-train."""
    import torch

    recorder = LaunchRecorder(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(rollout_setup, "engine_devices", lambda c: [torch.device("cuda", 1)])
    common = dict(rollout_engine="sglang", hf_checkpoint=str(tmp_path))
    for extra, expected in [({"colocate": "false", "rollout_num_gpus": "1"}, None),
                            ({"colocate": "false", "rollout_num_gpus": "1", "sglang_mem_fraction_static": "0.8"},
                             "0.8"),
                            ({"offload_train": "false"}, "0.5"),
                            ({"offload_train": "true"}, "0.7"),
                            ({"offload_train": "true", "sglang_mem_fraction_static": "0.6"}, "0.6")]:
        recorder.calls.clear()
        rollout_setup.build_engine(config(**common, **extra), None, device="cuda:0", dtype=None, log_dir=tmp_path)
        args = recorder.calls[0]["sglang_args"]
        fractions = [args[i + 1] for i, a in enumerate(args) if a == "--mem-fraction-static"]
        assert fractions == ([expected] if expected else []), (extra, args)


def test_attached_servers_carry_the_engine_tp_size(tmp_path):
    c = config(rollout_engine="sglang", colocate="false", rollout_num_gpus_per_engine=2,
               sglang_server_urls="http://127.0.0.1:1,http://127.0.0.1:2")
    engine = rollout_setup.build_sglang_engine(c, log_dir=tmp_path)
    assert engine.tp_size == 2 and engine.weight_group_size == 4


def test_sglang_servers_join_the_weight_group_at_n_ranks_apart():
    from redline.rollout.sglang.engine import SGLangEngine

    engine = SGLangEngine(["http://a", "http://b"], tp_size=2)
    joined = []

    async def record(url, *args):
        joined.append((url, *args))

    for worker in engine.workers:
        worker.init_weights_update_group = lambda *a, url=worker.url: record(url, *a)
    offsets, world = rank_offsets([engine.weight_group_size])
    asyncio.run(engine.join_weight_group("127.0.0.1", 29500, offsets[0], world, "g", "nccl"))
    assert [(url, rank, size) for url, _, _, rank, size, *_ in joined] == [("http://a", 1, 5), ("http://b", 3, 5)]


def run_seat_ranks(target, world, *args):
    return run_ranks(CTX, target, world, lambda rank, port: (rank, world, port, *args), TIMEOUT_S)


@pytest.mark.slow  # gloo processes
def test_the_leaders_url_reaches_every_rank_of_its_engine():
    outcome = run_seat_ranks(engine_seat_procs.share_a_launch, 2, False)
    assert outcome == {0: ("engine-object", "http://127.0.0.1:1234"), 1: (None, "http://127.0.0.1:1234")}


@pytest.mark.slow
def test_a_failed_launch_raises_on_every_rank_naming_the_leader():
    outcome = run_seat_ranks(engine_seat_procs.share_a_launch, 2, True)
    assert outcome[0] == ("raised", "no GPU for the server")
    assert outcome[1][0] == "raised" and "rank 0 failed to launch" in outcome[1][1]
    assert "no GPU for the server" in outcome[1][1]


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True])
def test_each_bucket_reaches_the_server_as_one_request_with_every_ranks_payload(offload):
    outcome = run_seat_ranks(engine_seat_procs.push_through_seat, 2, offload)
    assert all(not isinstance(o, str) for o in outcome.values()), outcome
    calls, version, buckets, description, timed = outcome[0]
    assert outcome[1][0] is None and outcome[1][1] == version == "2"  # every rank's engine holds the last version
    # every rank reports the same phases (the leader's engine calls included): the DP metric reduction needs it
    assert timed == outcome[1][4] and "perf/sync_time" in timed
    assert ("perf/release_time" in timed) == ("perf/resume_kv_time" in timed) == offload
    assert "sglang-tp" in description and "engine TP 2" in description
    assert buckets > 1
    updates = [body for path, body in calls if path == "/update_weights_from_tensor"]
    assert len(updates) == 2 * buckets
    for body in updates:
        own, other = body["serialized_named_tensors"]  # engine TP rank 0's payload first, then rank 1's
        assert own.startswith("rank0:") and other == "rank1:" + own.removeprefix("rank0:")
        assert body["load_format"] == "flattened_bucket"
    # the memory calls are made once per push, by the leader, around the update session
    paths = [path for path, _ in calls]
    push = ["/begin_weight_update", *["/update_weights_from_tensor"] * buckets, "/end_weight_update", "/flush_cache"]
    if offload:
        push = ["/release_memory_occupation", "/resume_memory_occupation", *push, "/resume_memory_occupation"]
    assert paths == push * 2


@pytest.mark.slow
def test_every_tp_rank_hands_its_engine_rank_the_full_tensors_of_each_bucket():
    outcome = run_seat_ranks(engine_seat_procs.tp_trainer_through_seat, 2)
    assert all(not isinstance(o, str) for o in outcome.values()), outcome
    calls, expected, mode = outcome[0]
    assert mode == outcome[1][2] == "sglang-tp" and outcome[1][0] is None
    updates = [body["serialized_named_tensors"] for path, body in calls if path == "/update_weights_from_tensor"]
    assert len(updates) > 1
    sent = {}
    for engine_rank, payloads in enumerate(zip(*updates)):
        received = dict(item.split("=") for p in payloads for item in p.split(":", 1)[1].split(";"))
        assert all(p.startswith(f"rank{engine_rank}:") for p in payloads)  # its own rank's copy, in TP order
        sent[engine_rank] = {name: int(h) for name, h in received.items()}
    # each TP rank packed the whole (gathered) tensors, equal to the unsharded model's
    assert sent[0] == sent[1] == expected
    paths = [path for path, _ in calls]
    assert paths[0] == "/release_memory_occupation" and paths[-1] == "/resume_memory_occupation"


def test_an_engine_must_span_whole_model_parallel_groups():
    c = config(rollout_num_gpus_per_engine=2, rollout_engine="sglang", tensor_model_parallel_size=4)
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size 4 × --pipeline-model-parallel-size 1: an "
                                          "engine must span whole model-parallel groups of 4 GPUs"):
        check_engine_gpus(c, engine="sglang", world_size=8, local_world_size=8)
    for n, tp, pp in ((2, 2, 1), (4, 2, 2), (4, 2, 1)):
        c = config(rollout_num_gpus_per_engine=n, rollout_engine="sglang", tensor_model_parallel_size=tp,
                   pipeline_model_parallel_size=pp)
        check_engine_gpus(c, engine="sglang", world_size=8, local_world_size=8)
