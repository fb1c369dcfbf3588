"""A tiny, untrained HTDemucs saved in demucs's own local-repo format.

No model weights can be downloaded in tests, the demo or CI, so they use this: the real
HTDemucs class, a few hundred kilobytes, saved as `<name>.th` = `{klass, args, kwargs, state}`
and loaded by `demucs.pretrained.get_model(name, repo=folder)` — the same loading code a real
model goes through. Its stems are not musically meaningful: it has never been trained.

A tiny BS-RoFormer is saved the same way as the published checkpoints are, under a
catalogued checkpoint's file names (`--roformer bs_roformer_viperx_1297`): its YAML
configuration (published keys, tiny dimensions) and a plain `torch.save(state_dict)`, so the
service loads it through the same path as the real one.

    python -m stemdeck_watch.workers.tinymodel FOLDER [--name tiny] [--six] [--roformer NAME]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

FOUR_STEMS = ["drums", "bass", "other", "vocals"]
SIX_STEMS = FOUR_STEMS + ["guitar", "piano"]


def tiny_htdemucs(six: bool = False, heads: int = 1) -> Any:
    """The tiny HTDemucs, untrained (torch's current seed draws its weights). One attention
    head keeps it off `nn.MultiheadAttention`'s fast path, which needs an even count."""
    from demucs.htdemucs import HTDemucs

    return HTDemucs(
        sources=SIX_STEMS if six else FOUR_STEMS,
        channels=4,
        depth=4,
        t_layers=1,
        t_heads=heads,
        dconv_comp=4,
        segment=4,
    )


def save_tiny_model(folder: Path, name: str = "tiny", six: bool = False, seed: int = 0) -> Path:
    """Write `<folder>/<name>.th`; the name must not contain '-' (demucs reads what follows a
    '-' as a checksum)."""
    import torch
    from demucs.htdemucs import HTDemucs

    if "-" in name:
        raise ValueError(f"model name {name!r} must not contain '-'")
    torch.manual_seed(seed)
    model = tiny_htdemucs(six)
    args, kwargs = model._init_args_kwargs
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.th"
    tmp = path.with_suffix(".th.tmp")
    torch.save(
        {"klass": HTDemucs, "args": args, "kwargs": kwargs, "state": model.state_dict()}, tmp
    )
    tmp.replace(path)
    return path


TINY_BS_ROFORMER = """\
audio:
  chunk_size: {chunk}
  num_channels: 2
  sample_rate: 44100
model:
  dim: 16
  depth: 1
  stereo: true
  num_stems: 1
  time_transformer_depth: 1
  freq_transformer_depth: 1
  freqs_per_bands: !!python/tuple [256, 256, 513]
  dim_head: 8
  heads: 2
  stft_n_fft: 2048
  stft_hop_length: 441
  stft_win_length: 2048
  mask_estimator_depth: 1
  flash_attn: true
training:
  instruments: [vocals, other]
  target_instrument: vocals
inference:
  batch_size: 1
  num_overlap: 2
"""


def save_tiny_roformer(folder: Path, name: str, seed: int = 0, chunk: int = 44100) -> Path:
    """Write the catalogued checkpoint `name`'s configuration and checkpoint files into
    `folder`, holding a tiny BS-RoFormer with random weights (`chunk`: samples per chunk).
    Returns the checkpoint."""
    import torch

    from stemdeck_watch.workers.roformer.catalogue import KNOWN
    from stemdeck_watch.workers.roformer.checkpoint import build_model
    from stemdeck_watch.workers.roformer.config import read_config

    entry = KNOWN[name]
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / entry.config_file
    config.write_text(TINY_BS_ROFORMER.format(chunk=chunk), encoding="utf-8")
    torch.manual_seed(seed)
    model = build_model(read_config(config))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    path = folder / entry.checkpoint_file
    torch.save(model.state_dict(), path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="stemdeck_watch.workers.tinymodel", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("--name", default="tiny")
    parser.add_argument("--six", action="store_true", help="guitar and piano too (6 stems)")
    parser.add_argument("--roformer", metavar="NAME", help="a tiny RoFormer saved as NAME")
    args = parser.parse_args(argv)
    if args.roformer:
        print(save_tiny_roformer(args.folder, args.roformer))
        return 0
    print(save_tiny_model(args.folder, args.name, args.six))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
