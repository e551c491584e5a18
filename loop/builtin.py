"""Built-in task and model for the quickstart: nothing is downloaded, redline makes both.

``prompt_data = "builtin:addition"`` writes JSONL files of single-digit sums (``"3+5="`` → ``"8"``): the RL prompts,
an eval set, and noisy demonstrations for the SFT warm-up (each prompt with the answers a+b-2 … a+b+2, so
imitation alone is right one time in five and RL has to find which answer the reward accepts);
``hf_checkpoint = "builtin:<model>"`` writes a Qwen3-architecture model with random weights and a
character-level tokenizer made with ``tokenizers``. Both land in ``<output_dir>/builtin/``. The models
(``MODELS``): ``tiny`` (~0.2M parameters, the CPU quickstart), ``50m`` (the quickstart task on a GPU) and
``qwen3-1.7b``, ``qwen3-4b``, ``qwen3-8b`` (those Qwen3 models' shapes, vocabulary included, for step-time
measurements; they learn nothing useful).
"""

import json
import random
from pathlib import Path

import torch

PREFIX = "builtin:"
CHARACTERS = list("0123456789+-*=?: ")
TINY_MODEL = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, max_position_embeddings=64, tie_word_embeddings=True)
# Qwen3 config fields of each built-in model; "vocab_size" absent = the character vocabulary, no more.
MODELS = {
    "tiny": TINY_MODEL,
    # 16 layers x (0.79M attention + 2.36M MLP) = 50.3M parameters; head_dim 64 suits every attention kernel
    "50m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, max_position_embeddings=256, tie_word_embeddings=True),
    # Qwen/Qwen3-1.7B's config.json: 1.72B parameters with the tied 151,936-token embedding
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, vocab_size=151936),
    # Qwen/Qwen3-4B's and Qwen/Qwen3-8B's config.json (4.02B tied, 8.19B untied): the end-to-end benchmark's shapes
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, vocab_size=151936),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, vocab_size=151936),
}


def is_builtin(value: str | None) -> bool:
    return bool(value) and value.startswith(PREFIX)


DEMO_OFFSETS = (-2, -1, 0, 1, 2)
OPERANDS = 5  # a, b in 0..4: 25 prompts


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def addition_task(folder: Path, *, seed: int = 0) -> dict[str, Path]:
    """``train.jsonl`` (every a+b with a, b ∈ 0..4, shuffled), ``eval.jsonl`` (the same, fixed order) and
    ``sft.jsonl`` (five demonstrations per prompt, one of them correct)."""
    folder.mkdir(parents=True, exist_ok=True)
    records = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(OPERANDS) for b in range(OPERANDS)]
    demos = [{"prompt": f"{a}+{b}=", "label": str(a + b + d)}
             for a in range(OPERANDS) for b in range(OPERANDS) for d in DEMO_OFFSETS]
    rng = random.Random(seed)
    paths = {"eval": _write(folder / "eval.jsonl", records)}
    rng.shuffle(records)
    rng.shuffle(demos)
    paths["train"] = _write(folder / "train.jsonl", records)
    paths["sft"] = _write(folder / "sft.jsonl", demos)
    return paths


TASKS = {"addition": addition_task}  # built-in task name -> writer of its train / eval / sft files


def char_tokenizer(vocab_size: int | None = None):
    """A character-level ``PreTrainedTokenizerFast``: one id per character, ``<|endoftext|>`` as EOS and PAD.

    ``vocab_size`` pads the vocabulary with ``<|filler_i|>`` tokens (no text encodes to them; they decode to
    their names), so a model of a real vocabulary size can emit any id and every id decodes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARACTERS)}}
    vocab.update({f"<|filler_{i}|>": i for i in range(len(vocab), vocab_size or 0)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>")


def tiny_model(folder: Path, *, seed: int = 0, vocab_multiple: int = 1) -> Path:
    """An HF directory (config, safetensors, tokenizer) of a ~0.2M-parameter Qwen3-architecture decoder."""
    return builtin_model(folder, "tiny", seed=seed, vocab_multiple=vocab_multiple)


def builtin_model(folder: Path, name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                  device: str = "cpu", num_hidden_layers: int | None = None, vocab_multiple: int = 1) -> Path:
    """An HF directory (config, safetensors in ``dtype``, tokenizer) of the built-in model ``name`` with random
    weights drawn on ``device`` (the larger models are quicker to draw on a GPU). ``num_hidden_layers``: a slice
    of the model, its shapes with only that many layers (scaling baselines that must fit one GPU).
    ``vocab_multiple``: a character vocabulary is padded with filler tokens to a multiple of it (tensor
    parallelism splits the vocabulary)."""
    from transformers import Qwen3Config

    from redline.trainer.models import from_config

    if name not in MODELS:
        raise ValueError(f"--hf-checkpoint builtin:{name}: unknown built-in model (known: {', '.join(MODELS)})")
    fields = dict(MODELS[name])
    if num_hidden_layers is not None:
        if num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {num_hidden_layers}")
        fields["num_hidden_layers"] = num_hidden_layers
    vocab_size = fields.pop("vocab_size", None)
    if vocab_size is None and vocab_multiple > 1:
        vocab_size = -(-len(char_tokenizer()) // vocab_multiple) * vocab_multiple
    tokenizer = char_tokenizer(vocab_size)
    vocab_size = len(tokenizer)  # every id the model can emit decodes
    folder.mkdir(parents=True, exist_ok=True)
    # SGLang picks its model class by ``architectures``
    config = Qwen3Config(vocab_size=vocab_size, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         architectures=["Qwen3ForCausalLM"], **fields)
    model = from_config(config, backend="bf16", dtype=dtype, device=device, seed=seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def materialize(config, builtin_dir: Path) -> dict[str, str]:
    """Resolve ``builtin:`` values of the config into real paths; returns ``{field: path}`` overrides."""
    overrides = {}
    # a built-in task name means its file of the role it is given, wherever it appears; the RL prompts' task also
    # supplies the eval and SFT files the config leaves unset
    roles = {"prompt_data": "train", "eval_prompt_data": "eval", "sft_prompt_data": "sft"}
    for key, role in roles.items():
        value = getattr(config.data, key)
        if not is_builtin(value):
            continue
        if value[len(PREFIX):] not in TASKS:
            raise ValueError(f"--{key.replace('_', '-')} {value}: unknown built-in task (known: {', '.join(TASKS)})")
        paths = TASKS[value[len(PREFIX):]](builtin_dir / value[len(PREFIX):], seed=config.train.seed)
        overrides[key] = str(paths[role])
        if key == "prompt_data":
            for other in ("eval_prompt_data", "sft_prompt_data"):
                if getattr(config.data, other) is None:
                    overrides[other] = str(paths[roles[other]])
    if is_builtin(config.model.hf_checkpoint):
        name = config.model.hf_checkpoint[len(PREFIX):]
        if name == "tiny":  # float32 on the CPU whatever the run: the quickstart's weights are the same everywhere
            folder = tiny_model(builtin_dir / name, seed=config.train.seed,
                                vocab_multiple=config.parallel.tensor_model_parallel_size)
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(config.model.dtype, torch.float32)
            folder = builtin_model(builtin_dir / name, name, seed=config.train.seed, dtype=dtype, device=device)
        overrides["hf_checkpoint"] = str(folder)
    return overrides
