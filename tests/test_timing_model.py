"""The timing model: each equation against hand-computed values, edge cases, `choose`."""

import dataclasses
import math
import time

import pytest
from fakes import KERNELS, Asleep

from pipesgd.timing import (
    Config,
    KernelCosts,
    NetworkParams,
    Profile,
    choose,
    describe_cluster,
    parse_bandwidth,
    parse_duration,
    predict,
    ring_allreduce_cost,
)
from pipesgd.timing import model as M


def net(**kw):
    # beta_cpu > 0: the comm thread's CPU moves the bytes, so kernels and transfer add up
    # as in eq. 5 (a NIC's DMA, beta_cpu = 0, hides the kernels: tested on its own below)
    base = dict(alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-10, sync_s=2e-5,
                kernels=KERNELS, copy_s_per_byte=0.0, beta_cpu_s_per_byte=1e-9, cores=64,
                ranks_per_host=1)
    base.update(kw)
    return NetworkParams(**base)


def prof(**kw):
    base = dict(forward_s=0.01, backward_s=0.02, update_s=0.005, gradient_bytes=4e6)
    base.update(kw)
    return Profile(**base)


# -- the equations as printed --------------------------------------------------------

def test_eq2_and_eq4_by_hand():
    assert M.eq2_sync(1, 2, 3) == 6
    assert M.eq4_pipelined(1, 2, 3) == 3
    assert M.eq4_pipelined(1, 5, 3) == 6


def test_eq5_by_hand():
    # p=4, n=4e6: 2*3*1e-5 + 2*3/4*4e6*1e-9 + 3/4*4e6*1e-10 + 2e-5
    expected = 6e-5 + 6e-3 + 3e-4 + 2e-5
    assert M.eq5_ring_comm(4, 4e6, 1e-5, 1e-9, 1e-10, 2e-5) == pytest.approx(expected)
    assert M.eq5_pipe_sequential(0.005, 0.01, 0.02, expected) == pytest.approx(0.035)


def test_eq6_by_hand_and_sequential_beats_segmented():
    # L = 8: latency and S are paid 8 times, bytes once.
    expected = 2 * 3 * 8 * 1e-5 + 6e-3 + 3e-4 + 8 * 2e-5
    l6 = M.eq6_ring_comm(4, 4e6, 1e-5, 1e-9, 1e-10, 2e-5, segments=8)
    assert l6 == pytest.approx(expected)
    assert M.eq5_ring_comm(4, 4e6, 1e-5, 1e-9, 1e-10, 2e-5) < l6
    assert M.eq6_pipe_segmented(0.001, 0.001, 0.0001, l6) == pytest.approx(l6)


def test_eq7_by_hand():
    assert M.eq7_scaling_efficiency(0.005, 0.03, 0.07) == pytest.approx(0.5)
    assert M.eq7_scaling_efficiency(0.005, 0.03, 0.01) == 1.0


def test_ring_cost_uncompressed_is_eq5():
    n, p, nw = 4e6, 4, net()
    cost = ring_allreduce_cost(n, p, nw, "none")
    assert cost.wall() == pytest.approx(M.eq5_ring_comm(p, n, 1e-5, 1e-9, 1e-10, 2e-5))


def test_ring_cost_trunc16_by_hand():
    # p=4, n=4e6 bytes: chunk 1e6 B = 250000 floats -> 500000 wire bytes per step
    cost = ring_allreduce_cost(4e6, 4, net(), "trunc16")
    assert cost.transfer == pytest.approx(6 * 500000 * 1e-9)
    assert cost.latency == pytest.approx(6e-5)
    # 1 encode + (p-2) decode_add_encode + the owner's decode_add_encode_decode + (p-1)
    # decodes, on a 1e6 B chunk
    kernels = 1e6 * (1e-10 + 2 * 3e-10 + 4e-10 + 3 * 2e-10)
    assert cost.kernels == pytest.approx(kernels)


def test_ring_cost_quant8_carries_a_scale_per_segment():
    # chunk 1e6 B = 250000 floats = 4 segments of 256 KiB -> 250000 + 16 wire bytes
    cost = ring_allreduce_cost(4e6, 4, net(), "quant8", segment_bytes=256 << 10)
    assert cost.transfer == pytest.approx(6 * 250016 * 1e-9)
    # the default segment (1 MiB) holds the whole chunk: one scale
    cost = ring_allreduce_cost(4e6, 4, net(), "quant8")
    assert cost.transfer == pytest.approx(6 * 250004 * 1e-9)


def test_predict_dsync_is_eq2_and_pipe_is_eq5():
    pr, nw = prof(), net()
    comm = M.eq5_ring_comm(4, 4e6, 1e-5, 1e-9, 1e-10, 2e-5)
    sync = predict(pr, nw, 4, staleness=1)
    assert sync.predicted_s == pytest.approx(M.eq2_sync(0.005, 0.03, comm))
    assert sum(sync.breakdown.values()) == pytest.approx(sync.predicted_s)
    pipe = predict(pr, nw, 4, staleness=2)
    assert pipe.predicted_s == pytest.approx(M.eq5_pipe_sequential(0.005, 0.01, 0.02, comm))
    assert pipe.bound == "compute"
    assert pipe.scaling_efficiency == pytest.approx(1.0)
    assert sum(pipe.breakdown.values()) == pytest.approx(pipe.predicted_s)


def test_predict_segments_is_eq6_when_communication_bound():
    pr = prof(forward_s=1e-4, backward_s=1e-4, update_s=1e-4)
    seg = predict(pr, net(), 4, staleness=2, overlap="backward", segments=8)
    assert seg.predicted_s == pytest.approx(M.eq6_ring_comm(4, 4e6, 1e-5, 1e-9, 1e-10, 2e-5, 8))
    assert seg.bound == "communication"
    assert sum(seg.breakdown.values()) == pytest.approx(seg.predicted_s)


def test_dsync_overlap_hides_communication_behind_backward():
    # 4 buckets ready at 1/4 .. 4/4 of a 20 ms backward; each bucket's ring is 1.5+ ms
    pr = prof()
    ovl = predict(pr, net(), 4, staleness=1, overlap="backward", segments=4)
    one = ring_allreduce_cost(1e6, 4, net(), "none").wall()
    # the last bucket leaves when backward ends: only its ring is exposed
    assert ovl.predicted_s == pytest.approx(0.035 + one)


