"""Throughput of the watch-folder service against the plain ways of running Demucs.

Ten synthetic clips, separated with the tiny untrained model on the CPU, four ways per run:

(a) service  - a running Service: clips are renamed into the inbox once the worker holds the
               model; from the last rename to the last job DONE (settle wait included).
(b) limit    - one process that already holds the model: decode (PyAV), apply_model as the
               worker calls it, write 4 x 16-bit wav; the loop only. The floor for (a).
(c) cli x N  - `python -m demucs ... CLIP` once per clip: process start + model load each time.
(d) cli x 1  - one `python -m demucs ... CLIP1 ... CLIP10` call.

Why: the service's one resident worker should cost little over (b) (targets: a <= 1.15 b +
settle), clearly beat a user running the CLI per song (c/a >= 2), and be no slower than a
batch CLI call (a <= d). With decode ahead and publish behind the worker never waits for
decoding or writing: its idle fraction between the first and the last separation (gaps
between separate requests over that span) should be <= 3 %, and (a - settle) / b <= 1.0 —
faster than the serial loop where the cores allow. The main process stays torch-free; torch
runs only in children.

    python benchmarks/bench_throughput.py [--runs 9] [--clips 10] [--seconds 10]
                                          [--threads N --ab-only]
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

from harness import (
    cpu_snapshot,
    machine,
    other_cores,
    parser as bench_parser,
    tiny_model,
    wait_quiet,
    with_load,
    write_results,
)

STEMS = ("drums", "bass", "other", "vocals")
CLI_ARGS = ["--shifts", "1", "--overlap", "0.25"]
CLI_ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def tiny_model_and_clips(work: Path, count: int, seconds: float) -> tuple[Path, list[Path]]:
    """The tiny model's repo (built in a child: no torch here) and `count` synthetic clips."""
    from stemdeck_watch.util.synth import write_song

    repo = work / "models"
    tiny_model(repo)
    clips = [write_song(work / "clips" / f"clip{i:02d}.wav", seconds, seed=i) for i in range(count)]
    return repo, clips


def run_service(
    clips: list[Path],
    repo: Path,
    root: Path,
    settle: float,
    work_beside: str = "auto",
    output_steps: bool = False,
    threads: int = 0,
) -> dict[str, Any]:
    """(a): seconds from the last rename into the inbox to the last job DONE, plus where the
    time went (event times relative to the last rename, and each job's manifest timings)."""
    from stemdeck_watch.core.config import default_toml, settings_from_dict
    from stemdeck_watch.core.events import EventBus, JobChanged
    from stemdeck_watch.core.jobs import JobState
    from stemdeck_watch.service import Service

    data = default_toml()  # as tests/conftest.py make_settings does
    data["folders"] = {
        n: str(root / n) for n in ("inbox", "outbox", "processed", "failed", "state")
    }
    data["separation"].update(model="tiny", model_repo=str(repo), device="cpu", threads=threads)
    data["watch"]["settle_seconds"] = settle
    # the same work as (b): the optional output steps have their own benchmark (bench_output)
    data["output"].update(beat_grid=output_steps, preview=output_steps, tags=output_steps)
    data["queue"]["work_beside"] = work_beside
    settings = settings_from_dict(data, source=root / "stemdeck.toml")
    bus, lock, finished = EventBus(), threading.Lock(), threading.Event()
    started: dict[str, float] = {}
    done: dict[str, tuple[float, str]] = {}
    failed: list[str] = []

    def on_change(event: JobChanged) -> None:
        now, job = time.monotonic(), event.job
        with lock:
            if job.state is JobState.DECODING:
                started.setdefault(job.id, now)
            elif job.state is JobState.DONE:
                done[job.id] = (now, job.output or "")
            elif job.state.is_final:
                failed.append(f"{job.name}: {job.state.value} {job.error}")
            if len(done) + len(failed) >= len(clips):
                finished.set()

    bus.subscribe(JobChanged, on_change)
    service = Service(settings, bus=bus)
    service.start()
    try:
        service.client.ensure_model("tiny", str(settings.model_repo))  # warm-up finished
        drop = root / "drop"
        drop.mkdir()
        for clip in clips:  # complete files outside the inbox, same filesystem
            shutil.copyfile(clip, drop / clip.name)
        inbox = settings.paths.inbox
        for clip in clips:
            os.replace(drop / clip.name, inbox / clip.name)
        t0, cpu0 = time.monotonic(), cpu_snapshot()
        if not finished.wait(900):
            raise RuntimeError(f"(a) timed out: {len(done)} of {len(clips)} jobs done")
        seconds = max(t for t, _ in done.values()) - t0
        other = other_cores(cpu0, time.monotonic() - t0)
        idle = worker_idle(list(service.client.busy)[-len(clips) :])
    finally:
        service.shutdown()
    if failed:
        raise RuntimeError(f"(a) jobs failed: {failed}")
    outputs = [
        o for o in settings.paths.outbox.iterdir() if o.is_dir() and not o.name.startswith(".")
    ]
    if len(outputs) != len(clips) or any(
        sorted(p.stem for p in o.glob("*.wav")) != sorted(STEMS) for o in outputs
    ):
        raise RuntimeError(f"(a) the outbox does not hold {len(clips)} folders of 4 stems")
    stages = {k: 0.0 for k in ("model", "decode", "separate", "write")}
    for out in outputs:
        timings = json.loads((out / "stemdeck.json").read_text())["timings"]
        stages = {k: v + float(timings.get(k, 0.0)) for k, v in stages.items()}
    job_wall = sum(done[j][0] - started[j] for j in done)
    return {
        "seconds": seconds,
        "other_cores": other,
        "worker_idle": idle,
        "first_start": min(started.values()) - t0,
        "job_wall_sum": job_wall,
        "stage_sums": {k: round(v, 3) for k, v in stages.items()},
    }


