"""Shapes of the Llama-family models tierserve knows by name.

Shared by the simulator (to predict FLOPs and bytes) and the PyTorch executor (to build
the model). Field names follow Hugging Face `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_scaling` with rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # defaults to hidden_size // num_attention_heads
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype_bytes: int = 2  # bf16/fp16 weights and KV cache

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer, at `dtype_bytes` per element."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_size * self.dtype_bytes

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_size
        kv = self.num_key_value_heads * self.head_size
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embeddings + h


# Source: meta-llama/Llama-3.1-8B config.json (8.03 B parameters).
LLAMA_3_1_8B = ModelConfig(
    name="llama-3.1-8b",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
    bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
)

# Source: meta-llama/Llama-3.1-70B config.json (70.6 B parameters).
LLAMA_3_1_70B = ModelConfig(
    name="llama-3.1-70b",
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
    bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009),
)

# The built-in demo model: Llama architecture, random weights made at start-up, a
# byte-level tokenizer (256 bytes + BOS=256, EOS=257, PAD=258). Small enough for a CPU.
DEMO_MODEL = ModelConfig(
    name="demo",
    vocab_size=259,  # every id decodes to a byte or a special token
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=256,
    eos_token_ids=(257,),
    dtype_bytes=4,  # float32 on CPU
)

KNOWN_MODELS: dict[str, ModelConfig] = {m.name: m for m in (LLAMA_3_1_8B, LLAMA_3_1_70B, DEMO_MODEL)}