def test_sequential_runs_the_optimizers_buckets_back_to_back():
    # Gradients of 1, 2 and 1 MB in the order backward makes them; 2 MB buckets are the
    # optimizer's three allreduces, all after backward: D-Sync pays each ring's latency
    # and sync, Pipe-SGD (communication-bound here) each one's time.
    pr = prof(forward_s=1e-4, backward_s=1e-4, update_s=1e-4, gradient_bytes=4e6,
              gradient_ready=[(1e6, 0.3), (2e6, 0.6), (1e6, 1.0)])
    rings = sum(ring_allreduce_cost(b, 4, net(), "none").wall() for b in (1e6, 2e6, 1e6))
    for k, compute in ((1, 3e-4), (2, 0.0)):
        seq = predict(pr, net(), 4, staleness=k, bucket_bytes=2_000_000)
        assert seq.segments == 3
        assert seq.predicted_s == pytest.approx(compute + rings)
    # one bucket is eq. 5, and so is `segments`' paper form
    one = predict(pr, net(), 4, staleness=1, bucket_bytes=8_000_000)
    eq5 = M.eq5_ring_comm(4, 4e6, 1e-5, 1e-9, 1e-10, 2e-5)
    assert one.segments == 1 and one.predicted_s == pytest.approx(3e-4 + eq5)
    paper = predict(pr, net(), 4, staleness=1, segments=3)
    assert paper.predicted_s == pytest.approx(one.predicted_s)


def test_compression_on_critical_path_of_dsync_hidden_by_pipe():
    pr = prof(gradient_bytes=40e6)
    nw = net(beta_s_per_byte=1e-10)
    cost = ring_allreduce_cost(40e6, 4, nw, "trunc16")
    d = predict(pr, nw, 4, staleness=1, compression="trunc16")
    assert d.predicted_s == pytest.approx(0.035 + cost.wall())
    assert d.breakdown["compression"] == pytest.approx(cost.kernels)
    p = predict(pr, nw, 4, staleness=2, compression="trunc16")
    assert cost.wall() < 0.035 and p.predicted_s == pytest.approx(0.035)
    assert p.breakdown["compression"] == 0.0


def test_token_bucket_burst_shortens_dsync_only():
    # p=4, n=4e6: each link carries 6e6 bytes (6 ms at 1 ns/B); a 1e6-byte bucket refills
    # during the 35 ms of compute, so D-Sync's ring saves 1 ms; Pipe-SGD's link never
    # idles while it is the longer side, and the bucket holds a sixth of its bytes, so
    # nothing changes there.
    pr = prof()
    plain, bucket = net(), net(burst_bytes=1e6)
    comm = M.eq5_ring_comm(4, 4e6, 1e-5, 1e-9, 1e-10, 2e-5)
    d = predict(pr, bucket, 4, staleness=1)
    assert d.predicted_s == pytest.approx(0.035 + comm - 1e-3)
    assert d.details["burst_saving_s"] == pytest.approx(1e-3)
    assert sum(d.breakdown.values()) == pytest.approx(d.predicted_s)
    slow = prof(forward_s=1e-4, backward_s=1e-4, update_s=1e-4)
    assert predict(slow, bucket, 4, staleness=2).predicted_s == pytest.approx(
        predict(slow, plain, 4, staleness=2).predicted_s)
    # 0.3 ms of compute and the ring's 0.38 ms off the wire (latency 6 x 10 us, sums
    # 3e6 B x 0.1 ns, sync 20 us) refill only 0.68e6 bytes of the bucket
    short = predict(slow, bucket, 4, staleness=1)
    off_wire = 6e-5 + 3e-4 + 2e-5
    assert short.details["burst_saving_s"] == pytest.approx(3e-4 + off_wire)
    assert short.predicted_s == pytest.approx(3e-4 + comm - 3e-4 - off_wire)
    # a bucket larger than the transfer saves the whole transfer, no more
    assert M.burst_saving(net(burst_bytes=1e9), 10.0, 6e-3) == pytest.approx(6e-3)
    with pytest.raises(ValueError, match="burst_bytes"):
        net(burst_bytes=-1.0)


def test_token_bucket_that_holds_an_iteration_sends_pipe_sgd_at_line_rate():
    # 0.3 ms of compute beside a ring that puts 6e6 bytes on each link: 6 ms at the
    # token rate, 0.38 ms off the wire (latency 6 x 10 us, sums 3e6 B x 0.1 ns, sync
    # 20 us). A bucket of 6e6 bytes is full again after each 6 ms iteration and sends
    # every byte at line rate: the link's rate, not the ring's 6.38 ms, bounds Pipe-SGD.
    slow = prof(forward_s=1e-4, backward_s=1e-4, update_s=1e-4)
    off_wire = 6e-5 + 3e-4 + 2e-5
    plain = predict(slow, net(), 4, staleness=2)
    assert plain.predicted_s == pytest.approx(6e-3 + off_wire)
    held = predict(slow, net(burst_bytes=6e6), 4, staleness=2)
    assert held.details["burst_saving_s"] == pytest.approx(6e-3)
    assert held.predicted_s == pytest.approx(6e-3)
    assert held.comm_s == pytest.approx(off_wire)
    assert held.bound == "communication" and "token bucket that holds them" in held.reason
    assert sum(held.breakdown.values()) == pytest.approx(held.predicted_s)
    # a bucket a byte short refills only in the ring's gaps: no saving counted
    short = predict(slow, net(burst_bytes=6e6 - 1), 4, staleness=2)
    assert short.predicted_s == pytest.approx(plain.predicted_s)
    assert short.details["burst_saving_s"] == 0.0
    # compute longer than the transfer hides the ring either way
    assert predict(prof(), net(burst_bytes=6e6), 4, staleness=2).predicted_s == \
        pytest.approx(predict(prof(), net(), 4, staleness=2).predicted_s)
    # off the wire longer than the transfer: the ring's own time bounds it
    slow_ring = net(burst_bytes=6e6, alpha_s=2e-3)
    assert predict(slow, slow_ring, 4, staleness=2).predicted_s == pytest.approx(
        6 * 2e-3 + 3e-4 + 2e-5)


