"""The embedded engine reading another model's flat weight storage in place (``EngineTargets.share`` /
``WeightLoader.share``): its parameters become views of the source, generation is unchanged, release and resume
leave them alone, a layout it cannot view changes nothing, and a load or ``unshare`` gives it its own copy back
without writing the source."""

import gc

import pytest
import torch
from redline.rollout.embedded.colocated import EngineTargets
from redline.rollout.embedded.engine import EmbeddedEngine
from redline.rollout.embedded.weights import flatten_parameters
from redline.rollout.types import GenerateRequest, SamplingParams
from redline.sync.checksum import new_accumulator
from redline.sync.zero_copy import plan_in_place
from redline.trainer.models import from_pretrained
from torch.multiprocessing.reductions import StorageWeakRef

from .engine_runner import run

PROMPT = "The quick brown fox jumps over"


def trainer_like(model_dir):
    """A second copy of the model in one flat storage, as the mixed-precision trainer keeps its compute weights;
    its in-place bucket plan and flat buckets."""
    model = from_pretrained(model_dir, dtype=torch.float32)
    flatten_parameters(model)
    plan, flats = plan_in_place(model.export_hf(), bucket_bytes=64 * 1024)
    return model, plan, flats


def engine_for(model_dir, **kwargs):
    return EmbeddedEngine.from_pretrained(model_dir, dtype=torch.float32, max_batch_size=2, max_seq_len=64, **kwargs)


