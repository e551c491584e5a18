"""redline's checked SGLang loader: buckets packed with their checksum (``CheckedPacker``), loaded by
``checked_load.load_bucket`` into a model laid out as SGLang's (``FakeSGLangModel``), the parameters read back
and compared — directly here, and through ``SGLangEngine.update_weights`` against the stand-in server. The
Triton checksum kernels run under the interpreter where the suite sets TRITON_INTERPRET=1, plain PyTorch
otherwise; the live test against SGLang on a GPU is in test_sglang_live.py."""

import asyncio

import pytest
import torch

from redline.rollout.sglang import payload as payload_module
from redline.rollout.sglang.checked_load import LOADER, decode_header, load_bucket
from redline.rollout.sglang.payload import CheckedPacker
from redline.rollout.sglang.weight_check import WeightsMismatch, engine_regions

from .fake_sglang import FakeSGLangModel, Payloads
from .test_sglang_weight_check import layer_tensors

URLS = ["http://a", "http://b"]


def bucket(dtype=torch.bfloat16, rows=300):
    """One layer's tensors (biases and all) plus a vocabulary parameter that SGLang pads, big enough to span
    several 8 KiB checksum rows."""
    g = torch.Generator().manual_seed(1)
    named = [(n, t.to(dtype)) for n, t in layer_tensors()]
    named += [("model.layers.0.mlp.down_proj.weight", torch.randn(rows, 64, generator=g).to(dtype)),
              ("model.embed_tokens.weight", torch.randn(100, 64, generator=g).to(dtype))]
    return named


@pytest.fixture
def payloads(monkeypatch):
    registry = Payloads()
    monkeypatch.setattr(payload_module, "serialize_payload", registry.serialize)
    return registry


def load(packer, payloads, named, model):
    """Pack ``named`` and load it on every server as SGLang would; each server has its own model."""
    for key, server_model in zip(packer.pack(named), model):
        load_bucket(server_model, payloads.get(key))


def test_engine_regions_place_fused_parts_after_the_parts_before_them():
    named = layer_tensors()
    regions = dict(zip([n for n, _ in named], engine_regions(named)))
    attn = "model.layers.0.self_attn."
    q, k = dict(named)[attn + "q_proj.weight"], dict(named)[attn + "k_proj.weight"]
    assert regions[attn + "q_proj.weight"] == (attn + "qkv_proj.weight", 0)
    assert regions[attn + "k_proj.weight"] == (attn + "qkv_proj.weight", q.numel() * 4)
    assert regions[attn + "v_proj.weight"] == (attn + "qkv_proj.weight", (q.numel() + k.numel()) * 4)
    assert regions[attn + "v_proj.bias"] == (attn + "qkv_proj.bias", 4 * 4)  # after q's 2 and k's 2 floats
    assert regions["model.layers.0.mlp.up_proj.weight"] == ("model.layers.0.mlp.gate_up_proj.weight", 6 * 4 * 4)
    assert regions["model.norm.weight"] == ("model.norm.weight", 0)
    without_q = [(n, t) for n, t in named if n != attn + "q_proj.weight"]
    with pytest.raises(ValueError, match=r"qkv_proj.weight: the bucket holding .*k_proj.weight lacks .*q_proj"):
        engine_regions(without_q)


