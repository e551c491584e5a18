"""Checking an SGLang server's weights: HF tensors fused into SGLang's layout, hashed, compared with what
``/weights_checker`` reports (a stand-in server here; the live check runs in test_sglang_live.py)."""

import hashlib
import time

import pytest
import torch

pytest.importorskip("aiohttp", reason="the SGLang client needs aiohttp")

from redline.rollout.sglang.engine import SGLangEngine
from redline.rollout.sglang.weight_check import (
    WeightsMismatch,
    expected_checksums,
    sglang_parameters,
)

from .engine_runner import run
from .fake_sglang import FakeSGLang


def byte_hash(t: torch.Tensor) -> int:
    return int.from_bytes(hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).digest()[:8], "big")


def layer_tensors():
    g = torch.Generator().manual_seed(0)
    names = ["q_proj", "k_proj", "v_proj", "o_proj"]
    named = [(f"model.layers.0.self_attn.{n}.weight", torch.randn(4 if n in ("q_proj", "o_proj") else 2, 4,
                                                                   generator=g)) for n in names]
    named += [(f"model.layers.0.self_attn.{n}.bias", torch.randn(2, generator=g)) for n in ("k_proj", "q_proj",
                                                                                           "v_proj")]
    named += [(f"model.layers.0.mlp.{n}.weight", torch.randn(6, 4, generator=g)) for n in ("up_proj", "gate_proj")]
    named += [("model.norm.weight", torch.randn(4, generator=g))]
    return named


def test_parts_are_fused_in_sglang_order_whatever_order_they_arrive_in():
    named = dict(layer_tensors())
    params = dict(sglang_parameters(named.items()))
    prefix = "model.layers.0."
    assert set(params) == {prefix + "self_attn.qkv_proj.weight", prefix + "self_attn.qkv_proj.bias",
                           prefix + "self_attn.o_proj.weight", prefix + "mlp.gate_up_proj.weight",
                           "model.norm.weight"}
    attn = prefix + "self_attn."
    assert torch.equal(params[attn + "qkv_proj.weight"], torch.cat([named[attn + f"{n}.weight"]
                                                                    for n in ("q_proj", "k_proj", "v_proj")]))
    assert torch.equal(params[attn + "qkv_proj.bias"], torch.cat([named[attn + f"{n}.bias"]
                                                                  for n in ("q_proj", "k_proj", "v_proj")]))
    assert torch.equal(params[prefix + "mlp.gate_up_proj.weight"],
                       torch.cat([named[prefix + "mlp.gate_proj.weight"], named[prefix + "mlp.up_proj.weight"]]))
    assert params["model.norm.weight"] is named["model.norm.weight"]


def test_each_fused_parameter_is_made_as_its_last_part_arrives():
    """Streamed: a whole model's check holds one fused copy at a time."""
    consumed = []

    def arriving():
        for name, tensor in layer_tensors():
            consumed.append(name)
            yield name, tensor

    made_after = {name: consumed[-1] for name, _ in sglang_parameters(arriving())}
    prefix = "model.layers.0."
    assert made_after[prefix + "self_attn.qkv_proj.weight"] == prefix + "self_attn.v_proj.weight"
    assert made_after[prefix + "mlp.gate_up_proj.weight"] == prefix + "mlp.gate_proj.weight"  # up arrived first


def test_the_embedding_and_lm_head_are_hashed_with_sglangs_zero_padded_vocabulary_rows():
    """SGLang pads their rows to a multiple of 64 and zero-fills the padding (a 485-token test tokenizer's model
    failed the live check without it); other parameters and padded-already vocabularies pass through."""
    embed, head, other = torch.randn(485, 8), torch.randn(512, 8), torch.randn(485, 8)
    params = dict(sglang_parameters([("model.embed_tokens.weight", embed), ("lm_head.weight", head),
                                     ("model.layers.0.mlp.down_proj.weight", other)]))
    assert params["model.embed_tokens.weight"].shape == (512, 8)
    assert torch.equal(params["model.embed_tokens.weight"][:485], embed)
    assert not params["model.embed_tokens.weight"][485:].any()
    assert params["lm_head.weight"] is head and params["model.layers.0.mlp.down_proj.weight"] is other


def test_a_fused_parameter_missing_a_part_is_named():
    named = [(n, t) for n, t in layer_tensors() if n != "model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"mlp\.gate_up_proj\.weight.*'up_proj'"):
        dict(sglang_parameters(named))


def verify(server, named):
    return run(SGLangEngine([server.url]), lambda e: e.verify_weights(named, hash_fn=byte_hash))


def test_verify_passes_when_the_server_reports_the_sent_tensors_and_ignores_its_buffers():
    named = layer_tensors()
    with FakeSGLang() as server:
        server.checksums = {**expected_checksums(named, byte_hash), "model.rotary_emb.cos_sin_cache": "00"}
        verify(server, named)
    assert server.paths() == ["/weights_checker"]


def test_verify_names_a_parameter_that_differs_or_is_missing():
    named = layer_tensors()
    expected = expected_checksums(named, byte_hash)
    with FakeSGLang() as server:
        server.checksums = {**expected, "model.layers.0.self_attn.qkv_proj.weight": "0" * 16}
        with pytest.raises(WeightsMismatch, match=r"1 parameter\(s\) differ.*qkv_proj\.weight.*0 not reported"):
            verify(server, named)
        server.checksums = {n: h for n, h in expected.items() if n != "model.norm.weight"}
        with pytest.raises(WeightsMismatch, match=r"0 parameter\(s\) differ.*1 not reported \['model\.norm"):
            verify(server, named)


def test_the_expected_hashes_are_computed_while_the_server_hashes_its_own():
    """The request leaves first: the hash function here waits until the server has been asked (it would wait in
    vain, and fail, if the expected hashes came first)."""
    named = layer_tensors()

    with FakeSGLang() as server:
        def hash_once_the_server_was_asked(tensor):
            deadline = time.monotonic() + 10
            while "/weights_checker" not in server.paths():
                assert time.monotonic() < deadline, "the server was not asked while the expected hashes were made"
                time.sleep(0.005)
            return byte_hash(tensor)

        server.checksums = expected_checksums(named, byte_hash)
        run(SGLangEngine([server.url]), lambda e: e.verify_weights(named, hash_fn=hash_once_the_server_was_asked))


def test_the_engine_counts_the_seconds_it_waits_on_the_servers_control_answers():
    with FakeSGLang(control_delay=0.05) as server:
        engine = SGLangEngine([server.url])
        run(engine, lambda e: e.release_memory({"kv_cache"}))
        assert 0.05 <= engine.handling_seconds < 1.0
        run(engine, lambda e: e.resume_memory({"weights", "kv_cache"}))  # two requests, one after the other
        assert 0.15 <= engine.handling_seconds < 2.0


def test_verify_refuses_tensor_parallel_servers():
    with FakeSGLang() as server, pytest.raises(ValueError, match="tp_size=2"):
        run(SGLangEngine([server.url], tp_size=2), lambda e: e.verify_weights(layer_tensors()))