def greedy(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    return engine.generate([GenerateRequest(engine.tokenizer.encode(PROMPT), params)])


def storage_of(tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("flat_weights", [False, True])
def test_shared_parameters_view_the_source_and_follow_its_writes(model_dir, flat_weights):
    source, plan, flats = trainer_like(model_dir)
    buffer = storage_of(flats[0])

    async def scenario(engine):
        [before] = await greedy(engine)
        targets = EngineTargets(engine)
        assert targets.share(flats, plan) is None and engine.weights.shared
        views = {storage_of(p) for p in engine.model.parameters()}
        [shared] = await greedy(engine)
        await engine.release_memory({"weights", "kv_cache"})  # shared weights are not the engine's to free
        released = {p.untyped_storage().nbytes() for p in engine.model.parameters()}
        await engine.resume_memory({"weights", "kv_cache"})
        [resumed] = await greedy(engine)
        assert targets.share(flats, plan) is None  # already views of them: an identity check
        with torch.no_grad():
            source.lm_head_weight().copy_(torch.flip(source.lm_head_weight(), dims=[0]))  # no sync
        [written] = await greedy(engine)
        return before, shared, resumed, written, views, released

    before, shared, resumed, written, views, released = run(engine_for(model_dir, flat_weights=flat_weights),
                                                            scenario)
    assert views == {buffer}
    assert 0 not in released
    assert shared.output_ids == resumed.output_ids == before.output_ids
    assert written.output_ids != before.output_ids  # the engine reads the source's memory, not a copy


def test_the_parameters_take_the_exact_addresses_of_the_sources_tensors_and_free_their_own(model_dir):
    source, plan, flats = trainer_like(model_dir)
    engine = engine_for(model_dir, flat_weights=True)
    try:
        targets = EngineTargets(engine)
        targets.load_bucket(flats[0], plan.buckets[0], new_accumulator(1, torch.device("cpu"))[0])  # caches views
        own = StorageWeakRef(engine.model.embed_tokens.weight.untyped_storage())
        assert targets.share(flats, plan) is None
        gc.collect()
        assert own.expired()  # no view of the engine's own copy is left anywhere
        held = dict(engine.model.named_parameters())
        for name, param in source.named_parameters():
            assert held[name].data_ptr() == param.data_ptr() and held[name].shape == param.shape, name
    finally:
        run(engine, lambda e: e.health())


def test_a_layout_the_engine_cannot_view_is_refused_and_changes_nothing(model_dir):
    _, plan, flats = trainer_like(model_dir)
    sources = {name: view for layout, flat in zip(plan.buckets, flats) for name, view in layout.views(flat)}
    k = "model.layers.0.self_attn.k_proj.weight"
    in_place = sources[k]
    sources[k] = in_place.clone()  # no longer right behind q in one storage
    engine = engine_for(model_dir)
    try:
        before = [p.data_ptr() for p in engine.model.parameters()]
        reason = engine.weights.share(sources)
        assert reason is not None and k in reason and "one storage" in reason
        assert not engine.weights.shared and [p.data_ptr() for p in engine.model.parameters()] == before
        sources[k] = in_place
        del sources["model.norm.weight"]
        assert "no source tensor for 'model.norm.weight'" in engine.weights.share(sources)
    finally:
        run(engine, lambda e: e.health())


def test_a_load_or_unshare_takes_an_own_copy_and_never_writes_the_source(model_dir):
    source, plan, flats = trainer_like(model_dir)
    original = source.lm_head_weight().clone()

    async def scenario(engine):
        targets = EngineTargets(engine)
        targets.share(flats, plan)
        [shared] = await greedy(engine)
        flipped = torch.flip(original, dims=[0])
        await engine.update_weights([[("lm_head.weight", flipped)]], version="1")
        loaded = engine.weights.shared, storage_of(engine.model.lm_head_weight()) == storage_of(flats[0])
        [after_load] = await greedy(engine)
        targets.share(flats, plan)
        targets.unshare()
        with torch.no_grad():
            source.lm_head_weight().zero_()
        [after_unshare] = await greedy(engine)
        return shared, after_load, after_unshare, loaded

    shared, after_load, after_unshare, loaded = run(engine_for(model_dir), scenario)
    assert loaded == (False, False)
    assert after_load.output_ids != shared.output_ids  # the load landed in the engine's own copy ...
    assert after_unshare.output_ids == shared.output_ids  # ... and unshare kept the source's values


def test_after_a_load_gave_it_its_own_copy_an_unshared_sync_copies_again(model_dir):
    """A load while shared re-points the parameters (the engine's graph and the sync's views are dropped), so a
    later unshared sync out of the same buffers copies them instead of taking them for its own bytes."""
    source, plan, flats = trainer_like(model_dir)
    engine = engine_for(model_dir)
    try:
        targets = EngineTargets(engine)
        targets.share(flats, plan)
        zeros = [(name, torch.zeros(size, *tensor.shape[1:])) for name, (tensor, _, size) in
                 engine.weights.slices.items()]
        engine.load_weights(zeros)  # the engine protocol's load: a copy of its own first, then the zeros
        assert not engine.weights.shared and engine.model.embed_tokens.weight.abs().sum() == 0
        targets.unshare()
        acc = new_accumulator(len(plan.buckets), torch.device("cpu"))
        for layout, flat in zip(plan.buckets, flats):
            targets.load_bucket(flat, layout, acc[layout.index])
        assert torch.equal(engine.model.embed_tokens.weight, source.embed_tokens.weight)
    finally:
        run(engine, lambda e: e.health())


def test_unsharing_an_engine_whose_weights_are_released_takes_no_lock_and_raises_nothing(model_dir):
    """The receiver unshares at every unshared session and when its sender leaves; an engine that released its
    weights (--offload-rollout) must let that pass, shared before or not."""
    _, plan, flats = trainer_like(model_dir)

    async def scenario(engine):
        targets = EngineTargets(engine)
        await engine.release_memory({"weights", "kv_cache"})
        targets.unshare()  # never shared
        await engine.resume_memory({"weights", "kv_cache"})
        targets.share(flats, plan)
        engine.load_weights([("model.norm.weight", torch.ones_like(engine.model.norm.weight))])
        await engine.release_memory({"weights", "kv_cache"})
        targets.unshare()  # shared, then a load gave it its own copy, then released
        return engine.weights.shared

    assert run(engine_for(model_dir), scenario) is False
