"""Precision on a full-size model: `separation.precision = "float32"` against `"auto"`.

A full-size HTDemucs (the released htdemucs architecture: 4 stems, 42 M parameters, 7.8 s
segments) with random weights is built by this benchmark in a child process and saved in
demucs's local-repo format (never shipped: the compute is the released model's, the weights
are not). Three 10 s synthetic clips go through a running Service once per setting (the
settings alternate, `--rounds` times): from a rename into the inbox to stems in the outbox.

Reported: seconds of worker separation per 10 s of audio (median over clips and rounds, from
each manifest's timings), their ratio, the SNR between the two settings' stems (float wavs,
shifts = 0 so both runs see the same segments), the precision "auto" chose on this machine
with its calibration figures, and how long the calibration took at model load.

    python benchmarks/bench_precision.py [--rounds 1] [--clips 3] [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import math
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
    wait_quiet,
    write_results,
)

MODEL = "htfull"
STEMS = ("drums", "bass", "other", "vocals")


def build_model(folder: Path) -> None:
    """In a child process: the released htdemucs architecture with random weights, saved as
    `<folder>/htfull.th` in the local-repo format."""
    import torch
    from demucs.htdemucs import HTDemucs

    torch.manual_seed(0)
    model = HTDemucs(
        sources=list(STEMS), bottom_channels=512, t_layers=5, dconv_mode=3, segment=7.8
    )
    args, kwargs = model._init_args_kwargs
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"klass": HTDemucs, "args": args, "kwargs": kwargs, "state": model.state_dict()},
        folder / f"{MODEL}.th",
    )
    print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))


def run_service(clips: list[Path], repo: Path, root: Path, precision: str) -> dict[str, Any]:
    """One service with `precision`; the clips renamed into its inbox once the model (and
    its calibration) is loaded. Returns per-clip worker seconds and the manifests' choice."""
    from stemdeck_watch.core.config import default_toml, settings_from_dict
    from stemdeck_watch.core.events import EventBus, JobChanged
    from stemdeck_watch.service import Service

    data = default_toml()
    data["folders"] = {
        n: str(root / n) for n in ("inbox", "outbox", "processed", "failed", "state")
    }
    data["separation"].update(
        model=MODEL, model_repo=str(repo), device="cpu", shifts=0, precision=precision
    )
    data["output"].update(bit_depth=32)
    data["watch"]["settle_seconds"] = 0.5
    data["notify"]["urls"] = []
    data["api"]["enabled"] = False
    data["tray"]["enabled"] = False
    settings = settings_from_dict(data, source=root / "stemdeck.toml")
    bus, lock, finished = EventBus(), threading.Lock(), threading.Event()
    final: dict[str, str] = {}

    def on_change(event: JobChanged) -> None:
        with lock:
            if event.job.state.is_final:
                final[event.job.id] = f"{event.job.state.value} {event.job.error or ''}"
                if len(final) >= len(clips):
                    finished.set()

    bus.subscribe(JobChanged, on_change)
    service = Service(settings, bus=bus)
    started = time.monotonic()
    service.start()
    try:
        info = service.client.ensure_model(MODEL, str(repo), precision=precision)
        load = time.monotonic() - started
        inbox, drop = settings.paths.inbox, root / "drop"
        drop.mkdir()
        for clip in clips:
            shutil.copyfile(clip, drop / clip.name)
        t0, cpu0 = time.monotonic(), cpu_snapshot()
        for clip in clips:
            os.replace(drop / clip.name, inbox / clip.name)
        if not finished.wait(3600):
            raise RuntimeError(f"{precision}: timed out, {len(final)} of {len(clips)} ended")
        wall = time.monotonic() - t0
        other = other_cores(cpu0, wall)
    finally:
        service.shutdown()
    bad = [v for v in final.values() if not v.startswith("done")]
    if bad:
        raise RuntimeError(f"{precision}: jobs did not finish: {bad}")
    separate, choices = {}, []
    for clip in clips:
        manifest = json.loads((settings.paths.outbox / clip.stem / "stemdeck.json").read_text())
        separate[clip.stem] = float(manifest["timings"]["separate"])
        choices.append(manifest["precision"])
    return {
        "separate": separate,
        "choice": choices[0],
        "same_choice": all(c == choices[0] for c in choices),
        "load_seconds": load,
        "wall": wall,
        "other_cores": other,
        "model_precision": info.precision,
        "outbox": str(settings.paths.outbox),
    }


