"""The embedded engine in its own process: same outputs as in-process, weight loads cross the process
boundary, errors come back to the caller."""

import asyncio

import pytest
import torch
from redline.rollout.embedded.engine import EmbeddedEngine
from redline.rollout.embedded.process import EmbeddedEngineProcess
from redline.rollout.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow  # starts a spawned Python process (a few seconds)


def test_process_engine_generates_loads_weights_and_reports_errors(model_dir, tokenizer):
    request = GenerateRequest(tokenizer.encode("What is 2 + 3?"), SamplingParams(temperature=0.0, max_new_tokens=8))

    async def in_process():
        engine = EmbeddedEngine.from_pretrained(model_dir, dtype=torch.float32, max_batch_size=2, max_seq_len=64)
        try:
            return (await engine.generate([request]))[0], engine.model.lm_head_weight().clone()
        finally:
            await engine.shutdown()
    expected, head = asyncio.run(in_process())

    async def in_child():
        engine = EmbeddedEngineProcess(model_dir, dtype=torch.float32, max_batch_size=2, max_seq_len=64)
        try:
            [before] = await engine.generate([request])
            await engine.update_weights([[("lm_head.weight", torch.flip(head, dims=[0]))]], version="v1")
            [after] = await engine.generate([request])
            with pytest.raises(KeyError, match="model.bogus"):
                await engine.load_weights([("model.bogus", torch.zeros(1))])
            healthy = await engine.health()
            return before, after, healthy
        finally:
            await engine.shutdown()
    before, after, healthy = asyncio.run(in_child())
    assert before.output_ids == expected.output_ids and before.logp == expected.logp
    assert after.weight_version == "v1" and after.output_ids != before.output_ids
    assert healthy


def test_an_engine_taking_weights_from_elsewhere_serves_its_sync_on_a_socket(model_dir, tokenizer):
    """``weights_from_elsewhere`` (a trainer rank beside the Ray actor hosting the engine): the colocated sync
    connects to the engine's ``weight_address``; the process's own ``weight_sender`` is refused."""
    from redline.rollout.embedded.process import weight_sender_at
    from redline.sync.plan import plan_for

    request = GenerateRequest(tokenizer.encode("What is 2 + 3?"), SamplingParams(temperature=0.0, max_new_tokens=8))

    async def scenario():
        engine = EmbeddedEngineProcess(model_dir, dtype=torch.float32, max_batch_size=2, max_seq_len=64,
                                       weights_from_elsewhere=True)
        try:
            [before] = await engine.generate([request])
            [(name, head)] = [(n, t) for n, t in await engine.export_weights() if n == "lm_head.weight"]
            flipped = [(name, torch.flip(head, dims=[0]))]
            with pytest.raises(RuntimeError, match="weight_sender_at"):
                engine.weight_sender(plan_for(flipped), "cpu")
            sender = weight_sender_at(engine.weight_address, plan_for(flipped), "cpu", alive=engine.running)
            try:
                sender.sync(flipped, version="v1")  # published by the engine's loader as the sync ends
            finally:
                sender.close()
            [after] = await engine.generate([request])
            [(_, loaded)] = [(n, t) for n, t in await engine.export_weights() if n == "lm_head.weight"]
            return before, after, loaded, flipped[0][1]
        finally:
            await engine.shutdown()

    before, after, loaded, sent = asyncio.run(scenario())
    assert after.weight_version == "v1" and after.output_ids != before.output_ids
    assert torch.equal(loaded, sent)
