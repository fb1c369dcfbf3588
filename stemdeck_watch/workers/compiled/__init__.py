"""The compiled path: a model built ahead of time, kept in the state folder, used by the worker.

`model` loads a compiled model from the cache and decides whether it is used; `graph` compiles
and loads each part of a network as one graph; `openvinograph` converts a transformer for
OpenVINO; `cache` keeps what was built, for what, and whether it paid; `build` is the
background process at idle priority that builds it, and its keeper.
"""
