"""The embedded engine: generation equals transformers' on the same checkpoint, log-probs equal the trainer's
forward, stops, seeds, continuous batching, pause, weight updates and memory release."""

import asyncio

import pytest
import torch
from redline.rollout.embedded.engine import EmbeddedEngine, EngineMemoryReleased
from redline.rollout.engine import Engine
from redline.rollout.types import FinishReason, GenerateRequest, SamplingParams
from redline.trainer.models import from_pretrained
from .engine_runner import run
from transformers import AutoModelForCausalLM

PROMPTS = ["What is 2 + 3?", "Solve", "The quick brown fox jumps over", "x"]


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()



def make_engine(model_dir, **kwargs):
    kwargs.setdefault("max_batch_size", 4)
    kwargs.setdefault("max_seq_len", 64)
    return EmbeddedEngine.from_pretrained(model_dir, dtype=torch.float32, **kwargs)


def requests(tokenizer, params, prompts=PROMPTS):
    return [GenerateRequest(tokenizer.encode(p), params) for p in prompts]


def test_implements_the_engine_protocol(model_dir):
    engine = make_engine(model_dir)
    assert isinstance(engine, Engine)
    assert run(engine, lambda e: e.health())


def test_greedy_generation_matches_transformers(model_dir, hf_model):
    engine = make_engine(model_dir)
    reqs = requests(engine.tokenizer, SamplingParams(temperature=0.0, max_new_tokens=10))
    results = run(engine, lambda e: e.generate(reqs))
    for req, res in zip(reqs, results):
        ids = torch.tensor([req.input_ids])
        expected = hf_model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)[0, ids.shape[1]:]
        assert res.output_ids == expected.tolist()


def test_logp_equals_trainer_forward_at_temperature(model_dir):
    engine = make_engine(model_dir)
    reqs = requests(engine.tokenizer, SamplingParams(temperature=0.7, max_new_tokens=12, seed=0))
    results = run(engine, lambda e: e.generate(reqs))
    trainer = from_pretrained(model_dir, dtype=torch.float32)
    sequences = [r.input_ids + res.output_ids for r, res in zip(reqs, results)]
    lengths = torch.tensor([len(s) for s in sequences])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    with torch.no_grad():
        hidden = trainer(torch.tensor([t for s in sequences for t in s]), cu_seqlens)
        logp_all = torch.log_softmax(hidden @ trainer.lm_head_weight().t() / 0.7, dim=-1)
    for i, (req, res) in enumerate(zip(reqs, results)):
        start = int(cu_seqlens[i]) + len(req.input_ids) - 1  # the position that predicts the first output
        rows = torch.arange(start, start + len(res.output_ids))
        expected = logp_all[rows, torch.tensor(res.output_ids)]
        torch.testing.assert_close(torch.tensor(res.logp), expected, atol=1e-5, rtol=0)


def test_max_new_tokens_ends_with_length(model_dir):
    engine = make_engine(model_dir)
    [res] = run(engine, lambda e: e.generate(requests(e.tokenizer, SamplingParams(max_new_tokens=5), PROMPTS[:1])))
    assert len(res.output_ids) == 5 and res.finish_reason == FinishReason.LENGTH


def test_zero_new_tokens_returns_empty(model_dir):
    engine = make_engine(model_dir)
    [res] = run(engine, lambda e: e.generate(requests(e.tokenizer, SamplingParams(max_new_tokens=0), PROMPTS[:1])))
    assert res.output_ids == [] and res.finish_reason == FinishReason.LENGTH


def greedy(engine, prompt, **params):
    params = SamplingParams(temperature=0.0, **{"max_new_tokens": 12, **params})
    return engine.generate([GenerateRequest(engine.tokenizer.encode(prompt), params)])


def test_stop_token_id_ends_response_at_first_occurrence(model_dir):
    async def check(engine):
        [free] = await greedy(engine, PROMPTS[0])
        stop_id = free.output_ids[3]
        [stopped] = await greedy(engine, PROMPTS[0], stop_token_ids=[stop_id])
        return free, stop_id, stopped
    free, stop_id, stopped = run(make_engine(model_dir), check)
    first = free.output_ids.index(stop_id)
    assert stopped.output_ids == free.output_ids[:first + 1]
    assert stopped.finish_reason == FinishReason.STOP


