"""An HTDemucs transformer converted for OpenVINO once, into a file, and compiled from it in
the worker.

On a CPU with bfloat16 in hardware (an AMD Zen 4 measured it), half of a segment is the
transformer, and there Inductor gains nothing: its attention and linear layers call the same
oneDNN kernels compiled as eager. OpenVINO's CPU plugin runs the same transformer about 1.7×
as fast in bfloat16 (its own fused attention), and its stems stay as close to float32 as
torch's. Its convolutions, though, were slower than torch's, and every switch between the two
runtimes costs a little, so only the transformer is converted; the encoder and decoder layers
stay with Inductor (compiled/graph.py), the STFT eager.

A converted part takes fixed shapes, one segment's: a call with any other shape is refused
the way a saved graph's guards refuse it (the error carries `GUARDS_REFUSED`), and the part
runs eager. It computes in the precision it is loaded for (`INFERENCE_PRECISION_HINT`, the
cache key's), and a call under another autocast is refused too. It is converted
without its position embedding routed (graph.py: prepare): OpenVINO reads the embedding
as the constants it is when the random shift is off, which is why a transformer that draws one
(`sin_random_shift` > 0) is left to Inductor.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from stemdeck_watch.workers.compiled.cache import CONVERTED_SUFFIX

STEM = ".openvino"  # ends the name of a converted part's files, and of its call
SUFFIX = f"{STEM}{CONVERTED_SUFFIX}"  # its weights beside it: .openvino.bin
PRECISION_HINTS = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
CONVERTED = ("CrossTransformerEncoder",)  # the class names of the parts converted
TELEMETRY = "openvino_telemetry"


def runtime() -> ModuleType:
    """`openvino`, imported without its telemetry. Its converter reports usage to Google
    Analytics from the moment it is imported, unless a consent file in the user's home says no;
    a service that separates a musician's songs sends nothing anywhere. Without the telemetry
    package the converter uses its own no-op stand-in, so it is made unimportable first."""
    if "openvino" not in sys.modules:
        sys.modules[TELEMETRY] = None  # type: ignore[assignment]
    import openvino

    return openvino


@functools.cache
def version() -> str:
    """OpenVINO's installed version, or "" when it is not installed: part of the cache's key.
    Read from its package's metadata: the worker asks for every model it loads, and importing
    the runtime costs a quarter of a second and its native libraries' memory."""
    try:
        return importlib.metadata.version("openvino")
    except importlib.metadata.PackageNotFoundError:
        return ""


def takes(part: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: str) -> bool:
    """Whether `part`, called with `args` and `kwargs`, is converted for OpenVINO: a
    transformer on the CPU, with OpenVINO installed, called with tensors alone, drawing no
    random shift."""
    return (
        device.split(":")[0] == "cpu"
        and type(part).__name__ in CONVERTED
        and not getattr(part, "sin_random_shift", 0)
        and not kwargs
        and all(isinstance(arg, torch.Tensor) for arg in args)
        and bool(version())
    )


def saved(folder: Path, index: int, part: str) -> Path:
    """Where a converted part of the `index`th network is saved in a build or an entry."""
    return folder / f"network-{index}.{part}{SUFFIX}"


def build(part: Any, args: tuple[torch.Tensor, ...], path: Path) -> None:
    """Convert `part`, as it runs on `args`, and save it at `path`. The inputs are float32
    (the runtime takes no bfloat16 arrays); the precision it computes in is chosen when it is
    loaded."""
    openvino = runtime()
    inputs = tuple(arg.detach().float().clone() for arg in args)
    with torch.no_grad():
        exported = torch.export.export(part, inputs)
    # one segment's shapes, fixed: what the guards of the other parts hold to as well
    converted = openvino.convert_model(exported, input=[tuple(arg.shape) for arg in inputs])
    openvino.save_model(converted, str(path), compress_to_fp16=False)


def runs_here(call: Callable[..., Any]) -> bool:
    """Whether a loaded part's call runs in OpenVINO (rather than Inductor's code)."""
    return str(getattr(call, "__name__", "")).endswith(STEM)


def running_in() -> str:
    """The precision torch's CPU autocast asks for now ("float32" when it is off): a part
    loaded for another runs eager, as a saved graph's guards have it."""
    if not torch.is_autocast_enabled("cpu"):
        return "float32"
    return str(torch.get_autocast_dtype("cpu")).removeprefix("torch.")


def load(path: Path, precision: str, name: str) -> Callable[..., Any]:
    """The part saved at `path`, compiled for this CPU to compute in `precision`, as a
    callable taking what the part takes and named `name` (what a refusal names)."""
    openvino = runtime()
    core = openvino.Core()
    compiled = core.compile_model(
        core.read_model(str(path)),
        "CPU",
        {
            "INFERENCE_PRECISION_HINT": PRECISION_HINTS.get(precision, "f32"),
            "PERFORMANCE_HINT": "LATENCY",
            # the worker's share of the cores, as torch has it (separation.threads)
            "INFERENCE_NUM_THREADS": torch.get_num_threads(),
        },
    )
    shapes = [tuple(port.get_shape()) for port in compiled.inputs]
    request = compiled.create_infer_request()
    lock = threading.Lock()  # one request: a second caller waits rather than overwriting it

    def call(*args: Any, **kwargs: Any) -> Any:
        got = [tuple(arg.shape) if isinstance(arg, torch.Tensor) else arg for arg in args]
        problem, asked = "", running_in()
        if kwargs or got != shapes:
            problem = f"converted for inputs shaped {shapes}, called with {got} {sorted(kwargs)}"
        elif asked != precision:
            problem = f"loaded to compute in {precision}, called under {asked}"
        if problem:
            from stemdeck_watch.workers.compiled.graph import GUARDS_REFUSED

            raise RuntimeError(f"{GUARDS_REFUSED}: {name} was {problem}")
        arrays = [arg.detach().float().contiguous().numpy() for arg in args]
        with lock:
            results = request.infer(arrays, share_inputs=True, share_outputs=False)
            outputs = tuple(torch.from_numpy(results[port]) for port in compiled.outputs)
        return outputs[0] if len(outputs) == 1 else outputs

    call.__name__ = name
    return call
