"""The compose example and the manual agree with the image: the manual shows `compose.yaml`
as it is, and its volumes and variables are the ones the Containerfile declares and the
entrypoint reads (no image is built here; `make image-test` runs it)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from stemdeck_watch.cli.container import FOLDERS

REPO = Path(__file__).resolve().parents[2]


def test_the_manual_shows_the_compose_file_as_it_is() -> None:
    page = (REPO / "docs" / "guide" / "nas.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(.*?)^```", page, flags=re.MULTILINE | re.DOTALL)
    assert (REPO / "compose.yaml").read_text(encoding="utf-8") in blocks


def test_the_compose_file_mounts_the_images_volumes_and_sets_its_variables() -> None:
    service = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["stemdeck"]
    containerfile = (REPO / "Containerfile").read_text()
    [declared] = re.findall(r"^VOLUME (\[.*\])$", containerfile, flags=re.MULTILINE)
    volumes = set(yaml.safe_load(declared))
    assert {entry.split(":")[1] for entry in service["volumes"]} == volumes
    # the first config's folders are those volumes
    assert {"/" + Path(path).parts[1] for path in FOLDERS.values()} <= volumes
    assert set(service["environment"]) == {"PUID", "PGID", "UMASK", "TZ"}
    entrypoint = (REPO / "container" / "entrypoint.sh").read_text()
    assert all(f'"${{{name}' in entrypoint for name in ("PUID", "PGID", "UMASK"))
