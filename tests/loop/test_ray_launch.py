"""``redline train --ray-address``: the quickstart placed by Ray takes the steps it takes without Ray, on one
local node and on a simulated two-node cluster (``ray.cluster_utils.Cluster``, each node with its own CPU), its
batches drawn by the rollout manager actor."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from .test_data_parallel import REPO, assert_same_records

pytestmark = [pytest.mark.ray, pytest.mark.slow]
QUICKSTART = ["examples/quickstart.toml", "--sft-steps", "3", "--eval-interval", "2"]
RAY_PREFIX = re.compile(r"(\x1b\[\d+m)?\((TrainerRank|raylet)[^)]*\)(\x1b\[0m)? ?")
FAULT_METRICS = ("rollout/engine_restarts", "rollout/retried_requests")  # engine processes under fault tolerance


def without_fault_counters(records):
    return [{k: v for k, v in r.items() if k not in FAULT_METRICS} for r in records]


def train(out, *args, env=None, check=True, timeout=300):
    """``redline train`` of the quickstart in a subprocess: (records, console, exit code). A run still going after
    ``timeout`` seconds is killed with its process group (the Ray runtime it started) and fails the test with the
    end of its output."""
    cmd = [sys.executable, "-m", "redline.cli", "train", *QUICKSTART, "--output-dir", str(out), *args]
    process = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env={**os.environ, "RAY_DEDUP_LOGS": "0", **(env or {})})
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"redline train {' '.join(args)} still ran after {timeout} s; the end of its output:\n"
                    f"{stdout[-3000:]}\n{stderr[-3000:]}")
    # the console wraps long lines, and Ray prefixes each line of an actor with its name and pid
    console = " ".join(RAY_PREFIX.sub("", stdout + stderr).split())
    if check:
        assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    metrics = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return records, console, process.returncode


@pytest.fixture(autouse=True)
def cpu_only():
    if torch.cuda.is_available():
        pytest.skip("CPU bundles; the GPU acceptance is benchmarks/ray_acceptance.py")


def saved_data_position(out):
    """The data position (the rollout state of rank 0) of the run's last checkpoint."""
    from redline.loop import checkpoint

    _, mine = checkpoint.load_state(checkpoint.resolve(out))
    return mine["rollout"]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The quickstart's 3 steps without Ray (checkpointed after the last): (records, output folder)."""
    out = tmp_path_factory.mktemp("single")
    records, _, _ = train(out, "--num-rollout", "3", "--save-interval", "3")
    return records, out


def test_quickstart_on_a_local_ray_runtime_takes_the_single_process_steps(tmp_path, single_process):
    records, console, _ = train(tmp_path / "ray", "--num-rollout", "3", "--save-interval", "3", "--ray-address",
                                "local")
    single, single_out = single_process
    assert "ray: rank 0 on node" in console and "model " in console  # the rank's lines reach the driver
    assert "ray: data-parallel rank 0's rollouts from the rollout manager actor" in console
    assert_same_records(single, records)
    assert [r["rollout/samples"] for r in records[1:]] == [200.0] * 3  # 25 prompts x 8 samples, every step
    # the checkpoint keeps the data position the manager actor reached: the one of the run without Ray
    position = saved_data_position(tmp_path / "ray")
    assert position == saved_data_position(single_out)
    assert position["data_source"]["position"] >= 3 * 25  # past the three rollouts' prompts
    placement = json.loads((tmp_path / "ray" / "placement.json").read_text())
    assert [row["rank"] for row in placement] == [0] and placement[0]["gpu"] is None


def test_a_rollout_manager_in_the_rank_takes_the_same_steps_without_an_actor(tmp_path, single_process):
    records, console, _ = train(tmp_path / "ray", "--num-rollout", "3", "--ray-address", "local",
                                "--rollout-manager", "rank")
    single, _ = single_process
    assert "ray: rank 0 on node" in console and "rollout manager actor" not in console
    assert_same_records(single, records)
    assert [r["rollout/samples"] for r in records[1:]] == [200.0] * 3


