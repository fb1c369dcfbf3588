"""The RoFormer engine: the published module tree, safe and strict loading, chunked inference.

Real checkpoints cannot be downloaded here. The published configurations are in
data/roformer/ as published; small models are built from them with shrunk dimensions, given
random weights, saved the way the checkpoints are published (`torch.save(state_dict)` plus
the YAML) and loaded through the same code as a real checkpoint. That the module tree is the
published one is checked at full size against fixtures recorded once from the reference
implementation (ZFTurbo's Music-Source-Separation-Training, `models/bs_roformer`): every key
of its state dict, in order, with its shape, for each catalogued configuration
(`roformer_keys_<name>.json.gz`); and that the arithmetic is the reference's, by outputs the
reference gave for small models whose weights are drawn per key from a seed
(`reference_outputs.npz`).
"""

from __future__ import annotations

import gzip
import json
import math
import pickle
import re
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stemdeck_watch.core.errors import ModelError
from stemdeck_watch.workers.demucs.precision import snr_db
from stemdeck_watch.util.safefile import sha256_of
from stemdeck_watch.workers.roformer.catalogue import CATALOGUE, KNOWN, MULTISONG
from stemdeck_watch.workers.roformer.checkpoint import (
    LoadedRoformer,
    build_model,
    load_roformer,
)
from stemdeck_watch.workers.roformer.config import BS, MEL, read_config
from stemdeck_watch.workers.roformer.layers import Transformer
from stemdeck_watch.workers.roformer.inference import (
    plan_chunks,
    separate_array,
    separate_file,
    separate_stream,
)
from stemdeck_watch.stages.scratch import AudioWriter

DATA = Path(__file__).parent / "data" / "roformer"
BS_CONFIG = DATA / KNOWN["bs_roformer_viperx_1297"].config_file
MEL_CONFIG = DATA / KNOWN["mel_band_roformer_kj"].config_file
SMALL_CHUNK = 441 * 20  # 0.2 s: 21 STFT frames at the published hop


def shrink(text: str, chunk: int = SMALL_CHUNK) -> str:
    """A published configuration with small dimensions and chunk, every other line as
    published (its `!!python/tuple` tags included)."""
    for key, value in (("dim", 16), ("depth", 1), ("heads", 2), ("dim_head", 8)):
        text = re.sub(rf"(?m)^  {key}: \d+", f"  {key}: {value}", text)
    return re.sub(r"(?m)^  chunk_size: \d+", f"  chunk_size: {chunk}", text)


def seeded_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Weights drawn per key from a seed of the key's name: the same for any implementation
    with the same keys. The rotary frequencies keep their computed values."""
    state = {}
    for key, value in model.state_dict().items():
        if key.endswith("rotary_embed.freqs"):
            state[key] = value.clone()
            continue
        generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        noise = torch.randn(value.shape, generator=generator) * 0.05
        state[key] = noise + (1.0 if key.endswith(("gamma", "temperature")) else 0.0)
    return state


def save_small(folder: Path, config: Path, seed: int = 0, chunk: int = SMALL_CHUNK) -> Path:
    """Write `<folder>/model.yaml` and `<folder>/model.ckpt` in the published format: the
    shrunk configuration and a plain state dict of random weights. Returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.yaml").write_text(shrink(config.read_text(), chunk))
    torch.manual_seed(seed)
    model = build_model(read_config(folder / "model.yaml"))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    torch.save(model.state_dict(), folder / "model.ckpt")
    return folder


def saved_state(folder: Path) -> dict[str, torch.Tensor]:
    """The state dict `save_small` wrote, read back to be altered (weights only: the same
    restricted unpickler the engine uses, though the file is the test's own)."""
    return torch.load(folder / "model.ckpt", weights_only=True)  # type: ignore[no-any-return]


def load_small(folder: Path) -> LoadedRoformer:
    return load_roformer(folder / "model.yaml", folder / "model.ckpt")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The small models run fastest on one thread: two threads for a few milliseconds of work
    cost more than they give on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedRoformer]:
    root = tmp_path_factory.mktemp("roformer")
    return {
        BS: load_small(save_small(root / "bs", BS_CONFIG)),
        MEL: load_small(save_small(root / "mel", MEL_CONFIG)),
    }


def song(frames: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(frames) / 44100
    tone = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1375 * t)
    return (tone + 0.1 * rng.standard_normal((2, frames))).astype(np.float32)


def worst_snr(reference: dict[str, np.ndarray] | np.ndarray, estimate: Any) -> float:
    if isinstance(reference, dict):
        reference = np.stack(list(reference.values()))
        estimate = np.stack(list(estimate.values()))
    return snr_db(torch.from_numpy(np.asarray(reference)), torch.from_numpy(np.asarray(estimate)))


