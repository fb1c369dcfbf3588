"""The manual: the reference pages are generated from the code, and every link leads somewhere.

The generated markdown is built here through the same functions the MkDocs hook calls, so a
generator that breaks (a key, a command or a route left out, a default shown wrong) fails the
suite even where MkDocs is not installed; `make docs` then checks links and anchors in full.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from stemdeck_watch.cli.main import _parser
from stemdeck_watch.core.config import key_table
from stemdeck_watch.ui.web.api import ROUTES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stemdeck_docs_hooks", DOCS / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(markdown: str) -> dict[str, list[str]]:
    """Table rows by their first cell's code, e.g. `watch.mode` → its cells."""
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if cells and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells
    return rows


def test_the_configuration_reference_shows_every_key_with_its_default_and_meaning() -> None:
    markdown = _hooks().generated("config-keys")
    rows = _rows(markdown)
    for key, default, meaning in key_table():
        assert key in rows, f"{key} is missing from the configuration reference"
        shown_default, _allowed, shown_meaning = rows[key][1:4]
        # the default as shown is TOML for the real default
        assert tomllib.loads(f"x = {shown_default.strip('`')}")["x"] == default, key
        assert shown_meaning, key
        assert meaning.split()[0] in shown_meaning, key
    # "allowed" is the key's own check speaking: the choices, the range
    assert '"auto", "native", "polling"' in rows["watch.mode"][2]
    assert "≥ 1 and ≤ 1000" in rows["links.max_entries"][2]
    # the sections are headings the guide can link to
    for section in {key.split(".")[0] for key, _, _ in key_table()}:
        assert f"### `[{section}]`" in markdown


def _commands(
    parser: argparse.ArgumentParser, words: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    found = [(words, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, words + (name,))
    return found


def test_the_command_reference_shows_every_command_and_flag() -> None:
    markdown = _hooks().generated("cli")
    heading = re.compile(r"^### `([^`]+)`\n(.*?)(?=^### |\Z)", re.MULTILINE | re.DOTALL)
    sections = dict(heading.findall(markdown))
    commands = _commands(_parser())
    leaves = [
        (words, sub)
        for words, sub in commands
        if words
        and not any(other[: len(words)] == words and other != words for other, _ in commands)
    ]
    assert {"run", "status", "cancel", "move", "config init"} <= {" ".join(w) for w, _ in leaves}
    for words, sub in leaves:
        name = " ".join(words)
        assert name in sections, f"`{name}` has no section in the command reference"
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for shown in action.option_strings or [action.metavar or action.dest]:
                assert f"`{shown}" in sections[name] or f" {shown}`" in sections[name], (
                    f"{shown} of `{name}` is missing from the command reference"
                )
    for option in ("--config", "--version"):  # the global options, above the commands
        assert f"`{option}" in markdown.split("### ", 1)[0]


def test_the_api_reference_shows_every_route() -> None:
    markdown = _hooks().generated("api")
    for pattern, methods in ROUTES:
        path = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", pattern.pattern).replace("\\", "")
        for method in methods:
            assert f"`{method} {path}`" in markdown, f"{method} {path} is not in the API page"
    assert "not described yet" not in markdown


def test_every_marker_in_the_docs_is_generated_and_an_unknown_one_fails() -> None:
    hooks = _hooks()
    used = set()
    for page in DOCS.rglob("*.md"):
        text = page.read_text(encoding="utf-8")
        used |= set(hooks.MARKER.findall(text))
        assert not hooks.MARKER.search(hooks.render(text)), page
    assert used == {"config-keys", "cli", "api"}
    with pytest.raises(ValueError, match="unknown generated section"):
        hooks.render("<!-- generated: colours -->")


def test_the_readme_is_a_front_door_of_at_most_200_lines() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200


def _shipped_files() -> set[str]:
    """Files a clone has: tracked, or new and not ignored (so a link to a gitignored file, such
    as a benchmark's results, fails here before it is committed)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: which files a clone has is unknown")
    return {name for name in listed.decode().split("\0") if name and (REPO / name).exists()}


def _links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    # code blocks and code spans hold no links
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def test_every_relative_link_in_the_readme_and_the_docs_leads_to_a_file_a_clone_has() -> None:
    shipped = _shipped_files()
    pages = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
    broken = []
    for page in pages:
        for target in _links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # another site, or a place on the same page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            name = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else None
            ok = name is not None and (
                name in shipped or any(f.startswith(name.rstrip("/") + "/") for f in shipped)
            )
            if not ok:
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []


def test_every_page_of_the_docs_is_in_the_nav() -> None:
    nav = set(re.findall(r":\s+(\S+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.MULTILINE))
    pages = {page.relative_to(DOCS).as_posix() for page in DOCS.rglob("*.md")}
    assert pages == nav
