"""Data sets for `pipesgd train` and how each rank reads its shard of a global batch.

Sources: "digits" (scikit-learn's bundled 8x8 handwritten digits, offline), a folder of
MNIST IDX files, or "synthetic" (learnable Gaussian data, for timing). Images are shaped
for the model: flat vectors for the MLP, 1x32x32 (or 3x32x32 synthetic) for the CNN.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from pipesgd.pipeline import data as pipeline_data

SYNTHETIC_TRAIN, SYNTHETIC_TEST = 8192, 1024
_MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


@dataclass(frozen=True)
class Dataset:
    """A training split and a held-out split, shaped for one model."""

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])


def _flat(model: str) -> bool:
    """Whether `model` takes flat samples; every other model gets (N, C, 32, 32) images."""
    from pipesgd.paper_models import PAPER_NETWORKS

    return model == "mlp" or (model in PAPER_NETWORKS and PAPER_NETWORKS[model].flat_input)


def _shape_images(images: Tensor, model: str) -> Tensor:
    """(N, H, W) images in [0, 1] -> flat (N, H*W) for an MLP, (N, 1, 32, 32) otherwise."""
    if _flat(model):
        return images.reshape(len(images), -1)
    images = images.unsqueeze(1)
    h, w = images.shape[-2:]
    if h < 16:  # 8x8 digits: upsample to the CNN's 32x32 input
        return F.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False)
    pad_h, pad_w = 32 - h, 32 - w
    return F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))


def digits(model: str) -> Dataset:
    """scikit-learn's digits: 1438 training and 359 held-out samples (fixed split)."""
    (train_x, train_y), (test_x, test_y) = pipeline_data.digits(test_fraction=0.2, seed=0)
    return Dataset(
        "digits",
        _shape_images(train_x.view(-1, 8, 8), model),
        train_y,
        _shape_images(test_x.view(-1, 8, 8), model),
        test_y,
        10,
    )


def synthetic(model: str, seed: int = 0) -> Dataset:
    """Gaussian inputs with a learnable label: 784 features (an MLP) or 3x32x32."""
    shape = (784,) if _flat(model) else (3, 32, 32)
    x, y = pipeline_data.synthetic(SYNTHETIC_TRAIN + SYNTHETIC_TEST, shape, 10, seed=seed)
    return Dataset("synthetic", x[:SYNTHETIC_TRAIN], y[:SYNTHETIC_TRAIN],
                   x[SYNTHETIC_TRAIN:], y[SYNTHETIC_TRAIN:], 10)


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes (bad magic number)")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != math.prod(dims):
        raise ValueError(f"{path}: header says {dims} but holds {data.size} bytes")
    return data.reshape(dims)


def _mnist_files(folder: Path) -> dict[str, Path]:
    """The four IDX files of an MNIST folder, by key of `_MNIST_FILES`.

    Raises:
        FileNotFoundError: `folder` is no folder, or one is missing (the message lists
            the expected names).
    """
    if not folder.is_dir():
        raise FileNotFoundError(
            f"--data {str(folder)!r}: expected 'digits', 'synthetic' or a folder of MNIST "
            "IDX files"
        )
    files = {}
    for key, stem in _MNIST_FILES.items():
        candidates = [folder / stem, folder / f"{stem}.gz", folder / stem.replace("-idx", ".idx")]
        found = next((c for c in candidates if c.exists()), None)
        if found is None:
            raise FileNotFoundError(
                f"{folder} lacks {stem} (or {stem}.gz); an MNIST folder holds "
                f"{', '.join(_MNIST_FILES.values())}. Use --data digits to train offline"
            )
        files[key] = found
    return files


def mnist(folder: str | Path, model: str) -> Dataset:
    """MNIST from the four IDX files (optionally .gz) in `folder`.

    Raises:
        FileNotFoundError: no such folder, or a file is missing (`_mnist_files`).
    """
    arrays = {key: _read_idx(path) for key, path in _mnist_files(Path(folder)).items()}
    to_images = lambda a: torch.from_numpy(a.astype(np.float32) / 255.0)  # noqa: E731
    return Dataset(
        "mnist",
        _shape_images(to_images(arrays["train_x"]), model),
        torch.from_numpy(arrays["train_y"].astype(np.int64)),
        _shape_images(to_images(arrays["test_x"]), model),
        torch.from_numpy(arrays["test_y"].astype(np.int64)),
        10,
    )


def check_source(source: str) -> None:
    """Refuse a `source` that `load` cannot read, before anything runs.

    Raises:
        FileNotFoundError: neither "digits" nor "synthetic", nor a folder holding the
            four MNIST IDX files.
    """
    if source not in ("digits", "synthetic"):
        _mnist_files(Path(source))


def load(source: str, model: str, seed: int = 0) -> Dataset:
    """`source` is "digits", "synthetic" or a folder of MNIST IDX files.

    Raises:
        FileNotFoundError: `source` is neither (as `check_source` says before a run).
    """
    if source == "digits":
        return digits(model)
    if source == "synthetic":
        return synthetic(model, seed)
    return mnist(source, model)


class ShardedBatches:
    """Global batches of `batch_size * size` samples in a seeded order per epoch; rank
    `rank` reads its disjoint slice of each. A trailing partial global batch is dropped.

    Args:
        num_samples: size of the training split.
        batch_size: samples per rank per iteration.
        rank, size: this rank and the number of ranks.
        seed: order seed; every rank derives the same permutation for (seed, epoch).

    Raises:
        ValueError: the data set holds less than one global batch.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, size: int,
                 seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"the batch size must be >= 1 sample per rank, got {batch_size}")
        global_batch = batch_size * size
        if global_batch > num_samples:
            raise ValueError(
                f"a global batch of {batch_size} x {size} ranks = {global_batch} samples does "
                f"not fit the {num_samples} training samples: lower --batch-size"
            )
        self.batch_size, self.rank = batch_size, rank
        self._order = pipeline_data.MicroBatches(
            torch.empty(num_samples, 0), torch.empty(num_samples), global_batch, seed=seed
        )

    def __len__(self) -> int:
        """Iterations per epoch."""
        return len(self._order)

    def indices(self, epoch: int, step: int) -> Tensor:
        """This rank's sample indices for iteration `step` of `epoch`."""
        batch = self._order.indices(epoch, step)
        return batch[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
