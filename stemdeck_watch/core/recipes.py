"""Recipes: which model makes which stem, chosen by name (`separation.recipe`).

No single model is best at every stem: a RoFormer's vocals score several dB above
HTDemucs's, while Demucs still gives drums, bass and other. A recipe runs its vocal model
on the mix first, then the Demucs model on what is left (the mix minus those vocals), and
keeps Demucs's drums and bass; "other" is the rest of the instrumental (the instrumental
minus drums and bass), so the four stems add up to the mix exactly, as one model's do.

A recipe names its models, so with one chosen `separation.model` is not used: the recipe's
`rest` model is. Presets, name tags and sidecars choose a recipe by name from this list only:
a file dropped into the inbox never names a checkpoint, a URL or a folder.

No torch here: the config, the drop gate and `models list` read it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    vocals: str  # a RoFormer checkpoint of workers/roformer/catalogue.py
    rest: str  # a Demucs model: drums and bass, and "other" as what remains
    about: str

    def made_by(self, stems: tuple[str, ...]) -> dict[str, str]:
        """Which model makes each of `stems` (the rest model's stems)."""
        return {stem: self.vocals if stem == "vocals" else self.rest for stem in stems}


RECIPES: tuple[Recipe, ...] = (
    Recipe(
        "best",
        vocals="bs_roformer_viperx_1297",
        rest="htdemucs_ft",
        about="BS-RoFormer vocals (viperx), drums, bass and "
        "other from the fine-tuned HTDemucs on the instrumental",
    ),
    Recipe(
        "best_quick",
        vocals="bs_roformer_viperx_1297",
        rest="htdemucs",
        about="BS-RoFormer vocals, the rest from htdemucs (one model, not four)",
    ),
    Recipe(
        "mel",
        vocals="mel_band_roformer_kj",
        rest="htdemucs_ft",
        about="Mel-Band RoFormer (Kimberley Jensen) vocals, the rest from htdemucs_ft",
    ),
)
KNOWN: dict[str, Recipe] = {recipe.name: recipe for recipe in RECIPES}


def recipe_name(value: object) -> str:
    """A config value for `separation.recipe`: "" (none) or a recipe of the list."""
    if value == "" or (isinstance(value, str) and value in KNOWN):
        return str(value)
    raise ValueError(f'"" (no recipe: separation.model alone) or one of {", ".join(KNOWN)}')
