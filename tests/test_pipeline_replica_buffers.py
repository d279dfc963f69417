"""A replicated stage's gradient sync on one rank (COMM_SELF): what each round hands back
against a float64 reference of the rounds' sums, with the K-step delay, while the
buffers of applied rounds are reused instead of allocated again."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from pipesgd.pipeline.replicas import ReplicaGradientSync
from pipesgd.staging import HostStaging


@pytest.mark.parametrize("staleness", [1, 2, 3])
@pytest.mark.parametrize("staged", [False, True])
def test_rounds_come_back_delayed_and_buffers_are_reused(staleness: int, staged: bool) -> None:
    sync = ReplicaGradientSync(MPI.COMM_SELF, staleness=staleness, bucket_bytes=1 << 10,
                               staging=HostStaging(torch.device("cpu")) if staged else None)
    g = torch.Generator().manual_seed(0)
    stage_buffer = torch.empty(1000)  # the stage's own sum, overwritten every round
    sums, counts, applied, addresses = [], [], [], set()
    try:
        for rnd in range(8):
            stage_buffer.copy_(torch.randn(1000, generator=g))
            count = 1 + rnd % 3
            sums.append(stage_buffer.double().clone())
            counts.append(count)
            sync.submit(stage_buffer, count)
            stage_buffer.fill_(float("nan"))  # the next backward overwrites it
            for out in sync.ready():
                addresses.add(out.data_ptr())
                applied.append(out.double().clone())
                out.fill_(float("nan"))  # the optimizer is done with it
        applied += [out.double().clone() for out in sync.flush()]
    finally:
        sync.shutdown()
    assert len(applied) == 8
    for rnd, out in enumerate(applied):
        torch.testing.assert_close(out, sums[rnd] / counts[rnd], rtol=1e-6, atol=0)
    # K rounds in flight and the one being applied: every later round reuses their
    # buffers (staged: a host and a device buffer each, which may swap roles on the CPU)
    assert len(addresses) <= (staleness + 1) * (2 if staged else 1)


def test_a_round_without_micro_batches_gives_nothing() -> None:
    sync = ReplicaGradientSync(MPI.COMM_SELF)
    try:
        sync.submit(torch.zeros(10), 0)
        assert sync.ready() == []
        sync.submit(torch.ones(10), 2)
        (out,) = sync.ready()
        assert torch.equal(out, torch.full((10,), 0.5))
    finally:
        sync.shutdown()
