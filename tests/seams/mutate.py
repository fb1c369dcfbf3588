"""`make mutants`: how good a net the model-based seams test is, measured on defects it should
catch. Each `tests/seams/mutants/NAME.patch` puts back one defect fixed before (its first
line says which, its second which hand-written test kills it); each is applied to a copy of
this working tree in a temporary folder (the checkout is never touched), and the seams test
runs there at the profile `make test` gives it, under a time limit. A mutant is killed when
the test fails, survives when it passes.

The copy without any patch runs first: the net must pass on the tree as it is, or its
verdicts on the mutants mean nothing. The tiny model's compiled form is built once, by that
first run, and kept for the others (STEMDECK_TEST_COMPILED).

Usage: python tests/seams/mutate.py [NAME ...] [--limit SECONDS] [--no-baseline] [--keep]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = Path(__file__).resolve().parent / "mutants"
TEST = "tests/seams/test_model_based.py"
TAG = re.compile(r"^\s*(?:E\s+)?(?:AssertionError: )?\[([a-z-]+)\]", re.MULTILINE)
SKIPPED = {".git", ".venv"}


def tree_files() -> list[str]:
    """The working tree as git sees it: tracked files and untracked ones it does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    return [
        name
        for name in listed.split("\0")
        if name and name.split("/")[0] not in SKIPPED and (ROOT / name).is_file()
    ]


def copy_tree(into: Path) -> None:
    for name in tree_files():
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target, follow_symlinks=False)


def left_running(tree: Path) -> None:
    """SIGKILL what a run left behind in this copy: the services the test started run in
    sessions of their own (with their workers), so killing the test's group misses them."""
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if Path(os.readlink(entry / "cwd")).is_relative_to(tree):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to look at


def run_one(
    patch: Path | None, work: Path, limit: float, env: dict[str, str]
) -> tuple[str, float, str]:
    """(verdict, seconds, the first problem's tag or the reason) for one copy."""
    tree = work / (patch.stem if patch else "baseline")
    copy_tree(tree)
    if patch is not None:
        applied = subprocess.run(
            ["git", "apply", str(patch)], cwd=tree, capture_output=True, text=True, timeout=60
        )
        if applied.returncode != 0:
            return "not applied", 0.0, applied.stderr.strip().splitlines()[0]
    log = work / f"{tree.name}.log"
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-x", "-q", TEST],
            cwd=tree,
            env={**env, "PYTHONPATH": str(tree)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            code = None
    left_running(tree)
    seconds = time.monotonic() - started
    text = log.read_text(errors="replace")
    if code is None:
        return "timed out", seconds, f"no verdict within {limit:.0f} s ({log})"
    if code == 0:
        return "survived" if patch else "passes", seconds, ""
    if code == 1:
        tags = TAG.findall(text)
        return ("killed" if patch else "FAILS"), seconds, (f"[{tags[0]}]" if tags else f"see {log}")
    return "error", seconds, f"pytest exited {code}; see {log}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--limit", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unpatched run")
    parser.add_argument("--keep", action="store_true", help="keep the copies and logs")
    args = parser.parse_args()
    patches = sorted(MUTANTS.glob("*.patch"))
    if args.names:
        patches = [MUTANTS / f"{name}.patch" for name in args.names]
        missing = [p.stem for p in patches if not p.is_file()]
        if missing:
            parser.error(f"no such mutant: {', '.join(missing)} (see {MUTANTS})")
    work = Path(tempfile.mkdtemp(prefix="stemdeck-mutants-"))
    env = dict(os.environ)
    env.setdefault("STEMDECK_TEST_COMPILED", str(work / "compiled"))
    rows: list[tuple[str, str, float, str]] = []
    try:
        for patch in ([None] if not args.no_baseline else []) + patches:
            name = patch.stem if patch else "(none: the tree as it is)"
            verdict, seconds, why = run_one(patch, work, args.limit, env)
            rows.append((name, verdict, seconds, why))
            print(f"{name}: {verdict} in {seconds:.0f} s {why}", flush=True)
    finally:
        if args.keep:
            print(f"copies and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'mutant':<{width}}  {'result':<11}  {'time':>6}  first problem")
    for name, verdict, seconds, why in rows:
        print(f"{name:<{width}}  {verdict:<11}  {seconds:>5.0f}s  {why}")
    mutants = [r for r in rows if r[0] in {p.stem for p in patches}]
    killed = sum(r[1] == "killed" for r in mutants)
    print(f"\nkilled {killed} of {len(mutants)} mutants ({TEST}, the profile make test runs)")
    baseline_ok = all(r[1] == "passes" for r in rows if r not in mutants)
    return 0 if baseline_ok else 1


if __name__ == "__main__":
    sys.exit(main())
