"""The networks of the Pipe-SGD paper's benchmarks (§4), built from their published shapes.

    paper-mnist-mlp     784-500-500-10, ReLU                      648,010 parameters
    paper-cifar100-cnn  3 conv (5x5: 32, 32, 64) + FC 64 + FC 100  151,428 parameters
    alexnet             one-tower AlexNet, 3x224x224, 1000 classes   61,100,840 parameters
    resnet18            ResNet-18, 3x224x224, 1000 classes           11,689,512 parameters

Each network is data (`PaperNetwork`): the sample shape and class count it expects, and
a function that returns its layer builders for a class count, so a pipeline plan can
cut between the layers (`pipesgd.pipeline.models.paper` wraps them as a `LayerModel`).
Plain torch: no torchvision.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

LayerBuilders = tuple[Callable[[], nn.Module], ...]


@dataclass(frozen=True)
class PaperNetwork:
    """One network of the paper: what it expects and how to build it.

    Attributes:
        name: the `--model` name.
        title: how the paper calls it.
        input_shape: shape of one sample.
        num_classes: classes of the paper's data set.
        layers: class count -> the layer builders, in order.
        flat_input: the network flattens its input first, so any sample shape with
            prod(input_shape) elements will do (MNIST's 1x28x28 as well as 784).
    """

    name: str
    title: str
    input_shape: tuple[int, ...]
    num_classes: int
    layers: Callable[[int], LayerBuilders]
    flat_input: bool = False

    def accepts(self, input_shape: tuple[int, ...]) -> bool:
        """Whether samples of `input_shape` fit the network."""
        if self.flat_input:
            return math.prod(input_shape) == math.prod(self.input_shape)
        return tuple(input_shape) == self.input_shape


def mnist_mlp_layers(num_classes: int = 10) -> LayerBuilders:
    """MNIST-MLP: the classical 3-layer perceptron, 784-500-500-classes with ReLU (6 layers
    with the leading Flatten)."""
    return (
        nn.Flatten,
        lambda: nn.Linear(784, 500),
        nn.ReLU,
        lambda: nn.Linear(500, 500),
        nn.ReLU,
        lambda: nn.Linear(500, num_classes),
    )


def cifar100_cnn_layers(num_classes: int = 100) -> LayerBuilders:
    """The AlexNet-style CIFAR100 network: 3 convolutional layers, 2 fully connected
    layers, then the softmax (in the loss). 9 layers, 151,428 parameters.

    The paper gives the structure (3 conv + 2 FC + softmax, 32x32x3 input, 100 classes)
    and leaves the shapes to its reference, the cuda-convnet CIFAR networks. These are
    their shapes: 5x5 convolutions of 32, 32 and 64 filters (padding 2), each followed
    by ReLU and 3x3 pooling of stride 2 (max after the first, average after the others;
    cuda-convnet's pooling covers the edge, hence `ceil_mode`: 32 -> 16 -> 8 -> 4),
    then FC 64 with ReLU and FC `num_classes`. cuda-convnet's layers-18pct ends in one
    FC layer; the 64-unit layer before the classifier (as in its layers-80sec) gives
    the paper's two. The response normalisation of layers-18pct is left out: it has no
    parameters, and so changes neither the gradient bytes nor much of the compute.
    """
    def conv(cin: int, cout: int) -> Callable[[], nn.Module]:
        return lambda: nn.Sequential(nn.Conv2d(cin, cout, 5, padding=2), nn.ReLU())

    return (
        conv(3, 32),
        lambda: nn.MaxPool2d(3, stride=2, ceil_mode=True),
        conv(32, 32),
        lambda: nn.AvgPool2d(3, stride=2, ceil_mode=True),
        conv(32, 64),
        lambda: nn.AvgPool2d(3, stride=2, ceil_mode=True),
        nn.Flatten,
        lambda: nn.Sequential(nn.Linear(64 * 4 * 4, 64), nn.ReLU()),
        lambda: nn.Linear(64, num_classes),
    )


def alexnet_layers(num_classes: int = 1000) -> LayerBuilders:
    """AlexNet in one tower (Krizhevsky's single-GPU form, as torchvision builds it):
    convolutions 11x11/4 64, 5x5 192, 3x3 384, 256, 256 with ReLU and 3x3/2 max pooling
    after the 1st, 2nd and 5th; then dropout, FC 4096, dropout, FC 4096, FC classes. No
    local response normalisation (no parameters). A 224x224 input leaves 256x6x6 for
    the first FC layer. 12 layers, 61,100,840 parameters for 1000 classes.
    """
    def conv(cin: int, cout: int, k: int, stride: int = 1,
             padding: int | None = None) -> Callable[[], nn.Module]:
        pad = k // 2 if padding is None else padding
        return lambda: nn.Sequential(nn.Conv2d(cin, cout, k, stride=stride, padding=pad),
                                     nn.ReLU())

    def fc(cin: int, cout: int) -> Callable[[], nn.Module]:
        return lambda: nn.Sequential(nn.Dropout(0.5), nn.Linear(cin, cout), nn.ReLU())

    pool = lambda: nn.MaxPool2d(3, stride=2)  # noqa: E731
    return (
        conv(3, 64, 11, stride=4, padding=2),  # 224 -> 55
        pool,
        conv(64, 192, 5),
        pool,
        conv(192, 384, 3),
        conv(384, 256, 3),
        conv(256, 256, 3),
        pool,
        nn.Flatten,
        fc(256 * 6 * 6, 4096),
        fc(4096, 4096),
        lambda: nn.Linear(4096, num_classes),
    )


class BasicBlock(nn.Module):
    """ResNet's two-convolution residual block: 3x3 conv, BN, ReLU, 3x3 conv, BN, plus
    the input (through a 1x1 conv and BN where the block changes stride or width)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(cout))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


def resnet18_layers(num_classes: int = 1000) -> LayerBuilders:
    """ResNet-18 (He et al. 2016): 7x7/2 conv 64, BN, ReLU, 3x3/2 max pooling, four
    stages of two `BasicBlock`s (64, 128, 256, 512 channels; the first block of each
    later stage halves the resolution), global average pooling, FC classes. 12 layers,
    11,689,512 parameters for 1000 classes.
    """
    def stem() -> nn.Module:
        conv = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        return nn.Sequential(conv, nn.BatchNorm2d(64), nn.ReLU(inplace=True))

    def block(cin: int, cout: int, stride: int = 1) -> Callable[[], nn.Module]:
        return lambda: BasicBlock(cin, cout, stride)

    return (
        stem,
        lambda: nn.MaxPool2d(3, stride=2, padding=1),
        block(64, 64), block(64, 64),
        block(64, 128, 2), block(128, 128),
        block(128, 256, 2), block(256, 256),
        block(256, 512, 2), block(512, 512),
        lambda: nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()),
        lambda: nn.Linear(512, num_classes),
    )


PAPER_NETWORKS: dict[str, PaperNetwork] = {
    net.name: net
    for net in (
        PaperNetwork("paper-mnist-mlp", "MNIST-MLP", (784,), 10, mnist_mlp_layers,
                     flat_input=True),
        PaperNetwork("paper-cifar100-cnn", "CIFAR100-CNN", (3, 32, 32), 100,
                     cifar100_cnn_layers),
        PaperNetwork("alexnet", "AlexNet", (3, 224, 224), 1000, alexnet_layers),
        PaperNetwork("resnet18", "ResNet-18", (3, 224, 224), 1000, resnet18_layers),
    )
}


def paper_network(name: str) -> PaperNetwork:
    """The network `name` (a key of `PAPER_NETWORKS`).

    Raises:
        ValueError: no such network; the message lists the known ones.
    """
    try:
        return PAPER_NETWORKS[name]
    except KeyError:
        raise ValueError(f"unknown paper network {name!r}; known: "
                         f"{', '.join(PAPER_NETWORKS)}") from None
