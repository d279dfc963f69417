"""Every JSON file a user hands the library is refused alike when it is wrong: a
ValueError naming the file and what it should hold (`pipesgd.json_files`), and a
one-line error from the command-line tools, never a traceback."""

from dataclasses import dataclass

import pytest

from pipesgd.cli import main
from pipesgd.json_files import dataclass_from_dict, load_json, read_json
from pipesgd.pipeline.plan import Plan
from pipesgd.planner import ModelProfile
from pipesgd.planner.topology import HierarchicalTopology
from pipesgd.timing.network import NetworkParams
from pipesgd.timing.profile import Profile


@dataclass
class Pair:
    a: int
    b: int = 2


def test_read_json_names_the_file_and_what_it_should_hold(tmp_path):
    good = tmp_path / "good.json"
    good.write_text('{"a": [1, 2]}')
    assert read_json(good, "a pair") == {"a": [1, 2]}
    with pytest.raises(ValueError, match=r"missing\.json: no such file; expected a pair"):
        read_json(tmp_path / "missing.json", "a pair")
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": ')
    with pytest.raises(ValueError, match=r"bad\.json: not JSON \(.* at line 1, column 7\); "
                                         r"expected a pair"):
        read_json(bad, "a pair")
    with pytest.raises(ValueError, match=r"cannot read it"):
        read_json(tmp_path, "a pair")  # a directory


def test_load_json_wants_an_object_and_prefixes_what_build_refuses(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"x\.json: holds a JSON array, expected a pair"):
        load_json(path, "a pair", lambda d: d)
    path.write_text('{"a": 1}')
    assert load_json(path, "a pair", lambda d: Pair(**d)) == Pair(1)

    def refuse(exc):
        def build(data):
            raise exc
        return build

    with pytest.raises(ValueError, match=r"^.*x\.json: a must be odd$"):
        load_json(path, "a pair", refuse(ValueError("a must be odd")))
    for exc in (TypeError("unexpected keyword"), KeyError("b")):
        with pytest.raises(ValueError, match=r"x\.json: not a pair \("):
            load_json(path, "a pair", refuse(exc))


def test_dataclass_from_dict_names_every_missing_field_and_ignores_unknown_keys():
    assert dataclass_from_dict(Pair, {"a": 1, "newer": 3}, "a pair") == Pair(1, 2)
    with pytest.raises(ValueError, match=r"a pair needs a; it has b, c"):
        dataclass_from_dict(Pair, {"b": 1, "c": 2}, "a pair")


@pytest.mark.parametrize("load,what", [
    (NetworkParams.load, "a network description"),
    (Profile.load, "a model profile"),
    (ModelProfile.load, "a per-layer profile"),
    (HierarchicalTopology.load, "a topology"),
    (Plan.load, "a pipeline plan"),
])
@pytest.mark.parametrize("text", ["[]", "{oops", '{"nothing": "useful"}'])
def test_every_loader_refuses_a_wrong_file_by_name(tmp_path, load, what, text):
    path = tmp_path / "wrong.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"wrong\.json: ") as info:
        load(path)
    if text != '{"nothing": "useful"}':  # a wrong object: each loader's own message
        assert what in str(info.value)
    with pytest.raises(ValueError, match=r"no such file; expected " + what):
        load(tmp_path / "missing.json")


def test_a_saved_network_and_profile_load_back(tmp_path):
    net = NetworkParams(alpha_s=2e-5, beta_s_per_byte=8e-9, gamma_s_per_byte=1e-10,
                        sync_s=1e-5)
    net.save(tmp_path / "net.json")
    assert NetworkParams.load(tmp_path / "net.json") == net
    prof = Profile(forward_s=1e-3, backward_s=2e-3, update_s=1e-4, gradient_bytes=4e6)
    prof.save(tmp_path / "prof.json")
    assert Profile.load(tmp_path / "prof.json") == prof


@pytest.mark.parametrize("flag", ["--network", "--profile"])
def test_timing_predict_prints_one_line_for_a_wrong_file(tmp_path, capsys, flag):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    args = ["timing", "predict", "--model", "mlp", "-p", "2", flag, str(path)]
    if flag == "--profile":
        args += ["--bandwidth", "1Gbit"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipesgd timing predict: error: ") and "list.json: holds a JSON " \
        "array" in err and "Traceback" not in err, err
