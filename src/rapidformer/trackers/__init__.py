"""``--report-to``: where rank 0 reports a run, beside the console.

Every tracker receives the same rows under the same names: each logged row's numbers as
``kind/name`` at the row's step (``train/loss``, ``train/tokens_per_s``, ``eval/eval_loss``;
``metrics.jsonl`` holds the same rows as ``{"kind": ..., name: value}``), and once, at the
start, the resolved config as hyperparameters and the run plan as text. A tracker that fails
(a full disk, a server gone) warns once and is dropped: training never stops for it. A resumed
run continues its MLflow, W&B and Trackio runs (their ids are kept in each checkpoint).

* :mod:`.files`: ``metrics.jsonl`` and TensorBoard under ``--save`` (the default);
* :mod:`.mlflow_run`, :mod:`.wandb_run`, :mod:`.trackio_run`: the real libraries
  (``pip install 'rapidformer[trackers]'``), imported only when named;
* :mod:`.guard`: the group of a run's trackers, each guarded; a user's callbacks join it.
"""

from rapidformer.trackers.guard import GuardedTrackers
from rapidformer.trackers.setup import TrackerSetup, open_trackers

__all__ = ["GuardedTrackers", "TrackerSetup", "open_trackers"]
