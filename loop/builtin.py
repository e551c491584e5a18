"""Built-in task and model for the quickstart: nothing is downloaded, redline makes both.

``prompt_data = "builtin:addition"`` writes a JSONL of single-digit sums (``"3+5="`` → ``"8"``);
``hf_checkpoint = "builtin:tiny"`` writes a small Qwen3-architecture model with random weights and a
character-level tokenizer trained with ``tokenizers``. Both land in ``<output_dir>/builtin/``.
"""

import json
import random
from pathlib import Path

import torch

PREFIX = "builtin:"
CHARACTERS = list("0123456789+-*=?: ")
TINY_MODEL = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, max_position_embeddings=64, tie_word_embeddings=True)


def is_builtin(value: str | None) -> bool:
    return bool(value) and value.startswith(PREFIX)


def addition_task(folder: Path, *, seed: int = 0) -> tuple[Path, Path]:
    """``train.jsonl`` (every a+b with a, b ∈ 0..9, shuffled) and ``eval.jsonl`` (the same set, fixed order)."""
    folder.mkdir(parents=True, exist_ok=True)
    records = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(10)]
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    random.Random(seed).shuffle(records)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder / "train.jsonl", folder / "eval.jsonl"


def char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast``: one id per character, ``<|endoftext|>`` as EOS and PAD."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARACTERS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>")


def tiny_model(folder: Path, *, seed: int = 0) -> Path:
    """An HF directory (config, safetensors, tokenizer) of a ~0.2M-parameter Qwen3-architecture decoder."""
    from transformers import Qwen3Config

    from redline.trainer.models import from_config

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = char_tokenizer()
    vocab_size = 32  # the characters plus room to spare, a multiple of 8
    config = Qwen3Config(vocab_size=vocab_size, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **TINY_MODEL)
    model = from_config(config, backend="bf16", dtype=torch.float32, device="cpu", seed=seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def materialize(config, builtin_dir: Path) -> dict[str, str]:
    """Resolve ``builtin:`` values of the config into real paths; returns ``{field: path}`` overrides."""
    overrides = {}
    if is_builtin(config.data.prompt_data):
        name = config.data.prompt_data[len(PREFIX):]
        if name != "addition":
            raise ValueError(f"--prompt-data {config.data.prompt_data}: unknown built-in task (known: addition)")
        train, evaluation = addition_task(builtin_dir / "addition", seed=config.train.seed)
        overrides["prompt_data"] = str(train)
        if config.data.eval_prompt_data in (None, config.data.prompt_data):
            overrides["eval_prompt_data"] = str(evaluation)
    if is_builtin(config.model.hf_checkpoint):
        name = config.model.hf_checkpoint[len(PREFIX):]
        if name != "tiny":
            raise ValueError(f"--hf-checkpoint {config.model.hf_checkpoint}: unknown built-in model (known: tiny)")
        overrides["hf_checkpoint"] = str(tiny_model(builtin_dir / "tiny", seed=config.train.seed))
    return overrides
