"""Models as ordered layer lists, so a plan can cut them at any layer boundary.

A `LayerModel` builds layer `i` on its own, seeded by (seed, i): a rank builds only the
layers of its stage, and every partition of the same model starts from the same
weights (a single process building all layers gets them too, for reference runs).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipesgd.paper_models import PAPER_NETWORKS, paper_network


@dataclass(frozen=True)
class LayerModel:
    """An ordered list of layer builders.

    Attributes:
        name: short name ("mlp", "cnn").
        builders: `builders[i]()` returns layer i as a fresh module.
        input_shape: shape of one sample.
        num_classes: output classes of the last layer.
    """

    name: str
    builders: tuple[Callable[[], nn.Module], ...]
    input_shape: tuple[int, ...]
    num_classes: int

    @property
    def num_layers(self) -> int:
        return len(self.builders)

    def build(self, start: int = 0, end: int | None = None, seed: int = 0) -> nn.Sequential:
        """Layers [start, end) as an `nn.Sequential`, each seeded by (seed, index)."""
        end = self.num_layers if end is None else end
        layers = []
        state = torch.random.get_rng_state()
        try:
            for i in range(start, end):
                torch.manual_seed(seed * 100_003 + i)
                layers.append(self.builders[i]())
        finally:
            torch.random.set_rng_state(state)
        return nn.Sequential(*layers)


def from_modules(layers: Sequence[nn.Module], input_shape: tuple[int, ...], num_classes: int,
                 name: str = "model") -> LayerModel:
    """Wrap already-built layers (every rank builds them all; prefer a `LayerModel`)."""
    import copy

    return LayerModel(
        name, tuple((lambda m=m: copy.deepcopy(m)) for m in layers), input_shape, num_classes
    )


def mlp(sizes: Sequence[int] = (64, 500, 500, 10)) -> LayerModel:
    """Linear/ReLU layers, e.g. 64-500-500-10 for the digits data set (5 layers)."""
    builders: list[Callable[[], nn.Module]] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        builders.append(lambda a=a, b=b: nn.Linear(a, b))
        if i < len(sizes) - 2:
            builders.append(nn.ReLU)
    return LayerModel("mlp", tuple(builders), (sizes[0],), sizes[-1])


def _he(layer: nn.Conv2d | nn.Linear) -> nn.Module:
    """He initialisation: without normalisation layers, torch's default init leaves the
    deep ReLU stack with vanishing activations, and plain SGD never leaves chance level."""
    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
    assert layer.bias is not None
    nn.init.zeros_(layer.bias)
    return layer


def _conv(cin: int, cout: int, batch_norm: bool, stride: int = 1) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        parts: list[nn.Module] = [_he(nn.Conv2d(cin, cout, 3, stride=stride, padding=1))]
        if batch_norm:
            parts.append(nn.BatchNorm2d(cout))
        parts.append(nn.ReLU())
        return nn.Sequential(*parts)

    return build


def cnn(num_classes: int = 10, channels: int = 3, batch_norm: bool = False) -> LayerModel:
    """AlexNet-style CNN for 32x32 inputs: 5 conv, 3 linear layers, 18.4 MB of weights.

    Layers: conv64/2, pool, conv192, pool, conv384, conv256, conv256, pool, flatten,
    fc1536, fc512, fc(num_classes) -- 12 layers. The strided first convolution keeps
    a batch of 32 near 0.1 s of forward and backward on one CPU core (88 MFLOP forward
    per sample), so on a 1 Gbit/s link the 18 MB gradient, not the arithmetic, is the
    bottleneck, as for the paper's GPU-trained CNNs. `batch_norm` adds BatchNorm after each
    convolution (its running statistics are per stage, not stashed).
    """
    builders: list[Callable[[], nn.Module]] = [
        _conv(channels, 64, batch_norm, stride=2),
        lambda: nn.MaxPool2d(2),
        _conv(64, 192, batch_norm),
        lambda: nn.MaxPool2d(2),
        _conv(192, 384, batch_norm),
        _conv(384, 256, batch_norm),
        _conv(256, 256, batch_norm),
        lambda: nn.MaxPool2d(2),
        nn.Flatten,
        lambda: nn.Sequential(_he(nn.Linear(256 * 2 * 2, 1536)), nn.ReLU()),
        lambda: nn.Sequential(_he(nn.Linear(1536, 512)), nn.ReLU()),
        lambda: nn.Linear(512, num_classes),
    ]
    return LayerModel("cnn", tuple(builders), (channels, 32, 32), num_classes)


def paper(name: str, num_classes: int | None = None) -> LayerModel:
    """A network of the Pipe-SGD paper (`pipesgd.paper_models`: "paper-mnist-mlp",
    "paper-cifar100-cnn", "alexnet", "resnet18") for its own input shape, with
    `num_classes` outputs (None: its data set's).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    net = paper_network(name)
    classes = net.num_classes if num_classes is None else num_classes
    return LayerModel(name, net.layers(classes), net.input_shape, classes)


MODELS: dict[str, Callable[[], LayerModel]] = {
    "mlp": mlp,
    "cnn": cnn,
    **{name: functools.partial(paper, name) for name in PAPER_NETWORKS},
}
