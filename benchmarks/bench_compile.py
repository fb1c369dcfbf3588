"""The compiled model on a full-size model: the service against one warm demucs process.

The full-size HTDemucs of bench_precision.py (the released architecture, random weights) and
`--clips` synthetic songs of `--seconds`. For each precision (float32, bfloat16):

- **one warm demucs process** (eager): a child process loads the model once, warms it up, then
  per clip reads the wav, normalises it as demucs does, runs `apply_model` (shifts 0) and
  writes four float wavs; the time per clip.
- **the service, eager** (`separation.compile = "off"`): each clip renamed into the inbox on
  its own, timed from the rename to its stems folder published (the settle wait included).
- **the service, first start** (`"on"`, an empty cache): the first clip is dropped at once,
  while the background compile runs beside it (first-song latency), then the build is awaited
  (cold compile time) and the remaining clips run (the first of them adopts and measures it).
- **the service, restarted** (`"on"`, the cache from the first start): how long the start
  takes until the worker has the compiled model in use (it loads it before its first song),
  then every clip compiled.

Last, the defaults (`precision = "auto"`, `compile = "auto"`) on a copy of the cache: what
they choose here and their time per clip, on `--pairs` songs of their own, each paired with
the same song through a warm eager process (bfloat16, or float32 when that round is not run)
just before it: the headline is the median ratio of the pairs (single clips swing by a
fifth on a shared machine, so more pairs than rounds). Stems of the compiled runs are
compared with the eager float32 process's (SNR).

    python benchmarks/bench_compile.py [--clips 3] [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_precision import MODEL, build_model, stems_snr
from harness import machine, parser as bench_parser, wait_quiet, wait_until, write_results

from stemdeck_watch.util.safefile import open_new, temp_name

BUILD_TIMEOUT = 3600.0  # seconds: a cold build of the full-size model took about 2 minutes


def in_process(repo: Path, clips: list[Path], precision: str, out: Path) -> None:
    """In a child process: one warm demucs process separating each clip; prints the seconds
    per clip as JSON. Without clips it prints "ready" once warm, then separates each clip
    path read from stdin and prints its seconds, one line each (the paired round)."""
    import numpy as np
    import soundfile
    import torch
    from demucs.apply import apply_model
    from demucs.pretrained import get_model

    from stemdeck_watch.workers.demucs.precision import autocast

    model = get_model(MODEL, repo=repo)
    model.eval()
    warm = torch.zeros(1, 2, model.samplerate)
    with torch.inference_mode(), autocast("cpu", precision):
        apply_model(model, warm, shifts=0, split=True, overlap=0.25, progress=False)

    def one(clip: Path) -> float:
        started = time.perf_counter()
        audio, sr = soundfile.read(clip, dtype="float32", always_2d=True)
        mix = torch.from_numpy(np.ascontiguousarray(audio.T))
        ref = mix.mean(0)
        mix = (mix - ref.mean()) / ref.std()
        with torch.inference_mode(), autocast("cpu", precision):
            stems = apply_model(model, mix[None], shifts=0, split=True, overlap=0.25)[0]
        stems = (stems.float() * ref.std() + ref.mean()).numpy()
        folder = out / clip.stem
        folder.mkdir(parents=True, exist_ok=True)
        for name, stem in zip(model.sources, stems):
            soundfile.write(folder / f"{name}.wav", stem.T, sr, subtype="FLOAT")
        return time.perf_counter() - started

    if clips:
        print(json.dumps([one(clip) for clip in clips]))
        return
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(one(Path(line.strip()))), flush=True)


def paired(run: Run, repo: Path, clips: list[Path], precision: str, out: Path) -> dict:
    """Each clip through a warm demucs process in `precision` and then through the service
    `run`, back to back: a drift in the machine's speed (10 % between rounds on a shared
    one) hits both sides of each pair alike. The ratio per pair, service / process."""
    child = subprocess.Popen(
        [sys.executable, __file__, "--in-process", str(repo), precision, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        while child.stdout.readline().strip() != "ready":
            if child.poll() is not None:
                raise RuntimeError("the demucs process ended before it was warm")
        process, walls, separate = [], [], []
        for clip in clips:
            child.stdin.write(f"{clip}\n")
            child.stdin.flush()
            process.append(float(json.loads(child.stdout.readline())))
            wall, manifest = run.drop(clip)
            walls.append(wall)
            separate.append(float(manifest["timings"]["separate"]))
    finally:
        child.stdin.close()
        child.wait(60)
    return {
        "baseline": precision,
        "process": process,
        "walls": walls,
        "separate": separate,
        "ratios": [w / p for w, p in zip(walls, process)],
    }


class Run:
    """One service on `root` (its state kept there between starts)."""

    def __init__(self, repo: Path, root: Path, precision: str, compile: str):
        from stemdeck_watch.core.config import default_toml, settings_from_dict

        data = default_toml()
        data["folders"] = {
            n: str(root / n) for n in ("inbox", "outbox", "processed", "failed", "state")
        }
        data["separation"].update(
            model=MODEL,
            model_repo=str(repo),
            device="cpu",
            shifts=0,
            precision=precision,
            compile=compile,
        )
        data["output"].update(bit_depth=32)
        data["watch"]["settle_seconds"] = 0.5
        data["notify"]["urls"] = []
        data["api"]["enabled"] = False
        data["tray"]["enabled"] = False
        self.settings = settings_from_dict(data, source=root / "stemdeck.toml")
        self.repo, self.root, self.precision = repo, root, precision
        self.service: Any = None
        self.ended: dict[str, threading.Event] = {}

    def start(self) -> dict[str, Any]:
        from stemdeck_watch.core.events import EventBus, JobChanged
        from stemdeck_watch.service import Service

        bus = EventBus()

        def on_change(event: JobChanged) -> None:
            if event.job.state.is_final:
                self.ended.setdefault(Path(event.job.source).stem, threading.Event()).set()

        bus.subscribe(JobChanged, on_change)
        self.service = Service(self.settings, bus=bus)
        started = time.monotonic()
        self.service.start()
        info = self.model()
        return {"load_seconds": time.monotonic() - started, "compiled": dict(info.compiled)}

    def model(self) -> Any:
        return self.service.client.ensure_model(MODEL, str(self.repo), precision=self.precision)

    def drop(self, clip: Path) -> tuple[float, dict[str, Any]]:
        """Rename `clip` into the inbox; seconds until its stems folder is published, and
        its manifest."""
        staged = self.root / temp_name(clip.name)
        with clip.open("rb") as source, open_new(staged) as target:
            shutil.copyfileobj(source, target)
        event = self.ended.setdefault(clip.stem, threading.Event())
        started = time.monotonic()
        os.replace(staged, self.settings.paths.inbox / clip.name)
        if not event.wait(1800):
            raise RuntimeError(f"{clip.name} did not end within 30 minutes")
        wall = time.monotonic() - started
        manifest = self.settings.paths.outbox / clip.stem / "stemdeck.json"
        if not manifest.is_file():
            raise RuntimeError(f"{clip.name} ended without stems: see {self.root}")
        return wall, json.loads(manifest.read_text())

    def stop(self) -> None:
        if self.service is not None:
            self.service.shutdown()
            self.service = None


def service_clips(run: Run, clips: list[Path]) -> dict[str, Any]:
    walls, separate, used = [], [], []
    for clip in clips:
        wall, manifest = run.drop(clip)
        walls.append(wall)
        separate.append(float(manifest["timings"]["separate"]))
        used.append(bool(manifest.get("compiled", {}).get("used")))
    return {"walls": walls, "separate": separate, "compiled_used": used}


def precision_round(
    repo: Path, clips: list[Path], again: list[Path], work: Path, precision: str, q: Any
) -> dict:
    """`clips` for the process, the eager service and the first start; `again` (other songs:
    the same ones would be duplicates) for the restarted service, and the process too."""
    result: dict[str, Any] = {}
    q()
    child = subprocess.run(
        [
            sys.executable,
            __file__,
            "--in-process",
            str(repo),
            precision,
            str(work / f"p-{precision}"),
        ]
        + [str(c) for c in clips + again],
        check=True,
        capture_output=True,
        text=True,
    )
    result["process"] = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"{precision} warm process: {result['process']}", file=sys.stderr, flush=True)

    q()
    run = Run(repo, work / f"off-{precision}", precision, "off")
    try:
        result["off_start"] = run.start()
        result["off"] = service_clips(run, clips)
    finally:
        run.stop()
    print(f"{precision} service eager: {result['off']}", file=sys.stderr, flush=True)

    q()
    root = work / f"on-{precision}"
    run = Run(repo, root, precision, "on")
    try:
        result["cold_start"] = run.start()
        first = service_clips(run, clips[:1])  # with the build running beside it
        builder = run.service.client.builder
        wait_until(lambda: builder.info() is None, BUILD_TIMEOUT, "the background build")
        key = result["cold_start"]["compiled"].get("key")
        result["build"] = builder.result(key)
        result["cold_first_clip"] = first
        result["cold_rest"] = service_clips(run, clips[1:])  # the first adopts it
        result["cold_compiled"] = dict(run.model().compiled)
    finally:
        run.stop()
    print(f"{precision} first start: {result['build']}", file=sys.stderr, flush=True)

    q()
    try:
        restart = run.start()
        # the worker loads the compiled model before it answers: in use once started
        restart["until_compiled"] = restart["load_seconds"]
        restart["compiled"] = dict(run.model().compiled)
        result["restart"] = restart
        result["on"] = service_clips(run, again)
        result["outbox"] = str(run.settings.paths.outbox)
    finally:
        run.stop()
    print(f"{precision} restarted: {result['on']}", file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--in-process":
        repo, precision, out, *clips = sys.argv[2:]
        in_process(Path(repo), [Path(c) for c in clips], precision, Path(out))
        return 0
    parser = bench_parser(__doc__, "compile", quiet=True, patience=120)
    parser.add_argument("--clips", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--pairs", type=int, default=5, help="songs in the paired headline")
    parser.add_argument(
        "--precisions",
        default="float32,bfloat16",
        help="the rounds, comma-separated (on a CPU without bf16 kernels eager bfloat16 "
        "takes minutes per segment: float32 alone)",
    )
    parser.add_argument("--build", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    precisions = [p for p in args.precisions.split(",") if p]
    if "float32" not in precisions:
        parser.error("--precisions must include float32: every round's stems are compared with it")
    if args.build:
        build_model(Path(args.build))
        return 0
    from stemdeck_watch.util.synth import write_song

    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="stemdeck-bench-compile-"))
    try:
        repo = work / "models"
        subprocess.run(
            [sys.executable, __file__, "--build", str(repo)], check=True, capture_output=True
        )
        clips = [
            write_song(work / "clips" / f"clip{i}.wav", args.seconds, seed=i)
            for i in range(args.clips)
        ]
        again = [
            write_song(work / "clips" / f"again{i}.wav", args.seconds, seed=100 + i)
            for i in range(args.clips)
        ]
        pairs = [
            write_song(work / "clips" / f"pair{i}.wav", args.seconds, seed=200 + i)
            for i in range(args.pairs)
        ]

        def q() -> None:
            wait_quiet(args.quiet, args.patience)

        rounds = {p: precision_round(repo, clips, again, work, p, q) for p in precisions}
        # the defaults, on the caches both rounds built and measured
        write_results(args.out, {"machine": machine(), "rounds": rounds, "partial": True})
        root = work / "defaults"
        (root / "state" / "compiled").mkdir(parents=True)
        for p in rounds:
            for entry in (work / f"on-{p}" / "state" / "compiled").iterdir():
                if entry.is_dir():
                    shutil.copytree(entry, root / "state" / "compiled" / entry.name)
                else:
                    shutil.copy2(entry, root / "state" / "compiled" / entry.name)
        q()
        run = Run(repo, root, "auto", "auto")
        baseline = "bfloat16" if "bfloat16" in precisions else "float32"
        try:
            defaults = run.start()
            defaults["compiled"] = dict(run.model().compiled)
            defaults["precision"] = dict(run.model().precision)
            defaults.update(paired(run, repo, pairs, baseline, work / "p-paired"))
        finally:
            run.stop()
        snr = {
            p: stems_snr(work / "p-float32", Path(r["outbox"]), again) for p, r in rounds.items()
        }
        assert "torch" not in sys.modules, "the benchmark's main process imported torch"
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    per10 = 10.0 / args.seconds
    lines = [
        f"Compile: full-size HTDemucs, {args.clips} clips x {args.seconds:g} s, "
        f"{machine()['nproc']} cores ({machine()['cpu']}), torch {machine()['torch']}",
        "",
        "| | " + " | ".join(precisions) + " |",
        "|---|" + "---:|" * len(precisions),
    ]

    def row(title: str, value: Any) -> None:
        lines.append(f"| {title} | " + " | ".join(value(rounds[p]) for p in precisions) + " |")

    row("one warm demucs process, eager: s per 10 s", lambda r: f"{med(r['process']) * per10:.2f}")
    row(
        "service, eager: first start incl. calibration, s",
        lambda r: f"{r['off_start']['load_seconds']:.1f}",
    )
    row(
        "service, eager: s per 10 s (settle incl.)",
        lambda r: f"{med(r['off']['walls']) * per10:.2f}",
    )
    row(
        "service, compiled: s per 10 s (settle incl.)",
        lambda r: f"{med(r['on']['walls']) * per10:.2f}",
    )
    row(
        "service, compiled: separation s per 10 s",
        lambda r: f"{med(r['on']['separate']) * per10:.2f}",
    )
    row(
        "compiled speed-up measured at adoption",
        lambda r: f"{r['cold_compiled'].get('speedup') or 0:.2f}×",
    )
    row(
        "compiled stems vs eager float32 process, worst SNR",
        lambda r: f"{snr[next(p for p in precisions if rounds[p] is r)]:.1f} dB",
    )
    row(
        "cold compile (background, idle priority), s",
        lambda r: f"{(r['build'] or {}).get('compile_seconds')}",
    )
    row(
        "first clip while it builds / eager service's first clip, s",
        lambda r: f"{r['cold_first_clip']['walls'][0]:.2f} / {r['off']['walls'][0]:.2f}",
    )
    row(
        "restart: start → compiled code in use, s",
        lambda r: f"{r['restart']['until_compiled']:.1f}",
    )
    headline = med(defaults["ratios"])
    lines += [
        "",
        f"defaults (precision auto → {defaults['precision'].get('precision')}, compile auto → "
        f"{defaults['compiled'].get('state')}), each clip right after the warm eager "
        f"{defaults['baseline']} process: {med(defaults['walls']) * per10:.2f} s against "
        f"{med(defaults['process']) * per10:.2f} s per 10 s; median ratio **{headline:.2f}** "
        f"(pairs: {', '.join(f'{r:.2f}' for r in defaults['ratios'])}; target ≤ 0.80)",
        f"total benchmark time {time.monotonic() - began:.0f} s",
    ]
    print("\n".join(lines))
    write_results(
        args.out,
        {
            "machine": machine(),
            "args": {k: v for k, v in vars(args).items() if k not in ("build", "out")},
            "rounds": rounds,
            "defaults": defaults,
            "snr_db": snr,
            "headline": headline,
            "total_seconds": time.monotonic() - began,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
