"""Activations and gradients between stages: non-blocking MPI point-to-point with a header.

Every tensor travels as two messages on a private dup of the communicator: a fixed
16-int64 header (sending stage, micro-batch, direction, weight version, dtype, shape)
then the payload. Tags are per (micro-batch, direction): a receive can be posted long
before its send, and messages between the same two ranks never cross. Sends are
`Isend`s whose buffers are kept until they complete, so a send never blocks and the
order of sends and receives in a schedule cannot deadlock by itself (schedule.simulate
checks the rest).

Tensors on a GPU travel through pinned host buffers (`pipesgd.staging.HostStaging`),
ordered by CUDA events, never by synchronizing the device: a send starts its copy to
the host behind the compute stream's work so far and posts its header at once; its
payload is posted once the copy has completed (checked after every action, waited for
only before this rank blocks: `flush`). A receive lands in a pinned buffer whose copy to
the device runs on the side stream, and the compute stream waits for that copy's event.

Before the first micro-batch, `handshake` sends each stage's output spec downstream;
the receiving stage tries its layers on it and answers. A mismatch raises
`StageMismatchError` on both ranks, naming both stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI
from torch import Tensor

from pipesgd.polling import Polling, wait_politely
from pipesgd.staging import CopyEvent, HostStaging
from pipesgd.timing import link_probes

from .pieces import cut, piece_bytes
from .plan import Plan
from .schedule import Action

MAGIC = 0x50495045  # "PIPE"
HEADER_LEN = 16
MAX_DIMS = HEADER_LEN - 8
ACT, GRAD = 0, 1
HANDSHAKE_TAG = 7
DTYPES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int64: 4,
    torch.int32: 5,
}
CODES = {v: k for k, v in DTYPES.items()}


class StageMismatchError(RuntimeError):
    """Two neighbouring stages disagree on what they exchange."""


@dataclass(frozen=True)
class TensorSpec:
    """dtype and shape of a tensor; the first (batch) dimension may vary per message."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"

    def matches(self, other: TensorSpec) -> bool:
        return (
            self.dtype == other.dtype
            and len(self.shape) == len(other.shape)
            and self.shape[1:] == other.shape[1:]
        )


