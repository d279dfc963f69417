"""Gradient compression used inside the ring-AllReduce (Pipe-SGD §3.2), on numpy float32.

This module wraps the C kernels of ``csrc/compress`` (``pipesgd._C.compression``) for
tests, benchmarks and users who want to see what a mode does to their gradients, and
holds the error bounds of a compressed ring-AllReduce.

Modes (``MODES``):

* ``"none"``: the float32 bytes themselves, 4 bytes per element.
* ``"trunc16"``: the upper 16 bits of each float32 (sign, exponent, 7 mantissa bits),
  truncated; 2 bytes per element. Relative error < 2^-7 per element. Inf stays Inf,
  every NaN becomes the quiet NaN 0x7FC0.
* ``"quant8"``: one float32 scale per block (a block is one ring segment), then one int8
  per element, ``4 + n`` bytes. scale = max|x|/127 rounded up to float32, q = round(x/scale),
  so |x - q*scale| <= scale/2 (up to float32 rounding, see ``QUANT8_HALF_STEP``). A block
  of zeros decodes to zeros; a block holding any NaN or Inf decodes to all NaN.

Example::

    >>> import numpy as np
    >>> from pipesgd import compression
    >>> x = np.array([0.5, -1.0, 0.25], dtype=np.float32)
    >>> wire = compression.encode(x, "quant8")
    >>> wire.nbytes == compression.wire_bytes(3, "quant8") == 7
    True
    >>> compression.decode(wire, 3, "quant8")
    array([ 0.49606305, -1.0000001 ,  0.25196853], dtype=float32)

Error bound of a compressed ring-AllReduce over p ranks (``allreduce_error_bound``)
----------------------------------------------------------------------------------
A ring segment travels p-1 hops in the reduce-scatter. Hop 1 sends encode(x_a) of the
rank a where the segment starts; every later rank decodes, adds its own block and
re-encodes (``decode_add_encode``); the owner decodes and adds the last block and
encodes the full sum once more for the allgather (``decode_add_encode_decode``, which
also decodes that wire for the owner), and the allgather forwards that wire unchanged,
so every rank decodes the same bytes. That is p quantisations, the
k-th of the partial sum P_k of k ranks (k = 1..p). Let y_k be the float32 partial sum
actually quantised, E_k a bound on |value after quantisation k - P_k|, and
u = 2^-24 the float32 unit roundoff.

quant8 (bound uniform over the block): with M_k = max_i |P_k(i)|,

    y_1 = x_a exactly;  for k > 1:  |y_k - P_k| <= E'_k = E_{k-1} + u (M_k + E_{k-1})
                                    (the exact sum decode + x has error E_{k-1}; fl(+) adds u)
    scale_k <= (M_k + E'_k)/127 * (1 + 2^-23) + 2^-149   (max|y_k| <= M_k + E'_k; rounded up)
    E_k = E'_k + scale_k * (1/2 + 382 u)                (QUANT8_HALF_STEP, below)

and the result of every rank is within E_p of the exact sum. Dropping the o(u) terms,
E_k <= E_{k-1} (1 + 1/254) + M_k / 254, so with A = max_i sum_r |x_r(i)| (>= every M_k):

    E_p <= ((1 + 1/254)^p - 1) * A  ~=  p/254 * A       (at most p/254 of the largest
                                                          sum of magnitudes in the block)

trunc16 (bound per element i): truncation keeps the sign and cuts at most 2^-7 of the
magnitude (< 2^-133 absolute for denormals); decoding is exact. With A_k(i) = |P_k(i)|:

    E'_k(i) = E_{k-1}(i) + u (A_k(i) + E_{k-1}(i))   (k > 1; E'_1 = 0)
    E_k(i)  = E'_k(i) + 2^-7 (A_k(i) + E'_k(i)) + 2^-133

so E_p(i) <= ((1 + 2^-7)^p - 1) * sum_r |x_r(i)|  (plus o(u) and denormal terms): the
2^-7 relative error compounds once per quantisation.

Which ranks form P_k depends on the segment and the ring direction, but in a ring it is
always a contiguous arc of k ranks, so the functions below take the worst arc for every
k and need the blocks only in ring order (rank order for a ring 0 -> 1 -> ... -> p-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

MODES = ("none", "trunc16", "quant8")

FLOAT32_UNIT_ROUNDOFF = 2.0**-24
# |y - decode(encode(y))| <= scale * QUANT8_HALF_STEP: rounding to the nearest integer
# contributes 1/2; the kernel computes y/scale as y * fl(1/scale), two float32 roundings
# of a quotient of magnitude <= 127, so at most 127 (2u + u^2) < 255 u; decoding rounds
# q*scale (|q*scale| <= 127 scale) once more, 127 u. Total < 1/2 + 382 u.
QUANT8_HALF_STEP = 0.5 + 382 * FLOAT32_UNIT_ROUNDOFF
TRUNC16_RELATIVE_ERROR = 2.0**-7
TRUNC16_DENORMAL_ERROR = 2.0**-133
_QUANT8_SCALE_ROUND_UP = 1 + 2.0**-23
_SMALLEST_DENORMAL = 2.0**-149
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _kernels() -> ModuleType:
    try:
        from pipesgd import _C
    except ImportError as err:  # pragma: no cover - depends on the build
        raise ImportError(
            "pipesgd._C is not built; run `make build` in the repository root"
        ) from err
    return _C.compression


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown compression mode {mode!r}; valid modes are {MODES}")
    return mode


def _check_float32(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` as a flat float32 view, or ValueError saying how to fix the call."""
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise ValueError(
            f"{name} has dtype {x.dtype}; compression works on float32 only (float64 is not "
            f"supported by the compressed modes): pass {name}.astype(np.float32)"
        )
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous; pass np.ascontiguousarray({name})")
    return x.reshape(-1)