# the module tree ------------------------------------------------------------------------


@pytest.mark.parametrize("entry", CATALOGUE, ids=lambda e: e.name)
def test_full_size_model_has_the_published_keys_and_shapes(entry: Any) -> None:
    """Built at the published dimensions (on the meta device: no memory), the model's state
    dict is the reference implementation's, key for key, in order, shape for shape."""
    with gzip.open(DATA / f"roformer_keys_{entry.name}.json.gz", "rt") as handle:
        fixture = json.load(handle)
    assert fixture["config"] == entry.config_file
    model = build_model(read_config(DATA / entry.config_file, entry.architecture), "meta")
    keys = {key: list(value.shape) for key, value in model.state_dict().items()}
    assert list(keys) == list(fixture["keys"])
    assert keys == fixture["keys"]
    assert fixture["parameters"] == entry.parameters


def set_model_key(text: str, key: str, value: str) -> str:
    """`model.<key>: <value>` in a configuration's text, in place where the key is there."""
    line = f"  {key}: {value}"
    if re.search(rf"(?m)^  {key}:", text):
        return re.sub(rf"(?m)^  {key}:.*$", line, text)
    return text.replace("model:\n", f"model:\n{line}\n", 1)


# the optional parts of the training code: a linear-attention transformer in every block,
# skip connections between blocks (two blocks, so that one is skipped over), two stems
OPTIONS = {"linear_transformer_depth": "1", "skip_connection": "true", "depth": "2"}
REFERENCE_CASES: dict[str, tuple[Path, dict[str, str]]] = {
    "bs": (BS_CONFIG, {}),
    "mel": (MEL_CONFIG, {}),
    "bs_options": (BS_CONFIG, {**OPTIONS, "num_stems": "2"}),
    "mel_options": (MEL_CONFIG, OPTIONS),
}


def reference_case(name: str) -> str:
    """The configuration text of one recorded case."""
    config, keys = REFERENCE_CASES[name]
    text = shrink(config.read_text())
    for key, value in keys.items():
        text = set_model_key(text, key, value)
    if keys.get("num_stems", "1") != "1":
        text = text.replace("target_instrument: vocals", "target_instrument: null")
    return text


@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_outputs_match_the_reference_implementation(tmp_path: Path, name: str) -> None:
    """Small models with seeded weights give the outputs the reference implementation gave
    for the same weights and input (recorded once): the arithmetic, not only the names."""
    recorded = np.load(DATA / "reference_outputs.npz")
    (tmp_path / "model.yaml").write_text(reference_case(name))
    model = build_model(read_config(tmp_path / "model.yaml"))
    model.load_state_dict(seeded_weights(model))
    with torch.inference_mode():
        out = model.eval()(torch.from_numpy(recorded["input"]))
    assert out.shape == recorded[name].shape
    assert worst_snr(recorded[name], out.numpy()) > 100


# loading --------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [BS_CONFIG, MEL_CONFIG], ids=[BS, MEL])
def test_small_model_saved_as_published_loads_through_the_real_path(
    tmp_path: Path, config: Path
) -> None:
    folder = save_small(tmp_path, config)
    state = saved_state(folder)
    loaded = load_small(folder)
    assert loaded.module.training is False
    for key, value in loaded.module.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert loaded.stems == ("vocals",)
    assert (loaded.samplerate, loaded.channels, loaded.chunk_size) == (44100, 2, SMALL_CHUNK)
    assert loaded.num_overlap == 2


def _rewrite(folder: Path, change: Any) -> None:
    state = saved_state(folder)
    change(state)
    torch.save(state, folder / "model.ckpt")


def test_a_missing_key_is_named(tmp_path: Path) -> None:
    folder = save_small(tmp_path, BS_CONFIG)
    _rewrite(folder, lambda s: s.pop("layers.0.1.layers.0.0.to_gates.bias"))
    with pytest.raises(ModelError, match=r"missing layers\.0\.1\.layers\.0\.0\.to_gates\.bias"):
        load_small(folder)


def test_an_unexpected_key_is_named(tmp_path: Path) -> None:
    folder = save_small(tmp_path, MEL_CONFIG)
    _rewrite(folder, lambda s: s.update({"final_norm.gamma": torch.ones(16)}))
    with pytest.raises(ModelError, match=r"unexpected final_norm\.gamma"):
        load_small(folder)


