"""Sequences the seams test (tests/seams/test_model_based.py) runs as written, before its
random examples: each walks the machine's own rules to a seam where a defect was found
before (a duplicate, a removal, work prepared ahead, a song written out behind the next
one, a planted link, a full disk, a share away, a recipe, a retry), with every invariant
checked after every step as in a random example. Random sequences reach these seams too, but rarely in the few examples CI
has time for; written out, they are reached in every run, in about the time of one random
example each (`make mutants` measures what they catch).

A script drops songs while the queue is paused and waits for each to be queued, so that the
order is the one written; where a window is short (a song's work prepared ahead while the
one before it separates, a song arriving while another separates), the worker is held
stopped for the moment it takes.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from stemdeck_watch.core.choices import SIDECAR_SUFFIX

from seams_folders import RECIPE_SLOT, STATUS_TEMP

Script = Callable[[Any], None]
VERBOSE = bool(os.environ.get("STEMDECK_MODEL_VERBOSE"))


def step(machine: Any, rule: str, **kwargs: Any) -> None:
    """One rule, then the invariants, as Hypothesis runs them."""
    started = time.monotonic()
    getattr(machine, rule)(**kwargs)
    machine.always()
    if VERBOSE:
        print(f"  {rule}({kwargs}) {time.monotonic() - started:.1f} s", flush=True)


def queued_in_order(machine: Any, drops: list[tuple[str, int]]) -> None:
    """Each (slot, song) dropped while the queue is paused, one at a time, in this order;
    then the queue started."""
    step(machine, "pause_or_start", pause=True)
    for count, (slot, song) in enumerate(drops, 1):
        if slot == "l.url":
            step(machine, "link", song=song, how="atomic")
        else:
            step(machine, "drop", slot=slot, song=song, how="atomic")
        if machine.failure is None:
            machine.until_queued(count)
    step(machine, "pause_or_start", pause=False)


# the songs the written sequences use: past the rules' own (SONGS), so that each section
# has songs no earlier one separated (a duplicate is not separated: no work ahead, nothing
# written out behind)
FIRST = 4
EXTRA = 16  # songs FIRST .. FIRST + EXTRA - 1
HEAVY = b"practice = true\nstem_file = true\n"  # a sidecar: its song takes long to write out


def duplicates(machine: Any) -> None:
    """The same song twice at once (separated once); the duplicate removed (the original's
    folder stays); the original's folder taken away and another song published there, then
    the first song dropped again (separated again, not pointed at that folder)."""
    song, other = FIRST, FIRST + 1
    step(machine, "drop", slot="a.wav", song=song, how="atomic")
    step(machine, "drop", slot="b.wav", song=song, how="atomic")
    step(machine, "wait", until="quiet")
    view = machine.view()
    ended = sorted(
        (j for j in view.jobs.values() if j.state in ("done", "failed", "cancelled")),
        key=lambda j: -j.created_at,
    )
    copy = next(
        (i for i, j in enumerate(ended) if (j.error or "").startswith("already separated")), 0
    )
    step(machine, "remove", pick=copy)
    step(machine, "wait", until="quiet")
    step(machine, "take_away", pick=0)
    step(machine, "drop", slot="a.wav", song=other, how="atomic")
    step(machine, "wait", until="quiet")
    step(machine, "drop", slot="b.wav", song=song, how="atomic")
    step(machine, "wait", until="quiet")


def ahead(machine: Any) -> None:
    """A song overwritten by a copy with its size and time (`cp -p` onto it) once it was
    decoded ahead; a link edited once its download was prepared ahead, in place and then
    keeping its size and time (a URL of the same length: only the URL tells)."""
    queued_in_order(machine, [("a.wav", FIRST + 2), ("b.wav", FIRST + 3)])
    step(machine, "replace_next", song=FIRST + 4, how="cp -p onto", after="prepared")
    step(machine, "wait", until="quiet")
    queued_in_order(machine, [("a.wav", FIRST + 5), ("l.url", FIRST + 6)])
    step(machine, "replace_next", song=FIRST + 7, how="inplace", after="prepared")
    step(machine, "wait", until="quiet")
    queued_in_order(machine, [("a.wav", FIRST + 8), ("l.url", FIRST + 9)])
    step(machine, "replace_next", song=FIRST + 10, how="cp -p onto", after="prepared")
    step(machine, "wait", until="quiet")


def full_disk(machine: Any) -> None:
    """The disk filled while a song separates, and a song dropped then: it waits for room,
    and is not prepared ahead meanwhile (only where a small disk can be had)."""
    if machine.disk is None:
        return  # no small disk here
    queued_in_order(machine, [("duo/a.wav", FIRST)])  # a new song with the preset's settings
    if machine.until_separating():
        with machine.frozen_worker():
            step(machine, "fill_disk", fill=True)
            step(machine, "drop", slot="b.wav", song=FIRST + 1, how="atomic")
            if machine.failure is None:
                machine.until_queued(1)
                machine.looked_ahead()
            machine.always()
    step(machine, "fill_disk", fill=False)
    step(machine, "wait", until="quiet")


def behind(machine: Any) -> None:
    """Songs written out behind the next one's separation: one cancelled while its stems
    are written, a clean stop while another is; a link planted at STATUS.txt's guessable
    temporary name meanwhile. The rules' own songs, none separated yet."""
    step(machine, "plant_link", where=STATUS_TEMP)
    # b is written out when the service is stopped: practice mp3s and a stem file make that
    # take long enough to be cut off, while the worker and its zygote are held
    machine.hands.place("b.wav" + SIDECAR_SUFFIX, HEAVY, "atomic")
    queued_in_order(machine, [("a.wav", 0), ("b.wav", 1), ("duo.wav", 2), ("duo/a.wav", 3)])
    step(machine, "cancel", phase="publishing", pick=0)
    step(machine, "restart", how="clean while held")
    step(machine, "wait", until="quiet")


