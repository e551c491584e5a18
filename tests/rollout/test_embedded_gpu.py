"""The embedded engine on a GPU (marked gpu): the CUDA-graph decode step agrees with eager decoding, and
bf16 log-probs stay close to the trainer's forward."""

import asyncio

import pytest
import torch
from redline.rollout.embedded.engine import EmbeddedEngine
from redline.rollout.types import GenerateRequest, SamplingParams
from redline.trainer.models import from_pretrained

pytestmark = pytest.mark.gpu

PROMPTS = [[10, 20, 30], [5, 6, 7, 8, 9, 10, 11], [42]]


def generate(model_dir, params, **kwargs):
    async def main():
        engine = EmbeddedEngine.from_pretrained(model_dir, dtype=torch.bfloat16, device="cuda", max_batch_size=4,
                                                max_seq_len=128, **kwargs)
        try:
            return await engine.generate([GenerateRequest(p, params) for p in PROMPTS])
        finally:
            await engine.shutdown()
    return asyncio.run(main())


def test_cuda_graph_decode_matches_eager(model_dir, cuda):
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    graphed = generate(model_dir, params, cuda_graph=True)
    eager = generate(model_dir, params, cuda_graph=False)
    for g, e in zip(graphed, eager):
        assert g.output_ids == e.output_ids
        torch.testing.assert_close(torch.tensor(g.logp), torch.tensor(e.logp), atol=1e-5, rtol=0)


def test_bf16_logp_close_to_trainer_forward(model_dir, cuda):
    params = SamplingParams(temperature=0.8, max_new_tokens=20, seed=0)
    results = generate(model_dir, params)
    trainer = from_pretrained(model_dir, dtype=torch.bfloat16, device="cuda")
    gaps = []
    for prompt, res in zip(PROMPTS, results):
        tokens = torch.tensor(prompt + res.output_ids, device="cuda")
        cu_seqlens = torch.tensor([0, tokens.numel()], dtype=torch.int32, device="cuda")
        with torch.no_grad():
            logits = trainer(tokens, cu_seqlens).float() @ trainer.lm_head_weight().float().t()
        logp = torch.log_softmax(logits / 0.8, -1)[len(prompt) - 1:-1]
        expected = logp.gather(-1, torch.tensor(res.output_ids, device="cuda")[:, None])[:, 0].cpu()
        gaps.append((expected - torch.tensor(res.logp)).abs())
    gap = torch.cat(gaps)
    print(f"embedded vs trainer bf16 logp gap: max {gap.max():.5f} mean {gap.mean():.5f}")
    # Cached decoding and the packed forward round differently in bf16, and this model's logits are large on
    # purpose (peaked test model), which amplifies that; on CPU the same check gives max 0.10 / mean 0.019.
    # bench_generate records the gap at a realistic Qwen3-0.6B shape.
    assert gap.mean() < 0.05
