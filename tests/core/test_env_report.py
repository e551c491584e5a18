"""`redline env`: versions, GPUs from NVML, backend choice."""

import json

import pytest
import torch
from click.testing import CliRunner

from redline.backends import select_backends
from redline.cli import main
from redline.env_report import collect


def test_report_lists_every_component():
    software = collect()["software"]
    for key in ["python", "torch", "cuda (torch build)", "triton", "TransformerEngine", "SGLang", "Ray",
                "flash-attn"]:
        assert key in software
    assert software["torch"] == torch.__version__


def test_json_output_is_machine_readable():
    result = CliRunner().invoke(main, ["env", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert set(report) == {"software", "platform", "gpus", "backends"}
    assert set(report["backends"]) == {"kernels", "fp8", "rollout"}


def test_human_output_shows_backends():
    result = CliRunner().invoke(main, ["env"])
    assert result.exit_code == 0, result.output
    assert "backends" in result.output and "rollout" in result.output and "kernels" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only backend choice")
def test_cpu_machine_uses_reference_kernels_and_embedded_engine():
    backends = select_backends()
    assert backends.kernels == "torch reference"
    assert backends.fp8 == "off"
    assert backends.rollout == "embedded"
    assert "error" in collect()["gpus"]


@pytest.mark.gpu
def test_gpu_report_reads_nvml():
    gpus = collect()["gpus"]
    assert "error" not in gpus, gpus
    assert len(gpus["devices"]) == torch.cuda.device_count()
    device = gpus["devices"][0]
    assert device["memory_total_mib"] > 0 and device["name"]
    assert select_backends().kernels == "triton"


def test_source_revision_is_git_describe_of_the_source_tree(tmp_path, monkeypatch):
    import subprocess

    from redline import env_report

    expected = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=env_report.SOURCE_TREE,
                              capture_output=True, text=True)
    if expected.returncode != 0:
        pytest.skip(f"{env_report.SOURCE_TREE} is not a git checkout: {expected.stderr.strip()}")
    assert env_report.source_revision() == expected.stdout.strip()
    monkeypatch.setattr(env_report, "SOURCE_TREE", tmp_path)  # no repository there
    assert env_report.source_revision() is None


def test_a_git_archive_of_the_tree_records_its_commit(tmp_path, monkeypatch):
    import io
    import subprocess
    import tarfile

    from redline import env_report

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=env_report.SOURCE_TREE, capture_output=True, text=True,
                          check=False)
    if head.returncode != 0:
        pytest.skip(f"{env_report.SOURCE_TREE} is not a git checkout: {head.stderr.strip()}")
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD", "core/REVISION"], cwd=env_report.SOURCE_TREE,
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path, filter="data")  # the tree as the GPU machine gets it
    monkeypatch.setattr(env_report, "SOURCE_TREE", tmp_path)
    assert env_report.source_revision() == head.stdout.strip()[:12]
    (tmp_path / "core" / "REVISION").write_text("$Format:%H$\n")  # a copy that is no archive: nothing to claim
    assert env_report.source_revision() is None


def test_write_environment_records_date_commit_versions_and_gpus(tmp_path):
    from datetime import datetime

    from redline import env_report

    path = env_report.write_environment(tmp_path / "results")
    record = json.loads(path.read_text())
    assert path == tmp_path / "results" / "environment.json"
    assert datetime.fromisoformat(record["date"]).tzinfo is not None
    assert record["commit"] == env_report.source_revision()
    assert record["software"]["torch"] == torch.__version__
    assert record["gpus"] == env_report.gpus()
