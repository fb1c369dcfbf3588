"""MkDocs hook: the reference pages are generated from the code, so they cannot drift from it.

A page holds a marker line such as `<!-- generated: config-keys -->`; `on_page_markdown`
replaces it with markdown built here from this checkout's own code: every config key from
`stemdeck_watch.core.config`, every command and flag from the CLI's argparse parser, and the local
API from its OpenAPI document (or, where the checkout has none, from the API's route table).
The repository root goes first on `sys.path` whenever a generator imports (MkDocs restores
`sys.path` after loading a hook), and a module found anywhere else is an error: an installed
copy of the package elsewhere is never the one documented. The tests build the same markdown through `generated()`, so a
broken generator fails `make test`, not only `mkdocs build`.

This file lives in `docs/` beside the pages; `mkdocs.yml` excludes it from the site.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Where the generators find the code they document: (module, attribute). If a module moves,
# change it here; `tests/docs/test_docs.py` fails until every generated page is whole again.
PARSER_SOURCE = ("stemdeck_watch.cli.main", "_parser")
CONFIG_SOURCE = "stemdeck_watch.core.config"
# The OpenAPI document, a function of the service's base URL. While a checkout has no such
# module, the API page is generated from ROUTES_SOURCE instead.
OPENAPI_SOURCE = ("stemdeck_watch.ui.web.openapi", "document")
ROUTES_SOURCE = ("stemdeck_watch.ui.web.api", "ROUTES")
BASE_URL = "http://127.0.0.1:PORT"

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->[ \t]*$", re.MULTILINE)

# Each config section's user-guide page, named under its table (links relative to
# docs/reference/config.md).
SECTION_GUIDES = {
    "folders": [
        ("The inbox", "../guide/inbox.md"),
        ("The outbox", "../guide/outbox.md"),
        ("The state folder", "../guide/state.md"),
    ],
    "watch": [("The inbox", "../guide/inbox.md"), ("Two computers", "../guide/two-computers.md")],
    "queue": [("The queue", "../guide/queue.md"), ("Models and speed", "../guide/models.md")],
    "separation": [("Models and speed", "../guide/models.md"), ("Presets", "../guide/presets.md")],
    "output": [("Outputs", "../guide/outputs.md"), ("Presets", "../guide/presets.md")],
    "links": [("Links", "../guide/links.md"), ("Playlists", "../guide/playlists.md")],
    "notify": [("Notifications", "../guide/notifications.md")],
    "api": [("The queue page", "../guide/queue-page.md"), ("HTTP API", "api.md")],
    "tray": [("Tray icon", "../guide/tray.md")],
    "executor": [("Scaling out", "../guide/scaling-out.md")],
}

# While the API page is built from the route table: what each route does (the OpenAPI
# document's summaries replace these). A route missing here is listed as "not described".
ROUTE_NOTES = {
    "GET /api/queue": "the `status --json` object, live",
    "GET /api/queue/events": "Server-Sent Events: `event: queue` frames carrying the same "
    "object, sent only when something visible changes; `: keep-alive` "
    "every 15 s; nothing else while idle",
    "POST /api/queue/pause": "pause (the running song finishes); reply: the queue object",
    "POST /api/queue/start": "start (also lifts a restore pause); reply: the queue object",
    "POST /api/queue/reorder": 'the same as move, with body `{"job": JOB, "after": JOB}` or '
    '`{"job": JOB, "first": true}`',
    "GET /api/jobs/{ref}": '`{"job": …}`',
    "POST /api/jobs/{ref}/cancel": "cancel; the file stays where it is",
    "POST /api/jobs/{ref}/retry": "queue a failed or cancelled job again, as a new job at the end",
    "POST /api/jobs/{ref}/remove": "remove a finished job (as `stemdeck-watch remove`); reply "
    '`{"removed", "not_deleted"}`',
    "POST /api/jobs/{ref}/move": 'body `{"after": JOB}` or `{"first": true}`; reply `{"job", '
    '"order", "queued", "note"?}`; if JOB has left the queue the '
    "job goes to the end and `note` says so",
}


# ------------------------------------------------------------------ the hook and its entry


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **_: Any) -> str:
    return render(markdown)


def render(markdown: str) -> str:
    """The page with every marker replaced; an unknown marker is an error (the build fails)."""

    def replace(match: re.Match[str]) -> str:
        return generated(match.group(1)).rstrip("\n")

    return MARKER.sub(replace, markdown)


def generated(name: str) -> str:
    """The markdown for one marker: `config-keys`, `cli` or `api`."""
    generators: dict[str, Callable[[], str]] = {
        "config-keys": config_keys_markdown,
        "cli": cli_markdown,
        "api": api_markdown,
    }
    if name not in generators:
        raise ValueError(f"unknown generated section {name!r}; known: {', '.join(generators)}")
    return generators[name]()


def _project(name: str) -> ModuleType:
    """A module of this checkout, never of another installed copy."""
    if sys.path[:1] != [str(ROOT)]:
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module(name)
    where = Path(module.__file__ or "").resolve()
    if not where.is_relative_to(ROOT):
        raise ImportError(
            f"{name} was imported from {where}, not from this checkout ({ROOT}); "
            f"the reference would describe other code"
        )
    return module


# ------------------------------------------------------------------ config keys


def config_keys_markdown() -> str:
    """One table per `[section]`: key, default, what the loader accepts, meaning."""
    config = _project(CONFIG_SOURCE)
    rows: dict[str, list[str]] = {}
    for key, default, meaning in config.key_table():
        section = key.split(".", 1)[0]
        allowed = _cell(_allowed(config, key))
        rows.setdefault(section, []).append(
            f"| `{key}` | `{_toml(default)}` | {allowed} | {_cell(meaning)} |"
        )
    out: list[str] = []
    for section, lines in rows.items():
        out += [f"### `[{section}]`", ""]
        guides = SECTION_GUIDES.get(section)
        if guides:
            out += ["See " + ", ".join(f"[{title}]({link})" for title, link in guides) + ".", ""]
        out += ["| key | default | allowed | meaning |", "|---|---|---|---|", *lines, ""]
    return "\n".join(out)


def _allowed(config: Any, key: str) -> str:
    """What the key's check accepts, in the words of its own error message: the check is
    handed a value no key accepts and says what it expected."""
    section, name = key.split(".", 1)
    sections = getattr(config, "SECTIONS", {})
    fields = (
        {f.name: f for f in dataclasses.fields(sections[section])} if section in sections else {}
    )
    check = fields[name].metadata.get("check") if name in fields else None
    if check is None:
        return ""

    class NoValue:
        pass

    try:
        check(NoValue())
    except ValueError as exc:
        return str(exc)
    except (TypeError, AttributeError, KeyError, IndexError):  # it cannot say: leave it empty
        return ""
    return ""


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _cell(text: str) -> str:
    """Plain text made safe for a markdown table cell: no HTML tags, no column breaks, and
    template fields such as {stem} shown as code (not read as an attribute list)."""
    text = (
        text.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace("|", "\\|")
        .replace("*", "\\*")
        .replace("\n", " ")
    )
    return re.sub(r"\{[A-Za-z_.]+\}", lambda m: f"`{m.group(0)}`", text)


# ------------------------------------------------------------------ commands and flags


def cli_markdown() -> str:
    """The global usage, then every command (nested ones as `config init`) with its usage line
    and a table of its arguments."""
    module, attribute = PARSER_SOURCE
    parser: argparse.ArgumentParser = getattr(_project(module), attribute)()
    out = ["```text", _usage(parser), "```", "", *_arguments(parser), ""]
    for words, sub, summary in _commands(parser, ()):
        out += [f"### `{' '.join(words)}`", ""]
        if summary:
            out += [_sentence(summary), ""]
        out += ["```text", _usage(sub), "```", "", *_arguments(sub), ""]
    return "\n".join(out)


def _commands(
    parser: argparse.ArgumentParser, words: tuple[str, ...]
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every command under `parser`, depth first; a command that only groups others (`config`)
    is listed through them."""
    found = []
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, sub in action.choices.items():
            nested = _commands(sub, words + (name,))
            if nested:
                found += nested
            else:
                found.append((words + (name,), sub, helps.get(name, "")))
    return found


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage line at a fixed width (argparse wraps at the terminal's, which would make the
    page depend on where it was built)."""
    formatter = argparse.HelpFormatter(prog=parser.prog, width=10_000)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        metavar = action.metavar if isinstance(action.metavar, str) else None
        if action.option_strings:
            shown = ", ".join(action.option_strings)
            if action.nargs != 0:
                shown += " " + (metavar or action.dest.upper())
        else:
            shown = metavar or action.dest
        meaning = _cell(action.help) if action.help and action.help != argparse.SUPPRESS else ""
        if action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0:
            meaning = (meaning + "; " if meaning else "") + f"default: `{action.default}`"
        rows.append(f"| `{shown}` | {meaning} |")
    if not rows:
        return []
    return ["| argument | meaning |", "|---|---|", *rows]


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


# ------------------------------------------------------------------ the local API


def api_markdown() -> str:
    """From the OpenAPI document where the checkout has one, else from the route table."""
    document = openapi_document()
    if document is not None:
        return _api_from_openapi(document)
    return _api_from_routes()


def openapi_document() -> dict[str, Any] | None:
    """The API's OpenAPI document, or None while the checkout has no module that builds it."""
    module, attribute = OPENAPI_SOURCE
    try:
        build = getattr(_project(module), attribute)
    except ModuleNotFoundError as exc:
        if exc.name != module:  # the module is there but something it imports is not
            raise
        return None
    document: dict[str, Any] = build(BASE_URL)
    return document


