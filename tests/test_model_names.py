"""Naming a model on the command line (pipesgd.model_names): built-ins sized for their
data, MODULE:FUNCTION from a module or a file, and clear errors for broken specs."""

import pytest
import torch
from cli_in_process import pipesgd
from torch import nn

from pipesgd.model_names import layer_model, load_model_function, parse_shape
from pipesgd.timing.profile import profile_named
from pipesgd.train import data, loop

USER_MODELS = '''
from torch import nn

def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(1024, 32), nn.ReLU(), nn.Linear(32, 10))

def one_block():
    return nn.Linear(784, 10)

def not_a_module():
    return 42
'''


@pytest.fixture
def models_file(tmp_path):
    path = tmp_path / "user_models.py"
    path.write_text(USER_MODELS)
    return path


def test_builtin_mlp_follows_the_data():
    digits = data.load("digits", "mlp")
    spec = layer_model("mlp", digits.input_shape, digits.num_classes)
    assert spec.input_shape == (64,) and spec.num_classes == 10
    # the network `pipesgd train --model mlp --data digits` trains, bit for bit
    a = spec.build(seed=3)
    b = loop.build_model("mlp", digits, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values(), strict=True))
    assert layer_model("mlp", (784,), 10).build()[0].in_features == 784


def test_a_user_sequential_keeps_its_layers_and_weights(models_file):
    spec = layer_model(f"{models_file}:mlp", (1, 32, 32), 10, seed=5)
    assert spec.num_layers == 4  # Flatten, Linear, ReLU, Linear: a plan may cut between
    net = spec.build()
    assert net(torch.zeros(2, 1, 32, 32)).shape == (2, 10)
    # every rank builds the same weights (seeded), and a different seed others
    again = layer_model(f"{models_file}:mlp", (1, 32, 32), 10, seed=5).build()
    other = layer_model(f"{models_file}:mlp", (1, 32, 32), 10, seed=6).build()
    assert torch.equal(net[1].weight, again[1].weight)
    assert not torch.equal(net[1].weight, other[1].weight)
    assert layer_model(f"{models_file}:one_block", (784,), 10).num_layers == 1


def test_train_builds_a_user_model_for_its_data(models_file):
    digits = data.load("digits", "user")  # images, as the CNN gets them
    net = loop.build_model(f"{models_file}:mlp", digits, seed=0)
    assert net(digits.train_x[:3]).shape == (3, 10)


def test_a_dotted_module_name_is_imported():
    fn = load_model_function("torch.nn:Identity")
    assert isinstance(fn(), nn.Identity)


@pytest.mark.parametrize(("spec", "message"), [
    ("resnet", "expected one of mlp, cnn or MODULE:FUNCTION"),
    ("no_such_module_here:build", "cannot import 'no_such_module_here'"),
    ("/no/such/file.py:build", "cannot import '/no/such/file.py'"),
    ("{file}:missing", "has no function 'missing'"),
    ("{file}:not_a_module", "returned int, not a torch.nn.Module"),
])
def test_broken_specs_say_what_is_wrong(models_file, spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layer_model(spec.format(file=models_file), (784,), 10)


def test_profile_a_user_model_by_name(models_file):
    prof = profile_named(f"{models_file}:mlp", 8, input_shape=(1, 32, 32), repeats=2,
                         warmup=1)
    params = 1024 * 32 + 32 + 32 * 10 + 10
    assert prof.gradient_bytes == params * 4
    with pytest.raises(ValueError, match="MODULE:FUNCTION with an input shape"):
        profile_named(f"{models_file}:mlp", 8)


def test_input_shape_parsing():
    assert parse_shape("3,32,32") == (3, 32, 32) and parse_shape("784") == (784,)
    for bad in ("", "3,x", "0,4"):
        with pytest.raises(ValueError, match="--input-shape"):
            parse_shape(bad)


def test_timing_predict_names_a_user_model(models_file):
    model = ("timing", "predict", "--model", f"{models_file}:mlp")
    out = pipesgd(*model, "--input-shape", "1,32,32", "-p", "2", "--batch-size", "8",
                  "--bandwidth", "1Gbit")
    assert out.returncode == 0, out.stderr
    bad = pipesgd(*model, "-p", "2", "--bandwidth", "1Gbit")  # no input shape
    assert bad.returncode == 2 and "needs --data or --input-shape" in bad.stderr


def test_a_model_file_runs_once_however_often_it_is_named(tmp_path):
    path = tmp_path / "counted.py"
    runs = tmp_path / "runs"
    path.write_text(f"open({str(runs)!r}, 'a').write('x')\n"
                    "from torch import nn\n"
                    "def build():\n    return nn.Linear(4, 2)\n")
    for _ in range(3):
        assert isinstance(load_model_function(f"{path}:build")(), nn.Linear)
    assert runs.read_text() == "x"