def test_token_bucket_refills_while_the_last_ring_step_waits_for_a_core():
    # Four ranks on two cores: D-Sync's last ring step waits lambda_load for a core after
    # the link carried its bytes, so the bucket refills for that wait too: the saving is
    # the stretched compute (2 x 0.3 ms), the wait (1 ms) and the ring's time off the wire.
    slow = prof(forward_s=1e-4, backward_s=1e-4, update_s=1e-4)
    host = dict(cores=2, ranks_per_host=4, load_latency_s=1e-3)
    d = predict(slow, net(burst_bytes=1e7, **host), 4, staleness=1)
    cost = M.ring_allreduce_cost(4e6, 4, net(**host))
    off_wire = cost.wall(kernel_stretch=2.0) - cost.transfer
    assert d.details["burst_saving_s"] == pytest.approx(2 * 3e-4 + 1e-3 + off_wire)
    assert d.details["burst_saving_s"] < cost.transfer
    plain = predict(slow, net(**host), 4, staleness=1)
    assert plain.predicted_s - d.predicted_s == pytest.approx(d.details["burst_saving_s"])


def test_token_bucket_burst_carries_on_past_a_small_first_bucket():
    # Two buckets: 40 kB ready early in backward (60 us on each link at p = 4), then 4 MB.
    # The refilled 1e6-byte token bucket (1 ms) sends the link's next bytes at line rate,
    # the small bucket's and then the large one's: D-Sync saves the whole 1 ms, not the
    # first bucket's 60 us.
    pr = prof(gradient_bytes=4.04e6, gradient_ready=[(4e4, 0.2), (4e6, 1.0)])
    plain, bucket = net(), net(burst_bytes=1e6)
    first_transfer = M.ring_allreduce_cost(4e4, 4, plain).transfer
    assert first_transfer == pytest.approx(6e-5)
    for overlap in ("sequential", "backward"):
        with_burst = predict(pr, bucket, 4, 1, overlap=overlap, bucket_bytes=1_000_000)
        without = predict(pr, plain, 4, 1, overlap=overlap, bucket_bytes=1_000_000)
        assert with_burst.segments == 2
        assert with_burst.details["burst_saving_s"] == pytest.approx(1e-3)
        # overlapped, the first bucket's ring runs hidden inside backward: only the
        # large bucket's share of the burst shortens the iteration
        saved = 1e-3 if overlap == "sequential" else 1e-3 - first_transfer
        assert without.predicted_s - with_burst.predicted_s == pytest.approx(saved)


def test_load_latency_delays_pipe_sgd_communication_that_overlaps_compute():
    # p=4, one bucket: 6 ring steps of 1 ms on the wire (4 MB at 1 ns/B: 6 ms). Compute
    # 35 ms, ring W ~6.4 ms on an idle host.
    pr = prof()
    W = M.eq5_ring_comm(4, 4e6, 1e-5, 1e-9, 1e-10, 2e-5)
    # all of W overlaps compute: every step waits 2 ms for a core, 1 ms of it behind its
    # own transfer; still compute-bound
    nw = net(load_latency_s=2e-3)
    assert predict(pr, nw, 4, staleness=2).predicted_s == pytest.approx(0.035)
    # 0.3 ms of compute overlaps only part of the ring. By hand: for those 0.3 ms the
    # ring advances at the loaded pace W / (W + D), then does the rest of W unloaded.
    fast = prof(forward_s=1e-4, backward_s=1e-4, update_s=1e-4)
    D, C = 6 * (2e-3 - 1e-3), 3e-4
    expected = C + (W - C * W / (W + D))
    pipe = predict(fast, nw, 4, staleness=2)
    assert pipe.predicted_s == pytest.approx(expected)
    assert pipe.details["load_delay_s"] == pytest.approx(expected - W)
    assert sum(pipe.breakdown.values()) == pytest.approx(pipe.predicted_s)
    # D-Sync communicates while compute waits; its ranks are on hosts of their own, so
    # the ranks that leave the allreduce first take no core from the others
    assert predict(fast, nw, 4, staleness=1).predicted_s == pytest.approx(3e-4 + W)
    assert M.loaded_comm_seconds(0.01, 0.02, 0.0) == 0.01
    # compute longer than the loaded ring: the whole ring runs loaded
    assert M.loaded_comm_seconds(0.01, 0.05, 0.02) == pytest.approx(0.03)
    with pytest.raises(ValueError, match="load_latency_s"):
        net(load_latency_s=-1e-3)


def test_unshared_fraction_is_the_comm_threads_demand_beyond_their_fair_share():
    # 4 ranks on 2 cores, one compute thread each: the 4 comm threads' fair share beside
    # the 4 compute threads is half the cores. u = R W_cpu / (C W).
    wall = 0.01
    assert M.unshared_fraction(wall / 2, wall, 4, 2, 1) == pytest.approx(1.0)      # u = 1
    assert M.unshared_fraction(0.375 * wall, wall, 4, 2, 1) == pytest.approx(0.5)  # 0.75
    assert M.unshared_fraction(0.25 * wall, wall, 4, 2, 1) == 0.0                  # 0.5
    assert M.unshared_fraction(wall, wall, 4, 2, 1) == 1.0           # capped at 1
    # three compute threads per rank leave the comm threads a quarter: u = 0.625
    assert M.unshared_fraction(0.3125 * wall, wall, 4, 2, 3) == pytest.approx(0.5)
    # free cores (a GPU cluster: C >= R (t + 1)) and no communication share nothing
    assert M.unshared_fraction(wall, wall, 4, 8, 1) == 0.0
    assert M.unshared_fraction(0.0, 0.0, 4, 2, 1) == 0.0


