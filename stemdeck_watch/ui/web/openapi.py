"""The local API described as an OpenAPI 3.1 document (`GET /api/openapi.json`).

Written by hand next to the routes in `api.py`, and checked against the live service by
Schemathesis in the test suite (every operation, valid and malformed input): a route, a
parameter or an answer that this document does not describe fails there.
"""

from __future__ import annotations

import copy
from typing import Any

from stemdeck_watch import __version__

JSON = "application/json"
CURSOR = r"([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)_([0-9]{1,18})"  # GET /api/jobs's `before`
NULLABLE_STRING = {"type": ["string", "null"]}
STATES = [
    "queued",
    "downloading",
    "decoding",
    "separating",
    "publishing",
    "done",
    "failed",
    "cancelled",
]
ERRORS = {
    400: "a body, query or job reference that is not valid (bad JSON, an unexpected field or "
    "query parameter, a name that matches several jobs)",
    401: "no token, or a wrong one (it is new at every start)",
    403: "a Host other than this service's loopback address, or a foreign Origin; for a "
    "song's files, a folder outside the outbox, reached through a link, or holding "
    "another job's stems",
    404: "no such job (or no such stem, picture or beat grid of it)",
    405: "the path exists with another method",
    409: "the job's state does not allow it",
    411: "a chunked body (send a Content-Length)",
    413: "a body over 64 KiB (an upload: over api.max_upload_mb)",
    415: "an upload whose name does not end in an extension the inbox takes, or not sent as "
    "application/octet-stream",
    416: "a Range that starts past the end of the file",
    507: "not enough room on the inbox's disk for the upload",
}
BINARY = {"type": "string", "format": "binary"}


def _move_target(job: bool = False) -> dict[str, Any]:
    """{"after": JOB} or {"first": true}; for reorder, with the job to move as "job"."""
    ref = {"type": "string", "minLength": 1, "description": "a job id, id prefix or song name"}
    mover = {"job": ref} if job else {}
    return {
        "oneOf": [
            {
                "type": "object",
                "required": [*mover, "after"],
                "additionalProperties": False,
                "properties": {**mover, "after": ref},
            },
            {
                "type": "object",
                "required": [*mover, "first"],
                "additionalProperties": False,
                "properties": {**mover, "first": {"const": True}},
            },
        ]
    }


SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
    "Playlist": {
        "type": "object",
        "required": ["id", "name", "entry", "entries"],
        "properties": {
            "id": {"type": "string"},
            "name": {"type": "string"},
            "entry": {"type": ["integer", "null"]},
            "entries": {"type": "integer"},
            "listed": {"type": ["integer", "null"]},
        },
    },
    "Job": {
        "type": "object",
        "required": [
            "id",
            "name",
            "kind",
            "state",
            "progress",
            "source",
            "output",
            "error",
            "preset",
            "created_at",
            "finished_at",
            "playlist",
            "faults",
        ],
        "properties": {
            "id": {"type": "string"},
            "name": {"type": "string"},
            "kind": {"enum": ["file", "link"]},
            "state": {"enum": STATES},
            "progress": {"type": "number", "minimum": 0, "maximum": 1},
            "source": {"type": "string", "description": "where the input is now"},
            "output": NULLABLE_STRING,
            "error": NULLABLE_STRING,
            "preset": NULLABLE_STRING,
            "created_at": {"type": "number"},
            "finished_at": {"type": ["number", "null"]},
            "playlist": {"oneOf": [{"$ref": "#/components/schemas/Playlist"}, {"type": "null"}]},
            "faults": {
                "type": "array",
                "description": "attempts the machine cut off (the "
                "worker died, stalled, ran out of memory); the song was tried again "
                "after each",
                "items": {"$ref": "#/components/schemas/Fault"},
            },
            "made_by": {
                "type": ["object", "null"],
                "description": "stem → the model that makes it (a recipe's vocal "
                "model for its vocals); null before the song separates",
                "additionalProperties": {"type": "string"},
            },
        },
    },
    "Fault": {
        "type": "object",
        "required": ["kind", "reason", "worker", "at", "plan"],
        "properties": {
            "kind": {"enum": ["died", "stalled", "memory"]},
            "reason": {"type": "string"},
            "worker": {"type": "string"},
            "at": {"type": "number"},
            "plan": {
                "type": "string",
                "description": "window, segment and device "
                "of the attempt where a memory fault changed them",
            },
        },
    },
    "Status": {
        "type": "object",
        "description": "the `status --json` object",
        "required": [
            "service",
            "paused",
            "pause_reason",
            "running",
            "active",
            "queued",
            "waiting",
            "jobs",
            "older_jobs",
            "folders",
        ],
        "properties": {
            "service": {"type": "object"},
            "paused": {"type": "boolean"},
            "pause_reason": NULLABLE_STRING,
            "running": {"oneOf": [{"$ref": "#/components/schemas/Job"}, {"type": "null"}]},
            "active": {
                "type": "array",
                "items": {"$ref": "#/components/schemas/Job"},
                "description": "every job being worked on now, oldest first: a song "
                "publishing behind the one separating, one per worker with several",
            },
            "queued": {"type": "array", "items": {"$ref": "#/components/schemas/Job"}},
            "waiting": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["source", "kind", "since"],
                    "properties": {
                        "source": {"type": "string"},
                        "kind": {"enum": ["file", "link"]},
                        "since": {"type": "number"},
                    },
                },
            },
            "jobs": {
                "type": "array",
                "items": {"$ref": "#/components/schemas/Job"},
                "description": "the jobs not finished and the most recent finished ones, "
                "newest first; GET /api/jobs pages through every job",
            },
            "older_jobs": {
                "type": "integer",
                "minimum": 0,
                "description": "finished jobs not listed in `jobs`",
            },
            "folders": {"type": "object", "additionalProperties": {"type": "string"}},
            "notes": {"type": "array", "items": {"type": "string"}},
            "worker": {"type": ["object", "null"]},
            "workers": {"type": "array", "items": {"type": "object"}},
            "eta": {
                "oneOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "required": ["songs", "seconds", "finish", "measured", "jobs"],
                        "description": "when the songs left are expected to be done (Unix times), "
                        "from the seconds of separation per second of audio measured "
                        "for the model and precision; `finish` and `seconds` are null "
                        "until a song was measured",
                        "properties": {
                            "songs": {"type": "integer"},
                            "seconds": {"type": ["number", "null"]},
                            "finish": {"type": ["number", "null"]},
                            "measured": {"type": "boolean"},
                            "paused": {
                                "type": "boolean",
                                "description": "nothing new starts: no `finish` for the queue",
                            },
                            "rate": {"type": ["object", "null"]},
                            "jobs": {
                                "type": "object",
                                "additionalProperties": {
                                    "type": "object",
                                    "properties": {
                                        "length": {"type": ["number", "null"]},
                                        "guessed": {"type": "boolean"},
                                        "seconds": {"type": ["number", "null"]},
                                        "start": {"type": ["number", "null"]},
                                        "finish": {"type": ["number", "null"]},
                                    },
                                },
                            },
                            "took": {
                                "type": "object",
                                "description": "seconds each finished job listed took",
                                "additionalProperties": {"type": "number"},
                            },
                        },
                    },
                ]
            },
            "download": {
                "description": "a model the worker downloads before it can separate (its "
                "first use), or null",
                "oneOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "required": ["model", "done", "total", "text"],
                        "properties": {
                            "model": {"type": "string"},
                            "done": {
                                "type": "integer",
                                "minimum": 0,
                                "description": "bytes downloaded",
                            },
                            "total": {
                                "type": ["integer", "null"],
                                "description": "bytes in all; null where the hub does not say",
                            },
                            "text": {
                                "type": "string",
                                "description": '"downloading htdemucs 34 / 80 MB"',
                            },
                        },
                    },
                ],
            },
            "pending_moves": {
                "type": "array",
                "description": "done or failed jobs whose input waits for its "
                "share to answer before it moves",
                "items": {
                    "type": "object",
                    "required": ["job", "source", "to", "since"],
                    "properties": {
                        "job": {"type": "string"},
                        "source": {"type": "string"},
                        "to": {"enum": ["processed", "failed"]},
                        "since": {"type": "number"},
                    },
                },
            },
        },
    },
    "JobReply": {
        "type": "object",
        "required": ["job"],
        "properties": {"job": {"$ref": "#/components/schemas/Job"}},
    },
    "Moved": {
        "type": "object",
        "required": ["job", "order", "queued"],
        "properties": {
            "job": {"type": "string"},
            "order": {"type": "array", "items": {"type": "string"}},
            "queued": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "name"],
                    "properties": {"id": {"type": "string"}, "name": {"type": "string"}},
                },
            },
            "note": {
                "type": "string",
                "description": "the anchor left the queue: the job went to the end",
            },
        },
    },
    "MoveTarget": _move_target(),
    "Reorder": _move_target(job=True),
    "Player": {
        "type": "object",
        "description": "a finished song as the page's player loads it",
        "required": [
            "job",
            "name",
            "samplerate",
            "frames",
            "duration",
            "stems",
            "preview",
            "beats",
        ],
        "properties": {
            "job": {"type": "string"},
            "name": {"type": "string"},
            "samplerate": {"type": "integer"},
            "frames": {"type": "integer"},
            "duration": {"type": "number"},
            "stems": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name", "url", "format", "samplerate", "channels", "frames"],
                    "properties": {
                        "name": {"type": "string"},
                        "url": {"type": "string"},
                        "format": {"type": "string"},
                        "samplerate": {"type": "integer"},
                        "channels": {"type": "integer"},
                        "frames": {"type": "integer"},
                    },
                },
            },
            "preview": {
                "oneOf": [
                    {"type": "null"},
                    {
                        "type": "object",
                        "required": ["url", "width", "height", "left", "top"],
                        "description": "the waveforms span x = left … width, below y = top",
                        "properties": {
                            "url": {"type": "string"},
                            "width": {"type": "integer"},
                            "height": {"type": "integer"},
                            "left": {"type": "integer"},
                            "top": {"type": "integer"},
                        },
                    },
                ]
            },
            "beats": NULLABLE_STRING,
        },
    },
    "Beats": {
        "type": "object",
        "required": ["tempo", "beats"],
        "properties": {
            "tempo": {"type": ["number", "null"]},
            "beats": {"type": "array", "items": {"type": "number"}},
        },
    },
    "Added": {
        "type": "object",
        "required": ["file"],
        "properties": {
            "file": {"type": "string"},
            "bytes": {"type": "integer"},
            "url": {"type": "string"},
            "preset": NULLABLE_STRING,
        },
    },
    "Empty": {
        "type": "object",
        "maxProperties": 0,
        "description": "no fields (an empty body may be left out)",
    },
}


