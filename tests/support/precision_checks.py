"""The precision rule on the real tiny model with injected calibration results, in one torch
process (the test process itself never imports torch).

Run by tests/workers/test_precision.py:

    python tests/support/precision_checks.py MODEL_REPO

prints one JSON object: for each case, what `precision.choose` decided. The tiny model is too
small to gain anything from bfloat16, so each case injects what a calibration measured: the
measuring step still runs the real model in float32 and in bfloat16 on the built-in signal;
only the seconds it reports (and, for "far", the candidate's output) are the case's.

- "close":  bfloat16 reported 1.5× faster, real bfloat16 output → bfloat16 (if that output is
            within 35 dB of float32, which the JSON reports alongside)
- "far":    1.5× faster, but the output is float32 plus noise 20 dB down → float32
- "slower": reported 0.8× the speed, real output → float32
- "hopeless": the convolution probe reports bfloat16 at 0.01× → float32, the model not run
- "small":  the small-model skip without STEMDECK_CALIBRATE=always → float32, nothing measured
- "probe":  the real probe of bfloat16 here: its figure and seconds

The injected cases pass the probe (it reports 1.0×): on a CPU without bfloat16 kernels the
real one would keep bfloat16 off the model.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def main() -> int:
    import torch

    from stemdeck_watch.workers.demucs import precision
    from stemdeck_watch.workers.worker import load_model

    model = load_model("tiny", str(Path(sys.argv[1])))
    speed = {"close": 1.5, "far": 1.5, "slower": 0.8}
    calls: list[str] = []
    results: dict[str, Any] = {}

    for case, factor in speed.items():

        def measure(
            m: Any, device: str, dtype: str, signal: Any, case: str = case, factor: float = factor
        ) -> tuple[float, Any]:
            _seconds, out = precision.run_once(m, device, dtype, signal)  # the real model
            calls.append(dtype)
            if dtype == "float32":
                return 1.0, out
            if case == "far":
                noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
                out = out + noise * out.std() * 0.1  # 20 dB down
            return 1.0 / factor, out

        os.environ[precision.CALIBRATE_ENV] = "always"
        choice = precision.choose("auto", "cpu", model, measure, probe=lambda d, p: 1.0)
        results[case] = choice.to_dict()
    calls.clear()
    results["hopeless"] = precision.choose(
        "auto", "cpu", model, measure, probe=lambda d, p: 0.01
    ).to_dict()
    results["hopeless_measured"] = list(calls)
    del os.environ[precision.CALIBRATE_ENV]
    started = time.monotonic()
    results["probe"] = {
        "speedup": precision.probe_convolution("cpu", "bfloat16"),
        "seconds": time.monotonic() - started,
    }
    calls.clear()
    results["small"] = precision.choose("auto", "cpu", model).to_dict()
    results["small_measured"] = list(calls)
    results["set"] = precision.choose("bfloat16", "cpu", model).to_dict()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
