"""The published RoFormer checkpoints this engine knows, with their published scores.

Each entry is a checkpoint (`.ckpt`, a state dict) and the YAML configuration published with
it, where both are downloaded from, and what each scores as published. A score says which
test set it comes from, because figures on different sets do not compare:

- `MULTISONG`: the Multisong dataset of MVSep's quality checker, as the table of pretrained
  models in ZFTurbo's Music-Source-Separation-Training gives them (it gives its fine-tuned
  HTDemucs4 vocals model 8.78 on the same set).
- `MUSDB_40`: the median over the first 40 tracks (by name) of MUSDB18's training subset, as
  python-audio-separator measured them (its `models-scores.json`, `median_scores`); the
  Kimberley Jensen model was measured on the first 11 only. The trainers may have trained on
  these tracks.
- `NAMED`: the figure in the checkpoint's file name, the trainer's own validation score on a
  set that was not published.

Sizes are not published: `parameters` is counted from the architecture at the configuration's
dimensions (the test fixture of its state dict's keys and shapes records it) and `megabytes`
is that many float32 weights. Neither the checkpoints' licences nor their sha256 sums are
published where these entries come from, so both are None ("not published"): a download
cannot be pinned until someone records a checksum from a copy they trust.

No torch here: `models list` reads this without a worker.
"""

from __future__ import annotations

import dataclasses

from stemdeck_watch.workers.roformer.config import BS, MEL

MULTISONG = "Multisong dataset (MVSep)"
MUSDB_40 = "MUSDB18 train, first 40 tracks (median)"
MUSDB_11 = "MUSDB18 train, first 11 tracks (median)"
NAMED = "trainer's own validation (set not published)"

_MSST_TABLE = "https://github.com/ZFTurbo/Music-Source-Separation-Training/blob/main/docs/pretrained_models.md"
_SEPARATOR_SCORES = "https://github.com/nomadkaraoke/python-audio-separator/blob/main/audio_separator/models-scores.json"
_MSST_CONFIGS = (
    "https://raw.githubusercontent.com/ZFTurbo/Music-Source-Separation-Training/main/configs"
)
_UVR_RELEASE = "https://github.com/TRvlvr/model_repo/releases/download/all_public_uvr_models"


@dataclasses.dataclass(frozen=True)
class Score:
    """One published figure: SDR (dB) of one stem on one test set, and where it is given."""

    stem: str
    sdr: float
    test_set: str
    source: str


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    name: str  # what a recipe, a preset or `models pull` calls it
    architecture: str  # config.BS or config.MEL
    trained_by: str
    stems: tuple[str, ...]  # the model's outputs (the instrumental is the mix minus them)
    config_file: str
    config_url: str
    checkpoint_file: str
    checkpoint_url: str
    scores: tuple[Score, ...]
    parameters: int
    licence: str | None = None  # None: not published
    config_sha256: str | None = None  # None: not published
    checkpoint_sha256: str | None = None  # None: not published

    @property
    def megabytes(self) -> int:
        """About the checkpoint's size: its parameters as float32."""
        return round(self.parameters * 4 / 1e6)

    def score(self, stem: str, test_set: str) -> float | None:
        for score in self.scores:
            if score.stem == stem and score.test_set == test_set:
                return score.sdr
        return None


CATALOGUE: tuple[Checkpoint, ...] = (
    Checkpoint(
        name="bs_roformer_viperx_1297",
        architecture=BS,
        trained_by="viperx",
        stems=("vocals",),
        config_file="model_bs_roformer_ep_317_sdr_12.9755.yaml",
        config_url=f"{_MSST_CONFIGS}/viperx/model_bs_roformer_ep_317_sdr_12.9755.yaml",
        checkpoint_file="model_bs_roformer_ep_317_sdr_12.9755.ckpt",
        checkpoint_url=f"{_UVR_RELEASE}/model_bs_roformer_ep_317_sdr_12.9755.ckpt",
        scores=(
            Score("vocals", 10.87, MULTISONG, _MSST_TABLE),
            Score("vocals", 11.7742, MUSDB_40, _SEPARATOR_SCORES),
            Score("instrumental", 16.4511, MUSDB_40, _SEPARATOR_SCORES),
            Score("vocals", 12.9755, NAMED, "the checkpoint's file name"),
        ),
        parameters=159_758_092,
    ),
    Checkpoint(
        name="mel_band_roformer_viperx_1143",
        architecture=MEL,
        trained_by="viperx",
        stems=("vocals",),
        config_file="model_mel_band_roformer_ep_3005_sdr_11.4360.yaml",
        config_url=f"{_MSST_CONFIGS}/viperx/model_mel_band_roformer_ep_3005_sdr_11.4360.yaml",
        checkpoint_file="model_mel_band_roformer_ep_3005_sdr_11.4360.ckpt",
        checkpoint_url=f"{_UVR_RELEASE}/model_mel_band_roformer_ep_3005_sdr_11.4360.ckpt",
        scores=(
            Score("vocals", 9.67, MULTISONG, _MSST_TABLE),
            Score("vocals", 10.5429, MUSDB_40, _SEPARATOR_SCORES),
            Score("instrumental", 15.1295, MUSDB_40, _SEPARATOR_SCORES),
            Score("vocals", 11.4360, NAMED, "the checkpoint's file name"),
        ),
        parameters=251_869_636,
    ),
    Checkpoint(
        name="mel_band_roformer_kj",
        architecture=MEL,
        trained_by="Kimberley Jensen",
        stems=("vocals",),
        config_file="config_vocals_mel_band_roformer_kj.yaml",
        config_url=f"{_MSST_CONFIGS}/KimberleyJensen/config_vocals_mel_band_roformer_kj.yaml",
        checkpoint_file="MelBandRoformer.ckpt",
        checkpoint_url="https://huggingface.co/KimberleyJSN/melbandroformer/resolve/main/MelBandRoformer.ckpt",
        scores=(
            Score("vocals", 10.98, MULTISONG, _MSST_TABLE),
            Score("vocals", 12.5967, MUSDB_11, _SEPARATOR_SCORES),
        ),
        parameters=228_202_852,
    ),
)
KNOWN = {entry.name: entry for entry in CATALOGUE}
