"""One RL step against SGLangEngine attached by URL to the stand-in server: the step generates through
/generate and pushes the plan's buckets through /update_weights_from_tensor, inside the two-stage memory
sequence, then checks the server's parameter hashes. The CUDA-IPC serialization (which needs SGLang and a GPU)
is replaced by a recorder, which also makes the stand-in report the hashes of what it was sent."""

import pytest
import torch
from rich.console import Console

pytest.importorskip("aiohttp", reason="the SGLang client needs aiohttp")

from redline.configfile import apply_overrides  # noqa: E402
from redline.loop.builtin import materialize  # noqa: E402
from redline.loop.step import rl_step  # noqa: E402
from redline.loop.train import build  # noqa: E402
from redline.rollout.engine import SerializedBucket  # noqa: E402
from redline.rollout.sglang import engine as sglang_engine  # noqa: E402
from redline.rollout.sglang import weight_check  # noqa: E402
from redline.rollout.sglang.weight_check import expected_checksums  # noqa: E402
from redline.sync.plan import plan_for  # noqa: E402

from redline.rollout.sglang import payload as payload_module  # noqa: E402

from tests.rollout.fake_sglang import FakeSGLang, FakeSGLangModel, Payloads  # noqa: E402
from tests.rollout.test_sglang_weight_check import byte_hash  # noqa: E402

from .test_train import small_config  # noqa: E402

BUCKET_BYTES = 128 * 1024


CONTROL_DELAY = 0.02  # seconds the stand-in takes to answer each weight update, memory call and hash request


def loaded_as_sent(server, monkeypatch) -> list[list[str]]:
    """Serialization by recorder: each bucket's names go to the returned list and the stand-in reports the hashes
    of what it was sent, as a server that loaded it would."""
    serialized = []

    def fake_serialize(named_tensors, tp_size=1):
        serialized.append([name for name, _ in named_tensors])
        server.checksums.update(expected_checksums(named_tensors, byte_hash))  # "loaded" what was sent
        return SerializedBucket(per_rank=(f"bucket-{len(serialized) - 1}",) * tp_size)

    monkeypatch.setattr(sglang_engine, "serialize_bucket", fake_serialize)
    monkeypatch.setattr(weight_check, "sglang_tensor_hash", lambda: byte_hash)
    return serialized


@pytest.mark.parametrize("version,session", [("0.5.17", False), ("0.5.23", True)])
def test_rl_step_on_an_attached_sglang_server(tmp_path, monkeypatch, version, session):
    """A server without redline's checked loader: pushed as flattened buckets, then checked by its hashes."""
    server = FakeSGLang(version=version, busy_flushes=0, control_delay=CONTROL_DELAY)
    serialized = loaded_as_sent(server, monkeypatch)
    with server:
        config = small_config(tmp_path, sft_steps="0", rollout_engine="sglang", sglang_server_urls=server.url,
                              offload_rollout="true", update_weight_buffer_size=str(BUCKET_BYTES),
                              check_sglang_weights="true")
        config = apply_overrides(config, materialize(config, tmp_path / "builtin"))
        state, _ = build(config, Console(quiet=True))
        try:
            metrics = rl_step(state, 0)
        finally:
            state.loop.run_until_complete(state.engine.shutdown())

    plan = plan_for(state.worker.model.export_hf(), BUCKET_BYTES)
    assert serialized == [b.names for b in plan.buckets]
    paths = server.paths()
    samples = config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
    assert paths[:samples] == ["/generate"] * samples
    updates = ["/update_weights_from_tensor"] * len(plan.buckets)
    if session:  # >= 0.5.21 takes updates only inside a begin/end session
        updates = ["/begin_weight_update", *updates, "/end_weight_update"]
    assert paths[samples:] == ["/release_memory_occupation", "/resume_memory_occupation", *updates,
                               "/flush_cache", "/weights_checker", "/resume_memory_occupation"]
    tags = [body["tags"] for path, body in server.calls if "memory_occupation" in path]
    assert tags == [["kv_cache", "cuda_graph", "weights"], ["weights"], ["kv_cache", "cuda_graph"]]
    sent = [body for path, body in server.calls if path == "/update_weights_from_tensor"]
    assert [b["serialized_named_tensors"] for b in sent] == [[f"bucket-{i}"] for i in range(len(plan.buckets))]
    assert {b["weight_version"] for b in sent} == {"1"}
    assert metrics["rollout/response_len_mean"] > 0 and metrics["perf/update_weights_time"] > 0
    # SGLang's own handling inside the push: the answers waited for, part of the phases that waited for them
    buckets = len(plan.buckets)
    assert CONTROL_DELAY * buckets <= metrics["perf/sync_sglang_time"] <= metrics["perf/sync_time"]
    assert (CONTROL_DELAY * (buckets + 3) <= metrics["perf/update_weights_sglang_time"]  # + resume ×2, checker
            <= metrics["perf/update_weights_time"])


