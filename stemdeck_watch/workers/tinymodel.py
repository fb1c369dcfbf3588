"""A tiny, untrained HTDemucs saved in demucs's own local-repo format.

No model weights can be downloaded in tests, the demo or CI, so they use this: the real
HTDemucs class, a few hundred kilobytes, saved as `<name>.th` = `{klass, args, kwargs, state}`
and loaded by `demucs.pretrained.get_model(name, repo=folder)` — the same loading code a real
model goes through. Its stems are not musically meaningful: it has never been trained.

    python -m stemdeck_watch.workers.tinymodel FOLDER [--name tiny] [--six]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="stemdeck_watch.workers.tinymodel", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("--name", default="tiny")
    parser.add_argument("--six", action="store_true", help="guitar and piano too (6 stems)")
    args = parser.parse_args(argv)
    print(save_tiny_model(args.folder, args.name, args.six))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