def _api_from_routes() -> str:
    module, attribute = ROUTES_SOURCE
    routes = getattr(_project(module), attribute)
    rows = []
    for pattern, methods in routes:
        path = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", pattern.pattern).replace("\\", "")
        for method in methods:
            endpoint = f"{method} {path}"
            note = ROUTE_NOTES.get(endpoint, "(not described yet)")
            rows.append(f"| `{endpoint}` | {note} |")
    return "\n".join(["| endpoint | what it does |", "|---|---|", *rows, ""])


def _api_from_openapi(document: dict[str, Any]) -> str:
    info = document.get("info", {})
    out = [info.get("description", ""), ""] if info.get("description") else []
    out += ["| endpoint | what it does |", "|---|---|"]
    operations = [
        (path, method, op)
        for path, item in document.get("paths", {}).items()
        for method, op in item.items()
        if isinstance(op, dict)
    ]
    for path, method, op in operations:
        out.append(
            f"| [`{method.upper()} {path}`](#{_slug(method, path)}) | "
            f"{_cell(op.get('summary', ''))} |"
        )
    out.append("")
    for path, method, op in operations:
        out += [f"### `{method.upper()} {path}` {{#{_slug(method, path)}}}", ""]
        if op.get("summary"):
            out += [_sentence(op["summary"]), ""]
        if op.get("security") == []:
            out += ["No token needed.", ""]
        params = op.get("parameters", [])
        if params:
            out += ["| parameter | in | required | meaning |", "|---|---|---|---|"]
            out += [
                f"| `{p['name']}` | {p.get('in', '')} | {'yes' if p.get('required') else 'no'}"
                f" | {_cell(p.get('description', ''))}: {_type(p.get('schema'))} |"
                for p in params
            ]
            out.append("")
        body = op.get("requestBody")
        if body:
            for media, content in body.get("content", {}).items():
                needed = "required" if body.get("required") else "optional"
                out += [f"Body ({media}, {needed}): {_type(content.get('schema'))}", ""]
        out += ["| status | meaning |", "|---|---|"]
        for status, reply in op.get("responses", {}).items():
            media_types: list[dict[str, Any]] = list(reply.get("content", {}).values())
            schema = media_types[0].get("schema") if media_types else None
            shown = f": {_type(schema)}" if schema else ""
            out.append(f"| {status} | {_cell(reply.get('description', ''))}{shown} |")
        out.append("")
    schemas = document.get("components", {}).get("schemas", {})
    if schemas:
        out += ["### Schemas", ""]
        for name, schema in schemas.items():
            out += [f"#### `{name}` {{#schema-{name.lower()}}}", ""]
            if schema.get("description"):
                out += [_sentence(_cell(schema["description"])), ""]
            properties = schema.get("properties", {})
            required = set(schema.get("required", []))
            if properties:
                out += ["| field | type | required | meaning |", "|---|---|---|---|"]
                out += [
                    f"| `{field}` | {_type(sub)} | {'yes' if field in required else 'no'}"
                    f" | {_cell(sub.get('description', ''))} |"
                    for field, sub in properties.items()
                ]
            else:
                out.append(_type(schema))
            out.append("")
    return "\n".join(out)


def _slug(method: str, path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{method} {path}".lower()).strip("-")


def _type(schema: dict[str, Any] | None) -> str:
    """A schema for the page: a named one links to its table under Schemas."""
    if schema and "$ref" in schema:
        name = _schema(schema)
        return f"[`{name}`](#schema-{name.lower()})"
    return f"`{_schema(schema)}`"


def _schema(schema: dict[str, Any] | None) -> str:
    """A JSON schema in a few words: `Job`, `string`, `array of Job`, `Job or null`, `{a, b?}`."""
    if not schema:
        return "any"
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    for combinator in ("oneOf", "anyOf"):
        if combinator in schema:
            return " or ".join(_schema(s) for s in schema[combinator])
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return " or ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type", "object" if "properties" in schema else "any")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        return f"array of {_schema(schema.get('items'))}"
    if kind == "object" and schema.get("properties"):
        required = set(schema.get("required", []))
        fields = [name + ("" if name in required else "?") for name in schema["properties"]]
        return "{" + ", ".join(fields) + "}"
    return str(kind)
