"""How the seams test (tests/test_model_based.py) runs: what its examples share, and its
profiles, seeds and replays.

`make test` runs the short profile ("seams-short", derandomized: the same examples every
run). `STEMDECK_SOAK=1` (`make soak`) runs rounds of the long one ("seams-soak") with a new
seed each for STEMDECK_SOAK_SECONDS. STEMDECK_MODEL_SEED=N replays seed N (the first round's,
in a soak), STEMDECK_MODEL_BLOB=… the `@reproduce_failure` blob a failure prints;
STEMDECK_MODEL_EXAMPLES=N changes the number of examples, STEMDECK_MODEL_VERBOSE=1 prints every
step, STEMDECK_MODEL_NO_MOUNT=1 leaves the small disk out.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import hypothesis
from hypothesis import Verbosity, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from stemdeck_watch.util.synth import write_song

from seams_service import MediaServer, SmallDisk
from support.compiled import BuiltCompile


@dataclasses.dataclass
class World:
    """What every example shares: the tiny model, the songs, the link server."""

    tmp: Path
    model_repo: Path
    songs: list[bytes]
    media: MediaServer
    small_disk: str | None  # why no small disk can be had here (None: it can)
    compiled: BuiltCompile  # the tiny model's compiled form, built once, for "cached" examples
    # what the examples did (printed after each run: a soak shows what it covered)
    tally: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


@contextlib.contextmanager
def make_world(tmp: Path, model_repo: Path, songs: int, compiled: BuiltCompile) -> Iterator[World]:
    """`songs` distinct songs of 1.2 s (one size: `cp -p` can keep size and mtime), served
    for links on loopback too."""
    data = [
        write_song(tmp / "songs" / f"c{i}.wav", 1.2, seed=7000 + i).read_bytes()
        for i in range(songs)
    ]
    media = MediaServer(data)
    try:
        no_disk = (
            "turned off by STEMDECK_MODEL_NO_MOUNT"
            if os.environ.get("STEMDECK_MODEL_NO_MOUNT")
            else SmallDisk.unavailable(tmp / "probe")
        )
        yield World(tmp, model_repo, data, media, no_disk, compiled)
    finally:
        media.close()


def run_profiles(
    machine: Callable[[], RuleBasedStateMachine],
    soak: bool,
    soak_seconds: float,
    tally: collections.Counter[str],
) -> None:
    replay = os.environ.get("STEMDECK_MODEL_SEED")
    if not soak:
        try:
            run_machine(machine, "seams-short", int(replay) if replay else None)
        finally:
            print(f"what the examples did: {dict(sorted(tally.items()))}")
        return
    end = time.monotonic() + soak_seconds
    seed = int(replay) if replay else random.SystemRandom().randrange(10**9)
    rounds = 0
    while rounds == 0 or time.monotonic() < end:
        print(f"soak round {rounds + 1}: STEMDECK_MODEL_SEED={seed} STEMDECK_SOAK=1", flush=True)
        try:
            run_machine(machine, "seams-soak", seed)
        finally:
            print(f"what the examples did: {dict(sorted(tally.items()))}", flush=True)
        rounds, seed = rounds + 1, seed + 1


def run_machine(
    machine: Callable[[], RuleBasedStateMachine], profile: str, seed: int | None = None
) -> None:
    chosen = settings.get_profile(profile)
    if os.environ.get("STEMDECK_MODEL_EXAMPLES"):
        chosen = settings(chosen, max_examples=int(os.environ["STEMDECK_MODEL_EXAMPLES"]))
    if os.environ.get("STEMDECK_MODEL_VERBOSE"):
        chosen = settings(chosen, verbosity=Verbosity.debug)  # every step of every example
    blob = os.environ.get("STEMDECK_MODEL_BLOB")
    factory: Any = lambda: machine()  # noqa: E731 (a fresh callable to hang the seed on)
    if blob:
        factory = hypothesis.reproduce_failure(hypothesis.__version__, blob.encode())(factory)
    elif seed is not None:
        factory = hypothesis.seed(seed)(factory)
        chosen = settings(chosen, derandomize=False)
    try:
        run_state_machine_as_test(factory, settings=chosen)
    except BaseException as exc:
        if seed is not None:
            exc.add_note(
                f"replay: STEMDECK_MODEL_SEED={seed}"
                + (" STEMDECK_SOAK=1" if profile == "seams-soak" else "")
            )
        raise
