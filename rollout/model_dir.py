"""Build small local model directories (no download): a BPE tokenizer trained on the spot with a ChatML chat
template, and a transformers Qwen3 checkpoint with random weights. Tests, live engine checks and benchmarks
use these where a real checkpoint is unavailable (the GPU machine reaches no model hub)."""

from __future__ import annotations

from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "What is 2 + 3? The answer is \\boxed{5}.",
    "Compute the sum of the first ten positive integers. The answer is 55.",
    "Solve for x: 2x + 4 = 10. So x = 3 and the final answer is \\boxed{3}.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Question: Who wrote the book? Answer: the author wrote it in the spring of the year.",
    "Let f(x) = x^2 - 1. Then f(3) = 8, and the roots are 1 and -1, \\frac{1}{2} of which is positive.",
    "user assistant system tool call result: the weather today is sunny with a light breeze.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 + - * / = ( ) [ ] { } \\sqrt \\pi",
]


def train_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML special tokens and chat template.

    ``<|endoftext|>`` is both EOS and PAD. Byte-level means any text encodes, whatever the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((corpus or _CORPUS) * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL_TOKENS[1:], chat_template=CHATML_TEMPLATE)


def make_model_dir(path: str | Path, *, hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2,
                   num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, vocab_size: int = 512,
                   max_position_embeddings: int = 2048, tie_word_embeddings: bool = False,
                   initializer_range: float = 0.02, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Write a Qwen3 HF directory (config.json, model.safetensors, tokenizer files) with random weights.

    A larger ``initializer_range`` than HF's 0.02 gives peaked next-token distributions (tests that compare
    greedy outputs across implementations need clear argmax margins).

    ``vocab_size`` is the tokenizer's training target; BPE may stop short of it when merges run out, and the
    model gets exactly the tokenizer's size so every id it can sample decodes.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    tokenizer = train_tokenizer(vocab_size)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, head_dim=head_dim,
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                         initializer_range=initializer_range,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
