"""Generation throughput at a Qwen3-0.6B shape (random weights): transformers' ``generate`` (baseline), the
embedded engine (static KV cache, CUDA-graph decode) and SGLang when installed, in the same run.

Workload: BATCH prompts of PROMPT_LEN random tokens, NEW_TOKENS sampled tokens each (temperature 1, no EOS in
the config, so every row generates exactly NEW_TOKENS). tokens/s = BATCH * NEW_TOKENS / median time, recorded
in ``extra_info["tokens_per_s"]``. The embedded run also records its bf16 log-prob gap to the trainer's forward.
Target (issue 5): embedded >= 5x transformers' generate.
"""

import asyncio

import pytest
import torch

from redline.rollout.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.gpu

BATCH, PROMPT_LEN, NEW_TOKENS = 64, 128, 256
GROUP = f"generate B={BATCH} prompt={PROMPT_LEN} new={NEW_TOKENS} Qwen3-0.6B shape bf16"
QWEN3_0_6B = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "max_position_embeddings": 40960, "rope_theta": 1_000_000.0, "tie_word_embeddings": True,
              "eos_token_id": None, "bos_token_id": None, "pad_token_id": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from redline.rollout.model_dir import train_tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("qwen3-0.6b-shape")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B)).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    train_tokenizer().save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, QWEN3_0_6B["vocab_size"], (BATCH, PROMPT_LEN), generator=g)


def record_throughput(benchmark):
    benchmark.extra_info["tokens_per_s"] = BATCH * NEW_TOKENS / benchmark.stats.stats.median


def test_transformers_generate(gpu_bench, benchmark, model_dir, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = prompts.cuda()

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                  do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    out = gpu_bench(run, group=GROUP, provider="transformers generate", baseline=True, rounds=3, warmup=1,
                    batch=BATCH, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS)
    assert out.shape == (BATCH, PROMPT_LEN + NEW_TOKENS)
    record_throughput(benchmark)


def test_embedded_engine(gpu_bench, benchmark, model_dir, prompts):
    from redline.rollout.embedded.engine import EmbeddedEngine

    loop = asyncio.new_event_loop()
    engine = EmbeddedEngine.from_pretrained(model_dir, dtype=torch.bfloat16, device="cuda", max_batch_size=BATCH,
                                            max_seq_len=PROMPT_LEN + NEW_TOKENS, eos_token_ids=())
    requests = sampling_requests(prompts)
    try:
        results = time_generation(gpu_bench, benchmark, loop, engine, requests, "redline embedded engine")
        benchmark.extra_info.update(logp_gap_vs_trainer(engine.model, requests[:8], results[:8]))
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()


def sampling_requests(prompts) -> list:
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
    return [GenerateRequest(p.tolist(), params) for p in prompts]


def time_generation(gpu_bench, benchmark, loop, engine, requests, provider: str) -> list:
    """Time ``engine.generate(requests)`` on ``loop``; every response must run the full NEW_TOKENS."""
    results = gpu_bench(lambda: loop.run_until_complete(engine.generate(requests)), group=GROUP, provider=provider,
                        rounds=3, warmup=1, batch=BATCH, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS)
    assert all(len(r.output_ids) == NEW_TOKENS for r in results)
    record_throughput(benchmark)
    return results


def logp_gap_vs_trainer(model, requests, results) -> dict:
    """Max / mean |engine logp - trainer forward logp| over the sampled tokens (same weights, bf16)."""
    gaps = []
    with torch.no_grad():
        for req, res in zip(requests, results):
            tokens = torch.tensor(req.input_ids + res.output_ids, device="cuda")
            cu_seqlens = torch.tensor([0, tokens.numel()], dtype=torch.int32, device="cuda")
            hidden = model(tokens, cu_seqlens)[len(req.input_ids) - 1:-1]
            logits = torch.mm(hidden, model.lm_head_weight().t(), out_dtype=torch.float32)
            expected = torch.log_softmax(logits, -1).gather(-1, tokens[len(req.input_ids):, None])[:, 0]
            gaps.append((expected.cpu() - torch.tensor(res.logp)).abs())
    gap = torch.cat(gaps)
    return {"logp_gap_max": gap.max().item(), "logp_gap_mean": gap.mean().item()}


@pytest.mark.sglang
def test_sglang(gpu_bench, benchmark, model_dir, prompts, tmp_path):
    from redline.rollout.sglang.engine import SGLangEngine

    loop = asyncio.new_event_loop()
    engine = SGLangEngine.launch(model_dir, log_dir=tmp_path, sglang_args=[
        "--skip-tokenizer-init", "--mem-fraction-static", "0.6", "--max-running-requests", str(BATCH)])
    requests = sampling_requests(prompts)
    try:
        time_generation(gpu_bench, benchmark, loop, engine, requests, "sglang (HTTP, CUDA graphs)")
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