def _check_wire(wire: np.ndarray, n: int, mode: str) -> np.ndarray:
    if not isinstance(wire, np.ndarray) or wire.dtype != np.uint8:
        got = wire.dtype if isinstance(wire, np.ndarray) else type(wire).__name__
        raise ValueError(f"wire must be a numpy uint8 array (from encode), got {got}")
    if wire.ndim != 1 or not wire.flags.c_contiguous:
        raise ValueError("wire must be a 1-D C-contiguous uint8 array")
    expected = wire_bytes(n, mode)
    if wire.size != expected:
        raise ValueError(
            f"wire has {wire.size} bytes but {n} elements in mode {mode!r} take {expected} "
            f"(wire_bytes({n}, {mode!r}))"
        )
    return wire


def _as_uint16(wire: np.ndarray) -> np.ndarray:
    if wire.ctypes.data % 2:  # a view at an odd offset: the kernels need aligned uint16
        wire = wire.copy()
    return wire.view(np.uint16)


def wire_bytes(n: int, mode: str) -> int:
    """Bytes on the wire for one block of ``n`` float32 elements in ``mode``."""
    _check_mode(mode)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return {"none": 4 * n, "trunc16": 2 * n, "quant8": 4 + n}[mode]


def encode(x: np.ndarray, mode: str) -> np.ndarray:
    """Encode ``x`` (float32, C-contiguous) as one block; returns the wire as uint8.

    Raises:
        ValueError: unknown mode, dtype other than float32, non-contiguous ``x``.
    """
    _check_mode(mode)
    x = _check_float32(x, "x")
    wire = np.empty(wire_bytes(x.size, mode), dtype=np.uint8)
    if mode == "none":
        wire.view(np.float32)[:] = x
    elif mode == "trunc16":
        _kernels().trunc16_encode(x, wire.view(np.uint16))
    else:
        _kernels().quant8_encode(x, wire)
    return wire


def decode(wire: np.ndarray, n: int, mode: str) -> np.ndarray:
    """Decode one block of ``n`` elements from ``wire``; returns a new float32 array.

    Raises:
        ValueError: unknown mode, wire not uint8 or not ``wire_bytes(n, mode)`` long.
    """
    _check_mode(mode)
    wire = _check_wire(wire, n, mode)
    out = np.empty(n, dtype=np.float32)
    if mode == "none":
        out.view(np.uint8)[:] = wire
    elif mode == "trunc16":
        _kernels().trunc16_decode(_as_uint16(wire), out)
    else:
        _kernels().quant8_decode(wire, out)
    return out


