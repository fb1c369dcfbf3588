"""A private two-node Ray cluster for the Ray executor's tests (tests/workers/test_ray*.py).

`ray.cluster_utils.Cluster`: a head and one more node, one CPU each, so two one-CPU workers
land on two nodes. Ray's usage stats and its token authentication are switched off for this
cluster only; it is shut down by its own handle (never `ray stop`, which would stop every
Ray process on the machine). This test process is the cluster's driver: a service started
in it uses that connection.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import pytest


@contextlib.contextmanager
def two_node_cluster() -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster

    env = pytest.MonkeyPatch()
    env.setenv("RAY_USAGE_STATS_ENABLED", "0")
    env.setenv("RAY_AUTH_MODE", "disabled")  # only this test cluster runs without a token
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        made.add_node(num_cpus=1)
        made.wait_for_nodes()
        ray.init(address=made.address, logging_level=logging.WARNING, log_to_driver=False)
        yield made
    finally:
        ray.shutdown()
        made.shutdown()
        env.undo()