def test_pipe_sgd_hides_nothing_where_the_comm_threads_alone_take_the_cores():
    # 4 ranks on 2 cores over a link whose every wire byte costs its comm thread 0.6 of
    # its wire time in CPU (softirqs on a TCP link without a token bucket): alone, the four
    # comm threads keep both cores busy, so beside compute the allreduce runs as if after
    # it, as D-Sync's does.
    fast = prof(forward_s=1e-3, backward_s=2e-3, update_s=5e-4)
    busy = net(cores=2, ranks_per_host=None, beta_cpu_s_per_byte=6e-10, load_latency_s=2e-3)
    pipe = predict(fast, busy, 4, staleness=2)
    sync = predict(fast, busy, 4, staleness=1)
    assert pipe.details["unshared_fraction"] == 1.0
    assert pipe.predicted_s == pytest.approx(sync.predicted_s)
    assert pipe.predicted_s == pytest.approx(pipe.compute_s + pipe.comm_s + 2e-3)
    assert pipe.bound == "cpu" and "does not overlap" in pipe.reason
    assert sum(pipe.breakdown.values()) == pytest.approx(pipe.predicted_s)
    # a link whose bytes cost a sixth of that leaves compute room: the comm threads keep
    # about 0.2 of the cores busy, under their half, and the ring overlaps
    light = dataclasses.replace(busy, beta_cpu_s_per_byte=1e-10)
    overlapped = predict(fast, light, 4, staleness=2)
    assert overlapped.details["unshared_fraction"] == 0.0
    assert overlapped.predicted_s < predict(fast, light, 4, staleness=1).predicted_s
    assert overlapped.predicted_s == pytest.approx(max(
        overlapped.compute_s, overlapped.comm_s + overlapped.details["load_delay_s"],
        overlapped.details["cpu_bound_s"]))
    # between the two, the prediction lies the unshared fraction of the way to serial
    half = dataclasses.replace(busy, beta_cpu_s_per_byte=3.6e-10)
    mid = predict(fast, half, 4, staleness=2)
    f = mid.details["unshared_fraction"]
    assert 0.0 < f < 1.0
    serial = mid.compute_s + mid.comm_s + 2e-3
    alone = max(mid.compute_s, mid.comm_s + mid.details["load_delay_s"],
                mid.details["cpu_bound_s"])
    assert mid.predicted_s == pytest.approx(f * serial + (1 - f) * alone)
    assert sum(mid.breakdown.values()) == pytest.approx(mid.predicted_s)


def test_dsync_buckets_beside_backward_share_the_cores():
    # 4 ranks on 2 cores; 4 buckets ready at 1/4 .. 4/4 of backward (stretched x2 to
    # 40 ms), each ring about 1.7 ms: the first three end beside backward, the last after.
    pr = prof()
    light = net(cores=2, ranks_per_host=None, beta_cpu_s_per_byte=1e-11)
    ovl = predict(pr, light, 4, staleness=1, overlap="backward", segments=4)
    W, cpu = ovl.comm_s, ovl.details["comm_cpu_s"]
    assert ovl.details["unshared_fraction"] == 0.0
    # compute and the three buckets' CPU share the two cores, then the last bucket runs
    # with no compute beside it: more than the host's CPU work spread over its cores
    expected = 4 * (0.035 + 0.75 * cpu) / 2 + W / 4
    assert expected > 4 * (0.035 + cpu) / 2 and expected > ovl.compute_s + W / 4
    assert ovl.predicted_s == pytest.approx(expected)
    assert ovl.details["cpu_bound_s"] == pytest.approx(expected)
    assert ovl.bound == "cpu" and "CPU work" in ovl.reason
    assert sum(ovl.breakdown.values()) == pytest.approx(ovl.predicted_s)
    # comm threads that alone keep the cores busy do not overlap backward: the buckets
    # run as if after it, as Pipe-SGD's allreduce does beside compute (or slower, where
    # their CPU, more than the cores give them in their own time, binds)
    busy = net(cores=2, ranks_per_host=None, beta_cpu_s_per_byte=6e-10, load_latency_s=2e-3)
    ovl = predict(pr, busy, 4, staleness=1, overlap="backward", segments=4)
    assert ovl.details["unshared_fraction"] == 1.0
    serial = ovl.compute_s + ovl.comm_s + 2e-3
    assert ovl.predicted_s == pytest.approx(max(serial, ovl.details["cpu_bound_s"]))
    assert ovl.predicted_s >= serial and ovl.bound == "cpu"
    half = predict(pr, dataclasses.replace(busy, beta_cpu_s_per_byte=4e-10), 4,
                   staleness=1, overlap="backward", segments=4)
    assert 0.0 < half.details["unshared_fraction"] < 1.0
    assert half.predicted_s > half.details["cpu_bound_s"]
    assert "does not overlap" in half.reason
    assert sum(ovl.breakdown.values()) == pytest.approx(ovl.predicted_s)
    # with a core per thread nothing of this applies (test above)
    free = predict(pr, net(), 4, staleness=1, overlap="backward", segments=4)
    assert free.details["unshared_fraction"] == 0.0


@pytest.mark.parametrize("p, waits", [(2, False), (3, True), (4, True)])
def test_d_sync_waits_for_a_core_only_when_the_ranks_that_left_take_them_all(p, waits):
    # p ranks of one compute thread each on 2 cores: the p - 1 ranks that leave the
    # allreduce first compute while the last one's comm thread finishes its last step.
    # At p = 2 one rank computes and the other core is free; from p = 3 none is.
    fast = prof(forward_s=1e-4, backward_s=1e-4, update_s=1e-4)
    shared = dict(cores=2, ranks_per_host=None)
    loaded = predict(fast, net(load_latency_s=2e-3, **shared), p, staleness=1)
    idle = predict(fast, net(**shared), p, staleness=1)
    assert loaded.predicted_s == pytest.approx(idle.predicted_s + (2e-3 if waits else 0.0))
    assert loaded.details["load_delay_s"] == pytest.approx(2e-3 if waits else 0.0)
    assert sum(loaded.breakdown.values()) == pytest.approx(loaded.predicted_s)


def test_a_ring_step_longer_than_the_wait_for_a_core_hides_it():
    # Each step of a 4 MB ring at p = 4 is 1 ms on the wire: a 1 ms wait for the comm
    # thread's core hides behind it, a 0.4 ms one too; a small ring pays the whole wait.
    bulk = M.ring_allreduce_cost(4e6, 4, net())
    assert bulk.transfer == pytest.approx(6e-3)
    assert M.core_wait_seconds(bulk, net(load_latency_s=1e-3)) == 0.0
    assert M.core_wait_seconds(bulk, net(load_latency_s=4e-4)) == 0.0
    assert M.core_wait_seconds(bulk, net(load_latency_s=3e-3)) == pytest.approx(6 * 2e-3)
    small = M.ring_allreduce_cost(4e3, 4, net())
    assert M.core_wait_seconds(small, net(load_latency_s=1e-3)) == pytest.approx(
        6 * (1e-3 - small.transfer / 6))
    alone = M.ring_allreduce_cost(4e6, 1, net())
    assert M.core_wait_seconds(alone, net(load_latency_s=1e-3)) == 0.0
    # so Pipe-SGD over a slow link, communication-bound, is the unloaded ring
    fast = prof(forward_s=1e-4, backward_s=1e-4, update_s=1e-4)
    W = M.eq5_ring_comm(4, 4e6, 1e-5, 1e-9, 1e-10, 2e-5)
    assert predict(fast, net(load_latency_s=1e-3), 4, staleness=2).predicted_s == \
        pytest.approx(W)