def decode_add_encode(wire: np.ndarray, local: np.ndarray, mode: str) -> np.ndarray:
    """One reduce-scatter hop: ``encode(decode(wire) + local)`` in a single fused pass.

    Bitwise equal to the composition of ``decode``, a float32 addition and ``encode``.

    Raises:
        ValueError: as for ``encode`` and ``decode``.
    """
    _check_mode(mode)
    local = _check_float32(local, "local")
    wire = _check_wire(wire, local.size, mode)
    out = np.empty_like(wire)
    if mode == "none":
        out.view(np.float32)[:] = decode(wire, local.size, mode) + local
    elif mode == "trunc16":
        _kernels().trunc16_decode_add_encode(_as_uint16(wire), local, out.view(np.uint16))
    else:
        scratch = np.empty(local.size, dtype=np.float32)
        _kernels().quant8_decode_add_encode(wire, local, scratch, out)
    return out


def decode_add(
    wire: np.ndarray, local: np.ndarray, mode: str, out: np.ndarray | None = None
) -> np.ndarray:
    """Last reduce-scatter hop: ``decode(wire) + local`` in a single fused pass.

    Args:
        out: float32 array of ``local.size`` elements to write into; may be ``local``
            itself (in-place). A new array when None.

    Raises:
        ValueError: as for ``encode`` and ``decode``, or ``out`` of the wrong size.
    """
    _check_mode(mode)
    local = _check_float32(local, "local")
    wire = _check_wire(wire, local.size, mode)
    if out is None:
        out = np.empty(local.size, dtype=np.float32)
    flat_out = _check_float32(out, "out")
    if flat_out.size != local.size:
        raise ValueError(f"out has {flat_out.size} elements, local has {local.size}")
    if mode == "none":
        np.add(decode(wire, local.size, mode), local, out=flat_out)
    elif mode == "trunc16":
        _kernels().trunc16_decode_add(_as_uint16(wire), local, flat_out)
    else:
        _kernels().quant8_decode_add(wire, local, flat_out)
    return out


def decode_add_encode_decode(
    wire: np.ndarray, local: np.ndarray, mode: str, factor: float = 1.0
) -> np.ndarray:
    """The owner's last reduce-scatter hop, fused: returns ``encode(decode(wire) + local)``
    and sets ``local`` to the decoded result times ``factor`` (1/p for an average).

    Bitwise equal to ``decode_add``, ``encode`` and a decode scaled by ``factor`` in turn;
    every rank decodes the returned bytes the same way, so the replicas stay identical.

    Raises:
        ValueError: as for ``encode`` and ``decode``, or ``local`` read-only.
    """
    _check_mode(mode)
    flat = _check_float32(local, "local")
    wire = _check_wire(wire, flat.size, mode)
    if not flat.flags.writeable:
        raise ValueError("local is read-only: it receives the decoded result")
    out = np.empty_like(wire)
    factor32 = np.float32(factor)
    if mode == "none":
        out.view(np.float32)[:] = decode(wire, flat.size, mode) + flat
        flat[:] = out.view(np.float32) * factor32 if factor32 != 1 else out.view(np.float32)
    elif mode == "trunc16":
        _kernels().trunc16_decode_add_encode_decode(_as_uint16(wire), flat, factor32,
                                                    out.view(np.uint16))
    else:
        _kernels().quant8_decode_add_encode_decode(wire, flat, factor32, out)
    return out


def roundtrip(x: np.ndarray, mode: str, block: int | None = None) -> np.ndarray:
    """``decode(encode(x))`` block by block, as the ring would see ``x`` in segments.

    Args:
        block: elements per block (each quant8 block gets its own scale); the last block
            may be shorter. None means the whole array is one block.

    Returns:
        A new flat float32 array with the decoded values.
    """
    _check_mode(mode)
    flat = _check_float32(x, "x")
    if block is None:
        block = max(flat.size, 1)
    if block < 1:
        raise ValueError(f"block must be >= 1 element, got {block}")
    out = np.empty_like(flat)
    for start in range(0, flat.size, block):
        part = flat[start : start + block]
        out[start : start + block] = decode(encode(part, mode), part.size, mode)
    return out