def test_eos_ends_response(model_dir):
    async def check(engine):
        [free] = await greedy(engine, PROMPTS[2])
        engine.eos_token_ids = frozenset({free.output_ids[2]})
        [stopped] = await greedy(engine, PROMPTS[2])
        return free, stopped
    free, stopped = run(make_engine(model_dir), check)
    assert stopped.output_ids == free.output_ids[:free.output_ids.index(free.output_ids[2]) + 1]
    assert stopped.finish_reason == FinishReason.STOP


def test_stop_string_ends_response_once_it_appears(model_dir):
    async def check(engine):
        [free] = await greedy(engine, PROMPTS[2])
        text = engine.tokenizer.decode(free.output_ids)
        stop = text[len(text) // 2:len(text) // 2 + 2]
        [stopped] = await greedy(engine, PROMPTS[2], stop=[stop])
        return free, stop, stopped
    free, stop, stopped = run(make_engine(model_dir), check)
    tok = make_engine(model_dir).tokenizer
    decoded = tok.decode(stopped.output_ids)
    assert stop in decoded and stop not in tok.decode(stopped.output_ids[:-1])
    assert stopped.output_ids == free.output_ids[:len(stopped.output_ids)]
    assert stopped.finish_reason == FinishReason.STOP


def test_same_seed_reproduces_and_different_seeds_differ(model_dir):
    async def draw(engine):
        params = [SamplingParams(temperature=1.5, max_new_tokens=16, seed=s) for s in (7, 7, 8)]
        ids = engine.tokenizer.encode(PROMPTS[1])
        return await engine.generate([GenerateRequest(ids, p) for p in params])
    a, b, c = run(make_engine(model_dir), draw)
    assert a.output_ids == b.output_ids and a.logp == b.logp
    assert a.output_ids != c.output_ids


def test_more_requests_than_rows_all_complete_like_alone(model_dir):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts = PROMPTS * 3  # 12 requests through 2 rows
    batched = run(make_engine(model_dir, max_batch_size=2), lambda e: e.generate(requests(e.tokenizer, params,
                                                                                          prompts)))
    alone = [run(make_engine(model_dir, max_batch_size=1),
                 lambda e, p=p: e.generate(requests(e.tokenizer, params, [p])))[0] for p in PROMPTS]
    assert [r.output_ids for r in batched] == [a.output_ids for a in alone] * 3


def test_context_limit_ends_with_length(model_dir):
    engine = make_engine(model_dir, max_seq_len=12)
    [res] = run(engine, lambda e: e.generate(requests(e.tokenizer, SamplingParams(max_new_tokens=50), ["x"])))
    assert len(engine.tokenizer.encode("x")) + len(res.output_ids) == 12
    assert res.finish_reason == FinishReason.LENGTH


def test_prompt_longer_than_cache_rejected(model_dir):
    engine = make_engine(model_dir, max_seq_len=4)
    with pytest.raises(ValueError, match="request 0: prompt of .* leaves no room in max_seq_len=4"):
        run(engine, lambda e: e.generate(requests(e.tokenizer, SamplingParams(), [PROMPTS[2]])))


def test_pause_aborts_running_requests_and_resume_serves_again(model_dir):
    async def scenario(engine):
        # ignore_eos: the random model may draw EOS before the pause, and the request must still run then
        long = GenerateRequest(engine.tokenizer.encode(PROMPTS[0]), SamplingParams(max_new_tokens=10_000,
                                                                                  ignore_eos=True))
        task = asyncio.create_task(engine.generate([long]))
        while not any(engine._slots):
            await asyncio.sleep(0.01)
        await engine.pause()
        [aborted] = await task
        await engine.resume()
        [after] = await engine.generate([GenerateRequest(long.input_ids, SamplingParams(max_new_tokens=3))])
        return aborted, after
    aborted, after = run(make_engine(model_dir, max_seq_len=20_000), scenario)
    assert aborted.finish_reason == FinishReason.ABORT
    assert 0 < len(aborted.output_ids) < 10_000 and len(aborted.logp) == len(aborted.output_ids)
    assert len(after.output_ids) == 3


def test_update_weights_changes_output_and_version(model_dir):
    async def scenario(engine):
        [before] = await greedy(engine, PROMPTS[0])
        weight = engine.model.lm_head_weight()
        await engine.update_weights([[("lm_head.weight", torch.flip(weight, dims=[0]))]], version="v2")
        [after] = await greedy(engine, PROMPTS[0])
        return before, after
    before, after = run(make_engine(model_dir), scenario)
    assert before.weight_version == "0" and after.weight_version == "v2"
    assert after.output_ids != before.output_ids


def test_fused_qkv_slices_load_by_hf_name(model_dir):
    engine = make_engine(model_dir)
    k = torch.full_like(engine.weights.slices["model.layers.0.self_attn.k_proj.weight"][0].narrow(
        0, *engine.weights.slices["model.layers.0.self_attn.k_proj.weight"][1:]), 0.5)
    run(engine, lambda e: e.update_weights([[("model.layers.0.self_attn.k_proj.weight", k)]], version="1"))
    reference = from_pretrained(model_dir, dtype=torch.float32)
    qkv, ref_qkv = engine.model.layers["0"].self_attn.qkv.weight, reference.layers["0"].self_attn.qkv.weight
    q_dim, kv_dim = engine.model.spec.q_dim, engine.model.spec.kv_dim
    torch.testing.assert_close(qkv[q_dim:q_dim + kv_dim], k)
    torch.testing.assert_close(qkv[:q_dim], ref_qkv[:q_dim])
    torch.testing.assert_close(qkv[q_dim + kv_dim:], ref_qkv[q_dim + kv_dim:])


def test_unknown_weight_name_rejected(model_dir):
    engine = make_engine(model_dir)
    with pytest.raises(KeyError, match="no parameter for HF tensor 'model.bogus'"):
        run(engine, lambda e: e.update_weights([[("model.bogus", torch.zeros(1))]], version="1"))


def test_release_then_resume_and_reload_restores_generation(model_dir):
    async def scenario(engine):
        [before] = await greedy(engine, PROMPTS[0])
        saved = [(n, t.clone()) for n, t in _hf_named(engine)]
        await engine.release_memory({"weights", "kv_cache"})
        with pytest.raises(EngineMemoryReleased):
            await greedy(engine, PROMPTS[0])
        await engine.resume_memory({"weights"})
        await engine.update_weights([saved], version="1")
        await engine.resume_memory({"kv_cache"})
        [after] = await greedy(engine, PROMPTS[0])
        return before, after
    before, after = run(make_engine(model_dir), scenario)
    assert after.output_ids == before.output_ids


def test_resumed_weights_are_allocated_by_the_loads_that_write_them(model_dir):
    """resume_memory({"weights"}) alone allocates nothing: each bucket's load allocates its own parameters (so a
    sync overlaps allocation with copies); what no load claimed is allocated before the KV cache."""
    def param_bytes(engine):
        return {n: p.untyped_storage().nbytes() for n, p in engine.model.named_parameters()}

    async def scenario(engine):
        [before] = await greedy(engine, PROMPTS[0])
        saved = [(n, t.clone()) for n, t in _hf_named(engine)]
        full = param_bytes(engine)
        await engine.release_memory({"weights", "kv_cache"})
        await engine.resume_memory({"weights"})
        resumed = param_bytes(engine)
        layer0 = [(n, t) for n, t in saved if n.startswith("model.layers.0.")]
        await engine.update_weights([layer0], version="1")
        after_layer0 = param_bytes(engine)
        await engine.resume_memory({"kv_cache"})
        after_cache = param_bytes(engine)
        await engine.update_weights([saved], version="2")
        [after] = await greedy(engine, PROMPTS[0])
        return before, after, full, resumed, after_layer0, after_cache

    before, after, full, resumed, after_layer0, after_cache = run(make_engine(model_dir), scenario)
    assert set(resumed.values()) == {0}
    assert {n for n, b in after_layer0.items() if b} == {n for n in full if n.startswith("layers.0.")}
    assert after_layer0["layers.0.self_attn.qkv.weight"] == full["layers.0.self_attn.qkv.weight"]
    assert after_cache == full
    assert after.output_ids == before.output_ids


def test_flat_weights_release_and_resume_as_one_storage_and_restore_generation(model_dir):
    """flat_weights: the parameters share one storage, generation is unchanged by the flattening, a release frees
    that storage, the first load of a sync brings all of it back, and reloading restores generation."""
    def storages(engine):
        return {p.untyped_storage().data_ptr() for p in engine.model.parameters()}

    async def scenario(engine):
        [before] = await greedy(engine, PROMPTS[0])
        saved = [(n, t.clone()) for n, t in _hf_named(engine)]
        shared = len(storages(engine))
        await engine.release_memory({"weights", "kv_cache"})
        released = {p.untyped_storage().nbytes() for p in engine.model.parameters()}
        await engine.resume_memory({"weights"})
        await engine.update_weights([saved[:1]], version="1")  # one tensor's load resumes the whole storage
        resumed = {p.untyped_storage().nbytes() for p in engine.model.parameters()}
        await engine.update_weights([saved], version="2")
        await engine.resume_memory({"kv_cache"})
        [after] = await greedy(engine, PROMPTS[0])
        return before, after, shared, released, resumed, len(storages(engine))

    [unflat] = run(make_engine(model_dir), lambda e: greedy(e, PROMPTS[0]))
    before, after, shared, released, resumed, shared_after = run(make_engine(model_dir, flat_weights=True), scenario)
    assert before.output_ids == unflat.output_ids
    assert shared == shared_after == 1 and released == {0} and len(resumed) == 1 and 0 not in resumed
    assert after.output_ids == before.output_ids


def _hf_named(engine):
    for name, (tensor, offset, size) in engine.weights.slices.items():
        yield name, tensor.narrow(0, offset, size)


def test_unknown_memory_tag_rejected(model_dir):
    with pytest.raises(ValueError, match=r"unknown memory tags \['cuda_graphs'\]"):
        run(make_engine(model_dir), lambda e: e.release_memory({"cuda_graphs"}))


def test_pause_aborts_queued_requests_and_rejects_new_ones_until_resume(model_dir):
    async def scenario(engine):
        ids = engine.tokenizer.encode(PROMPTS[0])
        # 2 rows: 1 queued; ignore_eos: none may end on its own before the pause (a random model draws EOS)
        long = [GenerateRequest(ids, SamplingParams(max_new_tokens=10_000, ignore_eos=True)) for _ in range(3)]
        task = asyncio.create_task(engine.generate(long))
        while sum(job is not None for job in engine._slots) < 2:
            await asyncio.sleep(0.01)
        await engine.pause()
        aborted = await task
        [while_paused] = await engine.generate([GenerateRequest(ids, SamplingParams(max_new_tokens=3))])
        await engine.resume()
        [after] = await engine.generate([GenerateRequest(ids, SamplingParams(max_new_tokens=3))])
        return aborted, while_paused, after
    aborted, while_paused, after = run(make_engine(model_dir, max_batch_size=2, max_seq_len=20_000), scenario)
    assert [r.finish_reason for r in aborted] == [FinishReason.ABORT] * 3
    assert [len(r.output_ids) > 0 for r in aborted] == [True, True, False]  # the queued one never ran
    assert while_paused.finish_reason == FinishReason.ABORT and while_paused.output_ids == []
    assert len(after.output_ids) == 3


@pytest.mark.multigpu
def test_engine_on_the_second_gpu_generates_what_one_on_the_first_does(model_dir, tokenizer):
    """A data-parallel rank's engine lives on cuda:1 while threads start on cuda:0: its CUDA-graph decode and
    Triton kernels must still run on cuda:1 (greedy output equal to the cuda:0 engine's)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    outputs = []
    for device in ("cuda:0", "cuda:1"):
        engine = make_engine(model_dir, device=device)
        outputs.append([r.output_ids for r in run(engine, lambda e: e.generate(requests(tokenizer, params)))])
        assert engine.use_cuda_graph and engine.device == torch.device(device)
    assert outputs[1] == outputs[0]
