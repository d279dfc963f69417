"""Two-level clusters (`pipesgd.timing.topology`) against hand computations and eq. 5."""

import pytest

from pipesgd.timing import model as M
from pipesgd.timing.topology import Link, Topology, two_level_gain

SHM = Link(alpha_s=2e-6, beta_s_per_byte=0.1e-9)
NET = Link(alpha_s=30e-6, beta_s_per_byte=8e-9)  # 1 Gbit/s
N_BYTES = 16e6


@pytest.mark.parametrize("p", [1, 2, 3, 8])
def test_one_rank_per_node_is_the_flat_ring_of_eq5(p: int) -> None:
    topo = Topology(nodes=p, ranks_per_node=1, node=SHM, network=NET)
    eq5 = M.eq5_ring_comm(p, N_BYTES, NET.alpha_s, NET.beta_s_per_byte, 0.0, 0.0)
    assert topo.flat_ring(N_BYTES) == pytest.approx(eq5)
    assert topo.two_level(N_BYTES) == pytest.approx(eq5)


def test_one_node_is_the_flat_ring_over_shared_memory() -> None:
    topo = Topology(nodes=1, ranks_per_node=4, node=SHM, network=NET)
    eq5 = M.eq5_ring_comm(4, N_BYTES, SHM.alpha_s, SHM.beta_s_per_byte, 0.0, 0.0)
    assert topo.flat_ring(N_BYTES) == pytest.approx(eq5)
    assert topo.two_level(N_BYTES) == pytest.approx(eq5)
    assert all(edge == SHM for edge in topo.ring_edges())


def test_two_nodes_of_two_ranks_by_hand() -> None:
    topo = Topology(nodes=2, ranks_per_node=2, node=SHM, network=NET)
    # ranks 0,1 on node 0 and 2,3 on node 1: edges 1->2 and 3->0 leave a node
    assert topo.ring_edges() == [SHM, NET, SHM, NET]
    n = N_BYTES
    flat = 2 * 3 * (NET.alpha_s + n / 4 * NET.beta_s_per_byte)
    two = 2 * 1 * (SHM.alpha_s + n / 2 * SHM.beta_s_per_byte) + 2 * 1 * (
        2 * NET.alpha_s + n / 2 * NET.beta_s_per_byte)
    assert topo.flat_ring(n) == pytest.approx(flat)
    assert topo.two_level(n) == pytest.approx(two)
    # the network carries 1.5 n per node in the flat ring, n in the two-level one
    assert two_level_gain(topo, n) == pytest.approx(flat / two)
    assert 1.4 < two_level_gain(topo, n) < 1.5


def test_bad_topologies_are_rejected() -> None:
    with pytest.raises(ValueError, match="nodes"):
        Topology(nodes=0, ranks_per_node=2, node=SHM, network=NET)
    with pytest.raises(ValueError, match="ranks_per_node"):
        Topology(nodes=2, ranks_per_node=1.5, node=SHM, network=NET)
    with pytest.raises(ValueError, match="beta"):
        Link(alpha_s=0.0, beta_s_per_byte=0.0)


def test_a_measured_network_over_nodes_gives_its_topology() -> None:
    from pipesgd.timing import NetworkParams

    net = NetworkParams(alpha_s=NET.alpha_s, beta_s_per_byte=NET.beta_s_per_byte,
                        gamma_s_per_byte=0.0, sync_s=0.0, node_alpha_s=SHM.alpha_s,
                        node_beta_s_per_byte=SHM.beta_s_per_byte, ranks_per_node=2)
    assert net.topology(4) == Topology(nodes=2, ranks_per_node=2, node=SHM, network=NET)
    assert net.topology(3) is None  # not a whole number of nodes
    assert NetworkParams.from_dict(net.to_dict()).topology(4) == net.topology(4)
    one_node = NetworkParams(alpha_s=1e-6, beta_s_per_byte=1e-10, gamma_s_per_byte=0.0,
                             sync_s=0.0)
    assert one_node.topology(4) is None
    with pytest.raises(ValueError, match="node_alpha_s"):
        NetworkParams(alpha_s=1e-6, beta_s_per_byte=1e-10, gamma_s_per_byte=0.0, sync_s=0.0,
                      node_beta_s_per_byte=1e-10)
