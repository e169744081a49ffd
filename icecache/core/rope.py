"""The model's rotary position embedding (RoPE), applied and inverted outside the model.

Layers receive keys after RoPE (``LayerKV`` sees what the attention function sees). A method that works on keys
before RoPE (ShadowKV factorises them) undoes the rotation with the model's own frequencies: RoPE turns each pair
of channels ``(x_i, x_{i + D/2})`` of the token at position ``t`` by the angle ``t * inv_freq_i`` and scales the
result by ``attention_scaling``, so the inverse is the opposite turn divided by that factor.

``Rotary.from_config`` reads the frequencies the way transformers' rotary embeddings do (``default``, or one of
``ROPE_INIT_FUNCTIONS`` for a fixed scaled RoPE such as Llama 3's); RoPE whose frequencies change with the
sequence length (``dynamic``, ``longrope``) or that turns only part of a head cannot be inverted by one fixed
rotation, and is recorded as unsupported (``inv_freq`` None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# RoPE types whose frequencies depend on the current sequence length: no fixed rotation to invert.
_LENGTH_DEPENDENT = ("dynamic", "longrope")


@dataclass(frozen=True)
class Rotary:
    """A model's RoPE: ``inv_freq`` (one per channel pair, float32 values) and the factor applied to cos and sin.
    ``inv_freq`` None: the model's RoPE is of a kind this module cannot invert (``rope_type`` says which)."""

    inv_freq: tuple[float, ...] | None
    attention_scaling: float = 1.0
    rope_type: str = "default"

    @property
    def supported(self) -> bool:
        return self.inv_freq is not None

    @classmethod
    def from_config(cls, config: Any) -> "Rotary | None":
        """The RoPE of a transformers config (None when the config has no rotary parameters)."""
        parameters = getattr(config, "rope_parameters", None)
        if not isinstance(parameters, dict) or "rope_theta" not in parameters:
            return None
        rope_type = str(parameters.get("rope_type", "default"))
        partial = parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        if rope_type in _LENGTH_DEPENDENT or float(partial) != 1.0:
            return cls(inv_freq=None, rope_type=rope_type if float(partial) == 1.0 else f"{rope_type} (partial)")
        if rope_type == "default":
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            # As the models' compute_default_rope_parameters: float32, so the values are the model's to the bit.
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
            inv_freq, scaling = 1.0 / (parameters["rope_theta"] ** exponents), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                return cls(inv_freq=None, rope_type=rope_type)
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        return cls(inv_freq=tuple(float(f) for f in inv_freq.float()), attention_scaling=float(scaling),
                   rope_type=rope_type)

    def frequencies(self, device: torch.device | str) -> torch.Tensor:
        if self.inv_freq is None:
            raise ValueError(f"RoPE of type {self.rope_type!r} has no fixed frequencies to apply or invert")
        return torch.tensor(self.inv_freq, dtype=torch.float32, device=device)

    def cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor | None = None):
        """float32 ``(cos, sin)`` of shape ``[*positions.shape, D]`` (already multiplied by ``attention_scaling``),
        computed as transformers does: the angle is one float32 product, the halves repeated."""
        freq = self.frequencies(positions.device) if inv_freq is None else inv_freq
        angles = positions.to(torch.float32)[..., None] * freq
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE of ``x [..., T, D]`` at ``positions [T]`` (or any shape broadcasting to ``x``'s leading dims),
        in float32."""
        cos, sin = self.cos_sin(positions, inv_freq)
        x = x.float()
        return x * cos + rotate_half(x) * sin

    def invert(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
        """The keys before RoPE: ``apply``'s inverse (the opposite turn, divided by the scaling twice since cos and
        sin each carry it once), in float32."""
        cos, sin = self.cos_sin(positions, inv_freq)
        x = x.float()
        return (x * cos - rotate_half(x) * sin) / (self.attention_scaling ** 2)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension's halves (transformers' convention)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
