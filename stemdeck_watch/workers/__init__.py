"""Executors: where separation runs.

`executor.kind = "local"` (the default) is the one resident worker subprocess
(pipeline/separate.py's WorkerClient). `"ray"` runs one resident-model Ray actor per worker
across the machines of a Ray cluster (ray_actor.py, ray_client.py, cluster.py), behind the
same client interface, so the pipeline cannot tell them apart.

Nothing in this package's `__init__` imports Ray: with `kind = "local"` Ray is never imported,
and without the `ray` extra installed everything but the Ray executor works.
"""
from __future__ import annotations

import importlib.util

KINDS = ("local", "ray")


def ray_installed() -> bool:
    """Whether the optional `ray` extra is importable (checked without importing it)."""
    return importlib.util.find_spec("ray") is not None


def ray_address(value: object) -> str:
    """Config check of `executor.address`: "auto" (the cluster this machine belongs to),
    "local" (a private cluster started on this machine), "ray://HOST:PORT" (Ray Client) or
    "HOST:PORT" (the head's GCS address)."""
    if not isinstance(value, str):
        raise ValueError('"auto", "local", "ray://HOST:PORT" or "HOST:PORT"')
    text = value.strip()
    if text in ("auto", "local"):
        return text
    rest = text[len("ray://"):] if text.startswith("ray://") else text
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError('"auto", "local", "ray://HOST:PORT" (Ray Client, usually '
                         'port 10001) or "HOST:PORT" (the head node, usually port 6379)')
    return text
