"""A weighted blend of datasets (``--data-path "0.3 A 0.7 B"``), as Megatron mixes corpora.

Sample i of the blend comes from the dataset whose share so far lags its weight the most, so
every prefix of the blend follows the weights as closely as whole samples allow, and the order
is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset


def blend_index(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each sample, index of the sample within that dataset)."""
    weights_array = np.asarray(weights, dtype=np.float64)
    taken = np.zeros(len(weights_array), dtype=np.int64)
    which = np.empty(num_samples, dtype=np.int64)
    within = np.empty(num_samples, dtype=np.int64)
    for i in range(num_samples):
        lag = weights_array * (i + 1) - taken
        choice = int(np.argmax(lag))
        which[i], within[i] = choice, taken[choice]
        taken[choice] += 1
    return which, within


def samples_per_dataset(weights: Sequence[float], num_samples: int) -> list[int]:
    """How many samples each dataset must provide for a blend of ``num_samples``."""
    which, _ = blend_index(weights, num_samples)
    return [int((which == d).sum()) for d in range(len(weights))]


class BlendedDataset(Dataset):
    def __init__(
        self, datasets: Sequence[Dataset], weights: Sequence[float], num_samples: int
    ) -> None:
        self.datasets = list(datasets)
        self.which, self.within = blend_index(weights, num_samples)

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, index: int) -> Any:
        return self.datasets[int(self.which[index])][int(self.within[index])]

    @property
    def lengths(self) -> np.ndarray:
        parts = [np.asarray(d.lengths) for d in self.datasets]  # type: ignore[attr-defined]
        return np.array([parts[w][i] for w, i in zip(self.which, self.within, strict=True)])