def _host_view(t: Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


@dataclass
class _Deferred:
    """A payload waiting for its copy to the host: posted once `copied` completes."""

    copied: CopyEvent
    dst: int
    tag: int
    host: Tensor
    source: Tensor  # the device tensor, kept alive until the copy has read it


class StageLink:
    """Point-to-point traffic of one stage replica with its neighbours.

    Args:
        staging: stages tensors through host buffers (None: send and receive host tensors
            directly; a GPU tensor then raises).
    """

    def __init__(self, comm: MPI.Comm, plan: Plan, rank: int,
                 staging: HostStaging | None = None) -> None:
        self.comm = comm.Dup()
        self.plan = plan
        self.rank = rank
        self.stage, self.replica = plan.position(rank)
        ub = self.comm.Get_attr(MPI.TAG_UB) or 32767
        self._tag_period = max(1, (ub - 16) // 4)
        self._sends: list[tuple[MPI.Request, object]] = []
        self._deferred: list[_Deferred] = []  # in send order
        self.staging = staging
        self._headers: dict[tuple[int, int], tuple[MPI.Request, np.ndarray]] = {}
        self.expected_in: TensorSpec | None = None
        self.expected_out: TensorSpec | None = None
        self.bytes_sent = 0
        self._polling = Polling.from_env()  # read once, not on every receive
        self._node_keys = self.comm.allgather(link_probes.node_key())
        self._pieces: dict[int, int] = {}  # neighbour -> payload piece bytes (0: whole)

    def _tag(self, mb: int, direction: int) -> int:
        return 16 + ((mb % self._tag_period) * 2 + direction) * 2

    def _label(self, stage: int, rank: int) -> str:
        return f"stage {stage} (rank {rank})"

    # ------------------------------------------------------------------ send
    def send(self, tensor: Tensor, action: Action, dst: int, version: int = 0) -> None:
        """Post the header and payload of `action` (SF or SB) to rank `dst`; never blocks."""
        direction = ACT if action.kind == "SF" else GRAD
        t = tensor.detach()
        if t.dtype not in DTYPES or t.dim() > MAX_DIMS:
            raise StageMismatchError(
                f"{self._label(self.stage, self.rank)} cannot send a {t.dtype} tensor with "
                f"{t.dim()} dims; send one of {list(DTYPES)} with at most {MAX_DIMS} dims"
            )
        header = np.zeros(HEADER_LEN, dtype=np.int64)
        header[:8] = [MAGIC, self.stage, self.rank, action.mb, direction, version,
                      DTYPES[t.dtype], t.dim()]
        header[8 : 8 + t.dim()] = t.shape
        tag = self._tag(action.mb, direction)
        self._sends.append((self.comm.Isend(header, dest=dst, tag=tag), header))
        self.bytes_sent += t.numel() * t.element_size()
        if self.staging is None:
            self._check_host(t.device, "send")
            t = t.contiguous()
            self._isend_payload(_host_view(t), dst, tag + 1, t)
            return
        host = self.staging.host_empty(t.shape, t.dtype)
        copied = self.staging.copy_to_host(host, t)
        self._deferred.append(_Deferred(copied, dst, tag + 1, host, t))
        self._post_copied(wait=False)

    def _check_host(self, device: torch.device, what: str) -> None:
        if device.type != "cpu":
            raise ValueError(
                f"{self._label(self.stage, self.rank)} cannot {what} a tensor on {device} "
                "without host staging: build the Pipeline with device= (it stages GPU "
                "tensors through pinned host buffers)"
            )

    def _post_copied(self, wait: bool) -> None:
        """Post the deferred payloads whose copies have completed, in send order; with
        `wait`, wait for every copy first (before this rank blocks)."""
        while self._deferred:
            d = self._deferred[0]
            if wait:
                d.copied.synchronize()
            elif not d.copied.query():
                return
            self._deferred.pop(0)
            self._isend_payload(_host_view(d.host), d.dst, d.tag, d.host)

    def _isend_payload(self, payload: np.ndarray, dst: int, tag: int, keep: object) -> None:
        """Post `payload` to `dst`, in the pieces agreed for that link (`pieces`);
        `keep` stays referenced until every piece is sent."""
        for part in cut(payload, self._pieces.get(dst, 0)):
            self._sends.append((self.comm.Isend(part, dest=dst, tag=tag), keep))

    def flush(self) -> None:
        """Post every payload still waiting for its copy to the host (waiting for those
        copies): call before blocking on anything a neighbour may need these sends for."""
        self._post_copied(wait=True)

    @property
    def pieces(self) -> dict[int, int]:
        """Neighbour rank -> the bytes of each piece its payloads travel in, as agreed at
        `handshake` (0: whole messages; `pipesgd.pipeline.pieces`)."""
        return dict(self._pieces)

    @property
    def deferred(self) -> int:
        """Payloads whose copy to the host has not completed yet (not posted)."""
        return len(self._deferred)

    # ------------------------------------------------------------------ receive
    def post(self, action: Action, src: int) -> None:
        """Post the header receive of `action` (RF or RB) early; idempotent."""
        direction = ACT if action.kind == "RF" else GRAD
        key = (action.mb, direction)
        if key not in self._headers:
            buf = np.empty(HEADER_LEN, dtype=np.int64)
            req = self.comm.Irecv(buf, source=src, tag=self._tag(action.mb, direction))
            self._headers[key] = (req, buf)

    def recv(self, action: Action, src: int, device: torch.device | None = None
             ) -> tuple[Tensor, int]:
        """Wait for `action`'s tensor from rank `src`; returns (tensor, weight version)."""
        self.post(action, src)
        direction = ACT if action.kind == "RF" else GRAD
        req, header = self._headers.pop((action.mb, direction))
        self.flush()  # the neighbour may wait for this rank's sends before sending
        wait_politely(req, self._polling)
        src_stage = action.stage - 1 if direction == ACT else action.stage + 1
        what = "activation" if direction == ACT else "gradient"
        me, them = self._label(self.stage, self.rank), self._label(src_stage, src)
        if header[0] != MAGIC or header[1] != src_stage or header[3] != action.mb \
                or header[4] != direction:
            raise StageMismatchError(
                f"{me} expected the {what} of micro-batch {action.mb} from {them} but got a "
                f"message from stage {header[1]} for micro-batch {header[3]}: both ranks must "
                f"run the same plan"
            )
        ndim = int(header[7])
        spec = TensorSpec(CODES[int(header[6])], tuple(int(d) for d in header[8 : 8 + ndim]))
        expected = self.expected_in if direction == ACT else self.expected_out
        if expected is not None and not spec.matches(expected):
            raise StageMismatchError(
                f"{me} expected the {what} of micro-batch {action.mb} from {them} as "
                f"{expected} but received {spec}"
            )
        device = device or torch.device("cpu")
        if self.staging is None:
            self._check_host(device, "receive")
            out = torch.empty(spec.shape, dtype=spec.dtype)
        else:
            out = self.staging.host_empty(spec.shape, spec.dtype)
        tag = self._tag(action.mb, direction) + 1
        wait_politely([self.comm.Irecv(part, source=src, tag=tag)
                       for part in cut(_host_view(out), self._pieces.get(src, 0))],
                      self._polling)
        if self.staging is not None:
            on_device = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            self.staging.copy_to_device(on_device, out)
            out = on_device
        return out, int(header[5])

    # ------------------------------------------------------------------ progress
    def progress(self) -> None:
        """Post the payloads whose copies have completed; free the buffers of completed
        sends (also drives MPI progress)."""
        self._post_copied(wait=False)
        if self._sends:
            done = MPI.Request.Testall([r for r, _ in self._sends])
            if done:
                self._sends.clear()
            else:
                self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def drain(self) -> None:
        """Wait for every send; fail if a posted receive was never used."""
        self.flush()
        MPI.Request.Waitall([r for r, _ in self._sends])
        self._sends.clear()
        if self._headers:
            left = sorted(self._headers)
            for req, _ in self._headers.values():
                req.Cancel()
            self._headers.clear()
            raise StageMismatchError(
                f"{self._label(self.stage, self.rank)} posted receives for (micro-batch, "
                f"direction) {left} that the schedule never used"
            )

    def close(self) -> None:
        self.comm.Free()

    # ------------------------------------------------------------------ handshake
    def handshake(
        self,
        input_spec: TensorSpec | None,
        probe: Callable[[TensorSpec], TensorSpec],
    ) -> TensorSpec:
        """Agree on tensor specs with both neighbours; returns this stage's output spec.

        Args:
            input_spec: the first stage's input spec (ignored on later stages).
            probe: runs this stage's layers on a tensor of a spec, returns the output spec;
                raises if the layers cannot take it.

        Raises:
            StageMismatchError: on both ranks of a disagreeing pair.
        """
        plan, stage = self.plan, self.stage
        me = self._label(stage, self.rank)
        ups = [plan.rank_of(stage - 1, r) for r in range(plan.stages[stage - 1].replicas)] \
            if stage > 0 else []
        downs = [plan.rank_of(stage + 1, r) for r in range(plan.stages[stage + 1].replicas)] \
            if stage < plan.num_stages - 1 else []
        # Pieces first, upstream links before downstream ones: stage 0 starts, each stage
        # follows its upstream neighbours, and a spec mismatch below leaves none waiting.
        for u in ups:
            self._pieces[u] = piece_bytes(self.comm, self._node_keys, u, sender=False)
        for d in downs:
            self._pieces[d] = piece_bytes(self.comm, self._node_keys, d, sender=True)
        if stage > 0:
            specs = [self.comm.recv(source=u, tag=HANDSHAKE_TAG) for u in ups]
            error = None
            out_spec = None
            try:
                got = {str(s) for s in specs}
                if len(got) > 1:
                    raise ValueError(f"replicas of stage {stage - 1} send different specs {got}")
                input_spec = specs[0]
                out_spec = probe(input_spec)
            except Exception as exc:  # reported to the upstream ranks, then raised here
                error = f"{type(exc).__name__}: {exc}"
            for u in ups:
                self.comm.send(error, dest=u, tag=HANDSHAKE_TAG + 1)
            if error is not None:
                raise StageMismatchError(
                    f"{me} cannot take the {specs[0]} activation of stage {stage - 1} "
                    f"(rank {ups[0]}): {error}. Move the stage boundary so the layers on "
                    f"both sides of it fit, e.g. check layers "
                    f"[{plan.stages[stage - 1].start}, {plan.stages[stage].end})"
                )
            self.expected_in = input_spec
        else:
            assert input_spec is not None
            out_spec = probe(input_spec)
        assert out_spec is not None
        self.expected_out = out_spec
        if downs:
            reqs = [self.comm.isend(out_spec, dest=d, tag=HANDSHAKE_TAG) for d in downs]
            replies = [self.comm.recv(source=d, tag=HANDSHAKE_TAG + 1) for d in downs]
            MPI.Request.waitall(reqs)
            for d, err in zip(downs, replies, strict=True):
                if err is not None:
                    raise StageMismatchError(
                        f"{self._label(stage + 1, d)} cannot take the {out_spec} activation "
                        f"that {me} sends: {err}. Move the stage boundary so the layers on "
                        f"both sides of it fit, e.g. check layers "
                        f"[{plan.stages[stage].start}, {plan.stages[stage + 1].end})"
                    )
        return out_spec