def test_shared_cores_stretch_compute_and_bind_pipe_sgd():
    # 4 ranks, 1 compute thread each, on 2 cores: compute runs at half speed, and
    # Pipe-SGD cannot hide the comm thread's CPU work.
    pr = prof()
    nw = net(cores=2, ranks_per_host=None, beta_cpu_s_per_byte=1e-9)
    pipe = predict(pr, nw, 4, staleness=2)
    cost = ring_allreduce_cost(4e6, 4, nw, "none")
    cpu = 4 * (0.035 + cost.cpu) / 2
    assert pipe.predicted_s == pytest.approx(cpu)
    assert pipe.bound == "cpu"
    assert pipe.details["compute_stretch"] == 2.0
    # with free cores the same cluster is the paper's eq. 5 again
    free = predict(pr, net(cores=64, ranks_per_host=None, beta_cpu_s_per_byte=1e-9), 4)
    assert free.predicted_s == pytest.approx(0.035)


def test_p1_has_no_communication():
    pr = predict(prof(), net(), 1, staleness=1, compression="quant8")
    assert pr.predicted_s == pytest.approx(0.035)
    assert pr.comm_s == 0 and pr.scaling_efficiency == 1.0


@pytest.mark.parametrize("p", [0, -1, 2.5])
def test_bad_p(p):
    with pytest.raises(ValueError, match="p"):
        predict(prof(), net(), p)


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="beta"):
        net(beta_s_per_byte=0.0)
    with pytest.raises(ValueError, match="alpha"):
        net(alpha_s=-1e-6)
    with pytest.raises(ValueError, match="forward_s"):
        prof(forward_s=-0.1)
    with pytest.raises(ValueError, match="gradient_bytes"):
        prof(gradient_bytes=math.nan)
    with pytest.raises(ValueError, match="compression"):
        predict(prof(), net(), 2, compression="zip")
    with pytest.raises(ValueError, match="staleness"):
        predict(prof(), net(), 2, staleness=0)
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth("0Gbit")
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth("fast")
    with pytest.raises(ValueError, match="duration"):
        parse_duration("-3us")
    with pytest.raises(ValueError, match="segments"):
        predict(prof(), net(), 2, segments=0)


def test_parsing():
    assert parse_bandwidth("10Gbit") == pytest.approx(1.25e9)
    assert parse_bandwidth("100gbit/s") == pytest.approx(12.5e9)
    assert parse_bandwidth("200mbit") == pytest.approx(25e6)
    assert parse_bandwidth("1.25GB/s") == pytest.approx(1.25e9)
    assert parse_duration("20us") == pytest.approx(2e-5)
    assert parse_duration("1.5ms") == pytest.approx(1.5e-3)
    assert parse_duration("0") == 0.0
    c = describe_cluster("10Gbit", "20us", cores=8)
    assert c.beta_s_per_byte == pytest.approx(8e-10) and c.alpha_s == pytest.approx(2e-5)


# -- choose ------------------------------------------------------------------------------

def test_choose_compute_bound_pipe_time_equals_compute():
    pr = prof()  # 35 ms compute, ~6.4 ms ring
    ranked = choose(pr, net(), 4)
    assert len(ranked) == 12
    best = ranked[0]
    assert best.config == Config(2, "none", "sequential")  # the simplest at the optimum
    assert best.predicted_s == pytest.approx(0.035)
    assert best.bound == "compute" and "compute" in best.reason
    times = [r.predicted_s for r in ranked]
    assert times[0] == min(times)


def test_choose_communication_bound_prefers_sequential_and_compression():
    # 10 ms of compute that Pipe-SGD hides behind a 330 ms allreduce: 3 %, beyond the
    # model's resolution (with 0.3 ms it would tie D-Sync, which the tie-break prefers)
    pr = prof(forward_s=5e-3, backward_s=5e-3, update_s=1e-4, gradient_bytes=400e6)
    ranked = choose(pr, net(), 4, segments=8)
    best = ranked[0]
    assert best.config.staleness == 2 and best.config.overlap == "sequential"
    assert best.config.compression == "quant8"
    assert best.bound == "communication"
    by = {r.config: r.predicted_s for r in ranked}
    # eq. 5 < eq. 6: sequential beats segmented for every mode when comm-bound
    for mode in M.MODES:
        assert by[Config(2, mode, "sequential")] < by[Config(2, mode, "backward")]
    analytic = min(by.values())
    assert best.predicted_s == analytic


def test_choose_prefers_no_compression_when_kernels_cost_more_than_they_save():
    # a fast link and slow kernels: compressing only adds kernel time
    slow = {m: KernelCosts(1e-8, 1e-8, 1e-8, 1e-8) for m in ("trunc16", "quant8")}
    pr = prof(forward_s=1e-4, backward_s=1e-4, update_s=1e-4)
    best = choose(pr, net(beta_s_per_byte=1e-11, kernels=slow), 4)[0]
    assert best.config.compression == "none"


def test_choose_a_tie_won_by_the_burst_goes_to_the_pipelined_configuration():
    # 0.3 ms of compute, a 6 ms ring all on the wire, a bucket larger than the compute
    # refills: D-Sync's burst saves exactly the compute, so it ties Pipe-SGD; the burst
    # is an upper bound.
    pr = prof(forward_s=1e-4, backward_s=1e-4, update_s=1e-4)
    nw = net(burst_bytes=1e6, alpha_s=0.0, gamma_s_per_byte=0.0, sync_s=0.0)
    by = {r.config: r for r in choose(pr, nw, 4)}
    dsync, pipe = by[Config(1, "none", "sequential")], by[Config(2, "none", "sequential")]
    assert dsync.predicted_s == pytest.approx(pipe.predicted_s)
    assert dsync.details["burst_saving_s"] == pytest.approx(3e-4)
    best = choose(pr, nw, 4, configs=[dsync.config, pipe.config])
    assert best[0].config == pipe.config
    # without a burst, D-Sync is slower outright; with no communication at all (p = 1)
    # the tie goes to the lower staleness as before
    on_wire = net(alpha_s=0.0, gamma_s_per_byte=0.0, sync_s=0.0)
    assert choose(pr, on_wire, 4, configs=[dsync.config, pipe.config])[0].config == pipe.config
    assert choose(pr, nw, 1, configs=[pipe.config, dsync.config])[0].config == dsync.config


