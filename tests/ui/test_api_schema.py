"""The local API against its own OpenAPI document (`GET /api/openapi.json`), with Schemathesis
driving the live service: every operation with valid and malformed input, every answer as
documented (status, content type, body), never a 500, and the bearer token enforced.

The event stream never ends, so Schemathesis cannot call it; it is checked here by hand
against the same document. Locally the module skips when Schemathesis is missing; under
CI=true it fails instead.
"""

from __future__ import annotations

import http.client
import json
import os
import re
from typing import Any, Iterator

import pytest

from stemdeck_watch.ui.web import api as api_module
from stemdeck_watch.ui.web import openapi

try:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("schemathesis is not installed (pip install -e '.[test]')", allow_module_level=True)

EVENTS = "/api/queue/events"
DOCUMENT = "/api/openapi.json"  # Schemathesis leaves out the document it was loaded from


@pytest.fixture
def live(make_settings: Any, service_factory: Any) -> Iterator[Any]:
    # links off: a schema-valid POST /api/links would otherwise have the service fetch
    # whatever address Schemathesis made up (and uploads stay small)
    service, _ = service_factory(make_settings(links={"enabled": False}, api={"max_upload_mb": 4}))
    yield service


@pytest.mark.slow
def test_every_endpoint_answers_as_documented_and_malformed_input_gets_a_4xx(live: Any) -> None:
    """Schemathesis's own checks on every answer: no 5xx, a documented status, content type
    and body; schema-valid input accepted, schema-invalid input refused with a 4xx; an
    operation that declares the token refuses a request without it."""
    schema = schemathesis.openapi.from_url(live.api.url + DOCUMENT[1:], timeout=10)
    auth = {"Authorization": f"Bearer {live.api.token}"}
    tested = set()
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path == EVENTS:
            continue  # endless: see the next test
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=20,
                deadline=None,
                database=None,
                print_blob=True,  # a failure prints the call that reproduces it
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            )
            def check(case: Any) -> None:
                case.call_and_validate(headers=auth, timeout=15)

            check()
        tested.add((operation.method.upper(), operation.path))
    served = {
        (method, path)
        for path, item in schema.raw_schema["paths"].items()
        for method in map(str.upper, item)
        if path not in (EVENTS, DOCUMENT)
    }
    assert tested == served and len(tested) == 19


def get(service: Any, path: str, token: str | None) -> tuple[int, dict[str, str], bytes]:
    """One GET; for the event stream, its head and first frame only."""
    conn = http.client.HTTPConnection("127.0.0.1", service.api.port, timeout=10)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        if response.getheader("Content-Type", "").startswith("text/event-stream"):
            body = b""
            while b"\n\n" not in body:
                body += response.read1(65536)
        else:
            body = response.read()
        return response.status, dict(response.getheaders()), body
    finally:
        conn.close()


def validator(document: dict[str, Any], name: str) -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    )


@pytest.mark.slow
def test_the_event_stream_is_as_documented_and_needs_the_token(live: Any) -> None:
    status, _, raw = get(live, "/api/openapi.json", None)  # the document needs no token
    assert status == 200
    document = json.loads(raw)
    described = document["paths"]["/api/queue/events"]["get"]
    status, headers, body = get(live, "/api/queue/events", None)
    assert status == 401 and "401" in described["responses"]
    assert headers["WWW-Authenticate"].startswith("Bearer")
    validator(document, "Error").validate(json.loads(body))

    status, headers, body = get(live, "/api/queue/events", live.api.token)
    assert status == 200 and "text/event-stream" in described["responses"]["200"]["content"]
    assert headers["Content-Type"].startswith("text/event-stream")
    event, data = body.split(b"\n\n")[0].split(b"\n")
    assert event == b"event: queue"
    validator(document, "Status").validate(json.loads(data.removeprefix(b"data: ")))


def test_the_document_describes_every_route_and_no_other() -> None:
    document = openapi.document("http://127.0.0.1:8765/")
    assert document["openapi"].startswith("3.1")
    assert document["servers"] == [{"url": "http://127.0.0.1:8765"}]
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
    }
    described = {
        (method.upper(), re.sub(r"\{[^}]+\}", "x", path))
        for path, item in document["paths"].items()
        for method in item
    }
    served = {
        (method, re.sub(r"\(\?P<\w+>\[\^/\]\+\)", "x", pattern.pattern).replace("\\.", "."))
        for pattern, methods in api_module.ROUTES
        for method in methods
    }
    assert described == served
    for path, item in document["paths"].items():
        for method, operation in item.items():
            public = operation.get("security") == []
            assert public == (path in api_module.PUBLIC), path
            codes = set(operation["responses"])
            assert {"200", "403", "405"} <= codes, (method, path)
            assert ("401" in codes) != public, (method, path)
            if method == "post":
                assert {"400", "411", "413"} <= codes, path


@pytest.mark.slow
def test_a_finished_songs_files_answer_as_documented(live: Any) -> None:
    """The player's endpoints on a real finished song (Schemathesis cannot guess a job id):
    the song's own stems, picture and beat grid, whole and in ranges, and names it does not
    have, each answer as the document says. (A Range is a header the document does not
    describe, so a range past the end, a schema-valid request refused, is left to
    tests/ui/test_player.py.)"""
    from test_player import finished_song

    job = finished_song(live)
    schema = schemathesis.openapi.from_url(live.api.url + DOCUMENT[1:], timeout=10)
    auth = {"Authorization": f"Bearer {live.api.token}"}
    ranges = [None, "bytes=0-99", "bytes=-10", "bytes=100-"]  # (416: tests/ui/test_player.py)
    seen: set[int] = set()
    calls = iter(range(10**6))
    for result in schema.get_all_operations():
        operation = result.ok()
        if not operation.path.startswith("/api/jobs/{ref}/") or operation.method != "get":
            continue

        @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE))
        @settings(
            max_examples=15,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        def check(case: Any) -> None:
            case.path_parameters["ref"] = job.id
            if "stem" in case.path_parameters and len(case.path_parameters["stem"]) % 2:
                case.path_parameters["stem"] = "vocals"
            picked = ranges[next(calls) % len(ranges)]
            response = case.call_and_validate(
                headers={**auth, **({"Range": picked} if picked else {})}, timeout=15
            )
            seen.add(response.status_code)

        check()
    assert {200, 206, 404} <= seen, seen
