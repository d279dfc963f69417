"""PipeDream's partitioner: the optimum of its objective (against brute force), the
paper's simple cases, flattening onto `Plan`, topologies."""

import functools
import itertools
import math
import random

import pytest

from pipesgd.pipeline.plan import Plan, PlanError, StagePlan
from pipesgd.planner import HierarchicalTopology, Level, ModelProfile, pipedream, to_plan
from pipesgd.planner.topology import SharedCores, from_network
from pipesgd.timing.cluster import describe_cluster

# ----------------------------------------------------------------- brute force


def cuts(i, j):
    """Every partition of layers i..j (inclusive) into contiguous (first, last) stages."""
    inner = list(range(i, j))  # a stage may end after any of these layers
    for k in range(len(inner) + 1):
        for ends in itertools.combinations(inner, k):
            bounds = [i - 1, *ends, j]
            yield [(bounds[t] + 1, bounds[t + 1]) for t in range(len(bounds) - 1)]


def splits(m, parts):
    """Every tuple of `parts` positive integers summing to m."""
    for bars in itertools.combinations(range(1, m), parts - 1):
        edges = [0, *bars, m]
        yield tuple(edges[t + 1] - edges[t] for t in range(parts))


def brute_force(compute, outputs, weights, counts, bandwidths):
    """PipeDream's objective minimized by enumerating, at every level, every contiguous
    partition and every assignment of that level's components to its stages."""

    @functools.cache
    def best(k, i, j, m):
        if k == 0:
            return sum(compute[i:j + 1])
        bw = bandwidths[k - 1]
        inner_m = counts[k - 2] if k > 1 else 1
        value = math.inf
        for stages in cuts(i, j):
            if len(stages) > m:
                continue
            for reps in splits(m, len(stages)):
                worst = 0.0
                for (a, b), r in zip(stages, reps, strict=True):
                    sync = 2 * (r - 1) * sum(weights[a:b + 1]) / bw
                    worst = max(worst, max(best(k - 1, a, b, inner_m), sync) / r)
                for _, b in stages[:-1]:
                    worst = max(worst, 2 * outputs[b] / bw)
                value = min(value, worst)
        return value

    return best(len(counts), 0, len(compute) - 1, counts[-1])


def random_case(rng, levels):
    n = rng.randint(1, 8)
    compute = [float(rng.randint(1, 20)) for _ in range(n)]
    outputs = [rng.choice([0.0, 1e7, 1e8, 1e9, 1e10]) * rng.random() for _ in range(n)]
    weights = [rng.choice([0.0, 1e8, 1e9, 1e10, 1e11]) * rng.random() for _ in range(n)]
    if levels == 1:
        counts = [rng.randint(1, 6)]
    else:
        counts = list(rng.choice([(1, 2), (2, 2), (2, 3), (3, 2), (2, 1), (1, 3)]))
    bandwidths = [rng.choice([1e9, 3e9, 1e10]) for _ in counts]
    profile = ModelProfile.from_columns(compute, [0.0] * n, outputs, weights)
    levels = tuple(Level(c, b) for c, b in zip(counts, bandwidths, strict=True))
    topology = HierarchicalTopology(levels)
    return profile, topology, (compute, outputs, weights, counts, bandwidths)


def tree_value(stages, level, case):
    """The objective of the result's own tree, recomputed here."""
    compute, outputs, weights, _counts, bandwidths = case
    bw = bandwidths[level - 1]
    worst = 0.0
    for st in stages:
        inner = tree_value(st.inner, level - 1, case) if level > 1 else \
            sum(compute[st.start:st.end])
        sync = 2 * (st.replicas - 1) * sum(weights[st.start:st.end]) / bw
        worst = max(worst, max(inner, sync) / st.replicas)
    for st in stages[:-1]:
        worst = max(worst, 2 * outputs[st.end - 1] / bw)
    return worst


def check_tree(stages, level, counts, start, end):
    assert stages[0].start == start and stages[-1].end == end
    assert all(a.end == b.start for a, b in itertools.pairwise(stages))
    assert sum(st.replicas for st in stages) == counts[level - 1]
    for st in stages:
        assert st.level == level
        if level > 1:
            check_tree(st.inner, level - 1, counts, st.start, st.end)
        else:
            assert st.inner == ()


