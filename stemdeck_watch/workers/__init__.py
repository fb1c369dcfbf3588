"""Workers: where separation runs.

Every worker is reached through one interface, `Separator` (separator.py).
`executor.kind = "local"` (the default) is the one resident worker subprocess (local.py's
WorkerClient, running worker.py). `"ray"` runs one resident-model Ray actor per worker across
the machines of a Ray cluster (the room `ray/`). executor.py builds the workers the
configuration asks for.

The worker serves two engines, each in a room of its own: `demucs/` (the Demucs models, their
catalogue and cache, bounded-memory inference, the precision choice, the last step of
HTDemucs) and `roformer/` (a recipe's vocals); `compiled/` holds the compiled form of
either. What every engine shares stays here: the worker process and its zygote, the interface,
downloads, the pace and stall watch, the C heap, the processes' lifetime.

Nothing in this package's `__init__` imports Ray: with `kind = "local"` Ray is never imported,
and without the `ray` extra installed everything but the Ray executor works.
"""

from __future__ import annotations

import importlib.util


def ray_installed() -> bool:
    """Whether the optional `ray` extra is importable (checked without importing it)."""
    return importlib.util.find_spec("ray") is not None