def test_a_shape_mismatch_is_named_with_both_shapes(tmp_path: Path) -> None:
    """A checkpoint trained with other dimensions than its configuration says."""
    folder = save_small(tmp_path, BS_CONFIG)
    other = save_small(tmp_path / "wide", BS_CONFIG)
    (other / "model.yaml").write_text(
        (folder / "model.yaml").read_text().replace("  dim: 16", "  dim: 24")
    )
    with pytest.raises(ModelError) as caught:
        load_small(other)
    message = str(caught.value)
    assert (
        "other shape: layers.0.0.layers.0.0.norm.gamma (16,) where the model has (24,)" in message
    )
    assert "published together" in message


class _Marker:
    """Unpickling this would create a file: the test checks it never ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (Path.touch, (Path(self.path),))


def test_a_checkpoint_that_needs_more_than_tensors_is_refused_unrun(tmp_path: Path) -> None:
    folder = save_small(tmp_path, BS_CONFIG)
    marker = tmp_path / "code-ran"
    state = saved_state(folder)
    state["extra"] = _Marker(str(marker))
    torch.save(state, folder / "model.ckpt")
    with pytest.raises(ModelError, match="refused the checkpoint .*not a plain state dict") as e:
        load_small(folder)
    assert "Unsupported global" in str(e.value) and "weights_only` set to `False" not in str(
        e.value
    )
    assert not marker.exists()


def test_a_plain_pickle_is_refused(tmp_path: Path) -> None:
    folder = save_small(tmp_path, BS_CONFIG)
    with open(folder / "model.ckpt", "wb") as handle:
        pickle.dump({"weights": _Marker(str(tmp_path / "ran"))}, handle, protocol=2)
    with pytest.raises(ModelError, match="refused the checkpoint"):
        load_small(folder)
    assert not (tmp_path / "ran").exists()


def test_a_wrapped_state_dict_loads(tmp_path: Path) -> None:
    """Trainers' wrappers (`{"state_dict": …}`) hold the same state dict."""
    folder = save_small(tmp_path, MEL_CONFIG)
    state = saved_state(folder)
    torch.save({"state_dict": state, "epoch": 3}, folder / "model.ckpt")
    assert load_small(folder).stems == ("vocals",)


def test_safetensors_load_too(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = save_small(tmp_path, BS_CONFIG)
    state = saved_state(folder)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    loaded = load_roformer(folder / "model.yaml", folder / "model.safetensors")
    assert torch.equal(loaded.module.state_dict()["final_norm.gamma"], state["final_norm.gamma"])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.replace("  dim: 16\n", "  dim: 16\n  wider: true\n"),
            r"model\.wider is not a key",
        ),
        (lambda t: t.replace("  dim: 16\n", ""), r"model\.dim is missing"),
        (lambda t: t.replace("  depth: 1", "  depth: one"), r"model\.depth should be int"),
        (lambda t: t.replace("  stereo: true", "  stereo: 1"), r"model\.stereo should be bool"),
        (lambda t: t.replace("  dim: 16\n", "  dim: 16\n  use_pope: true\n"), "PoPE"),
        (lambda t: t.replace("    - 129", "    - 128"), "adds up to 1024 bins"),
        (lambda t: t.replace("num_overlap: 2", "num_overlap: 0"), "inference.num_overlap"),
        (lambda t: t.replace("  num_channels: 2", "  num_channels: 1"), "audio.num_channels"),
        (lambda t: t.replace("  dim: 16\n", "  dim: !!python/object:os.system ls\n"), "not YAML"),
        (lambda t: "model: [1, 2]\n", "no `model:` section"),
        (lambda t: t.replace("  dim: 16\n", "  dim: 16\n  depth: 2\n"), "'depth' is given twice"),
    ],
)
def test_a_bad_configuration_is_named(tmp_path: Path, edit: Any, message: str) -> None:
    path = tmp_path / "model.yaml"
    path.write_text(edit(shrink(BS_CONFIG.read_text())))
    with pytest.raises(ModelError, match=message):
        read_config(path)


def test_the_catalogue_architecture_must_agree(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="describes a bs_roformer model"):
        read_config(BS_CONFIG, MEL)


# chunked inference ----------------------------------------------------------------------