@pytest.mark.parametrize("levels, seeds", [(1, range(300)), (2, range(300, 500))])
def test_pipedream_is_the_optimum_of_its_objective(levels, seeds):
    for seed in seeds:
        rng = random.Random(seed)
        profile, topology, case = random_case(rng, levels)
        result = pipedream(profile, topology)
        expected = brute_force(*case)
        assert result.time_per_minibatch_s == pytest.approx(expected, rel=1e-9), seed
        # The partition returned has that value, and it is well formed.
        check_tree(result.top, levels, case[3], 0, profile.num_layers)
        assert tree_value(result.top, levels, case) == pytest.approx(expected, rel=1e-9)
        assert sum(s.replicas for s in result.stages) == topology.num_workers
        workers = sorted(w for ws in result.placement for w in ws)
        assert workers == list(range(topology.num_workers))
        plan = to_plan(result, micro_batch=4)
        plan.validate(profile.num_layers)
        assert plan.noam == result.noam == math.ceil(
            topology.num_workers / result.stages[0].replicas)


# ----------------------------------------------------------------- the paper's cases


def hand(compute, outputs, weights, batch_size=0):
    n = len(compute)
    return ModelProfile.from_columns(compute, [0.0] * n, outputs, weights,
                                     batch_size=batch_size)


def test_replication_wins_with_tiny_weights_and_big_compute():
    # Splitting would ship 3 s of activations per minibatch; all-reducing 1 kB is free.
    profile = hand([4.0, 4.0], [1.5e9, 0.0], [1e3, 1e3])
    result = pipedream(profile, "4x[1GB/s]")
    assert result.stages == (StagePlan(0, 2, 4),)
    assert result.time_per_minibatch_s == pytest.approx(8 / 4, rel=1e-4)
    assert result.noam == 1


def test_a_pipeline_wins_with_big_weights():
    # Data parallelism: max(4, 2*1*4e9/1e9) / 2 = 4 s; a pipeline: max(2, 2 ms, 2) = 2 s.
    profile = hand([2.0, 2.0], [1e6, 0.0], [2e9, 2e9])
    result = pipedream(profile, "2x[1GB/s]")
    assert result.stages == (StagePlan(0, 1, 1), StagePlan(1, 2, 1))
    assert result.time_per_minibatch_s == pytest.approx(2.0)
    assert result.noam == 2
    plan = to_plan(result, schedule="1f1b", micro_batch=16)
    assert plan.schedule == "1f1b" and plan.noam == 2


def test_figure_8_two_replicas_feed_one_and_noam():
    # Fig. 8: a 2-unit stage replicated twice feeding a 1-unit stage on 3 workers. The
    # second stage holds big weights (as VGG's fully connected layers), so replicating
    # everything costs max(3, 2*2*1e9/1e9) / 3 = 4/3 > 1.
    profile = hand([2.0, 1.0], [0.0, 0.0], [0.0, 1e9], batch_size=64)
    result = pipedream(profile, "3x[1GB/s]")
    assert result.stages == (StagePlan(0, 1, 2), StagePlan(1, 2, 1))
    assert result.time_per_minibatch_s == pytest.approx(1.0)
    assert result.noam == math.ceil(3 / 2) == 2
    plan = to_plan(result)
    assert plan.micro_batch == 64 and plan.schedule == "1f1b-rr"
    assert plan.noam == 2 and plan.world_size == 3
    assert plan.extra["predicted_time_per_minibatch_s"] == pytest.approx(1.0)
    with pytest.raises(PlanError, match="1f1b-rr"):
        to_plan(result, schedule="1f1b")


def test_a_whole_pipeline_replicated_over_nodes_is_flattened():
    # Inside a node (slow PCIe), 1e10 B of weights make a 2-GPU pipeline best (4 s);
    # across nodes (fast), replicating that pipeline twice gives 8/4 = 2 s.
    profile = hand([4.0, 4.0], [1e6, 0.0], [5e9, 5e9])
    result = pipedream(profile, "2x[1GB/s], 2x[100GB/s]")
    assert result.time_per_minibatch_s == pytest.approx(2.0)
    (top,) = result.top
    assert (top.start, top.end, top.replicas) == (0, 2, 2)
    assert [(s.start, s.end, s.replicas) for s in top.inner] == [(0, 1, 1), (1, 2, 1)]
    assert result.stages == (StagePlan(0, 1, 2), StagePlan(1, 2, 2))
    # Worker w = node * 2 + gpu: each node runs both stages.
    assert result.placement == ((0, 2), (1, 3))
    assert result.noam == 2
    assert to_plan(result, micro_batch=8).extra["placement"] == [[0, 2], [1, 3]]
    assert "layers [0, 1) x2 on workers 0, 2" in result.describe()


