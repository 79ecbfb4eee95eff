"""Rotary position embeddings, including Llama-3 frequency scaling.

Uses the "rotate half" layout of Hugging Face Llama checkpoints: the first and second
halves of each head's vector form the (real, imaginary) pairs. Frequencies, cos and sin
are computed in float32 and cast to the activations' dtype, as the reference does.
"""

from __future__ import annotations

import math

import torch

from tierserve.model_config import RopeScaling


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, linear_factor: float = 1.0
) -> torch.Tensor:
    """One inverse frequency per rotated pair ([head_dim // 2], float32); `linear_factor`
    divides them all (rope_type "linear", position interpolation)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if linear_factor != 1.0:
        inv_freq = inv_freq / linear_factor
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama-3: slow down low frequencies by `factor`, keep high ones, blend in between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    # 0 at the low-frequency edge, 1 at the high-frequency edge.
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding:
    """Maps positions to (cos, sin) tables and rotates query/key heads."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None,
        device: torch.device,
        linear_factor: float = 1.0,
    ):
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling, linear_factor).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens] int positions -> cos, sin of shape [num_tokens, 1, head_dim]."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x ([num_tokens, num_heads, head_dim]) by the per-token angles."""
    # x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1), without building the
    # rotated copy: the same products and sums, two fewer temporaries of x's size.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    term = x2 * sin[..., :half]
    out[..., :half].sub_(term)
    torch.mul(x1, sin[..., half:], out=term)
    out[..., half:].add_(term)
    return out
