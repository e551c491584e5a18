"""What a decoder looks like, read from a HF ``config.json``: one frozen dataclass the model is built from."""

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelSpec:
    family: str  # HF model_type: llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before RoPE
    tie_word_embeddings: bool

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_hf_config(config_or_path: PretrainedConfig | str | Path) -> PretrainedConfig:
    """A ``PretrainedConfig`` as given, or read from a local directory / ``config.json`` path."""
    if isinstance(config_or_path, PretrainedConfig):
        return config_or_path
    path = Path(config_or_path)
    if path.is_file():
        path = path.parent
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path} (expected a local HF model directory)")
    return AutoConfig.from_pretrained(path)


def spec_from_hf(config: PretrainedConfig) -> ModelSpec:
    """The ``ModelSpec`` of a Llama / Qwen2 / Qwen3 HF config; other families raise ``ValueError``."""
    family = config.model_type
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"config.json model_type={family!r} is not supported; expected one of {SUPPORTED_FAMILIES}")
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"config.json use_sliding_window=True ({family}) is not supported: attention is full causal")
    if config.hidden_act != "silu":
        raise ValueError(f"config.json hidden_act={config.hidden_act!r}; the SwiGLU MLP needs 'silu'")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if config.num_attention_heads % num_kv_heads:
        raise ValueError(f"config.json num_attention_heads={config.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads={num_kv_heads}")
    attention_bias = bool(getattr(config, "attention_bias", False))
    return ModelSpec(
        family=family,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama and Qwen3 follow attention_bias for all four.
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=family == "qwen3",
        tie_word_embeddings=bool(config.tie_word_embeddings),
    )