def test_one_worker_runs_everything():
    result = pipedream(hand([1.0, 2.0, 3.0], [1.0] * 3, [1.0] * 3), "1x[1Gbit]")
    assert result.stages == (StagePlan(0, 3, 1),)
    assert result.time_per_minibatch_s == pytest.approx(6.0) and result.noam == 1


# ----------------------------------------------------------------- bad input


def test_a_profile_of_another_model_is_refused():
    with pytest.raises(ValueError, match="3 layers but the model has 5"):
        pipedream(hand([1.0] * 3, [0.0] * 3, [0.0] * 3), "2x[1Gbit]", num_layers=5)


def test_to_plan_needs_a_micro_batch():
    result = pipedream(hand([1.0], [0.0], [0.0]), "1x[1Gbit]")
    with pytest.raises(ValueError, match="micro_batch=32"):
        to_plan(result)
    assert isinstance(to_plan(result, micro_batch=32), Plan)


# ----------------------------------------------------------------- topologies


def test_topology_parses_innermost_first_and_round_trips(tmp_path):
    topo = HierarchicalTopology.parse("4x[20GB/s], 2x[1Gbit, 20us]", memory_per_worker="16GB")
    assert [lv.count for lv in topo.levels] == [4, 2]
    assert topo.levels[0].bandwidth == 20e9 and topo.levels[1].bandwidth == 1e9 / 8
    assert topo.levels[1].latency == pytest.approx(20e-6)
    assert topo.num_workers == 8 and topo.component_size(1) == 4
    assert topo.memory_per_worker == 16e9
    topo.save(tmp_path / "topo.json")
    assert HierarchicalTopology.load(tmp_path / "topo.json") == topo
    assert HierarchicalTopology.parse(str(topo), topo.memory_per_worker) == topo
    assert HierarchicalTopology.parse(" 8 x [ 100gbit/s ] ").num_workers == 8
    assert HierarchicalTopology.parse("4x[shm 20GB/s], 2x[ib 100Gbit, 2us]") == \
        HierarchicalTopology.parse("4x[20GB/s], 2x[100Gbit, 2us]")  # names for the reader
    with pytest.raises(ValueError, match=r"bad level '4x\[shm fast\]'.*bad bandwidth 'fast'"):
        HierarchicalTopology.parse("4x[shm fast]")
    assert HierarchicalTopology.parse("2x[1GB/s]", "16GiB").memory_per_worker == 16 * 2**30


def test_a_measured_network_gives_one_level_and_the_cores_its_ranks_share(tmp_path):
    net = describe_cluster("1Gbit", "50us", cores=2, ranks_per_host=None)
    net.beta_cpu_s_per_byte, net.gamma_s_per_byte = 2e-10, 1e-10
    net.eager_bytes = 65408
    topo = from_network(net, 4)
    assert topo.num_workers == 4 and topo.levels[0].bandwidth == pytest.approx(1e9 / 8)
    assert topo.levels[0].latency == pytest.approx(50e-6)
    assert topo.levels[0].eager_bytes == 65408
    # all four ranks on one host (ranks_per_host None)
    assert topo.shared_cores == SharedCores(2, 4, 2e-10, 1e-10)
    topo.save(tmp_path / "topo.json")
    assert HierarchicalTopology.load(tmp_path / "topo.json") == topo
    # a described cluster: one worker per host, its compute and comm threads on 2 cores
    given = from_network(describe_cluster("10Gbit", "20us"), 8).shared_cores
    assert (given.cores, given.workers_per_host) == (2, 1)
    net.cores = None  # nothing said about the cores: none shared
    assert from_network(net, 4).shared_cores is None


