"""Compression kernels (csrc/compress via pipesgd.compression) against float64 references.

The references below restate the maths of each mode with numpy float64 and bit
operations; they never call the kernels. The last section simulates a whole ring
AllReduce in one process with the kernels and checks it against the error bounds of
``pipesgd.compression.allreduce_error_bound``.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipesgd import compression
from pipesgd.compression import MODES

pytest.importorskip("pipesgd._C", reason="pipesgd._C is not built: run `make build`")

U = 2.0**-24  # float32 unit roundoff
# |x - decode(encode(x))| <= scale/2 up to float32 rounding: the kernel computes x/scale
# as x * fl(1/scale) (two roundings of a quotient <= 127: < 255 u) and decoding rounds
# q * scale (<= 127 scale: 127 u), so the slack is below 382 u of the scale.
QUANT8_SLACK = 382 * U
FLOAT32_MAX = float(np.finfo(np.float32).max)
DENORMAL = float(np.finfo(np.float32).smallest_subnormal)
SIZES = [1, 2, 3, 7, 16, 17, 255, 256, 257, 1000, 4097, 65537]
SEEDS = [0, 1, 2]


# ---- float64 references ----


def ref_trunc16_bits(x: np.ndarray) -> np.ndarray:
    """Upper 16 bits of every float32; every NaN becomes the quiet NaN 0x7FC0."""
    upper = (x.view(np.uint32) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), upper)


def next_float32(s: float, toward: float) -> float:
    return float(np.nextafter(np.float32(s), np.float32(toward)))


def ref_quant8_scale(x: np.ndarray) -> float:
    """max|x|/127 rounded up to float32 (down if 127 * scale would overflow float32)."""
    if not np.all(np.isfinite(x)):
        return float("nan")
    m = float(np.max(np.abs(x.astype(np.float64)), initial=0.0))
    if m == 0.0:
        return 0.0
    s = float(np.float32(m / 127))
    while 127 * s < m:  # 127 * float32 is exact in float64
        s = next_float32(s, np.inf)
    while 127 * next_float32(s, 0.0) >= m:
        s = next_float32(s, 0.0)
    if 127 * s > FLOAT32_MAX:
        s = next_float32(s, 0.0)
    return s


def rng_values(rng: np.random.Generator, n: int, scale: float = 1.0) -> np.ndarray:
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    x[rng.integers(0, n, size=max(1, n // 50))] = 0.0
    return x


def wire_scale(wire: np.ndarray) -> float:
    return float(wire[:4].view(np.float32)[0])


def wire_q(wire: np.ndarray) -> np.ndarray:
    return wire[4:].view(np.int8)


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal, except that any NaN matches any NaN."""
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | both_nan))


def check_quant8(x: np.ndarray, wire: np.ndarray, back: np.ndarray) -> None:
    scale = wire_scale(wire)
    expected = ref_quant8_scale(x)
    if np.isnan(expected):
        assert np.isnan(scale) and np.all(np.isnan(back))
        return
    assert scale == expected
    q = wire_q(wire)
    assert np.all(np.abs(q.astype(np.int32)) <= 127), "q must be clamped to [-127, 127]"
    if scale == 0.0:
        assert np.all(back == 0.0) and np.all(q == 0)
        return
    err = np.abs(back.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= scale * (0.5 + QUANT8_SLACK)), f"max error {err.max()} > {scale}/2"
    if scale >= np.finfo(np.float32).tiny:  # a denormal scale is too coarse for 127 steps
        big = np.argmax(np.abs(x))
        assert abs(int(q[big])) == 127, "the largest |x| must use the full int8 range"


# ---- API and validation ----


def test_modes_and_wire_bytes() -> None:
    assert MODES == ("none", "trunc16", "quant8")
    assert [compression.wire_bytes(5, m) for m in MODES] == [20, 10, 9]
    for mode in MODES:
        x = np.ones(5, dtype=np.float32)
        assert compression.encode(x, mode).nbytes == compression.wire_bytes(5, mode)


