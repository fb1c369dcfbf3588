"""The command line's grammar: the global options may follow every command, nested ones
too, as docs/reference/cli.md says."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from stemdeck_watch.cli.main import _parser

from support.helpers import write_config

# every command, at any depth, with arguments it needs: a new command is added here too
SAMPLES: dict[tuple[str, ...], list[str]] = {
    ("run",): ["--no-tray"],
    ("demo",): [],
    ("status",): ["--json"],
    ("pause",): [],
    ("start",): [],
    ("cancel",): ["abc123"],
    ("move",): ["abc123", "--first"],
    ("retry",): ["abc123"],
    ("remove",): ["abc123"],
    ("open",): [],
    ("doctor",): [],
    ("models", "list"): ["--json"],
    ("models", "pull"): ["htdemucs"],
    ("models", "verify"): [],
    ("models", "import"): ["offline-copy"],
    ("autostart",): ["--headless"],
    ("password",): ["--stdin"],
    ("health",): ["--stall", "60"],
    ("config", "init"): ["x.toml"],
}


def commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every command under `parser` that takes no further command."""
    found: set[tuple[str, ...]] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= commands(sub, words + (name,)) or {words + (name,)}
    return found


def test_config_may_follow_every_command_at_any_depth() -> None:
    assert commands(_parser()) == set(SAMPLES)
    for words, rest in SAMPLES.items():
        for argv in (
            [*words, *rest, "--config", "after.toml"],
            [*words, "--config", "after.toml", *rest],
        ):
            assert _parser().parse_args(argv).config == Path("after.toml"), argv
        before = _parser().parse_args(["--config", "before.toml", *words, *rest])
        assert before.config == Path("before.toml"), words
        assert _parser().parse_args([*words, *rest]).config is None, words
    nested = _parser().parse_args(["models", "--config", "between.toml", "verify"])
    assert nested.config == Path("between.toml")


def test_models_list_reads_the_config_named_after_it(tmp_path: Path, model_repo: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = write_config(
        elsewhere,
        model_repo,
        separation={"model": "htdemucs_6s", "model_repo": "", "model_hub": "http://127.0.0.1:9/"},
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "stemdeck_watch",
            "models",
            "list",
            "--json",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # no ./stemdeck.toml to fall back on
        env={**os.environ, "TORCH_HOME": str(tmp_path / "torch"), "HF_HOME": str(tmp_path / "hf")},
    )
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert listed["model"] == "htdemucs_6s" and listed["hub"] == "http://127.0.0.1:9/"
