"""A Llama-family decoder (Llama, Mistral, Qwen2) that keeps its K/V in a paged pool.

Parameter names follow Hugging Face checkpoints (`model.layers.0.self_attn.q_proj.weight`
...), so a safetensors state dict loads as is. One forward call runs a whole engine step:
the linear layers see every token of the step at once; only attention is per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.executors.pytorch.attention import AttentionMetadata, paged_attention
from tierserve.executors.pytorch.kv_pool import KVPool
from tierserve.executors.pytorch.rope import RotaryEmbedding, apply_rotary
from tierserve.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weights' dtype, then scale in the input dtype.
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_size
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out = paged_attention(q, k, v, kv[0], kv[1], meta)
        result: torch.Tensor = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return result


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return result


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool):
        super().__init__()
        self.self_attn = Attention(config, qkv_bias)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv, meta)
        result: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, qkv_bias) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder plus its output head; `lm_head` is absent when embeddings are tied."""

    def __init__(self, config: ModelConfig, *, qkv_bias: bool = False):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, qkv_bias)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(
            config.head_size, config.rope_theta, config.rope_scaling, torch.device("cpu")
        )

    def to_device(self, device: torch.device, dtype: torch.dtype) -> CausalLM:
        self.to(device=device, dtype=dtype)
        self.rotary.inv_freq = self.rotary.inv_freq.to(device)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        pool: KVPool,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run one step over `input_ids` ([num_tokens]); return logits of `logit_rows` only."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos_sin, pool.layer_kv(i), meta)
        h = self.model.norm(x[logit_rows])
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight)