def test_choose_takes_predictions_within_its_resolution_as_ties():
    # Pipe-SGD+Q/ovl predicted a hair ahead of D-Sync: below the model's resolution, so
    # the simpler one (lower K, no compression, sequential) ranks first; beyond it, the
    # faster one does.
    dsync = predict(prof(), net(), 4, 1, "none", "sequential")
    pipe = predict(prof(), net(), 4, 2, "quant8", "backward")
    assert dsync.details["burst_saving_s"] == pipe.details["burst_saving_s"] == 0

    def first(dsync_s: float, burst_saving_s: float = 0.0) -> Config:
        preds = [dataclasses.replace(pipe, predicted_s=1.0),
                 dataclasses.replace(dsync, predicted_s=dsync_s, details={
                     **dsync.details, "burst_saving_s": burst_saving_s})]
        fastest = min(pr.predicted_s for pr in preds)
        return min(preds, key=lambda pr: M.ranking_key(pr, fastest)).config

    assert first(1 + 0.9 * M.TIE_TOLERANCE) == dsync.config
    assert first(1 + 1.1 * M.TIE_TOLERANCE) == pipe.config
    # a burst saving too small to be what makes the tie leaves it to the simpler one (a
    # probe's 25 kB on a TCP link: 54 us of 135 ms); one without which D-Sync would not
    # tie sends it behind
    assert first(1.0, burst_saving_s=0.5 * M.TIE_TOLERANCE) == dsync.config
    assert first(1.0, burst_saving_s=1.5 * M.TIE_TOLERANCE) == pipe.config


def test_ties_go_to_pipe_sgd_where_compute_shares_too_few_cores():
    # Four ranks of one compute thread on two cores (compute stretched x2): a D-Sync
    # level with Pipe-SGD in the model ranks after it; beyond the tolerance the faster
    # one still ranks first. Two ranks on two cores keep the simpler one first.
    def first(ranks: int, dsync_s: float) -> Config:
        host = net(cores=2, ranks_per_host=ranks)
        preds = [dataclasses.replace(predict(prof(), host, ranks, k, "quant8"), predicted_s=t)
                 for k, t in ((1, dsync_s), (2, 1.0))]
        fastest = min(pr.predicted_s for pr in preds)
        return min(preds, key=lambda pr: M.ranking_key(pr, fastest)).config

    dsync, pipe = Config(1, "quant8", "sequential"), Config(2, "quant8", "sequential")
    assert first(4, 1.0) == pipe
    assert first(4, 1 - 0.5 * M.TIE_TOLERANCE) == pipe
    assert first(4, 1 - 2 * M.TIE_TOLERANCE) == dsync
    assert first(2, 1.0) == dsync
    assert first(2, 1 + 0.5 * M.TIE_TOLERANCE) == dsync


def test_prediction_json_fields():
    d = predict(prof(), net(), 2).to_dict()
    for key in ("staleness", "compression", "overlap", "predicted_s", "breakdown"):
        assert key in d
    assert set(d["breakdown"]) == set(M.BREAKDOWN_KEYS)


def test_profile_scaled_and_round_trip(tmp_path):
    pr = prof().scaled(10)
    assert pr.forward_s == pytest.approx(1e-3) and pr.gradient_bytes == 4e6
    pr.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == pr
    nw = net()
    nw.save(tmp_path / "n.json")
    assert NetworkParams.load(tmp_path / "n.json") == nw


def test_per_wire_byte_slope_less_reduction_by_hand():
    from pipesgd.timing.link_probes import per_wire_byte

    # p = 4: 2(p-1)/p = 1.5 wire bytes and (p-1)/p = 0.75 reduced bytes per buffer byte.
    sizes, gamma = (1000, 3000), 1e-9
    cost = {1000: 1e-5, 3000: 1e-5 + 2000 * (1.5 * 4e-9 + 0.75 * gamma)}
    assert per_wire_byte(cost, sizes, 4, gamma) == pytest.approx(4e-9)
    # noise that makes the larger size cheaper gives 0, never a negative cost
    assert per_wire_byte({1000: 2e-5, 3000: 1e-5}, sizes, 4, gamma) == 0.0


def test_allreduce_bytes_for_wire_puts_the_asked_bytes_on_each_link():
    from pipesgd.timing.link_probes import allreduce_bytes_for_wire

    for p in (2, 3, 4, 7):
        n = allreduce_bytes_for_wire(4 << 20, p)
        assert n % (4 * p) == 0  # whole float32 elements in every rank's chunk
        wire = 2 * (p - 1) / p * n
        assert 4 << 20 >= wire > (4 << 20) - 2 * (p - 1) * 4  # under by less than a quantum
    assert allreduce_bytes_for_wire(1, 4) == 16  # never empty

def test_kernel_costs_from_before_the_fused_owner_hop():
    # Older descriptions timed the owner's hop as decode_add, then encode and decode.
    old = {"encode": 1e-10, "decode_add_encode": 3e-10, "decode": 2e-10, "decode_add": 4e-10}
    k = KernelCosts.from_dict(old)
    assert k.decode_add_encode_decode == pytest.approx(7e-10)
    assert (k.encode, k.decode_add_encode, k.decode) == (1e-10, 3e-10, 2e-10)
    restored = NetworkParams.from_dict({**net().to_dict(), "kernels": {"quant8": old}})
    assert restored.kernel("quant8") == k


# -- kernels behind the wire (a NIC's DMA) and the host's rates -----------------------

