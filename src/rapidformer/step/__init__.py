"""The step's own code: what every run does between two optimizer steps, whatever accelerates it.

* :mod:`.forward_backward`: the default forward-backward slot (torch autograd, under DDP or
  FSDP2 or on one process); pipelines, DeepSpeed and ONNX Runtime bring other implementations;
* :mod:`.optimizer_step`: the default stepper slot: gradient reductions, unscale, global norm
  and clipping, then the update, skipped on the device when the ranks agreed to skip;
* :mod:`.gradients`: the global gradient norm and clipping over every shard, once;
* :mod:`.scaler_state`: the few ``GradScaler`` internals the stepper needs.

It sits below ``accel/``: the accelerations plug into these slots, never the other way round.
"""