def worker_idle(spans: list[tuple[float, float]]) -> dict[str, float]:
    """The worker's idle time between jobs: the gaps between consecutive separate requests,
    in seconds and as a fraction of the span from the first request's start to the last's end."""
    spans = sorted(spans)
    gaps = sum(max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:]))
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    return {
        "gaps": round(gaps, 4),
        "span": round(span, 4),
        "fraction": gaps / span if span > 0 else 0.0,
    }


def child_limit(repo: str, out: str, threads: int, clips: list[str]) -> None:
    """(b), in a child process: load once (untimed, with the worker's 1 s warm-up), then time
    decode -> normalise -> apply_model -> write 4 x 16-bit wav for every clip. `threads`: as
    `separation.threads` (0: one per physical core, as the worker)."""
    import numpy as np
    import soundfile
    import torch
    from demucs.apply import apply_model
    from demucs.pretrained import get_model

    from stemdeck_watch.stages.decode import decode_to_file
    from stemdeck_watch.workers.demucs.precision import threads_for

    torch.set_num_threads(threads_for(threads))
    model = get_model("tiny", repo=Path(repo)).to("cpu")
    rate, channels = int(model.samplerate), int(model.audio_channels)
    with torch.inference_mode():
        apply_model(
            model,
            torch.zeros(1, channels, rate),
            shifts=1,
            split=True,
            overlap=0.25,
            progress=False,
            device="cpu",
        )
    parts = {"decode": 0.0, "separate": 0.0, "write": 0.0}
    t0 = time.monotonic()
    for clip in map(Path, clips):
        t0_clip = time.monotonic()
        npy = decode_to_file(clip, Path(out) / f"{clip.stem}.npy", rate, channels).path
        mix = torch.from_numpy(np.load(npy))
        t1 = time.monotonic()
        ref = mix.mean(0)
        mean, std = ref.mean(), ref.std()
        if not torch.isfinite(std) or std < 1e-8:
            std = torch.tensor(1.0)
        with torch.inference_mode():
            sources = apply_model(
                model,
                ((mix - mean) / std)[None],
                shifts=1,
                split=True,
                overlap=0.25,
                segment=None,
                progress=False,
                device="cpu",
            )[0]
        sources = (sources * std + mean).numpy()
        t2 = time.monotonic()
        folder = Path(out) / clip.stem
        folder.mkdir(parents=True, exist_ok=True)
        for name, audio in zip(model.sources, sources):
            audio = audio / max(1.01 * float(np.abs(audio).max()), 1.0)
            soundfile.write(folder / f"{name}.wav", audio.T, rate, subtype="PCM_16")
        for part, since, until in (
            ("decode", t0_clip, t1),
            ("separate", t1, t2),
            ("write", t2, time.monotonic()),
        ):
            parts[part] += until - since
    seconds = time.monotonic() - t0
    print(
        json.dumps(
            {
                "seconds": seconds,
                "parts": {k: round(v, 3) for k, v in parts.items()},
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
            }
        )
    )