def stems_snr(a: Path, b: Path, clips: list[Path]) -> float:
    """The worst per-stem SNR (dB) of `b`'s stems against `a`'s, over every clip."""
    import numpy as np
    import soundfile

    worst = math.inf
    for clip in clips:
        for stem in STEMS:
            ref, _ = soundfile.read(a / clip.stem / f"{stem}.wav", dtype="float64")
            est, _ = soundfile.read(b / clip.stem / f"{stem}.wav", dtype="float64")
            noise = float(np.sum((ref - est) ** 2))
            if noise > 0:
                worst = min(worst, 10 * math.log10(float(np.sum(ref**2)) / noise))
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "precision", quiet=True, patience=120)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--clips", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--build", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build:
        build_model(Path(args.build))
        return 0
    from stemdeck_watch.util.synth import write_song

    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="stemdeck-bench-precision-"))
    try:
        repo = work / "models"
        built = subprocess.run(
            [sys.executable, __file__, "--build", str(repo)],
            check=True,
            capture_output=True,
            text=True,
        )
        parameters = json.loads(built.stdout.strip().splitlines()[-1])["parameters"]
        clips = [
            write_song(work / "clips" / f"clip{i}.wav", args.seconds, seed=i)
            for i in range(args.clips)
        ]
        runs: dict[str, list[dict[str, Any]]] = {"float32": [], "auto": []}
        snrs = []
        for n in range(args.rounds):
            outs = {}
            for precision in ("float32", "auto"):
                quiet = wait_quiet(args.quiet, args.patience)
                run = run_service(clips, repo, work / f"r{n}-{precision}", precision)
                run["quiet_before"] = quiet
                runs[precision].append(run)
                outs[precision] = Path(run["outbox"])
                print(
                    f"round {n + 1}/{args.rounds} {precision}: separate "
                    f"{sorted(run['separate'].values())} s, chose "
                    f"{run['choice'].get('precision')}",
                    file=sys.stderr,
                    flush=True,
                )
            snrs.append(stems_snr(outs["float32"], outs["auto"], clips))
        assert "torch" not in sys.modules, "the benchmark's main process imported torch"
    finally:
        shutil.rmtree(work, ignore_errors=True)

    per10 = {
        p: statistics.median(s * 10.0 / args.seconds for r in rs for s in r["separate"].values())
        for p, rs in runs.items()
    }
    auto = runs["auto"][0]
    choice = auto["choice"]
    snr = min(snrs)
    info = machine()
    lines = [
        f"Precision: full-size HTDemucs architecture ({parameters / 1e6:.1f} M parameters, "
        f"random weights), {args.clips} clips x {args.seconds:g} s through the service, "
        f"{args.rounds} round(s); {info['nproc']} cores ({info['cpu']}), torch "
        f"{info['torch']}",
        "",
        "| precision setting | used | s per 10 s of audio (median) | other procs, cores |",
        "|---|---|---:|---:|",
    ]
    for p, rs in runs.items():
        used = rs[0]["choice"].get("precision")
        other = statistics.median(r["other_cores"] for r in rs)
        lines.append(f"| `{p}` | {used} | {per10[p]:.2f} | {other:.2f} |")
    snr_text = "identical" if math.isinf(snr) else f"{snr:.1f} dB"
    lines += [
        "",
        "| figure | value |",
        "|---|---:|",
        f"| speed-up of `auto` over `float32` (ratio of medians) | "
        f"{per10['float32'] / per10['auto']:.2f}× |",
        f"| worst per-stem SNR, `auto` stems vs `float32` stems | {snr_text} |",
        f"| `auto` chose | {choice.get('precision')} |",
        f"| its calibration: speed-up / worst stem SNR | {choice.get('speedup')}× / "
        f"{choice.get('worst_snr_db')} dB |",
        f"| calibration time at model load | {choice.get('calibration_seconds')} s |",
        f"| model load incl. warm-up (+ calibration): float32 / auto | "
        f"{statistics.median(r['load_seconds'] for r in runs['float32']):.1f} s / "
        f"{statistics.median(r['load_seconds'] for r in runs['auto']):.1f} s |",
        "",
        f"reason: {choice.get('reason')}",
        f"total benchmark time {time.monotonic() - began:.0f} s",
    ]
    print("\n".join(lines))
    write_results(
        args.out,
        {
            "machine": info,
            "args": {k: v for k, v in vars(args).items() if k not in ("build", "out")},
            "parameters": parameters,
            "seconds_per_10s": per10,
            "snr_db": None if math.isinf(snr) else snr,
            "choice": choice,
            "runs": runs,
            "total_seconds": time.monotonic() - began,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
