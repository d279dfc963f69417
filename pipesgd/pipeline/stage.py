"""One stage replica's compute: forward and backward of micro-batches through its layers,
gradient accumulation into a flat buffer, and the optimizer step.

Forwards run on the parameter tensors the weight policy hands out (stash.py), swapped
into the module's parameter slots for the call as `torch.func.functional_call` would, so
the backward of a micro-batch differentiates exactly the version its forward used.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .p2p import TensorSpec
from .stash import WeightPolicy


@dataclass(slots=True)
class _InFlight:
    """What a micro-batch's backward needs: input leaf, output (or loss), its weights."""

    x: Tensor
    out: Tensor
    weights: list[Tensor]
    version: int
    recompute: bool = False  # only the input is kept; the backward recomputes `out`
    saved_bytes: int = 0  # what autograd keeps for the backward, weights excluded


class Stage:
    """Layers [start, end) of the model on this rank.

    Args:
        module: the stage's layers as one module (usually `nn.Sequential`).
        stage: stage index; `last` says whether it computes the loss.
        optimizer_factory: builds the optimizer over the live parameters.
        policy_factory: builds the weight-version policy over the live parameters.
        loss_fn: loss of the last stage.
        recompute: keep only each micro-batch's input and recompute its forward in the
            backward, on the version the forward used (activation recomputation). The
            last stage keeps its graph: its loss needs the labels.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        last: bool,
        optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        policy_factory: Callable[[list[nn.Parameter]], WeightPolicy],
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        recompute: bool = False,
    ) -> None:
        self.module = module
        self.recompute_activations = recompute and not last
        self.stage = stage
        self.last = last
        self.loss_fn = loss_fn
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._policy_factory = policy_factory
        self.policy = policy_factory(self.params)
        self.optimizer = optimizer_factory(self.params) if self.params else None
        # each trainable parameter's elements in the flat gradient buffer, in order
        ends = list(itertools.accumulate(p.numel() for p in self.params))
        self.param_ranges = list(zip([0, *ends][:-1], ends, strict=True))
        numel = ends[-1] if ends else 0
        dtype = self.params[0].dtype if self.params else torch.float32
        device = self.params[0].device if self.params else torch.device("cpu")
        self.grad_sum = torch.zeros(numel, dtype=dtype, device=device)
        self.grad_count = 0
        self._grad_views = self._views(self.grad_sum)
        self._in_flight: dict[int, _InFlight] = {}
        self.peak_activation_bytes = 0  # outputs (or kept inputs) of in-flight micro-batches
        self.peak_saved_bytes = 0  # what autograd keeps for their backwards, weights excluded
        self.steps = 0  # optimizer steps of the live parameters, resumes included
        self._storages = {p.untyped_storage().data_ptr(): i for i, p in enumerate(self.params)}
        self._backward_weights: list[Tensor] = self.params
        # Every place a trainable parameter is registered, ties included, as (submodule,
        # name, index in params): a forward on another version swaps its tensors in there.
        index = {id(p): i for i, p in enumerate(self.params)}
        self._slots: list[tuple[nn.Module, str, int]] = []
        for full, p in module.named_parameters(remove_duplicate=False):
            if id(p) in index:
                owner, _, name = full.rpartition(".")
                self._slots.append((module.get_submodule(owner), name, index[id(p)]))

    def _views(self, flat: Tensor) -> list[Tensor]:
        return [flat[start:end].view_as(p)
                for p, (start, end) in zip(self.params, self.param_ranges, strict=True)]

    def set_policy(self, factory: Callable[[list[nn.Parameter]], WeightPolicy]) -> None:
        """Another weight policy from now on (the steps taken so far carry over)."""
        self._policy_factory = factory
        self.reset_policy(self.steps)

    def reset_policy(self, steps: int = 0) -> None:
        """Start a fresh policy (after the live parameters were loaded from a checkpoint
        that had taken `steps` optimizer steps)."""
        if self._in_flight:
            raise RuntimeError("cannot change the weight policy with micro-batches in flight")
        self.steps = steps
        self.policy = self._policy_factory(self.params)
        self.policy.resume_steps(steps)

    # ------------------------------------------------------------------ compute
    def forward(self, mb: int, x: Tensor, version: int | None = None, live_ok: bool = False
                ) -> tuple[Tensor, int]:
        """Run the layers on `x` for micro-batch `mb`; returns (output, weight version).

        `live_ok`: no optimizer step runs before this micro-batch's backward (see stash).
        """
        v, weights = self.policy.forward_weights(mb, version, live_ok)
        if self.policy.recompute and self.last:
            raise RuntimeError(
                "the last stage cannot recompute its forward (its loss needs the labels at "
                "backward): give it one micro-batch in flight")
        if self.recomputes:
            # Only the input is kept: the backward recomputes the forward, on the weights
            # the policy names then (pipemare.py) or on this same version.
            with torch.no_grad():
                out = self._call(weights, x)
            kept = [] if self.policy.recompute else weights
            self._in_flight[mb] = _InFlight(x.detach(), out, kept, v, recompute=True)
            self._note_activations()
            return out, v
        if x.is_floating_point() and self.stage > 0:
            x = x.detach().requires_grad_(True)
        skip = {w.untyped_storage().data_ptr() for w in (*weights, *self.module.buffers())}
        saved: dict[int, int] = {}

        def pack(t: Tensor) -> Tensor | tuple:
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                saved[storage.data_ptr()] = storage.nbytes()
            return self._pack(t) if self.policy.backward_on_current_weights else t

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            out = self._call(weights, x)
        self._in_flight[mb] = _InFlight(x, out, weights, v, saved_bytes=sum(saved.values()))
        self._note_activations()
        return out, v

    # Asynchronous weights (pipemare.py): autograd saves a marker instead of a live weight
    # (or a view of it), and the backward reads the weights current then. No version
    # check applies to what the hooks return, so the live weights may step in between.
    def _pack(self, t: Tensor) -> Tensor | tuple[int, tuple[int, ...], tuple[int, ...], int]:
        i = self._storages.get(t.untyped_storage().data_ptr())
        if i is None:
            return t
        return (i, tuple(t.size()), t.stride(), t.storage_offset())

    def _unpack(self, saved: Tensor | tuple) -> Tensor:
        if isinstance(saved, Tensor):
            return saved
        i, size, stride, offset = saved
        return torch.as_strided(self._backward_weights[i], size, stride, offset)

    def _call(self, weights: list[Tensor], x: Tensor) -> Tensor:
        if weights is self.params:
            return self.module(x)
        # What torch.func.functional_call does, without its per-call lookup of every name
        # and check for ties (26 µs a forward on a 3-layer MLP stage, against a few).
        for owner, name, i in self._slots:
            owner._parameters[name] = weights[i]
        try:
            return self.module(x)
        finally:
            for owner, name, i in self._slots:
                owner._parameters[name] = self.params[i]

    def _note_activations(self) -> None:
        held = saved = 0
        for f in self._in_flight.values():
            kept = f.x if f.recompute else f.out
            held += kept.numel() * kept.element_size()
            saved += f.saved_bytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, held)
        self.peak_saved_bytes = max(self.peak_saved_bytes, saved)

    def _recompute(self, f: _InFlight) -> None:
        """The forward again, keeping its graph: on the policy's backward weights (async)
        or on the version the forward used. The caller has restored the micro-batch's RNG
        state (dropout masks match); buffers (BatchNorm statistics) are put back as the
        first forward left them."""
        weights = self.policy.backward_weights() if self.policy.recompute else f.weights
        if f.x.is_floating_point() and self.stage > 0:
            f.x = f.x.detach().requires_grad_(True)
        buffers = [b.detach().clone() for b in self.module.buffers()]
        f.out = self._call(weights, f.x)
        with torch.no_grad():
            for b, saved in zip(self.module.buffers(), buffers, strict=True):
                b.copy_(saved)
        f.weights = list(weights)

    def loss(self, mb: int, labels: Tensor) -> Tensor:
        """Last stage: replace micro-batch `mb`'s output by its loss (kept for backward)."""
        f = self._in_flight[mb]
        f.out = self.loss_fn(f.out, labels)
        return f.out

    def backward(self, mb: int, grad_out: Tensor | None,
                 made: Callable[[int], None] | None = None) -> Tensor | None:
        """Backward of micro-batch `mb`; accumulates weight gradients, returns the input's.

        Autograd accumulates straight into views of the flat buffer (each weight's `.grad`
        is its view for the duration): returning fresh gradient tensors instead costs a
        page fault per 4 KiB of them on every micro-batch, a third of a big stage's backward.
        `made(i)` is called as soon as parameter i's gradient has been added in (a replica
        starts its all-reduce bucket by bucket: `ReplicaGradientSync.open_round`).
        """
        f = self._in_flight.pop(mb)
        if f.recompute:
            self._recompute(f)
        elif self.policy.backward_on_current_weights:
            self._backward_weights = self.policy.backward_weights()
        wants_x = f.x.requires_grad
        inputs = ([f.x] if wants_x else []) + list(f.weights)
        if self.grad_count == 0:  # the first micro-batch of a round starts from zero
            self.grad_sum.zero_()
        grad_x = None
        if inputs:
            for w, view in zip(f.weights, self._grad_views, strict=True):
                w.grad = view
            hooks = [] if made is None or not all(w.is_leaf for w in f.weights) else [
                w.register_post_accumulate_grad_hook(lambda _w, i=i: made(i))
                for i, w in enumerate(f.weights)]
            try:
                torch.autograd.backward(f.out, grad_tensors=grad_out, inputs=inputs)
            finally:
                for w in f.weights:
                    w.grad = None
                for h in hooks:
                    h.remove()
            if wants_x:
                grad_x, f.x.grad = f.x.grad, None
        self.grad_count += 1
        self.policy.release(mb)
        return grad_x

    def take_gradient(self) -> tuple[Tensor, int]:
        """The round's summed gradient and micro-batch count; resets the count.

        The buffer is returned, not copied: it stays valid until the next backward,
        which overwrites it (consumers that keep it longer copy it).
        """
        if self.grad_count == 0:
            self.grad_sum.zero_()
        count, self.grad_count = self.grad_count, 0
        return self.grad_sum, count

    def step(self, flat_grad: Tensor) -> None:
        """Apply one averaged flat gradient with the optimizer; a new weight version."""
        if self.optimizer is not None:
            flat_grad = flat_grad.to(self.grad_sum.device)
            # an unreplicated stage applies its own sum: its views exist already
            views = self._grad_views if flat_grad is self.grad_sum else self._views(flat_grad)
            for p, g in zip(self.params, views, strict=True):
                p.grad = g
            scale = self.policy.lr_scale(self.stage)
            if scale != 1.0:
                saved = [group["lr"] for group in self.optimizer.param_groups]
                for group in self.optimizer.param_groups:
                    group["lr"] = group["lr"] * scale
            self.policy.step(self.optimizer)
            if scale != 1.0:
                for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
                    group["lr"] = lr
            for p in self.params:
                p.grad = None
        self.steps += 1
        self.policy.after_update()

    # ------------------------------------------------------------------ shapes
    def probe(self, spec: TensorSpec) -> TensorSpec:
        """Output spec for an input of `spec`, without touching parameters or buffers."""
        x = torch.zeros(spec.shape, dtype=spec.dtype, device=self.grad_sum.device)
        state = {n: t.detach().clone() for n, t in self.module.named_buffers()}
        state.update({n: p.detach() for n, p in self.module.named_parameters()})
        with torch.no_grad():
            out = functional_call(self.module, state, (x,))
        return TensorSpec(out.dtype, tuple(out.shape))

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def recomputes(self) -> bool:
        """The backward recomputes the forward (its RNG state must be restored first)."""
        return self.policy.recompute or self.recompute_activations
