"""The transformer converted for OpenVINO, for real: the build converts it, the entry holds
it, the worker's parts run it, a call it was not converted for runs eager, and importing the
runtime sends nothing anywhere (the tiny model, float32; built once per session:
tests/support/compiled.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from stemdeck_watch.cli.doctor import compiled_finding
from stemdeck_watch.workers.compiled.cache import CompileCache

from support.compiled import BuiltCompile, entry_key

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="Inductor's CPU compile, tried on Linux"),
]
torch = pytest.importorskip("torch")
pytest.importorskip("openvino", reason="OpenVINO has no wheel for this machine")
CONVERTED = "network-0.crosstransformer.openvino"


@pytest.fixture(autouse=True)
def no_tqdm_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts load in this process, not a worker's: tqdm's monitor thread (Inductor's
    progress) stays off."""
    monkeypatch.setattr(pytest.importorskip("tqdm").tqdm, "monitor_interval", 0)


def test_the_transformer_is_converted_for_openvino_and_every_part_runs_compiled(
    compiled_tiny: BuiltCompile, model_repo: Path, tmp_path: Path
) -> None:
    from stemdeck_watch.workers.compiled.model import open_compiled, using
    from stemdeck_watch.workers.compiled.graph import modes, segment_input
    from stemdeck_watch.workers.compiled.openvinograph import version
    from stemdeck_watch.workers.demucs.precision import snr_db
    from stemdeck_watch.workers.worker import load_model

    cache = compiled_tiny.copy_to(tmp_path)
    entry = cache / compiled_tiny.key
    names = {path.name for path in entry.iterdir()}
    assert {f"{CONVERTED}.xml", f"{CONVERTED}.bin"} <= names
    assert "network-0.crosstransformer.bin" not in names, "not compiled by Inductor as well"
    assert entry_key(cache, compiled_tiny.key).openvino == version() != ""

    model = load_model("tiny", str(model_repo))
    pairs = open_compiled(model, entry, "cpu", "float32")
    assert [call.__name__ for part, call in pairs if part is model.crosstransformer] == [CONVERTED]
    assert compiled_tiny.after["openvino"] == version(), "the worker says what runs it"
    said = compiled_finding("model", compiled_tiny.after).detail
    assert f"its transformer in OpenVINO {version().split('-')[0]}" in said, said
    silence = segment_input(model, "cpu")
    music = torch.randn(silence.shape, generator=torch.Generator().manual_seed(3)) * 0.1
    with modes("cpu", "float32"):
        eager = model(music)
        with using(pairs) as calls:
            compiled = model(music)
    assert (calls.compiled, calls.eager) == (len(pairs), 0), "every part, the transformer too"
    assert snr_db(eager[0], compiled[0]) >= 60, "float32 through OpenVINO: the eager stems"


def test_a_call_the_converted_part_was_not_made_for_runs_eager_and_says_why(
    compiled_tiny: BuiltCompile,
    model_repo: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from stemdeck_watch.workers.compiled.model import open_compiled, using
    from stemdeck_watch.workers.compiled.graph import GUARDS_REFUSED, modes, part_inputs
    from stemdeck_watch.workers.worker import load_model

    cache = compiled_tiny.copy_to(tmp_path)
    model = load_model("tiny", str(model_repo))
    pairs = open_compiled(model, cache / compiled_tiny.key, "cpu", "float32")
    part, args, _ = part_inputs(model, "cpu", "float32")["crosstransformer"]
    converted = dict(pairs)[part]
    shorter = tuple(arg[..., : arg.shape[-1] // 2].contiguous() for arg in args)
    with pytest.raises(RuntimeError, match=f"{GUARDS_REFUSED}: {CONVERTED} was converted for"):
        converted(*shorter)
    with modes("cpu", "float32"), using(pairs) as calls:
        out = part(*shorter)
    assert (calls.compiled, calls.eager) == (0, 1)
    with modes("cpu", "float32"):
        assert all(torch.equal(a, b) for a, b in zip(out, part(*shorter))), "the eager answer"
    assert re.search(
        rf"a part ran eager: {CONVERTED} \(CrossTransformerEncoder\): .* was converted for inputs "
        r"shaped \[\(1, \d+, \d+, \d+\)",
        caplog.text,
    )
    # built to compute in float32: under bfloat16 autocast it is not what the caller asked for
    with modes("cpu", "bfloat16"), pytest.raises(RuntimeError, match="called under bfloat16"):
        converted(*args)


def test_a_converted_part_the_build_did_not_name_makes_the_entry_unusable(
    compiled_tiny: BuiltCompile, tmp_path: Path
) -> None:
    cache = compiled_tiny.copy_to(tmp_path)
    key = entry_key(cache, compiled_tiny.key)
    (cache / compiled_tiny.key / "network-0.planted.openvino.xml").write_text("<net/>")
    store = CompileCache(cache)
    assert store.problem(key) == "network-0.planted.openvino.xml is not named in entry.json"


def test_what_is_converted_for_openvino(model_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stemdeck_watch.workers.compiled import openvinograph
    from stemdeck_watch.workers.compiled.graph import part_inputs
    from stemdeck_watch.workers.worker import load_model

    model = load_model("tiny", str(model_repo))
    inputs = part_inputs(model, "cpu", "float32")
    part, args, kwargs = inputs["crosstransformer"]
    assert openvinograph.takes(part, args, kwargs, "cpu")
    assert not openvinograph.takes(part, args, kwargs, "cuda:0"), "OpenVINO here is the CPU's"
    encoder, enc_args, enc_kwargs = inputs["encoder.0"]
    assert not openvinograph.takes(encoder, enc_args, enc_kwargs, "cpu"), "Inductor's"
    monkeypatch.setattr(part, "sin_random_shift", 2)
    assert not openvinograph.takes(part, args, kwargs, "cpu"), "a random shift is not constant"
    monkeypatch.setattr(part, "sin_random_shift", 0)
    monkeypatch.setattr(openvinograph, "version", lambda: "")
    assert not openvinograph.takes(part, args, kwargs, "cpu"), "without OpenVINO: Inductor"


def test_the_runtime_is_imported_without_its_telemetry() -> None:
    """OpenVINO's converter reports usage over the network from its import on unless a
    consent file says no; imported through `runtime`, its telemetry package never loads. Run
    with a home folder that does not exist, where the telemetry would send nothing even if it
    loaded: the test can fail without anything leaving the machine."""
    code = (
        "import sys, threading\n"
        "from stemdeck_watch.workers.compiled.openvinograph import runtime\n"
        "runtime().Core()\n"
        "assert sys.modules['openvino_telemetry'] is None, 'telemetry loaded'\n"
        "print(threading.active_count())\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1", "only the main thread: nothing sending"
