"""The worker's own refusal: whoever asks (a job, the warm-up, a Ray actor), demucs is only
ever handed a plain model name, never a URL, a scheme or a path."""

from __future__ import annotations

import socket
import sys
import types
from pathlib import Path

import pytest

from stemdeck_watch.workers.worker import ModelUnavailable, load_model


@pytest.mark.parametrize(
    "name", ["hf://evil/htdemucs", "https://evil.example/m", "file:/tmp/m", "../m", "/tmp/m"]
)
def test_a_model_name_with_a_scheme_or_a_path_is_refused_before_demucs_sees_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """demucs fetches `hf://` from HuggingFace before it looks at a repo, and builds the
    class the repository's metadata names: even with a model_repo set, the name is
    refused before demucs (or the network) is reached."""

    def refused(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("demucs or the network was reached")

    stub = types.ModuleType("demucs.pretrained")
    stub.get_model = refused  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "demucs.pretrained", stub)
    monkeypatch.setattr(socket.socket, "connect", refused)
    for repo in (None, str(tmp_path)):
        with pytest.raises(ModelUnavailable, match="not a model name"):
            load_model(name, repo)
