"""The RoFormer engine at full size: seconds per minute of audio, and peak memory.

Each catalogued checkpoint's architecture is built from its published configuration (the
copies in tests/workers/data/roformer/) with random weights — the compute of the published
model, not its weights — and separates a synthetic song through the engine's chunked
inference (`workers/roformer/inference.py`, one chunk at a time), in float32 and in each
reduced precision the device offers. Each (model, precision) runs in a child process of its
own, so that its peak memory (the process's peak resident set; on a GPU torch's peak
allocation) is its own.

Reported per row: seconds of separation per minute of audio (the song's time after one
untimed warm-up chunk), per chunk, and per minute of a long song (one chunk per step: a short
song's padded ends make its own figure higher), the peak memory, and the SNR of the reduced precision's stems
against float32's (random weights: a measure of rounding, not of quality).

    python benchmarks/bench_roformer.py [--seconds 30] [--device cpu] [--models NAME ...]
        [--precisions P ...] [--compile]

`--compile` runs each precision compiled too, as the service compiles a recipe's RoFormer
(compiled/graph.py: each part ahead of time, saved, loaded back; the build timed apart), and
says how much faster than eager it separated.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import ROOT, machine, parser as bench_parser, wait_quiet, write_results

CONFIGS = ROOT / "tests" / "workers" / "data" / "roformer"


def child(
    name: str, precision: str, device: str, seconds: float, stems_out: Path, compiled: bool
) -> None:
    """In a child process: build, compile if `compiled` (as the service's background build
    does, then loaded as its worker loads it), warm up, separate; print one JSON line of
    figures."""
    import contextlib
    import shutil
    import tempfile

    import numpy as np
    import torch

    from stemdeck_watch.workers.compiled import graph
    from stemdeck_watch.workers.compiled.model import use_inductor_cache, using

    from stemdeck_watch.util.synth import song
    from stemdeck_watch.workers.roformer.catalogue import KNOWN
    from stemdeck_watch.workers.roformer.checkpoint import LoadedRoformer, build_model
    from stemdeck_watch.workers.roformer.config import read_config
    from stemdeck_watch.workers.roformer.inference import plan_chunks, separate_array

    entry = KNOWN[name]
    config = read_config(CONFIGS / entry.config_file, entry.architecture)
    torch.manual_seed(0)
    started = time.perf_counter()
    module = build_model(config, device).eval()
    model = LoadedRoformer(module, config)
    built = time.perf_counter() - started
    compile_seconds, running = 0.0, contextlib.nullcontext()
    if compiled:
        folder = Path(tempfile.mkdtemp(prefix="bench-roformer-"))
        use_inductor_cache(folder / "inductor")
        started = time.perf_counter()
        graph.build([module], folder, device, precision)
        compile_seconds = time.perf_counter() - started
        running = using(graph.load([module], folder, device, precision))
    mix = np.ascontiguousarray(song(seconds, config.sample_rate, seed=3).T)
    with running as calls:
        started = time.perf_counter()
        separate_array(model, mix[:, : config.chunk_size // 2], precision=precision)  # warm-up
        warm_up = time.perf_counter() - started
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        stems = separate_array(model, mix, precision=precision)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        took = time.perf_counter() - started
    if calls is not None:
        calls.require_all("the song")  # a part its guards refused would time eager
        shutil.rmtree(folder, ignore_errors=True)
    np.save(stems_out, np.stack(list(stems.values())))
    plan = plan_chunks(mix.shape[1], config.chunk_size, config.num_overlap)
    chunks = len(plan.starts)
    # a long song needs one chunk per step: the per-minute figure a short test song (whose
    # padded ends are a larger share of it) overstates
    long_song = took / chunks * 60 * config.sample_rate / plan.step
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if device.startswith("cuda")
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    print(
        json.dumps(
            {
                "model": name,
                "precision": precision,
                "compiled": compiled,
                "device": device,
                "threads": torch.get_num_threads(),
                "parameters": sum(p.numel() for p in model.module.parameters()),
                "build_seconds": round(built, 2),
                "compile_seconds": round(compile_seconds, 1),
                "warm_up_seconds": round(warm_up, 2),
                "seconds": round(took, 2),
                "seconds_per_minute": round(took * 60 / seconds, 1),
                "chunks": chunks,
                "seconds_per_chunk": round(took / chunks, 2),
                "long_song_seconds_per_minute": round(long_song, 1),
                "peak_mib": round(peak),
            }
        )
    )


def snr(reference: Path, estimate: Path) -> float:
    import numpy as np

    ref, est = np.load(reference).astype(np.float64), np.load(estimate).astype(np.float64)
    noise = float(((ref - est) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((ref**2).sum()) / noise)


def run_child(
    args: Any, name: str, precision: str, compiled: bool, scratch: Path, env: dict[str, str]
) -> dict[str, Any]:
    """One (model, precision, eager or compiled) in a process of its own; its row."""
    load = wait_quiet(args.quiet, args.patience)
    out = scratch / f"{name}-{precision}{'-compiled' if compiled else ''}.npy"
    command = [sys.executable, __file__, "--seconds", str(args.seconds)]
    command += ["--compile"] if compiled else []
    command += ["--child", name, precision, args.device, str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        print(name, precision, "failed:", done.stderr[-500:], file=sys.stderr)
        return {"model": name, "precision": precision, "error": done.stderr[-2000:]}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    row["other_cores_before"] = load
    reference = scratch / f"{name}-float32.npy"
    if out != reference and reference.exists():
        row["snr_vs_float32_db"] = round(snr(reference, out), 1)
    return row


def main() -> None:
    from stemdeck_watch.workers.roformer.catalogue import CATALOGUE

    p = bench_parser(__doc__, "roformer", quiet=True)
    p.add_argument("--seconds", type=float, default=30.0, help="length of the synthetic song")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--models", nargs="*", default=[e.name for e in CATALOGUE])
    p.add_argument("--precisions", nargs="*", default=None, help="default: all the device has")
    p.add_argument(
        "--compile",
        action="store_true",
        help="run each precision compiled too, as the service compiles it, and compare with eager",
    )
    p.add_argument("--child", nargs=4, metavar=("MODEL", "PRECISION", "DEVICE", "OUT"))
    args = p.parse_args()
    if args.child:
        name, precision, device, out = args.child
        child(name, precision, device, args.seconds, Path(out), args.compile)
        return
    precisions = args.precisions or (
        ["float32", "bfloat16", "float16"]
        if args.device.startswith("cuda")
        else ["float32", "bfloat16"]
    )
    rows: list[dict[str, Any]] = []
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-roformer-{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for name in args.models:
        for precision in precisions:
            eager: dict[str, Any] = {}
            for compiled in (False, True) if args.compile else (False,):
                row = run_child(args, name, precision, compiled, scratch, env)
                rows.append(row)
                if "error" in row:
                    continue
                if not compiled:
                    eager = row
                elif eager:
                    row["speedup_vs_eager"] = round(eager["seconds"] / row["seconds"], 2)
                print(json.dumps(row), flush=True)
    try:
        host = machine()
    except Exception as exc:  # a machine without demucs (a GPU box): say so, keep the rows
        host = {"nproc": os.cpu_count(), "error": repr(exc)}
    results = {"machine": host, "seconds": args.seconds, "rows": rows}
    print(f"results: {write_results(args.out, results)}")
    print("| model | precision | device | s per min (long song) | peak MiB | SNR vs float32 |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "error" not in row:
            print(
                f"| {row['model']} | {row['precision']}{' compiled' if row['compiled'] else ''} "
                f"| {row['device']} ({row['threads']} threads) "
                f"| {row['long_song_seconds_per_minute']} | {row['peak_mib']} "
                f"| {row.get('snr_vs_float32_db', '')} |"
            )


if __name__ == "__main__":
    main()
