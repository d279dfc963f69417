"""The Pipe-SGD paper's networks (pipesgd.paper_models): parameter counts against the
published ones and against counts by hand from the layer shapes, shapes they take, and
their names on the command line."""

import pytest
import torch

from pipesgd.model_names import BUILTIN, layer_model, load_model_function
from pipesgd.paper_models import PAPER_NETWORKS, paper_network
from pipesgd.pipeline.models import MODELS, paper
from pipesgd.timing.profile import profile_named


def conv(k, cin, cout, bias=True):
    return k * k * cin * cout + (cout if bias else 0)


def fc(cin, cout):
    return cin * cout + cout


def bn(c):
    return 2 * c  # weight and bias (running statistics are buffers)


def basic_block(cin, cout, stride):
    n = conv(3, cin, cout, bias=False) + bn(cout) + conv(3, cout, cout, bias=False) + bn(cout)
    if stride != 1 or cin != cout:
        n += conv(1, cin, cout, bias=False) + bn(cout)
    return n


HAND = {
    "paper-mnist-mlp": fc(784, 500) + fc(500, 500) + fc(500, 10),
    "paper-cifar100-cnn": conv(5, 3, 32) + conv(5, 32, 32) + conv(5, 32, 64)
    + fc(64 * 4 * 4, 64) + fc(64, 100),
    "alexnet": conv(11, 3, 64) + conv(5, 64, 192) + conv(3, 192, 384) + conv(3, 384, 256)
    + conv(3, 256, 256) + fc(256 * 6 * 6, 4096) + fc(4096, 4096) + fc(4096, 1000),
    "resnet18": conv(7, 3, 64, bias=False) + bn(64)
    + 2 * basic_block(64, 64, 1)
    + basic_block(64, 128, 2) + basic_block(128, 128, 1)
    + basic_block(128, 256, 2) + basic_block(256, 256, 1)
    + basic_block(256, 512, 2) + basic_block(512, 512, 1)
    + fc(512, 1000),
}


def params(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", list(PAPER_NETWORKS))
def test_parameter_counts_match_the_layer_shapes(name):
    assert params(paper(name).build()) == HAND[name]


def test_parameter_counts_match_the_published_ones():
    assert HAND["paper-mnist-mlp"] == 648_010
    assert HAND["resnet18"] == 11_689_512  # He et al. / torchvision
    assert abs(HAND["alexnet"] - 61.1e6) < 0.05e6  # the one-tower AlexNet, ~61.1 M


@pytest.mark.parametrize("name", list(PAPER_NETWORKS))
def test_each_network_takes_its_samples_and_gives_its_classes(name):
    spec = paper(name)
    net = spec.build(seed=1)
    expected = {"paper-mnist-mlp": ((784,), 10), "paper-cifar100-cnn": ((3, 32, 32), 100),
                "alexnet": ((3, 224, 224), 1000), "resnet18": ((3, 224, 224), 1000)}[name]
    assert (spec.input_shape, spec.num_classes) == expected
    net.eval()
    with torch.no_grad():
        assert net(torch.randn(2, *spec.input_shape)).shape == (2, spec.num_classes)


def test_layers_can_be_cut_anywhere_and_rebuild_alike():
    spec = paper("paper-cifar100-cnn")
    whole = spec.build(seed=3)
    front, back = spec.build(0, 4, seed=3), spec.build(4, seed=3)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(whole(x), back(front(x)))


def test_names_work_where_the_builtins_do():
    for name in PAPER_NETWORKS:
        assert name in BUILTIN and name in MODELS
    # the data's class count replaces the paper's; the shape must be the paper's
    spec = layer_model("paper-cifar100-cnn", (3, 32, 32), 10)
    assert spec.build()[-1].out_features == 10
    assert layer_model("paper-mnist-mlp", (1, 28, 28), 10).build()(
        torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="'alexnet' takes samples of 3x224x224"):
        layer_model("alexnet", (3, 32, 32), 10)
    with pytest.raises(ValueError, match="takes samples of 784"):
        layer_model("paper-mnist-mlp", (1, 32, 32), 10)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="unknown paper network 'vgg16'; known: paper-mnist"):
        paper_network("vgg16")
    with pytest.raises(ValueError, match="alexnet, resnet18"):
        load_model_function("resnet")


def test_profile_named_needs_no_input_shape_for_a_paper_network():
    prof = profile_named("alexnet", 1, warmup=0, repeats=1, threads=1)
    assert prof.gradient_bytes == 4 * HAND["alexnet"]
    assert prof.batch_size == 1 and prof.forward_s > 0
