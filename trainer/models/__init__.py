"""Decoder models (Llama-3, Qwen2/2.5, Qwen3) built from HF configs, with HF checkpoint I/O.

``from_config`` / ``from_pretrained`` build a ``DecoderModel``; ``model(input_ids [T], cu_seqlens [S+1]) ->
hidden [T, H]``; ``model.export_hf()`` / ``model.save_pretrained(dir)`` write HF layout; ``KVCache`` and
``model.forward_cached`` serve incremental decoding.
"""

from redline.trainer.models.decoder import DecoderModel
from redline.trainer.models.export import export_hf, save_pretrained
from redline.trainer.models.load import from_config, from_pretrained
from redline.trainer.models.kv_cache import KVCache
from redline.trainer.models.spec import ModelSpec, spec_from_hf

__all__ = ["DecoderModel", "KVCache", "ModelSpec", "export_hf", "from_config", "from_pretrained",
           "save_pretrained", "spec_from_hf"]
