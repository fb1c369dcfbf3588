"""The pretrained Demucs models a person can choose from, as `stemdeck-watch models list`
describes them: how much there is to download and what each is good for. Which files each
needs comes from demucs's own lists (models.py); the stems from util/validators.py."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Known:
    name: str
    size_mb: int  # about how much it downloads (the hub says exactly when pulling)
    good_for: str


CATALOGUE: tuple[Known, ...] = (
    Known(
        "htdemucs",
        80,
        "the default: Hybrid Transformer Demucs, good quality on any music at a moderate speed",
    ),
    Known(
        "htdemucs_ft",
        320,
        "the best four-stem quality: one fine-tuned htdemucs per stem, "
        "about 4× as slow as htdemucs",
    ),
    Known(
        "htdemucs_6s", 55, "six stems: guitar and piano apart from other; piano is the weakest stem"
    ),
    Known(
        "hdemucs_mmi",
        85,
        "Hybrid Demucs v3 retrained on extra songs: the older "
        "architecture, a second opinion to htdemucs",
    ),
    Known(
        "mdx",
        320,
        "four Demucs v3 models of the 2021 Music Demixing challenge, trained on MusDB HQ only",
    ),
    Known(
        "mdx_extra",
        320,
        "the 2021 challenge entry trained with extra songs: better than mdx, slower than htdemucs",
    ),
    Known(
        "mdx_q",
        85,
        "mdx quantized: a quarter of the download, slightly worse; needs the diffq package",
    ),
    Known(
        "mdx_extra_q",
        85,
        "mdx_extra quantized: a quarter of the download, slightly worse; needs the diffq package",
    ),
)
KNOWN = {entry.name: entry for entry in CATALOGUE}

MARGIN = 0.5  # a download may exceed the catalogue's size by this much of it (it is "about")
UNLISTED_MB = 1000  # a model only the hub lists: larger than any pretrained Demucs model


def size_cap(name: str) -> int:
    """The most bytes a download of `name` may take: the catalogue's size plus the margin,
    or UNLISTED_MB for a model the catalogue does not know. The hub's own word on a size
    is not the bound: a server that lies about it, or streams without end, must not be able
    to fill the disk."""
    known = KNOWN.get(name)
    megabytes = known.size_mb * (1 + MARGIN) if known else UNLISTED_MB
    return int(megabytes * 1_000_000)
