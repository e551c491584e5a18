"""``--use-wandb``: each step's record also goes to a W&B run (offline here: nothing leaves the machine)."""

import pytest

from redline.loop.metrics import MetricsLog


def test_records_reach_an_offline_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'redline[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLog(tmp_path, use_wandb=True, run_name="wandb-test", config={"train": {"lr": 1e-6}})
    log.log(1, {"rollout/reward_mean": 0.25, "train/pg_loss": -0.5})
    log.log(2, {"rollout/reward_mean": 0.75, "train/pg_loss": -0.25})
    log.close()
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    assert b"rollout/reward_mean" in data and b"train/pg_loss" in data and b"wandb-test" in data
    assert [r["step"] for r in log.records] == [1, 2]
