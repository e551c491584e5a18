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
