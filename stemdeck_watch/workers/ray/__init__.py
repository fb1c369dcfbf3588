"""The Ray executor's room: resident-model workers on the machines of a Ray cluster.

`client.py` is the service's side of one worker (a `Separator`, as the local worker is),
`actor.py` the actor it owns on the cluster, which runs the same worker code as the local
process, and `cluster.py` the connection and the watch that pauses the queue while the
cluster is gone. Ray is imported by those modules only, never by this package's `__init__`:
with `executor.kind = "local"` Ray is never imported.
"""
