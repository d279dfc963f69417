"""Deterministic micro-batch streams: every rank derives the same order from (seed, epoch),
so the first stage reads inputs and the last stage reads labels without exchanging them.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import Tensor


class MicroBatches:
    """Fixed-size micro-batches of (inputs, labels), reshuffled every epoch.

    Args:
        inputs, labels: the whole data set (first dimension = samples).
        micro_batch: samples per micro-batch; a trailing partial micro-batch is dropped.
        seed: order seed; epoch e uses permutation (seed, e).
        shuffle: False keeps the data set order.
    """

    def __init__(self, inputs: Tensor, labels: Tensor, micro_batch: int, *, seed: int = 0,
                 shuffle: bool = True) -> None:
        if len(inputs) != len(labels):
            raise ValueError(f"{len(inputs)} inputs but {len(labels)} labels")
        if not 1 <= micro_batch <= len(inputs):
            raise ValueError(
                f"micro_batch {micro_batch} must be in [1, {len(inputs)}] (the data set size)"
            )
        self.x, self.y = inputs, labels
        self.micro_batch = micro_batch
        self.seed = seed
        self.shuffle = shuffle
        self._order: tuple[int, Tensor] | None = None

    def __len__(self) -> int:
        return len(self.x) // self.micro_batch

    def order(self, epoch: int) -> Tensor:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                perm = torch.randperm(len(self.x), generator=g)
            else:
                perm = torch.arange(len(self.x))
            self._order = (epoch, perm)
        return self._order[1]

    def indices(self, epoch: int, mb: int) -> Tensor:
        if not 0 <= mb < len(self):
            raise IndexError(f"micro-batch {mb} of an epoch of {len(self)}")
        return self.order(epoch)[mb * self.micro_batch : (mb + 1) * self.micro_batch]

    def inputs(self, epoch: int, mb: int) -> Tensor:
        return self.x[self.indices(epoch, mb)]

    def labels(self, epoch: int, mb: int) -> Tensor:
        return self.y[self.indices(epoch, mb)]


def _digits_table() -> np.ndarray:
    """scikit-learn's bundled digits, one row per image: 64 pixels (0-16), then the label.

    Read from the package's own file when it is where scikit-learn keeps it, without
    importing `sklearn.datasets`: that import took 0.9 s of every process, on every rank
    of every launch that trains on the digits; `load_digits` reads the same file.
    """
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                return np.loadtxt(f, delimiter=",")
    from sklearn.datasets import load_digits

    d = load_digits()
    return np.column_stack([d.data, d.target])


def digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[tuple[Tensor, Tensor],
                                                               tuple[Tensor, Tensor]]:
    """scikit-learn's bundled 8x8 digits (1797 samples, 64 features scaled to [0, 1])."""
    table = _digits_table()
    x = torch.tensor(table[:, :-1], dtype=torch.float32) / 16.0
    y = torch.tensor(table[:, -1], dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def digits_as_images(shape: tuple[int, ...], test_fraction: float = 0.2, seed: int = 0
                     ) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The digits as images of `shape` (channels, height, width): each 8x8 image scaled
    up bilinearly and repeated over the channels, so an image model learns a real task
    (in a few epochs) without a data set to download."""
    if len(shape) != 3:
        raise ValueError(f"digits as images need a (channels, height, width) input, got {shape}")
    channels, height, width = shape
    (x, y), (xt, yt) = digits(test_fraction, seed)

    def images(flat: Tensor) -> Tensor:
        small = flat.reshape(-1, 1, 8, 8)
        big = torch.nn.functional.interpolate(small, size=(height, width), mode="bilinear",
                                              align_corners=False)
        return big.expand(-1, channels, -1, -1).contiguous()

    return (images(x), y), (images(xt), yt)


def synthetic(samples: int, shape: tuple[int, ...], classes: int, seed: int = 0
              ) -> tuple[Tensor, Tensor]:
    """Gaussian inputs whose label is a fixed random linear function's argmax (learnable)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((samples, *shape), generator=g)
    w = torch.randn((int(torch.tensor(shape).prod()), classes), generator=g)
    y = (x.reshape(samples, -1) @ w).argmax(dim=1)
    return x, y