def test_dma_ring_hides_the_reduction_behind_the_transfer_by_hand():
    # p = 4, n = 4e6: chunks of 1e6 B in 256 KiB segments (4 per chunk). The wire takes
    # 6 x 1e6 x 1 ns = 6 ms, the 3 reductions 3 x 1e6 x 0.1 ns = 0.3 ms, of which only the
    # last segment's (0.3 ms / (3 x 4)) is not behind the wire.
    seg = 256 << 10
    dma = ring_allreduce_cost(4e6, 4, net(beta_cpu_s_per_byte=0.0), "none", seg)
    assert dma.wall() == pytest.approx(6e-5 + 6e-3 + 0.3e-3 / 12 + 2e-5)
    assert dma.kernels == pytest.approx(0.3e-3 / 12)
    assert dma.cpu == pytest.approx(0.3e-3)  # the core still does all of it
    # where the comm thread's CPU moves the bytes they take turns: eq. 5's sum
    cpu = ring_allreduce_cost(4e6, 4, net(beta_cpu_s_per_byte=1e-9), "none", seg)
    assert cpu.wall() == pytest.approx(6e-5 + 6e-3 + 0.3e-3 + 2e-5)
    assert cpu.kernels == pytest.approx(0.3e-3)


def test_dma_ring_bound_by_its_kernels_by_hand():
    # quant8 on a fast link: kernels 1e6 B x (encode 0.2 + 2 decode_add_encode 0.5 + owner
    # 0.3 + 3 decodes 0.1) ns = 1.8 ms; the wire 6 x (250000 + 4) B x 0.01 ns = 15 us.
    # One segment per chunk (1 MiB), 2(p-1) = 6 kernel calls: the fill is 1.8 ms / 6.
    nw = net(beta_s_per_byte=1e-11, beta_cpu_s_per_byte=0.0)
    cost = ring_allreduce_cost(4e6, 4, nw, "quant8")
    kernels = 1e6 * (2e-10 + 2 * 5e-10 + 3e-10 + 3 * 1e-10)
    assert cost.transfer == pytest.approx(6 * 250004 * 1e-11)
    assert cost.wall() == pytest.approx(6e-5 + kernels + kernels / 6 + 2e-5)
    # Pipe-SGD on that cluster hides it all behind 35 ms of compute; D-Sync pays it
    d = predict(prof(), nw, 4, staleness=1, compression="quant8")
    assert d.predicted_s == pytest.approx(0.035 + 6e-5 + kernels * 7 / 6 + 2e-5)


def test_described_cluster_host_rates_scale_together():
    from pipesgd.timing.cluster import HOST_CPU_DEFAULTS, describe_host

    base = describe_cluster("10Gbit", "20us")
    assert base.gamma_s_per_byte == HOST_CPU_DEFAULTS["gamma_s_per_byte"]
    fast = describe_cluster("10Gbit", "20us", host_gbps=20)
    factor = (1 / 20e9) / 1.9e-10  # the development VM reduces 1 / 1.9e-10 B/s
    assert fast.gamma_s_per_byte == pytest.approx(5e-11)
    assert fast.copy_s_per_byte == pytest.approx(6.8e-11 * factor)
    assert fast.kernel("quant8").decode_add_encode == pytest.approx(1.48e-10 * factor)
    assert fast.kernel("trunc16").encode == pytest.approx(6.1e-11 * factor)
    assert fast.beta_s_per_byte == base.beta_s_per_byte
    assert "reduction 5.3 GB/s per core" in describe_host(base)
    assert "HOST_CPU_DEFAULTS" in describe_host(base)
    assert "reduction 20.0 GB/s per core" in describe_host(fast, 20)
    assert "--host-gbps 20" in describe_host(fast, 20)
    # from a measured host instead of the defaults
    measured = describe_cluster("10Gbit", "20us", cpu_from=net(), host_gbps=5)
    assert measured.gamma_s_per_byte == pytest.approx(2e-10)
    assert measured.kernel("trunc16").decode == pytest.approx(2e-10 * 2)
    for bad in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="host_gbps must be a positive number"):
            describe_cluster("10Gbit", "20us", host_gbps=bad)


def test_host_staging_adds_two_copies_per_bucket_where_communication_shows():
    # δ = 1 ns/B: each byte of the 4 MB gradient crosses to the host and back: 8 ms
    pr, staged, plain = prof(), net(device_copy_s_per_byte=1e-9), net()
    assert ring_allreduce_cost(4e6, 4, staged).staging == pytest.approx(8e-3)
    d, d0 = predict(pr, staged, 4, staleness=1), predict(pr, plain, 4, staleness=1)
    assert d.predicted_s == pytest.approx(d0.predicted_s + 8e-3)
    assert d.breakdown["staging"] == pytest.approx(8e-3)
    assert d0.breakdown["staging"] == 0.0
    assert sum(d.breakdown.values()) == pytest.approx(d.predicted_s)
    # Pipe-SGD: hidden while compute (35 ms) is the longer side ...
    p = predict(pr, staged, 4, staleness=2)
    assert p.predicted_s == pytest.approx(0.035) and p.breakdown["staging"] == 0.0
    # ... and exposed where communication is (a 10x slower copy: 80 ms of staging)
    slow = predict(pr, net(device_copy_s_per_byte=1e-8), 4, staleness=2)
    assert slow.predicted_s == pytest.approx(
        ring_allreduce_cost(4e6, 4, net(device_copy_s_per_byte=1e-8)).wall())
    # the exposed part of communication, split in proportion: staging's share is 80 ms
    exposed = slow.predicted_s - 0.035
    assert slow.breakdown["staging"] == pytest.approx(exposed * 0.08 / slow.predicted_s)
    assert sum(slow.breakdown.values()) == pytest.approx(slow.predicted_s)
    # overlapping with backward: each bucket carries its own copies
    b4 = predict(pr, staged, 4, staleness=1, overlap="backward", segments=4)
    one = ring_allreduce_cost(1e6, 4, staged).wall()
    assert b4.predicted_s == pytest.approx(0.035 + one)
    assert one == pytest.approx(ring_allreduce_cost(1e6, 4, plain).wall() + 2e-3)


