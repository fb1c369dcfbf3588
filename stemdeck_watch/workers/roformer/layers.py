"""The building blocks both RoFormer architectures share, laid out as the published checkpoints
name them.

A checkpoint is a flat state dict whose keys spell the module tree it was trained in
(`layers.0.1.layers.0.0.to_qkv.weight`, `band_split.to_features.3.1.bias`, …), so every
module here sits at the attribute name and the `nn.Sequential` index its published
counterpart had. Where the training code held a parameterless module at an index (a dropout,
an einops rearrangement), an `nn.Identity` keeps that index taken, so the numbering after it
stays the published one. Dropout does nothing at inference and is left out.

The rotary position embedding is written here rather than taken from a package: the
checkpoints hold its frequencies under `…rotary_embed.freqs` (one shared module per axis,
stored once under every attention layer that uses it), and the rotation is the interleaved
pairs form those checkpoints were trained with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import pack, rearrange, unpack
from torch import nn


class RMSNorm(nn.Module):
    """x / |x| · sqrt(dim) · gamma: the norm every block of these models opens with."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class RotaryEmbedding(nn.Module):
    """Rotary position embedding over the sequence axis (-2) of (…, n, d) queries and keys.

    `freqs` is a persistent buffer because the checkpoints carry it; it is loaded like any
    weight. Angles are computed in float32 whatever the autocast precision: positions above
    256 are not exact in bfloat16."""

    freqs: torch.Tensor

    def __init__(self, dim_head: int, theta: float = 10000.0):
        super().__init__()
        # computed on the CPU under any default device: a meta build (to compare keys and
        # shapes) then pays no first-use cost of meta arithmetic
        steps = torch.arange(0, dim_head, 2, dtype=torch.float32, device="cpu")
        self.register_buffer("freqs", 1.0 / theta ** (steps[: dim_head // 2] / dim_head))

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        n = t.shape[-2]
        positions = torch.arange(n, device=t.device, dtype=torch.float32)
        freqs = self.freqs.to(device=t.device, dtype=torch.float32)  # built on the CPU
        angles = positions[:, None] * freqs[None, :]
        angles = angles.repeat_interleave(2, dim=-1)  # (n, rot): each angle turns one pair
        rot = angles.shape[-1]
        x, rest = t[..., :rot].float(), t[..., rot:]
        first, second = x.unflatten(-1, (-1, 2)).unbind(-1)
        turned = torch.stack((-second, first), dim=-1).flatten(-2)
        out = x * angles.cos() + turned * angles.sin()
        return torch.cat((out.to(t.dtype), rest), dim=-1)


class Attention(nn.Module):
    """Multi-head self-attention with rotary positions and a sigmoid gate per head."""

    def __init__(self, dim: int, heads: int, dim_head: int, rotary_embed: RotaryEmbedding):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.rotary_embed = rotary_embed  # shared by every layer of one axis
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Linear(dim, inner * 3, bias=False)
        self.to_gates = nn.Linear(dim, heads)
        self.to_out = nn.Sequential(nn.Linear(inner, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        q, k, v = rearrange(self.to_qkv(x), "b n (qkv h d) -> qkv b h n d", qkv=3, h=self.heads)
        q, k = self.rotary_embed.rotate(q), self.rotary_embed.rotate(k)
        out = F.scaled_dot_product_attention(q, k, v)
        gates = rearrange(self.to_gates(x), "b n h -> b h n 1").sigmoid()
        return self.to_out(rearrange(out * gates, "b h n d -> b n (h d)"))


class LinearAttention(nn.Module):
    """Cross-covariance attention (over the feature axis, linear in sequence length), the
    optional third transformer of a block (`linear_transformer_depth`)."""

    def __init__(self, dim: int, heads: int, dim_head: int, scale: float = 8.0):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.scale = scale
        self.norm = RMSNorm(dim)
        self.to_qkv = nn.Sequential(nn.Linear(dim, inner * 3, bias=False))
        self.temperature = nn.Parameter(torch.ones(heads, 1, 1))
        self.to_out = nn.Sequential(nn.Identity(), nn.Linear(inner, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        q, k, v = rearrange(self.to_qkv(x), "b n (qkv h d) -> qkv b h d n", qkv=3, h=self.heads)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        out = F.scaled_dot_product_attention(q * self.temperature.exp(), k, v, scale=self.scale)
        return self.to_out(rearrange(out, "b h d n -> b n (h d)"))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: float = 4):
        super().__init__()
        inner = int(dim * mult)
        # indices 0, 1, 4 hold weights in the checkpoints; 3 was a dropout
        self.net = nn.Sequential(
            RMSNorm(dim), nn.Linear(dim, inner), nn.GELU(), nn.Identity(), nn.Linear(inner, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Transformer(nn.Module):
    """`depth` pre-norm residual (attention, feed-forward) pairs, optionally normed at the end."""

    def __init__(
        self,
        *,
        dim: int,
        depth: int,
        heads: int,
        dim_head: int,
        norm_output: bool,
        rotary_embed: RotaryEmbedding | None = None,
        linear: bool = False,
    ):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(depth):
            attention: nn.Module
            if linear:
                attention = LinearAttention(dim, heads, dim_head)
            else:
                assert rotary_embed is not None
                attention = Attention(dim, heads, dim_head, rotary_embed)
            self.layers.append(nn.ModuleList([attention, FeedForward(dim)]))
        self.norm: nn.Module = RMSNorm(dim) if norm_output else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for pair in self.layers:
            assert isinstance(pair, nn.ModuleList)
            x = pair[0](x) + x  # attention
            x = pair[1](x) + x  # feed-forward
        return self.norm(x)


class BandSplit(nn.Module):
    """Each band's (frequency × channel × re/im) slice to one `dim` feature vector."""

    def __init__(self, dim: int, dim_inputs: tuple[int, ...]):
        super().__init__()
        self.dim_inputs = dim_inputs
        self.to_features = nn.ModuleList(
            nn.Sequential(RMSNorm(size), nn.Linear(size, dim)) for size in dim_inputs
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bands = x.split(self.dim_inputs, dim=-1)
        return torch.stack([net(band) for band, net in zip(bands, self.to_features)], dim=-2)


def mlp(dim_in: int, dim_out: int, dim_hidden: int, hidden_layers: int) -> nn.Sequential:
    """Linear layers with tanh between them; `hidden_layers` hidden widths of `dim_hidden`."""
    dims = (dim_in, *(dim_hidden,) * hidden_layers, dim_out)
    net: list[nn.Module] = []
    for index, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        net.append(nn.Linear(a, b))
        if index < len(dims) - 2:
            net.append(nn.Tanh())
    return nn.Sequential(*net)


class MaskEstimator(nn.Module):
    """One stem's complex mask, band by band, from the shared features (GLU-gated MLPs)."""

    def __init__(
        self, dim: int, dim_inputs: tuple[int, ...], hidden_layers: int, expansion: int = 4
    ):
        super().__init__()
        self.to_freqs = nn.ModuleList(
            nn.Sequential(mlp(dim, size * 2, dim * expansion, hidden_layers), nn.GLU(dim=-1))
            for size in dim_inputs
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bands = x.unbind(dim=-2)
        return torch.cat([net(band) for band, net in zip(bands, self.to_freqs)], dim=-1)


def build_blocks(
    *,
    dim: int,
    depth: int,
    heads: int,
    dim_head: int,
    time_depth: int,
    freq_depth: int,
    linear_depth: int,
    norm_output: bool,
) -> nn.ModuleList:
    """`depth` blocks of ([linear,] time, frequency) transformers; the time transformers share
    one rotary embedding, the frequency transformers another (as in training)."""
    time_rotary, freq_rotary = RotaryEmbedding(dim_head), RotaryEmbedding(dim_head)
    common = dict(dim=dim, heads=heads, dim_head=dim_head, norm_output=norm_output)
    blocks = nn.ModuleList()
    for _ in range(depth):
        block = nn.ModuleList()
        if linear_depth > 0:
            block.append(Transformer(depth=linear_depth, linear=True, **common))  # type: ignore[arg-type]
        block.append(Transformer(depth=time_depth, rotary_embed=time_rotary, **common))  # type: ignore[arg-type]
        block.append(Transformer(depth=freq_depth, rotary_embed=freq_rotary, **common))  # type: ignore[arg-type]
        blocks.append(block)
    return blocks


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, skip_connection: bool) -> torch.Tensor:
    """Axial attention over (batch, time, bands, dim): per block the optional linear
    transformer over all (time, band) positions, then along time per band, then along bands
    per time frame. `skip_connection` adds every earlier block's output before a block, as
    the configurations that set it were trained."""
    earlier: list[torch.Tensor] = []
    for block in blocks:
        assert isinstance(block, nn.ModuleList)
        transformers = list(block)
        if len(transformers) == 3:
            linear = transformers.pop(0)
            flat, shape = pack([x], "b * d")
            x = unpack(linear(flat), shape, "b * d")[0]
        time_transformer, freq_transformer = transformers
        if skip_connection:
            for previous in earlier:
                x = x + previous
        x = rearrange(x, "b t f d -> b f t d")
        flat, shape = pack([x], "* t d")
        x = unpack(time_transformer(flat), shape, "* t d")[0]
        x = rearrange(x, "b f t d -> b t f d")
        flat, shape = pack([x], "* f d")
        x = unpack(freq_transformer(flat), shape, "* f d")[0]
        if skip_connection:
            earlier.append(x)
    return x