def test_errors_say_what_to_do() -> None:
    x = np.zeros(4, dtype=np.float32)
    with pytest.raises(ValueError, match=r"float64 is not supported.*astype\(np.float32\)"):
        compression.encode(np.zeros(4), "quant8")
    with pytest.raises(ValueError, match="C-contiguous"):
        compression.encode(np.zeros(8, dtype=np.float32)[::2], "trunc16")
    with pytest.raises(ValueError, match=r"unknown compression mode 'int4'.*'quant8'"):
        compression.encode(x, "int4")
    with pytest.raises(ValueError, match=r"wire has 7 bytes.*take 8"):
        compression.decode(np.zeros(7, dtype=np.uint8), 4, "quant8")
    with pytest.raises(ValueError, match="uint8"):
        compression.decode(np.zeros(8, dtype=np.int8), 4, "quant8")
    with pytest.raises(ValueError, match=r"wire has 8 bytes.*take 10"):
        compression.decode_add(np.zeros(8, dtype=np.uint8), np.zeros(5, np.float32), "trunc16")
    with pytest.raises(ValueError, match="block must be >= 1"):
        compression.roundtrip(x, "quant8", block=0)


def test_compiled_functions_check_their_buffers() -> None:
    from pipesgd import _C

    with pytest.raises(ValueError, match="elements"):
        _C.compression.quant8_encode(np.zeros(4, np.float32), np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        wire = np.zeros(8, np.uint8)
        wire.flags.writeable = False
        _C.compression.quant8_encode(np.zeros(4, np.float32), wire)
    shared = np.zeros(64, np.uint8)  # local written over the wire it reads: refused
    with pytest.raises(ValueError, match="must not overlap"):
        _C.compression.quant8_decode_add_encode_decode(
            shared[:12], shared[8:40].view(np.float32), 1.0, np.zeros(12, np.uint8))
    with pytest.raises(ValueError, match="must not overlap"):
        _C.compression.trunc16_decode_add_encode_decode(
            np.zeros(8, np.uint16), shared[:32].view(np.float32), 1.0,
            shared[16:32].view(np.uint16))


# ---- trunc16 ----


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", SIZES)
def test_trunc16_is_the_upper_half(seed: int, n: int) -> None:
    x = rng_values(np.random.default_rng(seed), n, scale=10.0 ** (seed - 1))
    wire = compression.encode(x, "trunc16")
    np.testing.assert_array_equal(wire.view(np.uint16), ref_trunc16_bits(x))
    back = compression.decode(wire, n, "trunc16")
    np.testing.assert_array_equal(back.view(np.uint32), x.view(np.uint32) & 0xFFFF0000)
    nonzero = x != 0
    rel = np.abs(back[nonzero].astype(np.float64) - x[nonzero]) / np.abs(x[nonzero])
    assert np.all(rel < 2.0**-7)


def test_trunc16_special_values() -> None:
    low_payload_nan = np.array([0x7F800001, 0xFF800123], dtype=np.uint32).view(np.float32)
    x = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, DENORMAL, -3 * DENORMAL, FLOAT32_MAX, -1.0],
        dtype=np.float32,
    )
    x = np.concatenate([x, low_payload_nan])
    back = compression.decode(compression.encode(x, "trunc16"), x.size, "trunc16")
    assert np.signbit(back[1]) and back[1] == 0.0
    assert back[2] == np.inf and back[3] == -np.inf
    assert np.all(np.isnan(back[[4, -2, -1]])), "a NaN must never truncate to Inf"
    np.testing.assert_array_equal(back[5:9], [0.0, -0.0, np.float32(3.3895314e38), -1.0])


# ---- quant8 ----


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", SIZES)
def test_quant8_matches_reference(seed: int, n: int) -> None:
    x = rng_values(np.random.default_rng(seed), n, scale=10.0 ** (3 * seed - 3))
    wire = compression.encode(x, "quant8")
    check_quant8(x, wire, compression.decode(wire, n, "quant8"))


@pytest.mark.parametrize(
    "x",
    [
        pytest.param(np.zeros(5, np.float32), id="zeros"),
        pytest.param(np.array([0.0, -0.0, 0.0], np.float32), id="signed-zeros"),
        pytest.param(np.array([3.0], np.float32), id="n=1"),
        pytest.param(np.array([-2e-3], np.float32), id="n=1-negative"),
        pytest.param(np.array([DENORMAL], np.float32), id="one-denormal"),
        pytest.param(np.array([DENORMAL, -3 * DENORMAL, 0.0], np.float32), id="denormal-max"),
        pytest.param(np.array([1e-40, -5e-41, 7e-42], np.float32), id="denormals"),
        pytest.param(np.array([1e-38, 3e-39, -1e-45], np.float32), id="scale-denormal"),
        pytest.param(np.array([FLOAT32_MAX, -FLOAT32_MAX, 1.0], np.float32), id="float-max"),
        pytest.param(np.array([127.0, 0.5, 1.5, -2.5, 63.5], np.float32), id="ties"),
    ],
)
def test_quant8_edge_blocks(x: np.ndarray) -> None:
    wire = compression.encode(x, "quant8")
    back = compression.decode(wire, x.size, "quant8")
    check_quant8(x, wire, back)
    assert np.all(np.isfinite(back)), "a finite block must decode to finite values"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 3, 6])
