"""The compiled-model cache: whole entries only, foreign or damaged ones rebuilt, a size cap,
and the rule that decides whether a compiled model is used (no compiling here: see
test_compiled.py for the real thing)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

from stemdeck_watch.workers.compiled.cache import (
    ENTRY,
    INDUCTOR,
    CompileCache,
    CompileKey,
    Verdict,
    cpu_identity,
)
from stemdeck_watch.workers.compiled.model import MIN_SPEEDUP, Measured, decide

KEY = CompileKey("tiny", "f" * 24, "bfloat16", "cpu", "2.13.0", "CPython-3.11", "c" * 16)


def built(cache: CompileCache, key: CompileKey = KEY, size: int = 1000) -> Path:
    """An entry as a build leaves it: Inductor's files in a random folder, then committed."""
    build = cache.new_build(key)
    (build / INDUCTOR / "ab").mkdir(parents=True)
    (build / INDUCTOR / "ab" / "kernel.so").write_bytes(os.urandom(size))
    (build / INDUCTOR / "ab" / "kernel.py").write_text("# code\n")
    return cache.commit(build, key, {"compile_seconds": 12.5})


def test_a_committed_build_is_an_entry_that_names_its_key_and_files(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "compiled")
    folder = built(cache)
    assert folder == cache.entry_dir(KEY)
    entry = cache.entry(KEY)
    assert entry is not None and entry["compile_seconds"] == 12.5
    assert CompileKey.from_dict(entry["key"]) == KEY
    assert set(entry["files"]) == {"inductor/ab/kernel.so", "inductor/ab/kernel.py"}
    assert not list(cache.root.glob(".build-*")), "the build folder became the entry"
    assert not list(cache.root.rglob("*.tmp")), "no temporary file is left behind"


def test_a_build_that_never_finished_is_not_an_entry_and_goes(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "compiled")
    build = cache.new_build(KEY)  # a killed builder leaves this
    (build / INDUCTOR).mkdir()
    (build / INDUCTOR / "half.so").write_bytes(b"\0" * 10)
    assert build.name.startswith(".build-") and len(build.name) > len(".build-") + 20
    assert cache.entry(KEY) is None
    cache.remove_builds()
    assert not build.exists()


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing", "entry"])
def test_a_damaged_entry_is_removed_so_it_is_built_again(tmp_path: Path, damage: str) -> None:
    cache = CompileCache(tmp_path / "compiled")
    folder = built(cache)
    kernel = folder / INDUCTOR / "ab" / "kernel.so"
    if damage == "flipped":  # same size, other bytes
        data = bytearray(kernel.read_bytes())
        data[10] ^= 0xFF
        kernel.write_bytes(bytes(data))
    elif damage == "truncated":
        kernel.write_bytes(kernel.read_bytes()[:100])
    elif damage == "missing":
        kernel.unlink()
    else:
        (folder / ENTRY).write_text("{not json")
    assert cache.entry(KEY) is None
    assert not folder.exists()


def test_an_entry_built_for_another_key_is_foreign_and_removed(tmp_path: Path) -> None:
    """Copied from another machine, or another torch: its key says so."""
    cache = CompileCache(tmp_path / "compiled")
    other = dataclasses.replace(KEY, torch="2.12.0")
    source = built(cache, other)
    os.replace(source, cache.entry_dir(KEY))  # the other's files under this key's name
    assert cache.entry(KEY) is None
    assert not cache.entry_dir(KEY).exists()


def test_every_part_of_the_key_changes_its_folder() -> None:
    digests = {KEY.digest()}
    for field in dataclasses.fields(CompileKey):
        value = getattr(KEY, field.name)
        changed = value + 1 if isinstance(value, int) else value + "x"
        digests.add(dataclasses.replace(KEY, **{field.name: changed}).digest())
    assert len(digests) == 1 + len(dataclasses.fields(CompileKey))
    assert cpu_identity() == cpu_identity() and len(cpu_identity()) == 16