def test_two_node_cluster_places_a_rank_and_its_engine_on_each_node(tmp_path):
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the driver's node hosts no rank
    try:
        for name in ("node_a", "node_b"):  # one CPU each: the group's two bundles cannot share a node
            cluster.add_node(num_cpus=1, resources={name: 1})
        cluster.wait_for_nodes()
        batch = ["--rollout-batch-size", "24", "--global-batch-size", "192", "--num-rollout", "3"]
        records, console, _ = train(tmp_path / "ray", *batch, "--embedded-engine-process", "--actor-num-nodes", "2",
                                    "--ray-address", cluster.address)
        managers = list_actors(address=cluster.address, filters=[("class_name", "=", "RolloutManagerActor")])
        hosts = list_actors(address=cluster.address, filters=[("class_name", "=", "EngineHost")])
    finally:
        cluster.shutdown()
    single, _, _ = train(tmp_path / "single", *batch)
    placement = json.loads((tmp_path / "ray" / "placement.json").read_text())
    (seen_0,), (seen_1,) = (row["attempts"] for row in placement)
    assert seen_0["node_id"] == placement[0]["node_id"] and seen_1["node_id"] == placement[1]["node_id"]
    assert seen_0["node_id"] != seen_1["node_id"]  # a trainer rank on each node ...
    # ... and each rank's engine process, an actor sharing the rank's bundle (half of its one CPU each)
    assert "rollout engine: embedded (own process) (one per data-parallel rank, 2 ranks)" in console
    engines = re.findall(r"ray: engine 0 \(process \d+\) on node \S+ \((\w+)\), bundle (\d+) shared with its trainer "
                         r"rank, each taking \{'num_cpus': 0\.5\}", console)
    assert sorted(engines) == sorted((row["node_id"][:8], str(row["bundle"])) for row in placement)
    assert sorted(host.node_id for host in hosts) == sorted(row["node_id"] for row in placement)
    # one rollout manager actor serves both ranks' shards, each rank's batch the size it has without Ray
    assert len(managers) == 1
    shown = re.findall(r"ray: data-parallel rank (\d)'s rollouts from the rollout manager actor \(process (\d+)\)",
                       console)
    assert sorted(rank for rank, _ in shown) == ["0", "1"] and {pid for _, pid in shown} == {str(managers[0].pid)}
    assert [r["rollout/engine_restarts"] for r in records[1:]] == [0] * 3
    assert_same_records(single, without_fault_counters(records))


def test_two_node_cluster_runs_a_disaggregated_engine_on_its_own_bundle_on_the_other_node(tmp_path):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the driver's node hosts nothing
    try:
        for name in ("node_a", "node_b"):  # one CPU each: the trainer's bundle and the engine's cannot share one
            cluster.add_node(num_cpus=1, resources={name: 1})
        cluster.wait_for_nodes()
        batch = ["--num-rollout", "3", "--no-colocate", "--rollout-num-gpus", "1"]
        records, console, _ = train(tmp_path / "ray", *batch, "--ray-address", cluster.address)
    finally:
        cluster.shutdown()
    single, _, _ = train(tmp_path / "single", *batch)  # its engine process the trainer's child
    trainer, engine = json.loads((tmp_path / "ray" / "placement.json").read_text())
    assert "rank" in trainer and "engine" in engine and trainer["node_id"] != engine["node_id"]
    (seen,) = trainer["attempts"]
    assert seen["node_id"] == trainer["node_id"]
    # the engine process runs on the engine bundle's node, and the weight-update group meets on the trainer's
    # node IP (not 127.0.0.1)
    shown = re.search(r"ray: engine 0 \(process \d+\) on node (\S+) \((\w+)\), bundle (\d+); weight-update group "
                      r"on (\S+)", console)
    assert shown, console[-3000:]
    assert engine["node_id"].startswith(shown[2]) and int(shown[3]) == engine["bundle"]
    assert shown[4] == trainer["node_ip"]
    assert [r["rollout/samples"] for r in records[1:]] == [200.0] * 3
    assert_same_records(single, records)


def test_the_rollout_manager_actor_generates_on_sglang_servers_itself(tmp_path):
    """Given SGLang servers (the stand-in here), the actor is their client: it generates a whole batch with no call
    through the rank, and its samples carry the weight version the rank last pushed (the stand-in reports none).
    A rank-like actor drives it, since ``redline train`` refuses SGLang on a machine without CUDA."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'redline[ray]')")
    pytest.importorskip("aiohttp", reason="the SGLang client needs aiohttp")
    from redline.configfile import apply_overrides
    from redline.loop.builtin import materialize
    from tests.rollout.fake_sglang import fake_sglang_process

    from .test_sglang_disaggregated import received_paths
    from .test_train import small_config

    class Rank:  # what the manager actor knows of a trainer rank: its relay, which must stay unused
        relayed = 0

        async def rollout(self, config, url):
            from redline.loop.data_parallel import SINGLE_PROCESS
            from redline.loop.ray_rollout import MANAGER_ENV, remote_manager
            from redline.rollout.sglang.engine import SGLangEngine

            os.environ[MANAGER_ENV] = "redline-test-manager"
            manager = remote_manager(config, SINGLE_PROCESS)
            manager.engine = SGLangEngine([url], weight_version="7")
            batch = await manager.generate_rollout()
            await manager.close()
            return [s.weight_versions for group in batch.groups for s in group], self.relayed

        async def call(self, method, *args):
            self.relayed += 1

        async def generate_each(self, requests):
            self.relayed += 1
            yield b""

    with fake_sglang_process() as url:
        config = small_config(tmp_path, sft_steps="0", rollout_engine="sglang", sglang_server_urls=url)
        config = apply_overrides(config, materialize(config, tmp_path / "builtin"))
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
        try:
            versions, relayed = ray.get(ray.remote(Rank).remote().rollout.remote(config, url), timeout=120)
        finally:
            ray.shutdown()
        generated = received_paths(url).count("/generate")
    assert relayed == 0
    assert len(versions) == 5 * 4 and generated == 5 * 4  # rollout_batch_size 5 x 4 samples, each one request
    assert all(v == ["7"] for v in versions)