def run_limit(clips: list[Path], repo: Path, out: Path, threads: int = 0) -> dict[str, Any]:
    """(b): runs child_limit in a fresh process and returns what it printed."""
    cmd = [
        sys.executable,
        __file__,
        "--child-limit",
        str(repo),
        str(out),
        str(threads),
        *map(str, clips),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=CLI_ENV)
    if proc.returncode != 0:
        raise RuntimeError(f"(b) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_cli(clips: list[Path], repo: Path, out: Path) -> float:
    """(c) with one clip per call, (d) with all clips in one call: wall seconds of all calls."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "demucs",
            "--repo",
            str(repo),
            "-n",
            "tiny",
            "-o",
            str(out),
            *CLI_ARGS,
            *map(str, clips),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=CLI_ENV,
    )
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"python -m demucs failed:\n{proc.stderr[-3000:]}")
    for clip in clips:
        if not all((out / "tiny" / clip.stem / f"{s}.wav").is_file() for s in STEMS):
            raise RuntimeError(f"python -m demucs wrote no 4 stems for {clip.name}")
    return seconds


def stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


RATIOS = {
    "a/b": lambda r, s: r["a"] / r["b"],
    "(a-settle)/b": lambda r, s: (r["a"] - s) / r["b"],
    "c/a": lambda r, s: r["c"] / r["a"],
    "d/a": lambda r, s: r["d"] / r["a"],
}


def report(runs: list[dict[str, Any]], settle: float, clips: int) -> tuple[str, dict[str, Any]]:
    labels = {
        "a": f"(a) service (settle {settle:.1f} s)",
        "b": "(b) in-process limit",
        "c": "(c) demucs CLI, one call per clip",
        "d": "(d) demucs CLI, one call",
    }
    labels = {k: v for k, v in labels.items() if k in runs[0]}  # --ab-only: no CLI runs
    med = {k: stats([r[k] for r in runs])[0] for k in labels}
    lines = [
        "| method | median s | min s | max s | median s/clip | other procs, cores |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for k, label in labels.items():
        m, lo, hi = stats([r[k] for r in runs])
        other = stats([r["other_cores"][k] for r in runs])[0]
        lines.append(f"| {label} | {m:.2f} | {lo:.2f} | {hi:.2f} | {m / clips:.2f} | {other:.2f} |")
    rates = {
        name: fn
        for name, fn in RATIOS.items()  # --ab-only: the ratios to (b) alone
        if "c" in med or name.endswith("/b")
    }
    ratios = {name: fn(med, settle) for name, fn in rates.items()}
    idle = stats([r["a_detail"]["worker_idle"]["fraction"] for r in runs])[0]
    # a and b of one run ran back to back: the median of the per-run ratios is the figure
    # least moved by a machine whose speed drifts between runs
    lines += [
        "",
        "| ratio | of medians | median of per-run ratios | per-run min-max |",
        "|---|---:|---:|---:|",
    ]
    paired = {}
    for name, fn in rates.items():
        paired[name], lo, hi = stats([fn(r, settle) for r in runs])
        lines.append(f"| {name} | {ratios[name]:.3f} | {paired[name]:.3f} | {lo:.3f}-{hi:.3f} |")
    targets = {
        f"a <= 1.15*b + settle ({med['a']:.2f} <= {1.15 * med['b'] + settle:.2f})": med["a"]
        <= 1.15 * med["b"] + settle,
        f"worker idle <= 3 % ({100 * idle:.1f} %)": idle <= 0.03,
        f"(a - settle)/b <= 1.0 ({ratios['(a-settle)/b']:.3f})": ratios["(a-settle)/b"] <= 1.0,
    }
    if "c" in med:
        targets[f"c/a >= 2 ({ratios['c/a']:.2f})"] = ratios["c/a"] >= 2
        targets[f"a <= d ({med['a']:.2f} <= {med['d']:.2f})"] = med["a"] <= med["d"]
    lines += [""] + [f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in targets.items()]
    lines += [
        "",
        "| where the time goes, s (median over runs, summed over clips) | (a) | (b) |",
        "|---|---:|---:|",
    ]
    for part in ("decode", "separate", "write"):
        a_part = stats([r["a_detail"]["stage_sums"][part] for r in runs])[0]
        b_part = stats([r["b_detail"]["parts"][part] for r in runs])[0]
        lines.append(f"| {part} | {a_part:.2f} | {b_part:.2f} |")
    for label, fn in (
        ("(a) last rename -> first job starts (settle wait)", lambda d: d["first_start"]),
        (
            "(a) rest of each job (IPC, manifest, fsync, publish, move, registry)",
            lambda d: d["job_wall_sum"] - sum(d["stage_sums"].values()),
        ),
        (
            "(a) worker idle between separations (decode ahead, publish behind)",
            lambda d: d["worker_idle"]["gaps"],
        ),
    ):
        lines.append(f"| {label} | {stats([fn(r['a_detail']) for r in runs])[0]:.2f} | |")
    lines.append(f"| (a) worker idle fraction, first to last separation | {100 * idle:.1f} % | |")
    return "\n".join(lines), {
        "medians": med,
        "ratios": ratios,
        "paired_ratios": paired,
        "targets": targets,
        "worker_idle_fraction": idle,
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "throughput", quiet=True, patience=300)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--clips", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=1.0, help="watch.settle_seconds for (a)")
    parser.add_argument(
        "--work-beside",
        default="auto",
        choices=("auto", "on", "off"),
        help="queue.work_beside for (a)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="separation.threads for (a) and torch's threads in (b); 0: one per physical core",
    )
    parser.add_argument(
        "--ab-only", action="store_true", help="only (a) and (b): the demucs CLI ignores --threads"
    )
    parser.add_argument("--child-limit", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_limit:
        child_limit(
            args.child_limit[0], args.child_limit[1], int(args.child_limit[2]), args.child_limit[3:]
        )
        return 0
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="stemdeck-bench-"))
    try:
        repo, clips = tiny_model_and_clips(work, args.clips, args.seconds)
        runs: list[dict[str, Any]] = []
        for n in range(args.runs):
            run, waited = work / f"run{n}", time.monotonic()
            quiet = wait_quiet(args.quiet, args.patience)
            waited = time.monotonic() - waited
            a = run_service(
                clips, repo, run / "a", args.settle, args.work_beside, threads=args.threads
            )
            b, other_b = with_load(run_limit, clips, repo, run / "b", args.threads)
            runs.append(
                {
                    "a": a["seconds"],
                    "b": b["seconds"],
                    "other_cores": {"a": a["other_cores"], "b": other_b},
                    "quiet_before": quiet,
                    "waited": waited,
                    "a_detail": a,
                    "b_detail": b,
                }
            )
            if not args.ab_only:
                runs[-1]["c"], runs[-1]["other_cores"]["c"] = with_load(
                    lambda run=run: sum(run_cli([x], repo, run / "c") for x in clips)
                )
                runs[-1]["d"], runs[-1]["other_cores"]["d"] = with_load(
                    run_cli, clips, repo, run / "d"
                )
            print(
                f"run {n + 1}/{args.runs} (waited {waited:.0f} s for quiet): "
                + "  ".join(f"{k} {runs[-1][k]:.2f}" for k in "abcd" if k in runs[-1])
                + " s",
                file=sys.stderr,
                flush=True,
            )
            shutil.rmtree(run, ignore_errors=True)
        assert "torch" not in sys.modules, "the benchmark's main process imported torch"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = machine()
    table, summary = report(runs, args.settle, args.clips)
    total = time.monotonic() - began
    print(
        f"Separation throughput: {args.clips} clips x {args.seconds:g} s, tiny model, CPU, "
        f"{args.runs} runs; {info['nproc']} cores ({info['cpu']}), Python {info['python']}, "
        f"torch {info['torch']}, demucs {info['demucs']}\n"
    )
    print(table)
    print(f"\ntotal benchmark time {total:.0f} s")
    results = (
        args.out.with_name(f"throughput_threads{args.threads}.json") if args.threads else args.out
    )
    write_results(
        results,
        {
            "machine": info,
            "args": {k: v for k, v in vars(args).items() if k not in ("child_limit", "out")},
            "runs": runs,
            **summary,
            "total_seconds": total,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