def shares(machine: Any) -> None:
    """The inbox's share away while a song separates and the next one waits (held stopped
    for that moment: the inbox left an empty folder, then missing), then the outbox's while
    the next one separates: the queue pauses for each and goes on, and both songs are
    published once the shares answer; then a queued song deleted while the inbox is away."""
    queued_in_order(machine, [("a.wav", FIRST + 11), ("b.wav", FIRST + 12)])
    if machine.until_separating():
        with machine.frozen_worker():
            # left empty first, while the watcher is sure to be looking (once the inbox was
            # missing, the watcher starts looking again a moment after it is back)
            step(machine, "share_away", role="inbox", how="emptied", seconds=2.0)
            step(machine, "share_away", role="inbox", how="missing", seconds=2.0)
    if machine.until_separating():
        step(machine, "share_away", role="outbox", how="missing", seconds=2.0)
    step(machine, "wait", until="quiet")
    # a queued song deleted while the inbox is away, unheard: its job must end once it is
    # back (the queue paused meanwhile, so nothing else would end it)
    step(machine, "pause_or_start", pause=True)
    step(machine, "drop", slot="a.wav", song=FIRST + 15, how="atomic")
    if machine.failure is None:
        machine.until_queued(1)
    step(machine, "share_away", role="inbox", how="missing", seconds=0.0, deleted=True)
    step(machine, "pause_or_start", pause=False)
    step(machine, "wait", until="quiet")


def recipe(machine: Any) -> None:
    """One song under the recipe (RoFormer vocals, Demucs for the rest) and as itself, back
    to back: two separations with different settings, the worker switching models between
    them; then the recipe's song cancelled while it separates."""
    song = FIRST + 13
    queued_in_order(machine, [(RECIPE_SLOT, song), ("a.wav", song)])
    step(machine, "wait", until="quiet")
    queued_in_order(machine, [(RECIPE_SLOT, FIRST + 12)])
    step(machine, "cancel", phase="separating", pick=0)
    step(machine, "wait", until="quiet")


def retried(machine: Any) -> None:
    """A song cancelled while queued, retried, and the row the retry replaced removed: no
    tombstone may stand over the retry's version, and the retry runs."""
    step(machine, "pause_or_start", pause=True)
    step(machine, "drop", slot="b.wav", song=FIRST + 14, how="atomic")
    if machine.failure is None:
        machine.until_queued(1)
    step(machine, "cancel", phase="queued", pick=0)
    step(machine, "retry", pick=0)
    step(machine, "remove", pick=0)
    step(machine, "pause_or_start", pause=False)
    step(machine, "wait", until="quiet")


# in this order, on one service (its first song pays the worker's start, the rest do not)
SECTIONS: dict[str, Script] = {
    "duplicates": duplicates,
    "ahead": ahead,
    "full disk": full_disk,
    "behind": behind,
    "shares": shares,
    "recipe": recipe,
    "retried": retried,
}


def run_scripts(machine: Callable[[], Any], names: list[str] | None = None) -> None:
    """The sections (`names`: those alone) in turn on one service, on a small disk where
    one can be had; the first failure is raised, naming its section."""
    made = machine()
    section = "begin"
    started = time.monotonic()
    try:
        try:
            step(made, "begin", small=True, first=[], compiled="cached")
            for section, script in SECTIONS.items():
                if names is None or section in names:
                    script(made)
                    if made.failure is not None:
                        break  # the rest would only draw: the failure names this section
                    if VERBOSE:
                        print(f"section {section!r}: {time.monotonic() - started:.0f} s")
        except Exception as exc:
            made.failure = made.failure or exc
        made.teardown()
        print(f"the written sequences: {time.monotonic() - started:.0f} s", flush=True)
    except BaseException as exc:
        exc.add_note(
            f"in the written sequence {section!r} (tests/seams/seams_scripts.py; "
            f"STEMDECK_MODEL_SCRIPTS={section.replace(' ', '_')} runs it alone); steps: "
            + "; ".join(made.steps)
        )
        raise