def test_quant8_non_finite_block_decodes_to_nan(bad: float, where: int) -> None:
    x = np.linspace(-1, 1, 7, dtype=np.float32)
    x[where] = bad
    wire = compression.encode(x, "quant8")
    assert np.isnan(wire_scale(wire))
    assert np.all(np.isnan(compression.decode(wire, x.size, "quant8")))


def test_quant8_overflowing_sum_becomes_nan_block() -> None:
    x = np.array([FLOAT32_MAX, 1.0, -1.0], dtype=np.float32)
    out = compression.decode_add_encode(compression.encode(x, "quant8"), x, "quant8")
    assert np.all(np.isnan(compression.decode(out, 3, "quant8")))


def test_large_block() -> None:
    rng = np.random.default_rng(7)
    x = rng_values(rng, 3_000_001)
    for mode in ("trunc16", "quant8"):
        wire = compression.encode(x, mode)
        back = compression.decode(wire, x.size, mode)
        if mode == "quant8":
            check_quant8(x, wire, back)
        else:
            np.testing.assert_array_equal(wire.view(np.uint16), ref_trunc16_bits(x))


# ---- fused ring ops ----


def fused_inputs(mode: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    incoming = compression.encode(rng_values(rng, n, 3.0), mode)
    local = rng_values(rng, n, 10.0 ** (seed - 1))
    if seed == 2 and n > 4:  # special values in the mix
        local[[0, n // 2]] = [np.inf, np.nan] if mode != "quant8" else [DENORMAL, -0.0]
    return incoming, local


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", SIZES)
def test_fused_ops_equal_composition_bitwise(mode: str, seed: int, n: int) -> None:
    wire, local = fused_inputs(mode, n, seed)
    summed = compression.decode(wire, n, mode) + local  # float32 addition
    fused_wire = compression.decode_add_encode(wire, local, mode)
    np.testing.assert_array_equal(fused_wire, compression.encode(summed, mode))
    assert same_floats(compression.decode_add(wire, local, mode), summed)
    in_place = local.copy()
    assert compression.decode_add(wire, in_place, mode, out=in_place) is in_place
    assert same_floats(in_place, summed)
    # the owner's hop: decode_add, encode, then decode scaled by 1/p, in one kernel
    for factor in (1.0, 0.25, 1 / 3):
        owned = local.copy()
        out = compression.decode_add_encode_decode(wire, owned, mode, factor)
        np.testing.assert_array_equal(out, compression.encode(summed, mode))
        decoded = compression.decode(out, n, mode)
        assert same_floats(owned, decoded if factor == 1 else decoded * np.float32(factor))


@pytest.mark.parametrize("mode", ["trunc16", "quant8"])
def test_fused_ops_with_non_finite_inputs(mode: str) -> None:
    x = np.array([1.0, -2.0, 0.5, 4.0], np.float32)
    for bad in (np.nan, np.inf):
        local = x.copy()
        local[2] = bad
        wire = compression.encode(x, mode)
        summed = compression.decode(wire, 4, mode) + local
        fused = compression.decode_add_encode(wire, local, mode)
        np.testing.assert_array_equal(fused, compression.encode(summed, mode))
        owned = local.copy()
        np.testing.assert_array_equal(
            compression.decode_add_encode_decode(wire, owned, mode, 0.5), fused)
        back = compression.decode(fused, 4, mode)
        assert same_floats(owned, back * np.float32(0.5))
        if mode == "quant8":
            assert np.all(np.isnan(back))
        else:  # elementwise IEEE: Inf stays Inf, NaN stays NaN, the rest is untouched
            assert same_floats(back[2:3], np.array([bad], np.float32))
            assert np.all(np.isfinite(back[[0, 1, 3]]))


@pytest.mark.parametrize("mode", MODES)
def test_roundtrip_is_blockwise(mode: str) -> None:
    x = rng_values(np.random.default_rng(3), 1001)
    x[500:] *= 1e-4  # a quant8 block of small values keeps its own, smaller scale
    got = compression.roundtrip(x, mode, block=250)
    for start in range(0, x.size, 250):
        part = x[start : start + 250]
        expected = compression.decode(compression.encode(part, mode), part.size, mode)
        np.testing.assert_array_equal(got[start : start + 250], expected)
    np.testing.assert_array_equal(
        compression.roundtrip(x, mode), compression.decode(compression.encode(x, mode), 1001, mode)
    )


# ---- end-to-end error bound of a compressed ring AllReduce ----


def simulate_ring_allreduce(inputs: list[np.ndarray], mode: str) -> list[np.ndarray]:
    """The ring of the engine, in one process, with the compression kernels.

    Segment c starts at rank c, which sends encode(x_c); each of the next p-2 ranks
    decodes, adds its block and re-encodes; the owner (rank c-1) decodes and adds, then
    encodes the sum once for the allgather, which forwards those bytes unchanged.
    """
    p, n = len(inputs), inputs[0].size
    results = [np.empty(n, np.float32) for _ in range(p)]
    bounds = np.linspace(0, n, p + 1).astype(int)
    for c in range(p):
        seg = slice(bounds[c], bounds[c + 1])
        size = bounds[c + 1] - bounds[c]
        if p == 1:
            results[0][seg] = inputs[0][seg]
            continue
        wire = compression.encode(inputs[c][seg], mode)
        for hop in range(1, p - 1):
            wire = compression.decode_add_encode(wire, inputs[(c + hop) % p][seg], mode)
        total = compression.decode_add(wire, inputs[(c + p - 1) % p][seg], mode)
        final = compression.encode(total, mode)
        for r in range(p):
            results[r][seg] = compression.decode(final, size, mode)
    return results


def ring_inputs(kind: str, p: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        return [rng_values(rng, n) for _ in range(p)]
    if kind == "magnitudes":  # each rank on its own scale
        return [rng_values(rng, n, 10.0 ** (r % 4 - 2)) for r in range(p)]
    if kind == "cancelling":  # sums much smaller than the blocks
        base = rng_values(rng, n)
        return [base * (-1) ** r + rng_values(rng, n, 1e-3) for r in range(p)]
    if kind == "same-sign":  # partial sums grow every hop
        return [np.abs(rng_values(rng, n)) for _ in range(p)]
    raise ValueError(kind)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("kind", ["gaussian", "magnitudes", "cancelling", "same-sign"])
def test_ring_allreduce_within_bound(mode: str, p: int, kind: str) -> None:
    n = 4099
    for seed in SEEDS:
        inputs = ring_inputs(kind, p, n, seed)
        results = simulate_ring_allreduce(inputs, mode)
        for r in range(1, p):
            np.testing.assert_array_equal(results[r], results[0])  # ranks agree bitwise
        exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
        bounds = np.linspace(0, n, p + 1).astype(int)
        for c in range(p):
            seg = slice(bounds[c], bounds[c + 1])
            bound = compression.allreduce_error_bound([x[seg] for x in inputs], mode)
            err = np.abs(results[0][seg] - exact[seg])
            assert np.all(err <= bound), f"segment {c}: worst excess {np.max(err - bound)}"


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bounds_match_closed_forms(p: int) -> None:
    """The recursive bounds stay within the closed forms of the module docstring."""
    inputs = ring_inputs("gaussian", p, 1000, seed=p)
    magnitude = np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0)
    q8 = compression.quant8_allreduce_error_bound(inputs)
    assert np.all(q8 <= ((1 + 1 / 254) ** p - 1) * magnitude.max() * (1 + 1e-3))
    t16 = compression.trunc16_allreduce_error_bound(inputs)
    assert np.all(t16 <= ((1 + 2.0**-7) ** p - 1) * magnitude * (1 + 1e-3) + 1e-30)


def test_bounds_of_degenerate_blocks() -> None:
    zeros = [np.zeros(3, np.float32)] * 3
    assert np.all(compression.quant8_allreduce_error_bound(zeros) < 1e-40)
    with_nan = [np.array([1.0, np.nan], np.float32), np.ones(2, np.float32)]
    assert np.all(np.isinf(compression.quant8_allreduce_error_bound(with_nan)))
    t16 = compression.trunc16_allreduce_error_bound(with_nan)
    assert np.isfinite(t16[0]) and np.isinf(t16[1])
    empty = [np.zeros(0, np.float32)] * 4
    assert compression.allreduce_error_bound(empty, "quant8").shape == (0,)
    with pytest.raises(ValueError, match="ring order"):
        compression.quant8_allreduce_error_bound(np.zeros((2, 2, 2)))
