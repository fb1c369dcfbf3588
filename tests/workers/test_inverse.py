"""HTDemucs's last step through workers/demucs/inverse.py: the same stems as demucs's own code."""

from __future__ import annotations

import io

import pytest

from stemdeck_watch.workers.demucs import inverse
from stemdeck_watch.workers.tinymodel import save_tiny_model, tiny_htdemucs

torch = pytest.importorskip("torch")


def mix(seconds: float = 4.0) -> torch.Tensor:
    return torch.randn(1, 2, int(seconds * 44100), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("six", [False, True])
def test_the_routed_last_step_gives_demucs_own_stems_exactly(precision: str, six: bool) -> None:
    from stemdeck_watch.workers.compiled.graph import modes

    torch.manual_seed(0)
    model = tiny_htdemucs(six).eval()
    audio = mix()
    with modes("cpu", precision):
        own = model(audio)
        inverse.route([model])
        assert {"_mask", "_ispec"} <= vars(model).keys()  # routed
        routed = model(audio)
        shorter = model(audio[..., : 3 * 44100])  # padded to the segment by demucs first
    model._mask, model._ispec = type(model)._mask.__get__(model), type(model)._ispec.__get__(model)
    with modes("cpu", precision):
        shorter_own = model(audio[..., : 3 * 44100])
    assert torch.equal(routed, own)
    assert torch.equal(shorter, shorter_own)
    assert "_padded_output" not in vars(model)  # nothing kept once used


def test_a_spectrogram_it_did_not_lay_out_goes_through_demucs_own_padding() -> None:
    torch.manual_seed(0)
    model = tiny_htdemucs().eval()
    inverse.route([model])
    with torch.inference_mode():
        spec = model._spec(mix(1.0))[:, None]  # (1, 1, 2, bins, frames), complex
        length = 44100
        want = type(model)._ispec(model, spec, length)
        model._mask(spec, torch.randn(1, 1, 4, *spec.shape[-2:]))  # lays out another one
        got = model._ispec(spec, length)
    assert torch.equal(got, want)


def test_the_worker_routes_the_models_it_loads(tmp_path) -> None:
    from stemdeck_watch.workers.worker import Worker

    save_tiny_model(tmp_path, "tiny")
    model = Worker("cpu", io.StringIO()).model("tiny", str(tmp_path))
    assert {"_mask", "_ispec"} <= vars(model).keys()  # routed