def test_rl_step_on_a_server_with_the_checked_loader_checks_in_the_load(tmp_path, monkeypatch):
    """A server that loads through redline's checked loader (as every server redline launches does): each bucket is
    checksummed in the server's parameters as it loads, so no /weights_checker round trip follows, and the
    server ends up holding the trained weights."""
    payloads = Payloads()
    monkeypatch.setattr(payload_module, "serialize_payload", payloads.serialize)
    server = FakeSGLang(busy_flushes=0, payloads=payloads)
    with server:
        config = small_config(tmp_path, sft_steps="0", rollout_engine="sglang", sglang_server_urls=server.url,
                              offload_rollout="true", update_weight_buffer_size=str(BUCKET_BYTES))
        config = apply_overrides(config, materialize(config, tmp_path / "builtin"))
        state, _ = build(config, Console(quiet=True))
        server.loader_model = FakeSGLangModel(state.worker.model.export_hf())  # asked at the first push
        try:
            metrics = rl_step(state, 0)
        finally:
            state.loop.run_until_complete(state.engine.shutdown())
    plan = plan_for(state.worker.model.export_hf(), BUCKET_BYTES)
    samples = config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
    assert server.paths()[samples:] == ["/release_memory_occupation", "/resume_memory_occupation",
                                        *["/update_weights_from_tensor"] * len(plan.buckets), "/flush_cache",
                                        "/resume_memory_occupation"]
    assert state.engine.last_push_checked and state.engine.checksum_row_stride == 16
    held = dict(server.loader_model.named_parameters())
    for name, tensor in state.worker.model.export_hf():
        if name in held:  # the unfused ones; the fused ones are covered by the checksum
            assert torch.equal(held[name][:tensor.shape[0]], tensor), name
    assert "perf/check_weights_time" not in metrics and metrics["perf/sync_time"] > 0


@pytest.mark.parametrize("setting", ["default", "0", "no route"])
def test_redline_train_asks_the_servers_to_freeze_before_its_first_step(tmp_path, monkeypatch, capsys, setting):
    """The whole command on the stand-in server (which runs where SGLang cannot: no GPU, so the engine check is
    skipped): SGLang's processes freeze what they hold once the run is set up, as redline's own do."""
    from redline.loop import validate as validate_module
    from redline.loop.train import run

    monkeypatch.setattr(validate_module, "check_engine", lambda config: None)
    if setting == "0":
        monkeypatch.setenv("REDLINE_GC_FREEZE", "0")
    server = FakeSGLang(busy_flushes=0, freeze_gc=setting != "no route")
    loaded_as_sent(server, monkeypatch)
    with server:
        config = small_config(tmp_path, sft_steps="0", num_rollout="1", eval_interval="100",
                              rollout_engine="sglang", sglang_server_urls=server.url)
        assert run(config) == 0
    paths = server.paths()
    out = capsys.readouterr().out
    assert paths.count("/freeze_gc") == (0 if setting == "0" else 1)
    if setting == "default":
        assert paths.index("/freeze_gc") < paths.index("/generate")  # before the first step's rollout
    assert ("has no /freeze_gc" in out and server.url in out) == (setting == "no route")
