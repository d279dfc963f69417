"""measure_network on every rank: positive, sane, identical figures; JSON round trip."""

import json
import os
import sys
import tempfile

from mpi4py import MPI

from pipesgd.timing import NetworkParams, measure_network

comm = MPI.COMM_WORLD
net = measure_network(comm, repeats=8, kernel_bytes=1 << 20)
size = comm.Get_size()

assert net.measured_p == size, net
assert net.cores >= 1
assert 0 < net.beta_s_per_byte < 1e-6, f"beta {net.beta_s_per_byte} s/B: below 1 MB/s?"
assert 0 < net.gamma_s_per_byte < 1e-7, net.gamma_s_per_byte
assert 0 < net.copy_s_per_byte < 1e-7, net.copy_s_per_byte
for mode, k in net.kernels.items():
    for name, value in vars(k).items() if hasattr(k, "__dict__") else k.__dict__.items():
        assert 0 < value < 1e-7, (mode, name, value)
if size > 1:
    assert 0 < net.alpha_s < 0.05, f"alpha {net.alpha_s} s"
    assert 0 < net.sync_s < 0.05, f"S {net.sync_s} s"
    assert 0 <= net.beta_cpu_s_per_byte <= net.beta_s_per_byte
    # one node: no shaped link, so no bucket is looked for (test_netem.py checks buckets)
    assert net.burst_bytes == 0.0, net.burst_bytes
    if os.environ.get("PIPESGD_SHM_LINKS") != "0":
        # one node with shared-memory links: the engine's own buffers are reduced in
        # place, and that path is measured
        assert 0 < net.in_place_s_per_byte < 1e-7, net.in_place_s_per_byte
    else:  # no shared memory: the optimizer's buckets take the ring
        assert net.in_place_s_per_byte == 0.0, net.in_place_s_per_byte
else:
    assert net.in_place_s_per_byte == 0.0
# every rank reports the same alpha (broadcast) and kernel medians (allgathered)
everyone = comm.allgather((net.alpha_s, net.gamma_s_per_byte))
assert len(set(everyone)) == 1, everyone

with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    path = f.name
net.save(path)
again = NetworkParams.load(path)
assert again == net, (again, net)
if comm.Get_rank() == 0:
    print(json.dumps(net.to_dict()))
sys.stdout.flush()