def whole_song_overlap_add(model: LoadedRoformer, mix: np.ndarray, num_overlap: int) -> np.ndarray:
    """The windowed overlap-add written over whole arrays in one pass (torch's own reflect
    padding, the whole song padded at once): what the streamed version must equal."""
    chunk, frames = model.chunk_size, mix.shape[1]
    step = chunk // num_overlap
    overlap, fade = chunk - step, min(chunk // 10, chunk - step)
    border = overlap if frames > 2 * overlap and overlap > 0 else 0
    padded = torch.from_numpy(mix)
    if border:
        padded = F.pad(padded[None], (border, border), mode="reflect")[0]
    total = padded.shape[1]
    result = torch.zeros(len(model.stems), 2, total)
    counter = torch.zeros(total)
    for start in range(0, total, step):
        part = padded[:, start : start + chunk]
        length = part.shape[1]
        if length < chunk:
            mode = "reflect" if length > chunk // 2 else "constant"
            part = F.pad(part[None], (0, chunk - length), mode=mode)[0]
        with torch.inference_mode():
            out = model.module(part[None])[0]
        window = torch.ones(chunk)
        if start > 0:
            window[:fade] = torch.linspace(0, 1, fade)
        if start + chunk < total:
            window[-fade:] = torch.linspace(1, 0, fade)
        result[..., start : start + length] += out[..., :length] * window[:length]
        counter[start : start + length] += window[:length]
    return (result / counter)[..., border : border + frames].numpy()


@pytest.mark.parametrize("architecture", [BS, MEL])
def test_a_song_of_one_chunk_equals_one_forward_pass(
    small: dict[str, LoadedRoformer], architecture: str
) -> None:
    model = small[architecture]
    frames = model.chunk_size // 2  # one chunk; the rest of it is zeros
    mix = song(frames)
    padded = np.zeros((2, model.chunk_size), np.float32)
    padded[:, :frames] = mix
    with torch.inference_mode():
        whole = model.module(torch.from_numpy(padded)[None])[0, ..., :frames].numpy()
    assert worst_snr(whole, np.stack(list(separate_array(model, mix).values()))) > 100


@pytest.mark.parametrize("architecture", [BS, MEL])
def test_streamed_chunks_equal_the_whole_song_overlap_add(
    small: dict[str, LoadedRoformer], architecture: str
) -> None:
    """Many chunks, batches that do not divide them, both ends reflected: the streamed
    result is the whole-array computation's within float rounding."""
    model = small[architecture]
    mix = song(int(model.chunk_size * 3.3))
    whole = whole_song_overlap_add(model, mix, 2)
    for batch_size in (1, 3):
        streamed = separate_array(model, mix, batch_size=batch_size)
        assert worst_snr(whole, np.stack(list(streamed.values()))) > 100, batch_size


class _Pointwise(nn.Module):
    """A stand-in whose stems depend on each sample alone: overlap-add over any chunking must
    give exactly f(mix) for the whole song."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.tanh(audio), 0.5 * audio], dim=1)


class _StandIn:
    def __init__(self, chunk: int, num_overlap: int):
        self.module = _Pointwise()
        self.stems = ("a", "b")
        self.channels, self.chunk_size, self.num_overlap = 2, chunk, num_overlap


@pytest.mark.parametrize("num_overlap", [1, 2, 3, 4])
@pytest.mark.parametrize("frames", [1, 99, 1000, 1001, 2000, 5003])
def test_every_sample_is_weighed_and_the_padding_trimmed(num_overlap: int, frames: int) -> None:
    model = _StandIn(1000, num_overlap)
    mix = song(frames, seed=frames)
    out = separate_array(model, mix, batch_size=2)  # type: ignore[arg-type]
    expected = {"a": np.tanh(mix), "b": 0.5 * mix}
    assert worst_snr(expected, out) > 100


@pytest.mark.parametrize("batch_size", [1, 2])
def test_progress_rises_to_one_within_and_between_chunks(
    small: dict[str, LoadedRoformer], batch_size: int
) -> None:
    """After each chunk, and inside each chunk after each transformer (two in the small
    model: one block of time and frequency), always rising."""
    model = small[BS]
    frames = int(model.chunk_size * 3.5)
    seen: list[float] = []
    separate_array(model, song(frames), on_progress=seen.append, batch_size=batch_size)
    chunks = len(plan_chunks(frames, model.chunk_size, model.num_overlap).starts)
    batches = -(-chunks // batch_size)
    assert len(seen) == chunks + 2 * batches and seen[-1] == 1.0
    assert all(a < b for a, b in zip(seen, seen[1:]))


def test_a_cancel_stops_inside_a_chunk(small: dict[str, LoadedRoformer]) -> None:
    """Raising from the progress call after the second chunk's first transformer stops that
    chunk there: its second transformer never runs, nothing of it is handed on, and the
    engine's hooks are gone from the model afterwards."""
    model = small[MEL]
    frames = int(model.chunk_size * 3.5)
    mix = song(frames)
    chunks = len(plan_chunks(frames, model.chunk_size, model.num_overlap).starts)

    class Stop(Exception):
        pass

    def cancel(fraction: float) -> None:
        if fraction > 1 / chunks:
            raise Stop

    handed, last_ran = [0], [0]
    last = [m for m in model.module.modules() if isinstance(m, Transformer)][-1]
    counter = last.register_forward_hook(lambda *_: last_ran.__setitem__(0, last_ran[0] + 1))
    try:
        with pytest.raises(Stop):
            separate_stream(
                model,
                lambda a, b: mix[:, a:b],
                frames,
                lambda block: handed.__setitem__(0, handed[0] + block.shape[-1]),
                on_progress=cancel,
            )
    finally:
        counter.remove()
    assert last_ran[0] == 1  # the first chunk's; the second stopped before it
    border = plan_chunks(frames, model.chunk_size, model.num_overlap).border
    # what the first chunk made final: up to the second chunk's start, less the padding
    assert handed[0] == model.chunk_size // 2 - border
    assert not any(m._forward_hooks for m in model.module.modules())


def test_memory_is_bounded_by_the_chunk_not_the_song(small: dict[str, LoadedRoformer]) -> None:
    """Reads are chunk-sized, stems are handed on as they are final: the first block leaves
    before the last chunk is read, and no block is longer than a chunk plus a batch."""
    model = small[MEL]
    frames = model.chunk_size * 8
    mix = song(frames)
    events: list[tuple[str, int]] = []

    def read(a: int, b: int) -> np.ndarray:
        events.append(("read", b - a))
        return mix[:, a:b]

    separate_stream(
        model, read, frames, lambda block: events.append(("out", block.shape[-1])), batch_size=2
    )
    plan = plan_chunks(frames, model.chunk_size, model.num_overlap)
    assert max(n for kind, n in events if kind == "read") <= plan.chunk
    assert max(n for kind, n in events if kind == "out") <= plan.chunk + 2 * plan.step
    assert sum(n for kind, n in events if kind == "out") == frames
    first_out = min(i for i, (kind, _) in enumerate(events) if kind == "out")
    last_read = max(i for i, (kind, _) in enumerate(events) if kind == "read")
    assert first_out < last_read


def test_scratch_files_in_and_out(small: dict[str, LoadedRoformer], tmp_path: Path) -> None:
    model = small[BS]
    mix = song(int(model.chunk_size * 2.2))
    with AudioWriter(tmp_path / "mix.npy", 2) as writer:
        writer.write(mix)
    paths = separate_file(model, tmp_path / "mix.npy", tmp_path / "stems")
    assert list(paths) == ["vocals"]
    expected = separate_array(model, mix)["vocals"]
    assert np.array_equal(np.load(paths["vocals"]), expected)

    def cancel(fraction: float) -> None:
        raise RuntimeError("cancelled")

    with pytest.raises(RuntimeError):
        separate_file(model, tmp_path / "mix.npy", tmp_path / "gone", on_progress=cancel)
    assert list((tmp_path / "gone").iterdir()) == []


def test_bfloat16_runs_close_to_float32(small: dict[str, LoadedRoformer]) -> None:
    model = small[MEL]
    mix = song(int(model.chunk_size * 1.5))
    full = separate_array(model, mix)
    reduced = separate_array(model, mix, precision="bfloat16")
    snr = worst_snr(full, reduced)
    assert math.isfinite(snr) and snr > 20


def test_a_mix_of_the_wrong_channel_count_is_refused(small: dict[str, LoadedRoformer]) -> None:
    with pytest.raises(ValueError, match=r"takes \(2, frames\) audio"):
        separate_array(small[BS], song(1000)[:1])


def test_the_catalogue_reads_without_torch() -> None:
    """`models list` shows the catalogue without a worker: importing it imports no torch."""
    code = (
        "import sys, stemdeck_watch.workers.roformer.catalogue as c; "
        "assert c.KNOWN; print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "False"


def test_every_catalogued_score_names_its_test_set() -> None:
    for entry in CATALOGUE:
        assert entry.scores and all(s.test_set and s.source for s in entry.scores)
        assert entry.score("vocals", MULTISONG) is not None
        assert entry.licence is None  # none published
        assert entry.checkpoint_sha256 and entry.config_sha256 and entry.checkpoint_bytes
        # the pinned size fits the architecture: its parameters as float32, and a pickle's
        # few hundred kilobytes of names around them
        assert 0 < entry.checkpoint_bytes - entry.parameters * 4 < 1_000_000
        # the tests' copies of the configurations are the pinned files
        assert sha256_of(DATA / entry.config_file) == entry.config_sha256
