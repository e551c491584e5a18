"""The decoder equals transformers' own implementation (logits, checkpoints) for every supported family."""

import json

import pytest
import torch
import transformers

from redline.trainer.models import from_config, from_pretrained

LENGTHS = (5, 9, 3)


def hf_logits_per_sequence(hf_model, input_ids, cu_seqlens):
    """transformers' logits for each packed sequence run on its own (batch 1), concatenated: ``[T, V]``."""
    bounds = cu_seqlens.tolist()
    with torch.no_grad():
        return torch.cat([hf_model(input_ids[None, s:e]).logits[0] for s, e in zip(bounds[:-1], bounds[1:])])


def random_hf_model(config, seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_logits_match_transformers_on_the_same_weights(hf_config, batch_of, tmp_path):
    hf_model = random_hf_model(hf_config)
    hf_model.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, dtype=torch.float32)
    input_ids, cu_seqlens = batch_of(LENGTHS, hf_config.vocab_size)
    with torch.no_grad():
        ours = model.logits(input_ids, cu_seqlens)
    torch.testing.assert_close(ours, hf_logits_per_sequence(hf_model, input_ids, cu_seqlens), rtol=1e-5, atol=1e-5)


def test_saved_checkpoint_loads_in_transformers_with_identical_logits(hf_config, batch_of, tmp_path):
    model = from_config(hf_config, dtype=torch.float32, seed=1)
    model.save_pretrained(tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    input_ids, cu_seqlens = batch_of(LENGTHS, hf_config.vocab_size)
    with torch.no_grad():
        ours = model.logits(input_ids, cu_seqlens)
    torch.testing.assert_close(ours, hf_logits_per_sequence(hf_model, input_ids, cu_seqlens), rtol=1e-5, atol=1e-5)


def test_tied_checkpoint_stores_only_the_embedding(config_of, tmp_path):
    from_config(config_of("qwen3-tied"), dtype=torch.float32, seed=0).save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_sharded_save_round_trips_through_from_pretrained(config_of, batch_of, tmp_path):
    config = config_of("llama3")
    model = from_config(config, dtype=torch.float32, seed=2)
    model.save_pretrained(tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = from_pretrained(tmp_path, dtype=torch.float32)
    input_ids, cu_seqlens = batch_of(LENGTHS, config.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids, cu_seqlens), model(input_ids, cu_seqlens))


def test_export_order_keeps_each_layers_tensors_together(config_of):
    model = from_config(config_of("qwen2"), dtype=torch.float32, seed=0)
    layer_of = [name.split(".")[2] for name, _ in model.export_hf() if name.startswith("model.layers.")]
    runs = [layer for i, layer in enumerate(layer_of) if i == 0 or layer != layer_of[i - 1]]
    assert runs == sorted(set(runs), key=int)


def test_export_names_and_shapes_match_transformers_state_dict(hf_config):
    exported = {name: tuple(t.shape) for name, t in from_config(hf_config, dtype=torch.float32, seed=0).export_hf()}
    expected = {name: tuple(t.shape) for name, t in random_hf_model(hf_config).state_dict().items()}
    if hf_config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert exported == expected


def test_checkpoint_with_an_unknown_tensor_is_rejected(config_of, tmp_path):
    from safetensors.torch import load_file, save_file

    model = from_config(config_of("qwen3"), dtype=torch.float32, seed=0)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra.weight"):
        from_pretrained(tmp_path, dtype=torch.float32)


def test_unsupported_family_names_the_model_type():
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        from_config(transformers.GPT2Config(n_layer=1), dtype=torch.float32)


def test_same_seed_gives_the_same_weights_on_every_backend(config_of):
    from redline.trainer.fp8.linear import NativeFP8Backend

    config = config_of("qwen2")
    plain = dict(from_config(config, dtype=torch.float32, seed=3).export_hf())
    native = dict(from_config(config, backend=NativeFP8Backend(), dtype=torch.float32, seed=3).export_hf())
    assert plain.keys() == native.keys() and all(torch.equal(plain[n], native[n]) for n in plain)


@pytest.mark.gpu
def test_bf16_logits_on_gpu_track_transformers(config_of, batch_of, cuda, tmp_path):
    config = config_of("qwen3")
    random_hf_model(config).save_pretrained(tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).to(cuda).eval()
    model = from_pretrained(tmp_path, dtype=torch.bfloat16, device=cuda)
    input_ids, cu_seqlens = (t.to(cuda) for t in batch_of(LENGTHS, config.vocab_size))
    with torch.no_grad():
        ours = model.logits(input_ids, cu_seqlens).float()
    expected = hf_logits_per_sequence(hf_model, input_ids, cu_seqlens).float()
    assert (ours - expected).abs().max() < 0.05
