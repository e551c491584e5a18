"""The pieces of a Ray run that need no Ray runtime: the rank environment of each placement slot, the fault plan of
``REDLINE_FAULT``, the flags that need ``--ray-address``."""

import pytest
from redline.config import RunConfig
from redline.configfile import ConfigError, apply_overrides
from redline.loop import faults
from redline.loop.ray_launch import check_ray_flags
from redline.loop.ray_placement import Slot, rank_env


def test_each_rank_gets_torchruns_environment_on_its_node():
    slots = [Slot(3, "10.0.0.1", "a", 0, 29500), Slot(0, "10.0.0.1", "a", 1, 29501),
             Slot(1, "10.0.0.2", "b", 0, 29502), Slot(2, "10.0.0.2", "b", 1, 29503)]
    envs = [rank_env(slots, r, 4) for r in range(4)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]  # its GPU among the node's
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"0,1"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("10.0.0.1", "29500")}  # rank 0's node
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}


def test_a_rank_sees_only_the_groups_gpus_its_own_first_and_then_its_engines():
    lone = rank_env([Slot(0, "10.0.0.1", "a", 5, 1)], 0, 1)  # one rank on GPU 5: cuda:0 is GPU 5
    assert (lone["LOCAL_RANK"], lone["CUDA_VISIBLE_DEVICES"]) == ("0", "5")
    # --no-colocate: the trainer's bundle and two engine bundles on one node; the engines are cuda:1 and cuda:2
    trainer = rank_env([Slot(0, "10.0.0.1", "a", 2, 1), Slot(1, "10.0.0.1", "a", 3, 2),
                        Slot(2, "10.0.0.1", "a", 6, 3)], 0, 1)
    assert (trainer["LOCAL_RANK"], trainer["CUDA_VISIBLE_DEVICES"], trainer["WORLD_SIZE"]) == ("0", "2,3,6", "1")


def test_cpu_bundles_number_their_ranks_within_each_node():
    slots = [Slot(0, "10.0.0.1", "a", None, 1), Slot(1, "10.0.0.1", "a", None, 2), Slot(2, "10.0.0.1", "b", None, 3)]
    assert [rank_env(slots, r, 3)["LOCAL_RANK"] for r in range(3)] == ["0", "1", "0"]
    assert "CUDA_VISIBLE_DEVICES" not in rank_env(slots, 0, 3)


def test_fault_plan_is_empty_unless_set(monkeypatch):
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    assert faults.planned() == [] and faults.engine_to_kill(3) is None
    faults.after_step(0, 4)  # inert: this process lives on


def test_fault_plan_names_engine_and_trainer_kills(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "kill-engine:1@rollout:3, kill-trainer:0@step:4")
    monkeypatch.delenv(faults.ATTEMPT_ENV, raising=False)
    assert faults.planned() == [faults.Fault("kill-engine", 1, 3), faults.Fault("kill-trainer", 0, 4)]
    assert faults.engine_to_kill(3) == 1 and faults.engine_to_kill(2) is None
    monkeypatch.setenv(faults.ATTEMPT_ENV, "1")  # a restarted attempt does not die again
    assert faults.planned() == []


@pytest.mark.parametrize("bad", ["kill-engine:0@step:3", "kill-trainer:0", "explode:1@step:2"])
def test_a_malformed_fault_is_refused_by_name(monkeypatch, bad):
    monkeypatch.setenv(faults.FAULT_ENV, bad)
    with pytest.raises(ValueError, match=f"REDLINE_FAULT: '{bad}'"):
        faults.planned()


@pytest.mark.parametrize("flags, flag", [({"auto_resume": True}, "--auto-resume"),
                                         ({"rollout_manager": "rank"}, "--rollout-manager"),
                                         ({"actor_num_nodes": 2}, "--actor-num-nodes"),
                                         ({"actor_num_gpus_per_node": 2}, "--actor-num-gpus-per-node")])
def test_ray_only_flags_need_a_ray_address(flags, flag):
    with pytest.raises(ConfigError, match=f"{flag} needs --ray-address"):
        check_ray_flags(apply_overrides(RunConfig(), flags))
    check_ray_flags(apply_overrides(RunConfig(), {**flags, "ray_address": "local"}))


def test_fully_async_rollout_is_refused_on_ray_by_name():
    with pytest.raises(ConfigError, match="--async-rollout full is not yet on Ray"):
        check_ray_flags(apply_overrides(RunConfig(), {"ray_address": "local", "async_rollout": "full"}))
    check_ray_flags(apply_overrides(RunConfig(), {"ray_address": "local", "async_rollout": "one-step"}))


def test_a_rank_and_its_engine_process_share_a_bundle_half_and_half():
    from redline.loop.ray_placement import shared_bundle

    assert shared_bundle({"GPU": 1, "CPU": 4}) == {"num_gpus": 0.5, "num_cpus": 2.0}  # Ray gives both the GPU
    assert shared_bundle({"CPU": 1}) == {"num_cpus": 0.5}  # on the CPU the same code path: CPU fractions


def test_a_rank_bundle_takes_a_gpu_and_an_even_share_of_the_cpus():
    from redline.loop.ray_placement import actor_resources, bundle_for

    assert bundle_for({"CPU": 2.0}, 1) == {"CPU": 2}  # one rank on a CPU machine computes with every core
    assert bundle_for({"CPU": 2.0}, 2) == {"CPU": 1}
    assert bundle_for({"CPU": 1.0}, 4) == {"CPU": 1}
    assert bundle_for({"CPU": 128.0, "GPU": 8.0}, 8) == {"GPU": 1, "CPU": 16}
    assert actor_resources({"GPU": 1, "CPU": 16}) == {"num_gpus": 1, "num_cpus": 16}
    assert actor_resources({"CPU": 2}) == {"num_gpus": 0, "num_cpus": 2}


@pytest.mark.parametrize("flags, message", [
    ({"colocate": False, "embedded_engine_process": True}, "--no-colocate engines are not restarted yet"),
    ({"embedded_engine_process": False}, "add --embedded-engine-process"),
    ({"rollout_engine": "sglang"}, "add --embedded-engine-process")])
def test_fault_tolerance_where_it_cannot_act_is_refused_at_start_up(flags, message):
    from redline.loop.fault_tolerance import check_fault_tolerance

    watched = {"use_fault_tolerance": True, "rollout_engine": "embedded", "embedded_engine_process": True}
    check_fault_tolerance(apply_overrides(RunConfig(), watched))
    with pytest.raises(ConfigError, match=message):
        check_fault_tolerance(apply_overrides(RunConfig(), {**watched, **flags}))
