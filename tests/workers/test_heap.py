"""The worker's C heap keeps what one segment frees for the next (workers/heap.py): counted
in page faults, which are deterministic where timings are not."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
    reason="the heap's settings are glibc's; other C libraries keep freed memory their own way",
)

# Twelve "segments" replaying the same allocations (1–30 MB tensors, a few alive at once), as
# a model's segments do; the page faults of the last eight, and the resident memory after them
# and after give_back. With `worker`, the heap is set up as a worker's is: by making one.
REPLAY = textwrap.dedent(
    """
    import io, json, random, resource, sys
    import torch
    from stemdeck_watch.workers import heap

    if sys.argv[1] == "worker":
        from stemdeck_watch.workers.worker import Worker
        Worker("cpu", io.StringIO())

    def resident():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    def segment(seed):
        rng, live = random.Random(seed), []
        for _ in range(40):
            live.append(torch.ones(rng.randint(1, 30) * 2**18))
            if len(live) > 4:
                live.pop(rng.randrange(len(live)))

    for n in range(4):
        segment(n % 2)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for n in range(8):
        segment(n % 2)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    kept = resident()
    heap.give_back()
    held = sys.argv[1] == "worker" and heap.hold_for_separation()  # says it takes, once done
    print(json.dumps({"held": held, "faults": faults, "kept": kept, "given_back": resident()}))
    """
)


def replay(mode: str) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", REPLAY, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_worker_reuses_what_a_segment_freed_and_gives_it_back_after_the_song() -> None:
    plain, worker = replay("plain"), replay("worker")
    # glibc's own settings map and unmap the same memory again, segment after segment:
    # 15,000–320,000 faults here (where the heap lands decides); a worker's, next to none
    assert worker["faults"] < 8192, (worker, plain)
    # what it kept goes back to the system once the song is done
    assert worker["kept"] - worker["given_back"] > 32 * 2**20, worker
    assert worker["held"] is True and plain["held"] is False


# A worker loading a model, and the resident anonymous memory it gained by that: the model
# and what torch sets up once, not the warm-up's freed tensors (`drop_give_back`: the heap's
# give_back made a no-op, as a control).
LOAD = textwrap.dedent(
    """
    import io, json, sys
    import torch
    from stemdeck_watch.workers import heap
    from stemdeck_watch.workers.worker import Worker

    if sys.argv[2] == "drop_give_back":
        heap.give_back = lambda: None

    def anonymous():
        with open("/proc/self/status") as status:
            line = next(l for l in status if l.startswith("RssAnon:"))
        return int(line.split()[1]) * 1024

    worker = Worker("cpu", io.StringIO())
    before = anonymous()
    worker.model("tiny", sys.argv[1])
    print(json.dumps({"gained": anonymous() - before}))
    """
)


def load_gain(model_repo: Path, mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(model_repo), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return int(json.loads(done.stdout.strip().splitlines()[-1])["gained"])


def test_an_idle_worker_holds_its_model_not_the_warm_ups_tensors(model_repo: Path) -> None:
    # the heap keeps what is freed for the next segment (see above); a load's warm-up frees
    # its tensors too, and an idle worker, forked from the zygote, would hold them until
    # its first song: ~150 MB for the tiny model here (12 MB with it given back), more than the model and the zygote's
    # whole import of torch
    kept, given = load_gain(model_repo, "drop_give_back"), load_gain(model_repo, "plain")
    assert given < 48 * 2**20, (given, kept)
    assert kept - given > 32 * 2**20, (given, kept)