def test_a_verdict_is_kept_and_one_not_used_gives_the_space_back(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "compiled")
    folder = built(cache)
    assert cache.verdict(KEY) is None
    cache.record_verdict(KEY, Verdict(True, "compiled: 1.50×", 1.5, 48.0))
    assert cache.verdict(KEY) == Verdict(True, "compiled: 1.50×", 1.5, 48.0)
    assert folder.exists()
    other = dataclasses.replace(KEY, precision="float32")
    built(cache, other)
    cache.record_verdict(other, Verdict(False, "not worth it", 1.02, 60.0))
    assert cache.verdict(other) is not None and not cache.verdict(other).use  # type: ignore[union-attr]
    assert not cache.entry_dir(other).exists()
    # a verdict file for another key under this key's name is not believed
    cache.verdict_path(KEY).write_text(cache.verdict_path(other).read_text())
    assert cache.verdict(KEY) is None


def test_the_cache_keeps_under_its_cap_removing_those_used_longest_ago(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "compiled", cap_mb=2.5)
    keys = [dataclasses.replace(KEY, model=f"m{i}") for i in range(3)]
    for i, key in enumerate(keys):
        built(cache, key, size=1 << 20)
        os.utime(cache.entry_dir(key) / ENTRY, (1000 + i, 1000 + i))
    assert cache.entry_dir(keys[1]).exists() and cache.entry_dir(keys[2]).exists()
    assert not cache.entry_dir(keys[0]).exists(), "the one used longest ago went"
    cache.touch(keys[1])  # used now
    built(cache, dataclasses.replace(KEY, model="m3"), size=1 << 20)
    assert cache.entry_dir(keys[1]).exists() and not cache.entry_dir(keys[2]).exists()


def test_links_in_an_entry_are_neither_listed_nor_followed(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path / "compiled")
    secret = tmp_path / "secret.txt"
    secret.write_text("not the cache's")
    build = cache.new_build(KEY)
    (build / INDUCTOR).mkdir()
    (build / INDUCTOR / "link").symlink_to(secret)
    cache.commit(build, KEY, {})
    entry = cache.entry(KEY)
    assert entry is not None and entry["files"] == {}
    assert secret.read_text() == "not the cache's"


def measured(speedup: float, snr: float) -> Measured:
    return Measured(speedup, snr, 1.0, 1.0 / speedup)


@pytest.mark.parametrize(
    ("setting", "speedup", "snr", "use"),
    [
        ("auto", 1.5, 48.0, True),
        ("auto", MIN_SPEEDUP, 35.0, True),
        ("auto", 1.10, 48.0, False),  # not fast enough
        ("auto", 1.5, 30.0, False),  # not accurate enough
        ("auto", 1.5, -math.inf, False),  # NaN stems
        ("auto", 1.5, math.inf, True),  # identical stems
        ("on", 0.9, 48.0, True),  # on: whatever its speed...
        ("on", 2.0, 20.0, False),  # ...never less accurate
    ],
)
def test_the_rule_that_decides_whether_the_compiled_model_is_used(
    setting: str, speedup: float, snr: float, use: bool
) -> None:
    verdict = decide(setting, measured(speedup, snr))
    assert verdict.use is use
    assert f"{speedup:.2f}×" in verdict.reason
    json.dumps(verdict.to_dict(), allow_nan=False)  # goes into JSON as it is


def test_a_stem_that_is_not_finite_never_passes_the_accuracy_rule() -> None:
    torch = pytest.importorskip("torch")
    from stemdeck_watch.workers.demucs.precision import snr_db

    reference = torch.ones(4, 2, 100)
    broken = reference.clone()
    broken[2, 0, 5] = float("nan")
    assert snr_db(reference, broken) == -math.inf
    assert snr_db(reference, reference) == math.inf


@pytest.mark.parametrize("setting", ["auto", "on"])
def test_a_verdict_on_stems_that_were_not_finite_is_refused_again_under_any_setting(
    tmp_path: Path, setting: str
) -> None:
    from stemdeck_watch.workers.compiled.model import remeasured

    cache = CompileCache(tmp_path)
    k = KEY
    cache.record_verdict(k, decide("auto", measured(1.5, -math.inf)))
    kept = cache.verdict(k)
    assert kept is not None and kept.finite is False and "not finite" in kept.reason
    again = decide(setting, remeasured(kept))
    assert again.use is False and "not finite" in again.reason
    identical = decide("auto", measured(1.5, math.inf))
    assert decide(setting, remeasured(identical)).use is True