def _errors(*codes: int) -> dict[str, Any]:
    return {
        str(code): {
            "description": ERRORS[code],
            "content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for code in codes
    }


def _ok(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _body(schema: dict[str, Any], required: bool = False) -> dict[str, Any]:
    return {"required": required, "content": {JSON: {"schema": schema}}}


JOB_REF = {
    "name": "ref",
    "in": "path",
    "required": True,
    "description": "a job id, a unique id prefix or a unique song name",
    "schema": {"type": "string", "minLength": 1},
}


def _operation(
    summary: str,
    ok: dict[str, Any],
    errors: tuple[int, ...],
    *,
    body: dict[str, Any] | None = None,
    job: bool = False,
    public: bool = False,
    parameters: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    post = body is not None
    codes = set(errors) | {400, 403, 405}  # 400: also a query string it does not take
    codes |= set() if public else {401}
    codes |= {400, 411, 413} if post else set()
    codes |= {404} if job else set()
    op: dict[str, Any] = {"summary": summary, "responses": {"200": ok, **_errors(*sorted(codes))}}
    if body is not None:
        op["requestBody"] = body
    params = ([JOB_REF] if job else []) + (parameters or [])
    if params:
        op["parameters"] = params
    if public:
        op["security"] = []
    return op


def _file(
    summary: str, types: tuple[str, ...], parameters: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A song's file: whole (200) or the one range a `Range: bytes=first-last` header asks
    for (206)."""
    content = {kind: {"schema": BINARY} for kind in types}
    op = _operation(
        summary,
        {"description": "the whole file", "content": content},
        (409,),
        job=True,
        parameters=parameters,
    )
    op["responses"]["206"] = {
        "description": "the range asked for",
        "content": content,
        "headers": {
            "Content-Range": {"schema": {"type": "string"}, "description": "bytes FIRST-LAST/SIZE"}
        },
    }
    op["responses"].update(_errors(416))
    return op


STEM = {
    "name": "stem",
    "in": "path",
    "required": True,
    "description": "a stem's name",
    "schema": {"type": "string", "minLength": 1},
}


def _any_case(extensions: list[str] | tuple[str, ...]) -> str:
    """A pattern for names ending in one of `extensions`, in any case (no regex flags in
    OpenAPI's patterns)."""
    spelled = [
        "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re_escape(c) for c in ext)
        for ext in extensions
    ]
    return rf"\.({'|'.join(spelled)})$"


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def document(
    base_url: str,
    extensions: list[str] | tuple[str, ...] = (),
    presets: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """The document, with this service's own address as its server (and its audio
    extensions and presets, which say which uploads are taken)."""
    name_schema: dict[str, Any] = {"type": "string", "minLength": 1}
    if extensions:
        name_schema["pattern"] = _any_case(extensions)
    preset_schema: dict[str, Any] = (
        {"enum": sorted(presets)} if presets else {"type": "string", "maxLength": 0}
    )
    empty = _body(_ref("Empty"))
    status = _ok("the queue: the `status --json` object", _ref("Status"))
    paths = {
        "/api/queue": {"get": _operation("the queue, live", status, ())},
        "/api/queue/events": {
            "get": _operation(
                "Server-Sent Events: an `event: queue` frame with the Status object whenever "
                "something visible changes, `: keep-alive` comments while nothing does",
                {
                    "description": "an endless event stream",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}},
                },
                (),
            )
        },
        "/api/queue/pause": {
            "post": _operation(
                "pause the queue: the running song finishes, no new one starts",
                status,
                (),
                body=empty,
            )
        },
        "/api/queue/start": {
            "post": _operation(
                "start the queue (also one paused after a restart)", status, (), body=empty
            )
        },
        "/api/queue/reorder": {
            "post": _operation(
                "move a queued job after another one, or first",
                _ok("the new order", _ref("Moved")),
                (404, 409),
                body=_body(_ref("Reorder"), required=True),
            )
        },
        "/api/jobs": {
            "get": _operation(
                "every job, newest first, a page at a time",
                _ok(
                    "one page; `next` is the `before` of the next page, null after the last",
                    {
                        "type": "object",
                        "required": ["jobs", "next"],
                        "properties": {
                            "jobs": {"type": "array", "items": _ref("Job")},
                            "next": NULLABLE_STRING,
                        },
                    },
                ),
                (400,),
                parameters=[
                    {
                        "name": "before",
                        "in": "query",
                        "required": False,
                        "description": "the `next` of the page before",
                        "schema": {"type": "string", "pattern": f"^{CURSOR}$"},
                    },
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "description": "jobs per page (default 100)",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                    },
                ],
            )
        },
        "/api/jobs/{ref}": {
            "get": _operation("one job", _ok("the job", _ref("JobReply")), (400,), job=True)
        },
        "/api/jobs/{ref}/cancel": {
            "post": _operation(
                "cancel a job; its file stays where it is",
                _ok("the job", _ref("JobReply")),
                (409,),
                body=empty,
                job=True,
            )
        },
        "/api/jobs/{ref}/retry": {
            "post": _operation(
                "queue a failed or cancelled job again, as a new job at the end",
                _ok(
                    "the new job (null while the queue is full)",
                    {
                        "type": "object",
                        "required": ["job", "retried"],
                        "properties": {
                            "job": {"oneOf": [_ref("Job"), {"type": "null"}]},
                            "retried": {"type": "string"},
                            "note": {"type": "string"},
                        },
                    },
                ),
                (409,),
                body=empty,
                job=True,
            )
        },
        "/api/jobs/{ref}/remove": {
            "post": _operation(
                "delete a finished job's stems and forget the job",
                _ok(
                    "the job removed, and what could not be deleted",
                    {
                        "type": "object",
                        "required": ["removed", "not_deleted"],
                        "properties": {
                            "removed": _ref("Job"),
                            "not_deleted": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                ),
                (409,),
                body=empty,
                job=True,
            )
        },
        "/api/jobs/{ref}/move": {
            "post": _operation(
                "move a queued job after another one, or first",
                _ok("the new order", _ref("Moved")),
                (409,),
                body=_body(_ref("MoveTarget"), required=True),
                job=True,
            )
        },
        "/api/jobs/{ref}/player": {
            "get": _operation(
                "a finished song's stems, picture and beat grid, for the page's player",
                _ok("the song", _ref("Player")),
                (409,),
                job=True,
            )
        },
        "/api/jobs/{ref}/stems/{stem}": {
            "get": _file(
                "one stem of a finished song (HTTP Range: one range per request)",
                ("audio/wav", "audio/flac", "audio/mpeg", "application/octet-stream"),
                [STEM],
            )
        },
        "/api/jobs/{ref}/preview": {
            "get": _file("a finished song's preview picture", ("image/png",))
        },
        "/api/jobs/{ref}/beats": {
            "get": _operation(
                "a finished song's beat grid: tempo and beat times in seconds",
                _ok("the beat grid", _ref("Beats")),
                (409,),
                job=True,
            )
        },
        "/api/intake": {
            "get": _operation(
                "what the page may add: presets, audio extensions, the upload limit, links on",
                _ok(
                    "the limits",
                    {
                        "type": "object",
                        "required": ["presets", "extensions", "max_upload_bytes", "links"],
                        "properties": {
                            "presets": {"type": "array", "items": {"type": "string"}},
                            "extensions": {"type": "array", "items": {"type": "string"}},
                            "max_upload_bytes": {"type": "integer"},
                            "links": {"type": "boolean"},
                        },
                    },
                ),
                (),
            )
        },
        "/api/uploads": {
            "post": _operation(
                "add a song to the inbox: the body is the file's bytes (with a Content-Length), "
                "written under a hidden name and renamed into place when complete, never over "
                "another file; the name is made safe (one path component, no control characters); "
                "409 when the preset's folder in the inbox is a link or not a folder",
                _ok("where it went, relative to the inbox", _ref("Added")),
                (409, 415, 507),
                body={
                    "required": True,
                    "content": {"application/octet-stream": {"schema": BINARY}},
                },
                parameters=[
                    {
                        "name": "name",
                        "in": "query",
                        "required": True,
                        "description": "the file's name; its extension must be one the inbox takes",
                        "schema": name_schema,
                    },
                    {
                        "name": "preset",
                        "in": "query",
                        "required": False,
                        "description": "a preset: the song goes into the inbox's folder of it",
                        "schema": preset_schema,
                    },
                ],
            )
        },
        "/api/links": {
            "post": _operation(
                "add a link to the inbox, as a .url file (409 while links.enabled is false, or "
                "when the preset's folder in the inbox is a link or not a folder)",
                _ok("where it went, relative to the inbox", _ref("Added")),
                (409,),
                body=_body(
                    {
                        "type": "object",
                        "required": ["url"],
                        "additionalProperties": False,
                        "properties": {
                            "url": {"type": "string", "minLength": 1},
                            "name": {"type": "string"},
                            "preset": preset_schema,
                        },
                    },
                    required=True,
                ),
            )
        },
        "/api/page-code": {
            "post": _operation(
                "a one-time address of the queue page: its code is traded for the token once, "
                "within `expires_in` seconds",
                _ok(
                    "the address",
                    {
                        "type": "object",
                        "required": ["url", "expires_in"],
                        "properties": {"url": {"type": "string"}, "expires_in": {"type": "number"}},
                    },
                ),
                (),
                body=empty,
            )
        },
        "/api/token": {
            "post": _operation(
                "trade a one-time code from the page's address for the token (no token needed; "
                "403 for a code used before, expired or never issued)",
                _ok(
                    "the token",
                    {
                        "type": "object",
                        "required": ["token"],
                        "properties": {"token": {"type": "string"}},
                    },
                ),
                (),
                public=True,
                body=_body(
                    {
                        "type": "object",
                        "required": ["code"],
                        "additionalProperties": False,
                        "properties": {"code": {"type": "string", "minLength": 1}},
                    },
                    required=True,
                ),
            )
        },
        "/api/openapi.json": {
            "get": _operation(
                "this document (no token needed)",
                _ok("the OpenAPI document", {"type": "object"}),
                (),
                public=True,
            )
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "stemdeck-watch local API",
            "version": __version__,
            "description": "The running service's queue. From the computer that runs it, "
            "every request needs `Authorization: Bearer <token>` (the "
            "token is in `api.token` in the state folder, new at every "
            "start) except the two marked otherwise. From another device (`api.host` "
            "other than loopback), every request needs the session cookie that signing in "
            "at `/signin` gives, and no other.",
        },
        "servers": [{"url": base_url.rstrip("/")}],
        "security": [{"bearer": []}, {"session": []}],
        "paths": paths,
        "components": {
            "schemas": copy.deepcopy(SCHEMAS),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "session": {"type": "apiKey", "in": "cookie", "name": "stemdeck-session"},
            },
        },
    }
