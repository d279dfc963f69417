"""Held-out evaluation of a pipeline: its current weights on data it does not train on.

A forward-only pass through the stages in evaluation mode (dropout off, batch norm on
its running statistics), no gradient, no stash: the weights are each stage's live ones
(under T2 not its extrapolated copy, which exists only during a backward). The first
replica of every stage computes, batch after batch, each stage passing its output to the
next stage's first replica; the last stage's loss and accuracy reach every rank.
Replicas hold the same weights (the engine keeps them identical); their batch-norm
statistics may differ, and the first replica's count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from pipesgd.polling import idle_barrier, wait_politely, wait_until

if TYPE_CHECKING:
    from .runtime import Pipeline


@dataclass(frozen=True)
class Evaluation:
    """Mean loss and accuracy over `samples` held-out samples."""

    loss: float
    accuracy: float
    samples: int


def evaluate(pipe: Pipeline, inputs: Tensor, labels: Tensor,
             batch_size: int | None = None) -> Evaluation:
    """Loss and accuracy of `pipe`'s current weights on (inputs, labels); collective
    over the pipeline's ranks, the same result on every rank.

    Args:
        pipe: a pipeline between epochs (no micro-batch in flight).
        inputs, labels: the same held-out samples on every rank (the first stage reads
            the inputs, the last the labels).
        batch_size: samples per forward (default: the plan's micro-batch).

    Raises:
        ValueError: inputs and labels of different lengths, none, or a bad batch size.
    """
    if len(inputs) != len(labels) or len(inputs) == 0:
        raise ValueError(f"evaluate needs as many labels as inputs, at least one: got "
                         f"{len(inputs)} inputs and {len(labels)} labels")
    batch = pipe.plan.micro_batch if batch_size is None else batch_size
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch!r}")
    if pipe.stage.in_flight:
        raise RuntimeError(f"rank {pipe.rank}: evaluate between epochs, not with "
                           f"{pipe.stage.in_flight} micro-batches in flight")
    comm = pipe.comm.Dup()  # apart from the runtime's own messages
    try:
        totals = np.zeros(3)  # loss sum, correct, samples
        if pipe.replica == 0:
            _forward_all(pipe, comm, inputs, labels, batch, totals)
        idle_barrier(comm)  # ranks done early leave the cores to those still computing
        loss_sum, correct, seen = comm.allreduce(totals)  # elementwise
    finally:
        comm.Free()
    return Evaluation(loss_sum / seen, correct / seen, int(seen))


def _forward_all(pipe: Pipeline, comm, inputs: Tensor, labels: Tensor, batch: int,
                 totals: np.ndarray) -> None:
    """This stage's forward of every batch, between its neighbours' first replicas."""
    plan, stage = pipe.plan, pipe.stage_id
    before = None if pipe.first else plan.rank_of(stage - 1, 0)
    after = None if pipe.last else plan.rank_of(stage + 1, 0)
    module, device = pipe.stage.module, pipe.stage.grad_sum.device
    was_training = module.training
    module.eval()
    sent = None  # the previous batch's send: its buffer lives until it completes
    try:
        with torch.no_grad():
            for start in range(0, len(inputs), batch):
                if before is None:
                    x = inputs[start:start + batch]
                else:
                    # MPI's blocking receive spins: wait as the stages do, then take it
                    wait_until(lambda: comm.Iprobe(source=before))
                    x = torch.from_numpy(comm.recv(source=before))
                out = module(x.to(device))
                if after is not None:
                    if sent is not None:
                        wait_politely(sent)
                    sent = comm.isend(out.cpu().numpy(), dest=after)
                    continue
                y = labels[start:start + batch].to(device)
                totals[0] += float(pipe.stage.loss_fn(out, y)) * len(y)
                totals[1] += int((out.argmax(dim=1) == y).sum())
                totals[2] += len(y)
        if sent is not None:
            wait_politely(sent)
    finally:
        module.train(was_training)
