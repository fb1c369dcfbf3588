"""HTDemucs's last step, from its output spectrogram to audio, with one copy instead of three.

The network ends its frequency branch with `_mask`, which lays its output out as complex
numbers (one contiguous copy of every source's spectrogram), and `_ispec`, which pads that
copy twice (one frequency bin at the top, two frames at each end: two more allocations,
each filled with zeros and written again) before the inverse STFT. On a full-size model that
is 0.1 GB moved three times per segment, done the same way eager and compiled (the network's
own forward stays eager, compiled/graph.py). Here `_mask` writes its layout straight into the
zero-padded buffer `_ispec` wants, and `_ispec` takes that buffer as it is: the same numbers
in the same places, so the inverse STFT and the stems are exactly those of demucs's own code
(tests/workers/test_inverse.py), about 40 ms sooner per 7.8 s segment of a full-size model.

Only the layout of a model with complex-as-channels output (`cac`, every HTDemucs released)
is taken over; anything else, and any other call of `_ispec`, runs demucs's own method.
"""

from __future__ import annotations

import math
from types import MethodType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# the padding demucs's `_ispec` gives the spectrogram: bins added at the top, frames at
# each end
TOP_BINS, EDGE_FRAMES = 1, 2


def route(networks: list[Any]) -> None:
    """Have each HTDemucs among `networks` run its last step through this module."""
    from demucs.htdemucs import HTDemucs

    for network in networks:
        if isinstance(network, HTDemucs) and network.cac:
            network._mask = MethodType(_mask, network)
            network._ispec = MethodType(_ispec, network)


def _mask(self: Any, z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """demucs's `_mask` for `cac`: the sources' spectrograms as complex numbers, here a view
    into the padded buffer `_ispec` takes (kept on the network until it does)."""
    import torch

    batch, sources, channels, bins, frames = m.shape
    padded = m.new_zeros(
        batch, sources, channels // 2, bins + TOP_BINS, frames + 2 * EDGE_FRAMES, 2
    )
    layout = m.view(batch, sources, -1, 2, bins, frames).permute(0, 1, 2, 4, 5, 3)
    padded[..., :bins, EDGE_FRAMES : EDGE_FRAMES + frames, :] = layout
    whole = torch.view_as_complex(padded)
    out = whole[..., :bins, EDGE_FRAMES : EDGE_FRAMES + frames]
    self._padded_output = (out, whole)
    return out


def _ispec(self: Any, z: torch.Tensor, length: int | None = None, scale: int = 0) -> torch.Tensor:
    """demucs's `_ispec`, without its padding when `z` is what `_mask` just laid out: the
    inverse STFT of the padded buffer, trimmed to `length` as demucs trims it."""
    kept = vars(self).pop("_padded_output", None)
    if kept is None or kept[0] is not z or scale != 0 or length is None:
        return type(self)._ispec(self, z, length, scale)
    from demucs.spec import ispectro

    hop = self.hop_length
    pad = hop // 2 * 3
    x = ispectro(kept[1], hop, length=hop * math.ceil(length / hop) + 2 * pad)
    return x[..., pad : pad + length]