def test_device_copy_rate_described_and_checked():
    from pipesgd.timing.cluster import with_device_copy

    gpu = describe_cluster("10Gbit", "20us", device_gbps=25)
    assert gpu.device_copy_s_per_byte == pytest.approx(1 / 25e9)
    assert describe_cluster("10Gbit", "20us").device_copy_s_per_byte == 0.0
    assert with_device_copy(gpu, None) is gpu
    for bad in (0, -1, float("inf"), "fast", True):
        with pytest.raises(ValueError, match="device_gbps must be a positive number"):
            with_device_copy(gpu, bad)
    with pytest.raises(ValueError, match="device_copy_s_per_byte must be >= 0"):
        net(device_copy_s_per_byte=-1e-9)
    again = NetworkParams.from_dict(gpu.to_dict())
    assert again.device_copy_s_per_byte == gpu.device_copy_s_per_byte
    old = {k: v for k, v in gpu.to_dict().items() if k != "device_copy_s_per_byte"}
    assert NetworkParams.from_dict(old).device_copy_s_per_byte == 0.0  # files from before


def test_one_flows_rate_round_trips_and_is_checked():
    measured = net(flow_beta_s_per_byte=4e-9)
    assert NetworkParams.from_dict(measured.to_dict()).flow_beta_s_per_byte == 4e-9
    old = {k: v for k, v in measured.to_dict().items() if k != "flow_beta_s_per_byte"}
    assert NetworkParams.from_dict(old).flow_beta_s_per_byte == 0.0  # files from before
    with pytest.raises(ValueError, match="flow_beta_s_per_byte must be >= 0"):
        net(flow_beta_s_per_byte=-1e-9)
    # the timing model's ring is every rank at once: β, whatever one flow does alone
    plain = predict(prof(), net(), 4, 1, "none")
    assert predict(prof(), measured, 4, 1, "none").predicted_s == plain.predicted_s


def test_nothing_is_staged_from_the_cpu():
    from pipesgd.timing.host_costs import measure_device_copy

    assert measure_device_copy("cpu") == 0.0


@pytest.mark.parametrize("threads", [1, 2])
def test_profile_counts_cpu_time_on_one_thread_and_wall_time_on_more(threads):
    # A layer that sleeps 5 ms per forward costs no CPU: on one torch thread the profile
    # counts what a pass costs, not how long it waited (for a core ranks share, or here
    # for nothing); with more threads it is wall time (their CPU time is not the thread's).
    import torch
    from torch import nn

    from pipesgd.device import torch_threads
    from pipesgd.timing import profile

    model = nn.Sequential(nn.Linear(4, 4), Asleep())
    batch = (torch.randn(2, 4), torch.tensor([0, 1]))
    with torch_threads(threads):
        pr = profile(model, batch, torch.optim.SGD(model.parameters(), lr=0.1), repeats=4)
    assert pr.backward_s > 0
    assert (pr.forward_s < 2e-3) if threads == 1 else (pr.forward_s >= 5e-3)


def test_profile_keeps_gradients_in_place_and_times_their_zeroing():
    # As a run trains: `DistributedOptimizer` lends bucket views as `.grad`, zeroes them in
    # place and the backward adds into them, so the profile must neither make fresh
    # gradients (cheaper than training's) nor leave the zeroing out of the forward.
    import torch
    from torch import nn

    from pipesgd.device import torch_threads
    from pipesgd.timing import profile

    class SlowZero(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            end = time.thread_time() + 5e-3  # CPU work: counted on one torch thread
            while time.thread_time() < end:
                pass
            super().zero_grad(set_to_none=set_to_none)

    model = nn.Linear(4, 2)
    lent = [torch.zeros_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), lent, strict=True):
        p.grad = g
    batch = (torch.randn(3, 4), torch.tensor([0, 1, 1]))
    with torch_threads(1):
        pr = profile(model, batch, SlowZero(model.parameters(), lr=0.1), repeats=3)
    assert pr.forward_s >= 5e-3
    assert all(p.grad is g for p, g in zip(model.parameters(), lent, strict=True))
    assert any(g.abs().sum() > 0 for g in lent)  # the backward wrote into them


# -- the engine's own buffers, reduced in place on one node ---------------------------

def test_in_place_allreduce_is_two_waits_and_its_bytes_once():
    one_node = net(in_place_s_per_byte=5e-11)
    cost = M.in_place_allreduce_cost(4e6, 4, one_node)
    # by hand: 2 α + n β_in_place + S, every byte on the comm thread's CPU
    assert cost.wall() == pytest.approx(2 * 1e-5 + 4e6 * 5e-11 + 2e-5)
    assert cost.cpu == pytest.approx(4e6 * 5e-11) and cost.kernels == 0.0
    assert cost.waits == 2
    assert M.in_place_allreduce_cost(4e6, 1, one_node) == M.RingCost()


@pytest.mark.parametrize("mode", ["none", "trunc16", "quant8"])
def test_allreduce_cost_is_in_place_only_where_the_engine_takes_that_path(mode: str):
    one_node = net(in_place_s_per_byte=5e-11)
    ring = M.ring_allreduce_cost(4e6, 4, one_node, mode)
    expected = M.in_place_allreduce_cost(4e6, 4, one_node) if mode == "none" else ring
    assert M.allreduce_cost(4e6, 4, one_node, mode) == expected
    # not measured (several nodes, a described cluster): the ring
    assert M.allreduce_cost(4e6, 4, net(), mode) == M.ring_allreduce_cost(4e6, 4, net(), mode)
    # buckets staged from a GPU are not the engine's buffers: the ring
    staged = net(in_place_s_per_byte=5e-11, device_copy_s_per_byte=1e-10)
    assert M.allreduce_cost(4e6, 4, staged, mode) == M.ring_allreduce_cost(4e6, 4, staged, mode)


def test_predict_uses_the_in_place_cost_for_uncompressed_buckets():
    # Communication-bound D-Sync, sequential: the iteration is compute + one allreduce.
    fast = prof(forward_s=1e-4, backward_s=1e-4, update_s=1e-4)
    ring = predict(fast, net(), 4, staleness=1)
    in_place = predict(fast, net(in_place_s_per_byte=5e-11), 4, staleness=1)
    saved = M.ring_allreduce_cost(4e6, 4, net()).wall() - \
        M.in_place_allreduce_cost(4e6, 4, net(in_place_s_per_byte=5e-11)).wall()
    assert ring.predicted_s - in_place.predicted_s == pytest.approx(saved)
    # compressed configurations are unchanged
    q = [predict(fast, n, 4, staleness=1, compression="quant8").predicted_s
         for n in (net(), net(in_place_s_per_byte=5e-11))]
    assert q[0] == pytest.approx(q[1])
