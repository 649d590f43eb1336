"""One module per acceleration, each exposing ``apply_<name>(state, config, mesh) -> state``
(which returns the state unchanged when its switch is off) and, where it has any, its
validation ``rules(config, context)``.

The order in which they are applied, and the list of rules, live in
:mod:`rapidformer.engine.order` only.
"""
