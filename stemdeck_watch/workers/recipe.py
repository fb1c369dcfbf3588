"""A song separated by recipe, in the worker: the lead model's stems from the mix, Demucs's
from what it leaves (core/recipes.py says which model makes which stem).

A separate request may carry a "lead": a RoFormer checkpoint and its own settings
(`{"engine": "roformer", "model": NAME, "batch_size": N, "num_overlap": N|null,
"precision": P}`). Then the worker

1. separates the mix with the RoFormer, chunk by chunk (workers/roformer/inference.py), into
   its stems (`vocals.npy`);
2. writes the instrumental, the mix minus those stems, block by block;
3. separates the instrumental with the request's Demucs model, as any song (its own
   statistics: the mix's are not the instrumental's);
4. keeps Demucs's stems but the lead's (its drums, bass, and for a six-stem model guitar
   and piano) and writes "other" as the instrumental minus them.

So the stems add up to the mix to float rounding, as one model's output does after the
residual: the output's one-gain rule holds unchanged. What Demucs still hears of the vocals
in the instrumental (the RoFormer's misses) goes to "other", where it was in the mix.

Progress: the RoFormer's part is LEAD_SHARE of the song, reported after each of its
transformers (seconds apart even on a CPU, so the stall watchdog hears from it), Demucs's the
rest; a cancel or a fault stops either inside. The memory ladder: a shrunk request
(`shrink`, after the memory ran out) halves the RoFormer's batch (`lead_batch`) as it halves
Demucs's window, and the pipeline moves the song to the CPU after that, as for Demucs alone.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np

from stemdeck_watch.core.errors import ModelError
from stemdeck_watch.stages.scratch import BLOCK_FRAMES, AudioReader, AudioWriter

log = logging.getLogger("stemdeck_watch.worker.recipe")

LEAD_SHARE = 0.5  # of a song's progress: the RoFormer's part
WORK = ".recipe"  # in the output folder while it runs: the instrumental, Demucs's own stems

Progress = Callable[[float], None]


class LeadUnavailable(Exception):
    """The lead model cannot be had or does not fit; the message says which and what to do."""


def load_lead(name: str, repo: str | None, device: str) -> Any:
    """The catalogued RoFormer `name`, from the owner's model_repo folder or the model cache,
    loaded weights-only and strictly (a key that does not fit is named)."""
    from stemdeck_watch.workers.demucs.models import cache_dir
    from stemdeck_watch.workers.roformer.checkpoint import load_roformer
    from stemdeck_watch.workers.roformer.store import RoformerStoreError, entry_of, where

    try:
        entry = entry_of(name)
        config, checkpoint = where(name, cache_dir(), repo)
    except RoformerStoreError as exc:
        raise LeadUnavailable(str(exc)) from None
    missing = [path.name for path in (config, checkpoint) if not path.is_file()]
    if missing:
        place = (
            f"separation.model_repo ({repo}): copy the published files there "
            f"(`stemdeck-watch models list` says where they come from)"
            if repo
            else f"the model cache ({config.parent}): run `stemdeck-watch models pull {name}` "
            f"or `stemdeck-watch models import FOLDER`"
        )
        raise LeadUnavailable(
            f"could not load the RoFormer {name!r}: {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not in {place}"
        )
    try:
        loaded = load_roformer(config, checkpoint, entry.architecture)
    except ModelError as exc:
        raise LeadUnavailable(f"could not load the RoFormer {name!r}: {exc}") from None
    loaded.module.to(device)
    return loaded


def separate_led(
    lead: Any,
    request: dict[str, Any],
    input_path: Path,
    output_dir: Path,
    on_progress: Progress,
    demucs: Callable[[dict[str, Any], Path, Path, Progress], dict[str, Path]],
) -> tuple[dict[str, Path], dict[str, str]]:
    """Separate as the module docstring says; `lead`: the loaded RoFormer; `demucs`: the
    worker's own separation of a file by the request's Demucs model. Returns the stems
    (in Demucs's order) and which model made each."""
    from stemdeck_watch.workers.roformer.inference import separate_file

    step = request["lead"]
    weight = next(iter(lead.module.parameters()), None)
    device = weight.device.type if weight is not None else "cpu"
    batch = lead_batch(step.get("batch_size"), lead.config.batch_size, device, request)
    output_dir.mkdir(parents=True, exist_ok=True)
    work = output_dir / WORK
    shutil.rmtree(work, ignore_errors=True)  # a failed attempt's
    (work / "stems").mkdir(parents=True)
    try:
        led = separate_file(
            lead,
            input_path,
            output_dir,
            batch_size=batch,
            num_overlap=step.get("num_overlap") or None,
            precision=lead_precision(step.get("precision"), device),
            on_progress=lambda v: on_progress(LEAD_SHARE * v),
        )
        instrumental = work / "instrumental.npy"
        _difference(input_path, list(led.values()), instrumental)
        rest = {k: v for k, v in request.items() if k not in ("lead", "mean", "std")}
        theirs = demucs(
            rest,
            instrumental,
            work / "stems",
            lambda v: on_progress(LEAD_SHARE + (1 - LEAD_SHARE) * v),
        )
        kept = [stem for stem in theirs if stem not in led and stem != "other"]
        _difference(instrumental, [theirs[s] for s in kept], output_dir / "other.npy")
        stems: dict[str, Path] = {}
        for stem in theirs:
            stems[stem] = led.get(stem) or output_dir / f"{stem}.npy"
            if stem in kept:
                os.replace(theirs[stem], stems[stem])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    made_by = {stem: str(step["model"]) if stem in led else str(request["model"]) for stem in stems}
    return stems, made_by


def lead_batch(asked: int | None, own: int, device: str, request: dict[str, Any]) -> int:
    """Chunks the RoFormer runs at once: as asked, else its configuration's own on a GPU
    (the figure it was published with) and one on a CPU (as fast, and the least memory);
    halved for each time the memory ran out under the song (`shrink`), down to one."""
    batch = int(asked or (own if device != "cpu" else 1))
    return max(1, batch >> int(request.get("shrink") or 0))


def lead_precision(asked: str | None, device: str) -> str:
    """The precision the RoFormer runs in: as asked, or for "auto" (the default) the one
    measured fastest and close enough on the device: float16 on a CUDA GPU (as fast as
    bfloat16 at full size, and 59–64 dB from float32's stems against bfloat16's 41–46),
    float32 elsewhere (bfloat16 ran a small model ~19× slower on a CPU; docs/benchmarks.md)."""
    if asked and asked != "auto":
        return asked
    return "float16" if device == "cuda" else "float32"


def _difference(minuend: Path, subtrahends: list[Path], out: Path) -> None:
    """`out` = `minuend` minus every file of `subtrahends`, block by block (float32, as
    the files hold them: the sum back is exact to float rounding)."""
    source = AudioReader(minuend)
    others = [AudioReader(path) for path in subtrahends]
    with AudioWriter(out, source.channels) as writer:
        for start in range(0, source.frames, BLOCK_FRAMES):
            stop = min(source.frames, start + BLOCK_FRAMES)
            block = source.read(start, stop).astype(np.float32, copy=True)
            for other in others:
                block -= other.read(start, stop)
            writer.write(block)
