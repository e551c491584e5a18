"""Live SGLang engines on a GPU (marked sglang + gpu): generation with log-probs, weight updates that change
the output, two-stage release/resume, two engines behind sglang-router.

The model is made on the spot (random Qwen3 weights, BPE tokenizer with a chat template); servers run without
CUDA graphs and with a small memory fraction so two fit on one GPU.
"""

import asyncio

import pytest
import torch
from redline.rollout.model_dir import make_model_dir
from redline.rollout.sglang.weight_check import WeightsMismatch
from redline.rollout.types import FinishReason, GenerateRequest, SamplingParams

pytestmark = [pytest.mark.sglang, pytest.mark.gpu, pytest.mark.slow]

SERVER_ARGS = ["--sglang-disable-cuda-graph", "--sglang-mem-fraction-static", "0.25"]
PROMPT = [10, 20, 30, 40, 50]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def live_model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("live-qwen3"), hidden_size=256, intermediate_size=512,
                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(live_model_dir, loop, tmp_path_factory):
    from redline.rollout.sglang.engine import SGLangEngine

    engine = SGLangEngine.launch(live_model_dir, sglang_args=SERVER_ARGS,
                                 log_dir=tmp_path_factory.mktemp("sglang-logs"))
    yield engine
    loop.run_until_complete(engine.shutdown())


def hf_weights(model_dir):
    from safetensors.torch import load_file

    return {k: v.cuda() for k, v in load_file(model_dir / "model.safetensors").items()}


def greedy(loop, engine, prompt=PROMPT):
    [res] = loop.run_until_complete(engine.generate([GenerateRequest(prompt, GREEDY)]))
    return res


def test_generate_returns_tokens_and_logprobs_matching_the_trainer(engine, loop, live_model_dir):
    from redline.trainer.models import from_pretrained

    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=1)
    [res] = loop.run_until_complete(engine.generate([GenerateRequest(PROMPT, params)]))
    assert len(res.output_ids) == len(res.logp) > 0
    assert res.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    trainer = from_pretrained(live_model_dir, dtype=torch.bfloat16, device="cuda")
    tokens = torch.tensor(PROMPT + res.output_ids, device="cuda")
    cu_seqlens = torch.tensor([0, tokens.numel()], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        logits = (trainer(tokens, cu_seqlens).float() @ trainer.lm_head_weight().float().t())
    expected = torch.log_softmax(logits, -1)[len(PROMPT) - 1:-1].gather(
        -1, torch.tensor(res.output_ids, device="cuda")[:, None])[:, 0]
    gap = (expected.cpu() - torch.tensor(res.logp)).abs()
    print(f"sglang vs trainer logp gap: max {gap.max():.4f} mean {gap.mean():.4f}")
    assert gap.mean() < 0.05  # bf16, two different kernel stacks; the printed numbers are the measurement


def test_weight_update_changes_output_and_restoring_brings_it_back(engine, loop, live_model_dir):
    weights = hf_weights(live_model_dir)
    before = greedy(loop, engine)
    flipped = [("lm_head.weight", torch.flip(weights["lm_head.weight"], dims=[0]).contiguous())]
    loop.run_until_complete(engine.update_weights([flipped], version="flipped"))
    assert engine.checked_loads and engine.last_push_checked  # checked by redline's loader inside the server
    changed = greedy(loop, engine)
    with pytest.raises(WeightsMismatch, match=r"1 parameter\(s\) differ.*lm_head\.weight"):
        loop.run_until_complete(engine.verify_weights(weights.items()))
    loop.run_until_complete(engine.update_weights([[("lm_head.weight", weights["lm_head.weight"])]], version="back"))
    restored = greedy(loop, engine)
    loop.run_until_complete(engine.verify_weights(weights.items()))  # every parameter, fused ones included
    assert changed.output_ids != before.output_ids and changed.weight_version == "flipped"
    assert restored.output_ids == before.output_ids and restored.weight_version == "back"


def test_a_tensor_the_server_cannot_place_fails_the_checked_push(engine, loop):
    """SGLang's loader drops a rotary buffer's name; the checked load finds no such parameter and says so."""
    bogus = [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(32, dtype=torch.bfloat16, device="cuda"))]
    with pytest.raises(WeightsMismatch, match="bucket 0 .* could not be checked"):
        loop.run_until_complete(engine.update_weights([bogus], version="bogus"))
    assert not engine.last_push_checked


def test_release_and_two_stage_resume_then_sync(engine, loop, live_model_dir):
    weights = hf_weights(live_model_dir)
    before = greedy(loop, engine)
    free_before = torch.cuda.mem_get_info()[0]
    loop.run_until_complete(engine.release_memory({"weights", "kv_cache"}))
    freed = torch.cuda.mem_get_info()[0] - free_before
    loop.run_until_complete(engine.resume_memory({"weights"}))
    loop.run_until_complete(engine.update_weights([list(weights.items())], version="resynced"))
    loop.run_until_complete(engine.resume_memory({"kv_cache"}))
    after = greedy(loop, engine)
    assert freed > 0
    assert after.output_ids == before.output_ids


def test_two_engines_behind_the_router(live_model_dir, tmp_path):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install 'redline[sglang]')")
    from redline.rollout.sglang.engine import SGLangEngine

    async def scenario():
        engine = SGLangEngine.launch(live_model_dir, num_engines=2, base_gpu_ids=[0, 0], use_router=True,
                                     sglang_args=SERVER_ARGS, log_dir=tmp_path)
        try:
            requests = [GenerateRequest(PROMPT, GREEDY) for _ in range(8)]
            return engine.router is not None, await engine.generate(requests), await engine.health()
        finally:
            await engine.shutdown()
    routed, results, healthy = asyncio.run(scenario())
    assert routed and healthy
    assert len({tuple(r.output_ids) for r in results}) == 1  # same weights behind both: same greedy output


@pytest.mark.multigpu
def test_disaggregated_broadcast_into_a_server_on_another_gpu(live_model_dir, tmp_path):
    """``--no-colocate``'s push: the trainer on cuda:0 broadcasts the plan's buckets over NCCL to a server on
    cuda:1, announcing each with /update_weights_from_distributed; the server then holds the trainer's weights
    (its hashes are compared) and generates with them."""
    from redline.loop.weight_sync import BroadcastWeightSync
    from redline.rollout.sglang.engine import SGLangEngine
    from redline.trainer.models import from_pretrained

    model = from_pretrained(live_model_dir, dtype=torch.bfloat16, device="cuda:0")
    with torch.no_grad():
        model.lm_head_weight().copy_(torch.flip(model.lm_head_weight(), dims=[0]))

    async def scenario():
        engine = SGLangEngine.launch(live_model_dir, base_gpu_ids=[1], sglang_args=SERVER_ARGS, log_dir=tmp_path)
        sync = BroadcastWeightSync(model, [engine], bucket_bytes=2**20, device=torch.device("cuda:0"), timeout_s=120,
                                   verify=True)
        try:
            before = (await engine.generate([GenerateRequest(PROMPT, GREEDY)]))[0]
            await sync.connect()
            for version in ("1", "2"):  # the second push reuses the group and the sender's slots
                await sync.push(version)  # ends with the hash comparison: raises WeightsMismatch on a difference
            after = (await engine.generate([GenerateRequest(PROMPT, GREEDY)]))[0]
            await sync.close()
            return len(sync.plan.buckets), before, after
        finally:
            await engine.shutdown()

    buckets, before, after = asyncio.run(scenario())
    assert buckets > 2
    assert after.output_ids != before.output_ids and after.weight_version == "2"
