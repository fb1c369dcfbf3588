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

`parameters` is counted from the architecture at the configuration's dimensions (the test
fixture of its state dict's keys and shapes records it). The checkpoints' sizes and sha256
sums are not published by their trainers; the pins here are the sums that independent
projects recorded from the copies they downloaded and agree on (the Hugging Face file's own
LFS sum for the Kimberley Jensen checkpoint, at the revision its address names), each
consistent with the parameter count: a pull or an import of anything else is refused. The
configurations are pinned to one commit of ZFTurbo's repository, with the sums of the files
at that commit. Licences are not published where these entries come from: None.

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
_MSST_COMMIT = "ccc011abf7f89dd7922bb2888d48493b575c0289"  # 2026-06-09
_MSST_CONFIGS = (
    f"https://raw.githubusercontent.com/ZFTurbo/Music-Source-Separation-Training/{_MSST_COMMIT}"
    "/configs"
)
_KJ_REVISION = "ac9b0614ab3cd7f77219e18ba494dfd93956c348"
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
    config_sha256: str | None = None  # None: not pinned
    checkpoint_sha256: str | None = None  # None: not pinned
    checkpoint_bytes: int | None = None  # the pinned file's size; None: not known

    @property
    def megabytes(self) -> int:
        """The checkpoint's size: the pinned file's, else about its parameters as float32."""
        return round((self.checkpoint_bytes or self.parameters * 4) / 1e6)

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
        config_sha256="42e5635ceab7287b83d9591c9880966f0b61cff26a0a40a29d236bacb32e5f2c",
        checkpoint_sha256="5b84f37e8d444c8cb30c79d77f613a41c05868ff9c9ac6c7049c00aefae115aa",
        checkpoint_bytes=639_331_213,
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
        config_sha256="4e0a24c9078b007caeea94efaad78ed4f29d4f44a80a6aefc4295bff09490314",
        checkpoint_sha256="21b9d0958e35b8ebfbe2afe69bbd5444e5ffe2f5d80ae0d583b833d2f3c0d139",
        checkpoint_bytes=1_007_816_988,
    ),
    Checkpoint(
        name="mel_band_roformer_kj",
        architecture=MEL,
        trained_by="Kimberley Jensen",
        stems=("vocals",),
        config_file="config_vocals_mel_band_roformer_kj.yaml",
        config_url=f"{_MSST_CONFIGS}/KimberleyJensen/config_vocals_mel_band_roformer_kj.yaml",
        checkpoint_file="MelBandRoformer.ckpt",
        checkpoint_url=(
            f"https://huggingface.co/KimberleyJSN/melbandroformer/resolve/{_KJ_REVISION}"
            "/MelBandRoformer.ckpt"
        ),
        scores=(
            Score("vocals", 10.98, MULTISONG, _MSST_TABLE),
            Score("vocals", 12.5967, MUSDB_11, _SEPARATOR_SCORES),
        ),
        parameters=228_202_852,
        config_sha256="f63f38eb1e6e40a7db0dade714a5ae257555dd8748f4e774eae8679275a81926",
        checkpoint_sha256="87201f4d31afb5bc79993230fc49446918425574db48c01c405e44f365c7559e",
        checkpoint_bytes=913_106_900,
    ),
)
KNOWN = {entry.name: entry for entry in CATALOGUE}
