"""The compose example and the manual agree with the image: the manual shows `compose.yaml`
as it is, and its volumes, variables and published port are the ones the Containerfile
declares and the entrypoint and the first config read (no image is built here;
`make image-test` runs it)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from stemdeck_watch.cli.container import FOLDERS, HOSTS, PAGE_PORT, PASSWORD_FILES
from stemdeck_watch.util.validators import host_names

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
    assert set(service["environment"]) == {
        "PUID", "PGID", "UMASK", "TZ", PASSWORD_FILES[0], HOSTS
    }  # fmt: skip
    entrypoint = (REPO / "container" / "entrypoint.sh").read_text()
    assert all(f'"${{{name}' in entrypoint for name in ("PUID", "PGID", "UMASK"))


def test_the_compose_file_publishes_the_page_and_gives_its_password_as_a_secret() -> None:
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    service = compose["services"]["stemdeck"]
    assert [entry.split(":")[-1] for entry in service["ports"]] == [str(PAGE_PORT)]
    assert f"EXPOSE {PAGE_PORT}" in (REPO / "Containerfile").read_text()
    [secret] = service["secrets"]
    assert service["environment"][PASSWORD_FILES[0]] == f"/run/secrets/{secret}"
    assert "file" in compose["secrets"][secret]
    assert "PASSWORD" not in service["environment"]  # never the password itself
    assert host_names(service["environment"][HOSTS].split(","))  # names api.hosts takes