@pytest.mark.parametrize("row_stride", [1, 16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_checked_bucket_loads_into_sglangs_layout_and_verifies(payloads, row_stride, backend, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("REDLINE_SYNC_COPY", backend)  # the packing and the read-back kernels both
    named = bucket()
    models = [FakeSGLangModel(named), FakeSGLangModel(named)]
    packer = CheckedPacker(torch.device("cpu"), row_stride, URLS)
    load(packer, payloads, named, models)
    packer.verify()
    params = dict(models[1].named_parameters())
    attn = "model.layers.0.self_attn."
    sent = dict(named)
    assert torch.equal(params[attn + "qkv_proj.weight"],
                       torch.cat([sent[attn + f"{p}_proj.weight"] for p in "qkv"]))
    embed = params["model.embed_tokens.weight"]
    assert embed.shape[0] == 128 and torch.equal(embed[:100], sent["model.embed_tokens.weight"])
    header = decode_header(payloads.get(packer.pack(named)[1])[0][0])
    nbytes = sum(t.numel() * 2 for _, t in named)
    assert header["row_stride"] == row_stride and header["nbytes"] == nbytes
    assert header["result"] == -(-nbytes // 8) * 8 + 32  # the second server's slot, after the first's


def test_a_tensor_the_server_did_not_load_fails_the_push_naming_server_and_bucket(payloads):
    named = bucket()
    stale = "model.layers.0.mlp.down_proj.weight"
    models = [FakeSGLangModel(named), FakeSGLangModel(named, skip={stale})]
    packer = CheckedPacker(torch.device("cpu"), 1, URLS)
    load(packer, payloads, [(n, t) for n, t in named], models)
    with pytest.raises(WeightsMismatch, match=r"http://b: bucket 0 \(12 tensors, .*\): the server's parameters "
                                              r"read back checksum"):
        packer.verify()


def test_a_sampled_check_catches_a_corrupted_counted_row(payloads):
    named = bucket(rows=4096)  # down_proj spans 64 rows of 8 KiB
    models = [FakeSGLangModel(named)]
    packer = CheckedPacker(torch.device("cpu"), 16, URLS[:1])
    [key] = packer.pack(named)
    [(header, flat)] = payloads.get(key)
    flat[0] ^= 1  # the first row is always counted (the packed checksum was taken before)
    load_bucket(models[0], [(header, flat)])
    with pytest.raises(WeightsMismatch, match="bucket 0"):
        packer.verify()


def test_a_parameter_the_server_lacks_is_named(payloads):
    named = bucket()
    model = FakeSGLangModel(named)
    del model.params["model.norm.weight"]
    model.skip = {"model.norm.weight"}
    packer = CheckedPacker(torch.device("cpu"), 1, URLS[:1])
    load(packer, payloads, named, [model])
    with pytest.raises(WeightsMismatch, match="could not be checked: model.norm.weight: the server has no "
                                              "parameter of that name"):
        packer.verify()


def test_a_failing_load_is_reported_not_raised_in_the_server(payloads):
    named = bucket()

    class Broken(FakeSGLangModel):
        def load_weights(self, named):
            raise KeyError("no such parameter in this model")

    packer = CheckedPacker(torch.device("cpu"), 1, URLS[:1])
    load(packer, payloads, named, [Broken(named)])  # returns: the server keeps serving
    with pytest.raises(WeightsMismatch, match="the loader failed"):
        packer.verify()


def test_a_payload_not_packed_by_redline_is_logged_and_left_alone(caplog):
    model = FakeSGLangModel(bucket())
    before = {n: p.clone() for n, p in model.named_parameters()}
    for named in ([("x", torch.zeros(4, dtype=torch.uint8))], [("x", torch.zeros(4, dtype=torch.uint8))] * 2):
        assert load_bucket(model, named) is None  # raised, it would stop the server's scheduler
    assert "not a redline bucket header" in caplog.text and "one (header, flat bucket) pair, got 2" in caplog.text
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_server_that_loads_a_copy_is_reported_as_unchecked_not_as_a_mismatch(payloads):
    named = bucket()
    packer = CheckedPacker(torch.device("cpu"), 1, URLS)
    keys = packer.pack(named)
    load_bucket(FakeSGLangModel(named), payloads.get(keys[0]))  # writes into the trainer's buffer
    load_bucket(FakeSGLangModel(named), [(h, f.clone()) for h, f in payloads.get(keys[1])])  # another GPU: a copy
    assert packer.verify() == ["http://b"]


def test_a_server_that_wrote_some_results_but_not_all_fails_the_push(payloads):
    named = bucket()
    packer = CheckedPacker(torch.device("cpu"), 1, URLS[:1])
    load(packer, payloads, named, [FakeSGLangModel(named)])
    packer.pack(named)  # bucket 1: never loaded
    with pytest.raises(WeightsMismatch, match=r"http://a: bucket 1 .* was not checked: the server wrote no result"):
        packer.verify()


def test_the_engine_checks_while_it_loads_and_skips_weights_checker(payloads):
    pytest.importorskip("aiohttp", reason="the SGLang client needs aiohttp")
    from redline.rollout.sglang.engine import SGLangEngine

    from .fake_sglang import FakeSGLang

    buckets = [bucket()[:7], bucket()[7:]]
    named = [t for b in buckets for t in b]
    for corrupt, ok in ((None, True), (1, False)):
        server = FakeSGLang(busy_flushes=0, loader_model=FakeSGLangModel(named), payloads=payloads,
                            corrupt_bucket=corrupt)
        with server:
            engine = SGLangEngine([server.url])  # attached: whether it loads checked is asked of the server

            async def push():
                try:
                    await engine.update_weights(buckets, "3")
                finally:
                    await engine.shutdown()

            if ok:
                asyncio.run(push())
            else:
                with pytest.raises(WeightsMismatch, match="bucket 1"):
                    asyncio.run(push())
        sent = [body for path, body in server.calls if path == "/update_weights_from_tensor"]
        assert [b["load_format"] for b in sent] == [LOADER, LOADER]
        assert engine.checked_loads and engine.last_push_checked is ok
        assert "/weights_checker" not in server.paths()
    params = dict(server.loader_model.named_parameters())
    assert torch.equal(params["model.layers.0.mlp.down_proj.weight"], dict(named)["model.layers.0.mlp.down_proj.weight"])


def test_servers_that_load_copies_leave_the_push_to_weights_checker(payloads, caplog):
    pytest.importorskip("aiohttp", reason="the SGLang client needs aiohttp")
    from redline.rollout.sglang.engine import SGLangEngine

    from .fake_sglang import FakeSGLang

    named = bucket()
    server = FakeSGLang(busy_flushes=0, loader_model=FakeSGLangModel(named), payloads=payloads, copies_payload=True)
    with server:
        engine = SGLangEngine([server.url])

        async def push():
            try:
                await engine.update_weights([named], "1")
            finally:
                await engine.shutdown()

        asyncio.run(push())
    assert not engine.last_push_checked  # the loop runs /weights_checker after such a push
    assert engine.checked_loads is False  # later pushes go as flattened buckets
    assert "wrote no checked-load results" in caplog.text
