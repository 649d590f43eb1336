"""What keeps a run alive, or ends it cleanly, when something outside it goes wrong.

* :mod:`~rapidformer.reliability.signals`: stop signals (preemption) become a request that the
  loop honours at the next step boundary, after a checkpoint.
* :mod:`~rapidformer.reliability.guard`: every rank agrees, once per step, whether to skip the
  step (a non-finite loss or gradient anywhere) and whether to stop (a signal anywhere).
* :mod:`~rapidformer.reliability.peers`: a collective that fails because a peer died or stalls
  becomes an error naming the missing rank.

Sits beside ``state.py``: it imports only the process-group helpers, errors and logging.
"""
