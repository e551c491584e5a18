"""Faults under ``--ray-address local``, injected with ``REDLINE_FAULT``: a SIGKILLed engine process is restarted
mid-rollout and the run takes the steps of an undisturbed one; a SIGKILLed trainer is resumed from its checkpoint
(``--auto-resume``) and ``metrics.jsonl`` holds each step once, the same records as an undisturbed run. The rollout
manager is the default actor. In the rank (``--rollout-manager rank``) it calls the engines and checkpoints its state
as a run without Ray does: engine faults there are ``tests/rollout/test_fault_tolerance.py``'s, and a resume from
the rank's own checkpoint is every ``--load`` test's (``test_ray_launch`` runs that placement)"""

import pytest

from .test_data_parallel import assert_same_records
from .test_ray_launch import cpu_only, train, without_fault_counters  # noqa: F401 - cpu_only: the autouse fixture

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    records, _, _ = train(tmp_path_factory.mktemp("undisturbed"), "--num-rollout", "4")
    return records


def test_a_killed_engine_is_restarted_and_the_step_keeps_its_batch(tmp_path, undisturbed):
    records, console, _ = train(tmp_path, "--num-rollout", "4", "--ray-address", "local", "--embedded-engine-process",
                                "--rollout-health-check-interval", "0.5", "--rollout-health-check-timeout", "10",
                                env={"REDLINE_FAULT": "kill-engine:0@rollout:1"})
    assert "fault tolerance: health checks every 0.5 s" in console
    rl = records[1:]
    assert [r["rollout/engine_restarts"] for r in rl] == [0, 1, 0, 0]  # rollout 1 is step 2
    assert rl[1]["rollout/retried_requests"] > 0 and sum(r["rollout/retried_requests"] for r in rl) == \
        rl[1]["rollout/retried_requests"]
    assert [r["rollout/samples"] for r in rl] == [200.0] * 4
    # nothing lost, nothing twice: the records of the undisturbed run, fault counters aside
    assert_same_records(undisturbed, without_fault_counters(records))


def test_a_killed_trainer_resumes_from_its_checkpoint_with_each_step_logged_once(tmp_path, undisturbed):
    records, console, _ = train(tmp_path, "--num-rollout", "4", "--ray-address", "local", "--auto-resume",
                                "--save-interval", "2", "--no-use-fault-tolerance",
                                env={"REDLINE_FAULT": "kill-trainer:0@step:3"})  # after step 3, checkpoint at 2
    assert f"trainer rank died; restart 1/3 from {tmp_path / 'checkpoints' / 'rollout_1'}" in console
    assert "resumed from" in console
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert_same_records(undisturbed, records)


def test_without_auto_resume_a_killed_trainer_fails_the_run(tmp_path):
    _, console, code = train(tmp_path, "--num-rollout", "2", "--ray-address", "local", "--no-use-fault-tolerance",
                             env={"REDLINE_FAULT": "kill-trainer:0@step:1"}, check=False)
    assert code == 1 and "--auto-resume is off" in console and "trainer rank died (" in console
