"""The accelerations: one module per switch, one sub-package per switch that needs several files.

Each exposes ``apply_<name>(state, config, mesh) -> state`` (the state unchanged when its switch
is off) and, where it owns flags, a :class:`~rapidformer.config.validate.Feature` (``FEATURE``:
its flags, its rules, the backends it cannot run on). A feature's rules refuse only its own
flags, so everything a switch cannot do is in its own module.

* one file: ``data``, ``data_parallel``, ``fp8``, ``liger``, ``lm_loss``, ``materialize``,
  ``precision``, ``recompute``, ``sharding``, ``tensor_parallel``;
* packages: ``compile/``, ``deepspeed/``, ``lora/``, ``moe/``, ``onnx/``, ``optim/``, ``pipeline/``.

They plug into the step's own code (:mod:`rapidformer.step`), never the other way round. The
order in which they are applied, and the list of features, live in
:mod:`rapidformer.engine.order` only.
"""
