"""One module per acceleration, each exposing ``apply_<name>(state, config, dims) -> state``.

The order in which they are applied lives in :mod:`rapidformer.engine.engine` only.
"""