def _ring_blocks(blocks_of_each_rank: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    blocks = np.asarray(blocks_of_each_rank, dtype=np.float64)
    if blocks.ndim == 1:
        blocks = blocks[np.newaxis, :]
    if blocks.ndim != 2 or blocks.shape[0] < 1:
        raise ValueError(
            "blocks_of_each_rank must be p equally long 1-D blocks, one per rank in ring "
            f"order, e.g. [x0[seg], x1[seg]]; got shape {blocks.shape}"
        )
    return blocks


def _worst_arc_sums(blocks: np.ndarray) -> np.ndarray:
    """[k-1, i] = max over contiguous ring arcs of k ranks of |sum of their blocks at i|.

    Inflated by p float64 roundings so the float64 sums cannot understate the bound.
    """
    p = blocks.shape[0]
    worst = np.zeros_like(blocks)
    for start in range(p):
        acc = np.zeros(blocks.shape[1])
        for k in range(p):
            acc += blocks[(start + k) % p]
            np.maximum(worst[k], np.abs(acc), out=worst[k])
    return worst * (1 + p * 2.0**-52)


def quant8_allreduce_error_bound(blocks_of_each_rank: Sequence[np.ndarray]) -> np.ndarray:
    """Per-element bound on |ring-AllReduce result - exact sum| for one quant8 block.

    Args:
        blocks_of_each_rank: the block (ring segment) of every rank, in ring order; a
            list of p equally long arrays or a (p, n) array.

    Returns:
        float64 array of n bounds (equal for all elements, since the block shares a
        scale); +inf where no bound holds because the block is or may become non-finite
        (the ring then delivers NaN for the whole block). Derivation in the module
        docstring.
    """
    blocks = _ring_blocks(blocks_of_each_rank)
    n = blocks.shape[1]
    if not np.all(np.isfinite(blocks)):
        return np.full(n, np.inf)
    worst = _worst_arc_sums(blocks).max(axis=1, initial=0.0)
    u = FLOAT32_UNIT_ROUNDOFF
    err = 0.0
    for k, m_k in enumerate(worst):
        before = err + u * (m_k + err) if k > 0 else 0.0
        if m_k + before > _FLOAT32_MAX:
            return np.full(n, np.inf)
        scale = (m_k + before) / 127 * _QUANT8_SCALE_ROUND_UP + _SMALLEST_DENORMAL
        err = before + scale * QUANT8_HALF_STEP
    return np.full(n, err)


def trunc16_allreduce_error_bound(blocks_of_each_rank: Sequence[np.ndarray]) -> np.ndarray:
    """Per-element bound on |ring-AllReduce result - exact sum| for one trunc16 block.

    Args:
        blocks_of_each_rank: as for ``quant8_allreduce_error_bound``.

    Returns:
        float64 array of n bounds, +inf where an input is non-finite or a partial sum
        may overflow float32. Derivation in the module docstring.
    """
    blocks = _ring_blocks(blocks_of_each_rank)
    worst = _worst_arc_sums(blocks)
    u = FLOAT32_UNIT_ROUNDOFF
    err = np.zeros(blocks.shape[1])
    for k, a_k in enumerate(worst):
        before = err + u * (a_k + err) if k > 0 else np.zeros_like(err)
        err = before + TRUNC16_RELATIVE_ERROR * (a_k + before) + TRUNC16_DENORMAL_ERROR
    finite = np.all(np.isfinite(blocks), axis=0) & (worst.max(axis=0) + err <= _FLOAT32_MAX)
    return np.where(finite, err, np.inf)


def none_allreduce_error_bound(blocks_of_each_rank: Sequence[np.ndarray]) -> np.ndarray:
    """Per-element bound for the uncompressed ring: p-1 float32 additions.

    Standard summation bound gamma_{p-1} * sum_r |x_r(i)|, gamma_m = m u / (1 - m u)
    (additions in the denormal range are exact, so no absolute term).
    """
    blocks = _ring_blocks(blocks_of_each_rank)
    m = (blocks.shape[0] - 1) * FLOAT32_UNIT_ROUNDOFF
    magnitude = np.abs(blocks).sum(axis=0) * (1 + blocks.shape[0] * 2.0**-52)
    err = m / (1 - m) * magnitude
    return np.where(np.isfinite(err) & (magnitude <= _FLOAT32_MAX), err, np.inf)


def allreduce_error_bound(blocks_of_each_rank: Sequence[np.ndarray], mode: str) -> np.ndarray:
    """Per-element bound on the error of a ring-AllReduce of one block in ``mode``.

    Example (an end-to-end test of the engine, one segment ``seg`` of p ranks' inputs)::

        bound = allreduce_error_bound([x[seg] for x in inputs_in_ring_order], "quant8")
        assert np.all(np.abs(result[seg] - exact[seg]) <= bound)
    """
    _check_mode(mode)
    return {
        "none": none_allreduce_error_bound,
        "trunc16": trunc16_allreduce_error_bound,
        "quant8": quant8_allreduce_error_bound,
    }[mode](blocks_of_each_rank)