def test_a_measurement_across_nodes_gives_the_nodes_and_the_network_as_two_levels():
    # 2 nodes of 2 ranks: 20 GB/s inside a node, 1 Gbit/s between (as `measure` finds
    # them under `bench/netem.py --nodes`)
    net = describe_cluster("1Gbit", "50us")
    net.ranks_per_node, net.node_alpha_s, net.node_beta_s_per_byte = 2, 2e-6, 1 / 20e9
    net.burst_bytes, net.eager_bytes = 122880.0, 65408
    topo = from_network(net, 4)
    inner, outer = topo.levels
    assert (inner.count, outer.count) == (2, 2) and topo.num_workers == 4
    assert inner.bandwidth == pytest.approx(20e9) and inner.latency == pytest.approx(2e-6)
    assert inner.eager_bytes == 0 and inner.burst_bytes == 0  # pulled, no token bucket
    assert outer.bandwidth == pytest.approx(1e9 / 8) and outer.latency == pytest.approx(50e-6)
    assert outer.burst_bytes == 122880.0 and outer.eager_bytes == math.inf
    # PipeDream's DP plans on it as on the same hierarchy written by hand
    # (two layers of heavy weights on four workers: the replicas' all-reduce decides)
    prof = ModelProfile.from_columns([1.0] * 2, [2.0] * 2, [1e3] * 2, [1e9] * 2,
                                     batch_size=8)
    by_hand = HierarchicalTopology.parse("2x[20GB/s, 2us], 2x[1Gbit, 50us]")
    measured, described = pipedream(prof, topo), pipedream(prof, by_hand)
    assert measured.stages == described.stages
    assert measured.time_per_minibatch_s == pytest.approx(described.time_per_minibatch_s)
    # and faster than all four on the network's links alone would be
    flat = pipedream(prof, HierarchicalTopology.parse("4x[1Gbit, 50us]"))
    assert measured.time_per_minibatch_s < flat.time_per_minibatch_s
    # one level where the ranks do not fill whole nodes, or the node's link is unknown
    assert len(from_network(net, 3).levels) == 1
    net.node_beta_s_per_byte = net.node_alpha_s = None
    assert len(from_network(net, 4).levels) == 1


def test_a_measured_network_between_nodes_moves_whole_messages_at_once(tmp_path):
    # Between nodes the pipeline sends payloads in eager pieces: every byte leaves when
    # sent. The links' measured token bucket goes with them.
    net = describe_cluster("1Gbit", "50us")
    net.eager_bytes, net.burst_bytes = 65408, 122880.0
    assert from_network(net, 4).levels[0].eager_bytes == 65408  # one node
    net.ranks_per_node = 1
    level = from_network(net, 4).levels[0]
    assert level.eager_bytes == math.inf and level.burst_bytes == 122880.0
    assert level.flow_bandwidth == 0.0  # one flow's rate not measured
    net.flow_beta_s_per_byte = 8 / 2e9  # one flow alone at 2 Gbit/s
    assert from_network(net, 4).levels[0].flow_bandwidth == pytest.approx(2e9 / 8)
    topo = from_network(net, 4)
    topo.save(tmp_path / "topo.json")
    assert HierarchicalTopology.load(tmp_path / "topo.json") == topo
    net.eager_bytes = 256  # too small to cut into: as the transport sends it
    assert from_network(net, 4).levels[0].eager_bytes == 256
    with pytest.raises(ValueError, match="cores must be an integer >= 1"):
        SharedCores(0, 4)
    with pytest.raises(ValueError, match="bad shared_cores"):
        HierarchicalTopology.from_dict({"levels": [{"count": 2, "bandwidth": 1e9}],
                                        "shared_cores": {"cores": 2}})


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty topology"),
        ("4[20GB/s]", "expected COUNTx\\[BANDWIDTH\\] at position 0"),
        ("4x20GB/s", "expected COUNTx"),
        ("4x[20GB/s] 2x[1Gbit]", "expected ',' between levels at position 11"),
        ("4x[20GB/s],", "at position 11"),
        ("4x[fast]", "bad level '4x\\[fast\\]'.*bad bandwidth"),
        ("4x[]", "give a bandwidth"),
        ("4x[1Gbit, 2us, 3]", "give a bandwidth and optionally a latency"),
        ("4x[1Gbit, soon]", "bad duration 'soon'"),
        ("0x[1Gbit]", "at least 1 component"),
        ("4x[0Gbit]", "positive"),
        ("4x[[1Gbit]]", "expected COUNTx"),
    ],
)
def test_malformed_topologies_say_what_to_write(text, message):
    with pytest.raises(ValueError, match=message):
        HierarchicalTopology.parse(text)


def test_bad_topology_values():
    with pytest.raises(ValueError, match="bad memory size"):
        HierarchicalTopology.parse("2x[1Gbit]", "lots")
    with pytest.raises(ValueError, match="at least one level"):
        HierarchicalTopology(())
    with pytest.raises(ValueError, match="integer >= 1"):
        Level(0, 1e9)
    with pytest.raises(ValueError, match="'levels'"):
        HierarchicalTopology.from_dict({"levels": [{"count": 2}]})
