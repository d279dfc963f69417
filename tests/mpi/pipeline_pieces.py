"""Payloads cut into pieces change nothing but how they travel: with every rank told it
is on a node of its own, whose messages wait for their sender, each link agrees a piece
size at the handshake (the transport's eager limit, measured), and the same plans train
to bitwise the same weights as with whole messages, on the host and through host
staging (the GPU's path). Told only that they are on nodes of their own, ranks on
shared memory (whose receiver pulls a large message) keep messages whole.

Run: mpirun -n 3 python tests/mpi/pipeline_pieces.py
"""

import torch
from mpi4py import MPI

import pipesgd.timing.link_probes as link_probes
from pipesgd.pipeline import MicroBatches, Pipeline, Plan, StagePlan, models
from pipesgd.pipeline.data import synthetic
from pipesgd.pipeline.pieces import SMALLEST

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
MODEL = models.mlp((10, 1024, 1024, 4))  # 5 layers; 16 KiB activations per micro-batch
MB = 4
PLANS = {
    "1f1b 1-1-1": Plan(stages=(StagePlan(0, 2, 1), StagePlan(2, 4, 1), StagePlan(4, 5, 1)),
                       schedule="1f1b", micro_batch=MB),
    "1f1b-rr 1-2": Plan(stages=(StagePlan(0, 2, 1), StagePlan(2, 5, 2)),
                        schedule="1f1b-rr", micro_batch=MB),
}


def train(plan: Plan, staging: bool) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """The merged model after an epoch, and this rank's pieces per neighbour."""
    x, y = synthetic(12 * MB, (10,), 4, seed=5)
    pipe = Pipeline(MODEL, plan, comm, lr=0.05, momentum=0.9, seed=3, staging=staging)
    pipe.train_epoch(MicroBatches(x, y, MB, shuffle=True, seed=1), 0)
    pieces = pipe.link.pieces
    state = pipe.model_state(root=None)
    pipe.close()
    assert state is not None
    return state, pieces


def neighbours(plan: Plan) -> set[int]:
    stage = plan.position(rank)[0]
    return {plan.rank_of(s, r) for s in (stage - 1, stage + 1) if 0 <= s < plan.num_stages
            for r in range(plan.stages[s].replicas)}


real_node_key, real_waits = link_probes.node_key, link_probes.waits_for_sender
for name, plan in PLANS.items():
    for staging in (False, True):
        whole, none = train(plan, staging)
        assert set(none) == neighbours(plan) and not any(none.values()), \
            f"{name}: ranks on one node cut payloads: {none}"
        # every rank a node of its own, whose messages wait for their sender (as over TCP,
        # tests/test_netem.py; on shared memory they do not, below)
        link_probes.node_key = lambda: f"node-{rank}"
        link_probes.waits_for_sender = lambda *args, **kwargs: True
        try:
            cut, pieces = train(plan, staging)
        finally:
            link_probes.node_key, link_probes.waits_for_sender = real_node_key, real_waits
        assert set(pieces) == neighbours(plan), f"{name}: pieces agreed with {pieces}"
        assert all(SMALLEST <= b < 16384 for b in pieces.values()), \
            f"{name}: shared memory's eager limit is a few KiB, measured {pieces}"
        agreed = comm.allgather(pieces)
        for peer, size in pieces.items():
            assert agreed[peer][rank] == size, f"{name}: ranks {rank} and {peer} disagree"
        for key, value in whole.items():
            assert torch.equal(value, cut[key]), f"{name}: {key} differs when cut"
        if rank == 0:
            print(f"{name}{' staged' if staging else ''}: pieces {sorted(set(pieces.values()))} "
                  "bytes, cut == whole", flush=True)

# Nodes of their own, but a large message is pulled by its receiver: whole messages.
link_probes.node_key = lambda: f"node-{rank}"
try:
    _, pieces = train(PLANS["1f1b 1-1-1"], False)
finally:
    link_probes.node_key = real_node_key
assert set(pieces) == neighbours(PLANS["1f1b 1-1-1"]) and not any(pieces.values()), \
    f"a receiver-pulled link cut payloads: {pieces}"
if rank == 0:
    print("separate nodes, receiver pulls: whole messages", flush=True)
