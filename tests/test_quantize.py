"""The ZeRO++ quantization kernels (cpp/src/quantize*.cpp) through zerocore._C and zerocore.ops.

Everything is judged against a float64 reference written here (Note [Quantization arithmetic] in
cpp/include/zerocore/quantize.hpp, restated):

    scale = max|x| / qmax rounded *up* to fp32 (qmax = 127 for int8, 7 for int4); 0 for an all-zero group
    q     = round_half_even(x / scale), the real quotient rounded once (computed in float64, which is exact
            here: x / scale is either exactly a half-integer or at least 2^-25 away from one)
    x'    = q * scale rounded to fp32 (the product is exact in float64), then to the output dtype

and the kernels must match it bit for bit (q, scales and x'), on every SIMD path. The error bounds checked
on top, per element:

    |x - q * scale| <= scale / 2                                       exactly, in float64
    |x - x'| <= scale / 2 + 2^-24 |q * scale| + 2^-150                 (x' in fp32: the product's rounding)
                          + u |x'| + t                                 (bf16 / fp16 x': u = 2^-8 / 2^-11,
                                                                        t = 2^-134 / 2^-25, half the dtype's
                                                                        smallest subnormal)

for every element whose fp32 value q * scale lies inside the output dtype's finite range (fp16 overflows to
inf beyond 65504, as any conversion to fp16 does).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import zerocore
from zerocore import _C, ops

QMAX = {8: 127, 4: 7}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PATHS = [p for p in zerocore.build_info()["simd_compiled"] if _C.cpu_supports_simd_path(p)]
BITS_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# Output rounding of x' beyond fp32's: relative u and absolute t (see the module docstring).
OUT_ROUNDING = {torch.float32: (0.0, 0.0), torch.bfloat16: (2.0**-8, 2.0**-134), torch.float16: (2.0**-11, 2.0**-25)}
CANONICAL_NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


# -------------------------------------------------------------------------------------------------------------
# The float64 reference
# -------------------------------------------------------------------------------------------------------------


def _groups(n: int, group_size: int) -> int:
    return -(-n // group_size)


def ref_quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q as int64 values, fp32 scales) of Note [Quantization arithmetic], computed in float64."""
    x64 = x.reshape(-1).double()
    n, qmax = x64.numel(), QMAX[bits]
    groups = _groups(n, group_size)
    padded = torch.cat([x64, x64.new_zeros(groups * group_size - n)]).view(groups, group_size)
    absmax = padded.abs().amax(dim=1) if groups else x64.new_zeros(0)
    scale = (absmax / qmax).float()  # rounded to nearest (double rounding is innocuous for a quotient)
    below = scale.double() * qmax < absmax  # exact: 24 x 7 bits
    scale = torch.where(below, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    s64 = scale.double().repeat_interleave(group_size)[:n]
    q = torch.where(s64 > 0, torch.round(x64 / torch.where(s64 > 0, s64, 1.0)), 0.0)
    return q.long(), scale


def ref_dequantize(q: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    s64 = scales.double().repeat_interleave(group_size)[: q.numel()]
    return (q.double() * s64).float().to(dtype)


def unpack(q: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The q values of the kernel's storage as int64: int8 bytes, or int4 nibbles (low first, two's complement)."""
    if bits == 8:
        assert q.dtype == torch.int8 and q.numel() == n
        return q.long()
    assert q.dtype == torch.uint8 and q.numel() == (n + 1) // 2
    b = q.long()
    nibbles = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:n]
    return (nibbles ^ 8) - 8


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS_VIEW[t.dtype]) if t.dtype in BITS_VIEW else t


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    diff = (_bits(actual) != _bits(expected)).nonzero()
    if diff.numel():
        i = diff[0].item()
        pytest.fail(f"{what}: {diff.numel()} element(s) differ, first at {i}: {actual[i].item()!r} "
                    f"(expected {expected[i].item()!r})")


def check_against_reference(x: torch.Tensor, bits: int, group_size: int, what: str = "") -> None:
    """Quantizes x with zerocore and checks q, scales, the bounds and x' for every output dtype."""
    n = x.numel()
    q, scales = ops.quantize(x, bits=bits, group_size=group_size)
    ref_q, ref_scales = ref_quantize(x, bits, group_size)
    assert_bitwise_equal(scales, ref_scales, f"{what} scales")
    values = unpack(q, n, bits)
    assert torch.equal(values, ref_q), f"{what} q differs at {(values != ref_q).nonzero()[:5].flatten().tolist()}"
    assert values.abs().max().item() <= QMAX[bits] if n else True
    x64 = x.reshape(-1).double()
    s64 = scales.double().repeat_interleave(group_size)[:n]
    exact = values.double() * s64
    err = (x64 - exact).abs()
    assert bool((err <= s64 / 2).all()), f"{what} |x - q*scale| > scale/2 at {(err > s64 / 2).nonzero()[:5].tolist()}"
    product32 = exact.float().double()
    for dtype in DTYPES:
        out = ops.dequantize(q, scales, n, bits, group_size, dtype=dtype)
        assert_bitwise_equal(out, ref_dequantize(values, scales, group_size, dtype), f"{what} dequantize to {dtype}")
        u, t = OUT_ROUNDING[dtype]
        x_out = out.double()
        bound = s64 / 2 + 2.0**-24 * exact.abs() + 2.0**-150 + u * x_out.abs() + t
        in_range = product32.abs() <= torch.finfo(dtype).max
        bad = in_range & ((x64 - x_out).abs() > bound)
        assert not bool(bad.any()), f"{what} error bound for {dtype} fails at {bad.nonzero()[:5].flatten().tolist()}"


# -------------------------------------------------------------------------------------------------------------
# Inputs
# -------------------------------------------------------------------------------------------------------------

# Exponent ranges that keep each dtype finite with room to spare (fp32 stays below 2^126, so x' never meets the
# fp32 overflow threshold either).
EXPONENTS = {torch.float32: (-40, 40), torch.bfloat16: (-40, 40), torch.float16: (-8, 8)}
TINY = {torch.float32: -140, torch.bfloat16: -128, torch.float16: -20}


def make_input(kind: str, n: int, group_size: int, bits: int, dtype: torch.dtype, seed: int, zero_groups: bool):
    gen = torch.Generator().manual_seed(seed)
    lo, hi = EXPONENTS[dtype]
    groups = max(1, _groups(n, group_size))
    per_group_exp = torch.randint(lo, hi + 1, (groups,), generator=gen).double().repeat_interleave(group_size)[:n]
    if kind == "normal":
        x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(per_group_exp)
    elif kind == "ties":
        # k/2 * 2^e with |k| <= 2 qmax, and +-qmax * 2^e in every group: scale 2^e exactly, every value a
        # multiple of scale/2, so about half of them are exact ties that must go to the even neighbour.
        qmax = QMAX[bits]
        k = torch.randint(-2 * qmax, 2 * qmax + 1, (n,), generator=gen).double() / 2
        k[::group_size] = qmax * torch.where(torch.rand(k[::group_size].shape, generator=gen) < 0.5, -1.0, 1.0)
        x = k * torch.exp2(per_group_exp.clamp(lo + 10, hi - 10))
    elif kind == "tiny":
        x = torch.randn(n, generator=gen, dtype=torch.float64) * 2.0 ** TINY[dtype]
    else:  # "mixed": magnitudes spread over the whole range within each group, some exact zeros
        e = torch.randint(lo, hi + 1, (n,), generator=gen).double()
        x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(e)
        x[torch.rand(n, generator=gen) < 0.1] = 0.0
    if zero_groups and n:
        zero = torch.rand(groups, generator=gen) < 0.3
        x[zero.repeat_interleave(group_size)[:n]] = 0.0
    return x.to(dtype)


@st.composite
def cases(draw, max_n: int = 400):
    bits = draw(st.sampled_from([8, 4]))
    group_size = draw(st.integers(1, 80))
    if bits == 4:
        group_size += group_size % 2
    n = draw(st.integers(0, max_n))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["normal", "ties", "tiny", "mixed"]))
    x = make_input(kind, n, group_size, bits, dtype, draw(st.integers(0, 2**32 - 1)), draw(st.booleans()))
    return x, bits, group_size, kind


def _raw_floats(draw, dtype: torch.dtype, n: int) -> torch.Tensor:
    """n arbitrary finite values of dtype from raw bit patterns (subnormals, zeros of both signs, extremes)."""
    if dtype == torch.float32:
        # Exponent field <= 252 (|x| < 2^126): beyond, q * scale may round past fp32's largest value.
        words = draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n))
        words = [w if (w >> 23) & 0xFF <= 252 else w & ~(0xFF << 23) for w in words]
        return torch.tensor([w - 2**32 if w >= 2**31 else w for w in words], dtype=torch.int32).view(torch.float32)
    exponent_mask = 0x7F80 if dtype == torch.bfloat16 else 0x7C00
    halves = draw(st.lists(st.integers(0, 2**16 - 1), min_size=n, max_size=n))
    halves = [h if h & exponent_mask != exponent_mask else h & 0x8000 for h in halves]  # inf/NaN -> +-0
    return torch.tensor([h - 2**16 if h >= 2**15 else h for h in halves], dtype=torch.int16).view(dtype)


# -------------------------------------------------------------------------------------------------------------
# Against the float64 reference
# -------------------------------------------------------------------------------------------------------------


@given(cases())
def test_matches_float64_reference(case):
    x, bits, group_size, kind = case
    check_against_reference(x, bits, group_size, f"{kind} n={x.numel()} {x.dtype} bits={bits} gs={group_size}")


@given(st.data())
def test_matches_reference_on_arbitrary_bit_patterns(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    bits = data.draw(st.sampled_from([8, 4]))
    group_size = data.draw(st.integers(1, 12).map(lambda g: g + g % 2 if bits == 4 else g))
    x = _raw_floats(data.draw, dtype, data.draw(st.integers(0, 40)))
    check_against_reference(x, bits, group_size, f"raw {dtype} bits={bits} gs={group_size}")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_sizes_and_partial_last_group(bits, dtype):
    for n, group_size in [(1, 2), (2, 2), (3, 2), (7, 4), (31, 16), (33, 16), (2049, 2048), (4095, 2048), (5, 64)]:
        x = make_input("normal", n, group_size, bits, dtype, seed=n, zero_groups=False)
        check_against_reference(x, bits, group_size, f"n={n} gs={group_size}")
        q, scales = ops.quantize(x, bits=bits, group_size=group_size)
        assert scales.numel() == _groups(n, group_size)
        assert q.numel() == (n if bits == 8 else (n + 1) // 2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_threaded_with_nontemporal_stores(bits, path, dtype):
    # 2^20 + 37 elements: split over the kernel threads, q and the output written with non-temporal stores
    # where their lines are aligned (from 2^20 elements on, SIMD paths), and with regular stores into slices
    # that start an element into their buffers.
    n, group_size = 2**20 + 37, 2048
    x = make_input("mixed", n, group_size, bits, dtype, seed=5, zero_groups=True)
    with ops.force_simd_path(path):
        _check_large(x, n, bits, group_size)


def _check_large(x: torch.Tensor, n: int, bits: int, group_size: int) -> None:
    q, scales = ops.quantize(x, bits=bits, group_size=group_size)
    values = unpack(q, n, bits)
    ref_q, ref_scales = ref_quantize(x, bits, group_size)
    assert_bitwise_equal(scales, ref_scales, "scales")
    assert torch.equal(values, ref_q)
    # q written through regular stores where its lines are not aligned: the same bytes.
    q_buffer, s_other = torch.empty(q.numel() + 1, dtype=q.dtype), torch.empty_like(scales)
    assert _C.quantize(x, bits, group_size, q_buffer[1:], s_other) == (0, -1)
    assert torch.equal(q_buffer[1:], q) and torch.equal(s_other, scales)
    for dtype in DTYPES:
        expected = ref_dequantize(values, scales, group_size, dtype)
        for offset in (0, 1):
            buffer = torch.full((n + 2,), -3.0, dtype=dtype)
            ops.dequantize(q, scales, n, bits, group_size, out=buffer[offset : offset + n])
            assert_bitwise_equal(buffer[offset : offset + n], expected, f"{dtype}, offset {offset}")
            assert (buffer[:offset] == -3.0).all() and (buffer[offset + n :] == -3.0).all()


def test_all_zero_groups_have_scale_zero_and_q_zero():
    for bits in (8, 4):
        x = torch.zeros(100)
        x[40:50] = torch.linspace(-1, 1, 10)
        x[60] = -0.0
        q, scales = ops.quantize(x, bits=bits, group_size=10)
        assert scales.tolist() == [0.0] * 4 + [scales[4].item()] + [0.0] * 5 and scales[4].item() > 0
        assert (unpack(q, 100, bits)[:40] == 0).all() and (unpack(q, 100, bits)[50:] == 0).all()
        out = ops.dequantize(q, scales, 100, bits, 10)
        assert (out[:40] == 0).all() and (out[50:] == 0).all()
        assert_bitwise_equal(out[:40], torch.zeros(40), "all-zero groups give +0")


# -------------------------------------------------------------------------------------------------------------
# Storage
# -------------------------------------------------------------------------------------------------------------


def test_int4_packing_layout():
    # absmax 7 -> scale 1, so q = x: element 2k in the low nibble, 2k + 1 in the high one, two's complement.
    x = torch.tensor([1.0, -1.0, 7.0, -7.0, 0.0, 3.0, -2.0])
    q, scales = ops.quantize(x, bits=4, group_size=8)
    assert scales.tolist() == [1.0]
    assert q.tolist() == [0xF1, 0x97, 0x30, 0x0E]  # the odd element's byte has a zero high nibble
    assert ops.dequantize(q, scales, 7, 4, 8).tolist() == x.tolist()


@given(st.integers(1, 300), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_int4_round_trip_of_every_nibble(n, half_group, seed):
    # Values already on the grid (k * scale, |k| <= 7, one +-7 per group) come back exactly.
    group_size = 2 * half_group
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(-7, 8, (n,), generator=gen)
    k[::group_size] = 7
    x = k.float() * 0.25
    q, scales = ops.quantize(x, bits=4, group_size=group_size)
    assert torch.equal(unpack(q, n, 4), k.long())
    assert torch.equal(ops.dequantize(q, scales, n, 4, group_size), x)


# -------------------------------------------------------------------------------------------------------------
# SIMD paths
# -------------------------------------------------------------------------------------------------------------


def _run_path(path: str, x: torch.Tensor, bits: int, group_size: int) -> list[torch.Tensor]:
    with ops.force_simd_path(path):
        q, scales = ops.quantize(x, bits=bits, group_size=group_size)
        outs = [ops.dequantize(q, scales, x.numel(), bits, group_size, dtype=d) for d in DTYPES]
    return [q, scales, *outs]


@given(cases(max_n=300))
def test_simd_paths_write_identical_bytes(case):
    x, bits, group_size, _ = case
    results = {path: _run_path(path, x, bits, group_size) for path in PATHS}
    for path in PATHS[1:]:
        for name, a, b in zip(["q", "scales", "fp32", "bf16", "fp16"], results[path], results["scalar"]):
            assert_bitwise_equal(a, b, f"{path} vs scalar: {name}")


def test_simd_paths_identical_on_a_large_threaded_input():
    n = 300_001
    x = make_input("mixed", n, 1000, 8, torch.bfloat16, seed=11, zero_groups=True)
    x[12345] = 2.0**-130  # a tiny group among ordinary ones
    for bits in (8, 4):
        results = {path: _run_path(path, x, bits, 1000) for path in PATHS}
        for path in PATHS[1:]:
            for a, b in zip(results[path], results["scalar"]):
                assert_bitwise_equal(a, b, f"{path} vs scalar, bits={bits}")


@pytest.mark.parametrize("group_size", [64, 130, 2048])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_simd_paths_identical_on_groups_of_whole_vectors(group_size, dtype, bits):
    """Groups long enough for the SIMD paths' whole-vector loops (32-128 elements per iteration), starting at
    every alignment (the input a slice at an odd offset), with ties, tiny (lifted) scales, zeros and a partial
    last group: every path writes the scalar path's bytes."""
    for seed, kind in enumerate(["normal", "ties", "tiny", "mixed"]):
        for offset in (0, 1, 6):
            n = 3 * group_size + 37
            x = make_input(kind, n + offset, group_size, bits, dtype, seed=100 * seed + offset, zero_groups=True)[offset:]
            results = {path: _run_path(path, x, bits, group_size) for path in PATHS}
            for path in PATHS[1:]:
                for name, a, b in zip(["q", "scales", "fp32", "bf16", "fp16"], results[path], results["scalar"]):
                    assert_bitwise_equal(a, b, f"{path} vs scalar: {name}, {kind}, offset {offset}")


_SCALE_EDGES = [2.0**-149, 2.0**-126, 2.0**-98 * (1 - 2.0**-24), 2.0**-98, 2.0**-98 * (1 + 2.0**-23), 1.0,
                2.0**100 * (1 - 2.0**-24), 2.0**100, 2.0**100 * (1 + 2.0**-23), 2.0**120, 3.4028234663852886e38]


def _every_int8_value_at(scales: list[float], path: str) -> list[torch.Tensor]:
    """Dequantized outputs of every int8 byte (-128 included) at each scale, one group of 256 per scale: whole
    vectors of q, so the SIMD paths' vector loops take every group they can."""
    q = torch.arange(-128, 128, dtype=torch.int8).repeat(len(scales))
    scale = torch.tensor(scales, dtype=torch.float32)
    with ops.force_simd_path(path):
        return [ops.dequantize(q, scale, q.numel(), 8, 256, dtype=d) for d in DTYPES]


@given(st.lists(st.integers(1, 0x7F7FFFFF), min_size=1, max_size=40))
def test_dequantize_of_every_int8_value_at_any_scale_matches_the_scalar_path(words):
    """Arbitrary positive finite scales (raw fp32 bit patterns: subnormal to the largest) and the edges of the
    SIMD paths' own ranges (int8 to bf16 rounds in floating point only between 2^-98 and 2^100): every path
    writes the scalar path's bytes for every q."""
    scales = torch.tensor(words, dtype=torch.int32).view(torch.float32).tolist() + _SCALE_EDGES
    expected = _every_int8_value_at(scales, "scalar")
    for path in PATHS[1:]:
        for dtype, a, b in zip(DTYPES, _every_int8_value_at(scales, path), expected):
            assert_bitwise_equal(a, b, f"{path} vs scalar, int8 to {dtype}")


def test_dequantize_in_a_directed_rounding_mode_matches_the_scalar_path():
    """A caller that set a directed MXCSR rounding mode (fesetround, on this thread): int8 to bf16's vector
    loop, which rounds in floating point, stands aside, and every path still writes the scalar path's bytes
    (q * scale rounded in the caller's mode, then to bf16 to nearest even, as the scalar path does)."""
    ctypes = pytest.importorskip("ctypes")
    libc = ctypes.CDLL(None)
    scales = [0.0123, 1.0 / 3.0, 2.0**-97 * 1.75, 7.0e20]
    for mode in (0xC00, 0x400, 0x800):  # FE_TOWARDZERO, FE_DOWNWARD, FE_UPWARD on x86-64
        assert libc.fesetround(mode) == 0
        try:
            expected = _every_int8_value_at(scales, "scalar")
            results = {path: _every_int8_value_at(scales, path) for path in PATHS[1:]}
        finally:
            libc.fesetround(0)
        nearest = _every_int8_value_at(scales, "scalar")
        assert not torch.equal(expected[0], nearest[0])  # the mode reached the kernels
        for path, outs in results.items():
            for dtype, a, b in zip(DTYPES, outs, expected):
                assert_bitwise_equal(a, b, f"{path} vs scalar in rounding mode {mode:#x}, int8 to {dtype}")


# -------------------------------------------------------------------------------------------------------------
# Non-finite inputs
# -------------------------------------------------------------------------------------------------------------


@given(st.data())
def test_nonfinite_inputs_are_counted_and_never_quantized(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    bits = data.draw(st.sampled_from([8, 4]))
    group_size = data.draw(st.integers(1, 20).map(lambda g: g + g % 2 if bits == 4 else g))
    n = data.draw(st.integers(1, 200))
    positions = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6, unique=True))
    kinds = data.draw(st.lists(st.sampled_from([math.inf, -math.inf, math.nan]), min_size=len(positions),
                               max_size=len(positions)))
    x = make_input("normal", n, group_size, bits, dtype, seed=n, zero_groups=False)
    for i, v in zip(positions, kinds):
        x[i] = v
    q = torch.full((n if bits == 8 else (n + 1) // 2,), 5, dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.empty(_groups(n, group_size))
    count, first = _C.quantize(x, bits, group_size, q, scales)
    assert (count, first) == (len(positions), min(positions))
    bad_groups = sorted({i // group_size for i in positions})
    assert all(math.isnan(scales[g].item()) for g in bad_groups)
    values = unpack(q, n, bits)
    ref_q, ref_scales = ref_quantize(x, bits, group_size)
    for g in range(scales.numel()):
        lo, hi = g * group_size, min(n, (g + 1) * group_size)
        if g in bad_groups:
            assert (values[lo:hi] == 0).all()
        else:
            assert scales[g].item() == ref_scales[g].item() and torch.equal(values[lo:hi], ref_q[lo:hi])
    with pytest.raises(ValueError, match=rf"{len(positions)} non-finite value\(s\).*flat index {min(positions)}\b"):
        ops.quantize(x, bits=bits, group_size=group_size)
    # A flagged group dequantizes to NaN (the dtype's canonical quiet NaN), never to a plausible number.
    for out_dtype in DTYPES:
        out = ops.dequantize(q, scales, n, bits, group_size, dtype=out_dtype)
        for g in bad_groups:
            chunk = _bits(out[g * group_size : min(n, (g + 1) * group_size)])
            assert (chunk == CANONICAL_NAN_BITS[out_dtype]).all()


def test_fp16_overflow_in_the_input_is_flagged():
    x = torch.tensor([1.0, 70000.0, 2.0]).half()  # 70000 is inf in fp16
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\).*flat index 1\b"):
        ops.quantize(x)


# -------------------------------------------------------------------------------------------------------------
# Dequantizing into a caller's buffer
# -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_writes_only_its_slice(bits, dtype):
    n, group_size = 1001, 64
    x = make_input("normal", n, group_size, bits, dtype, seed=3, zero_groups=True)
    q, scales = ops.quantize(x, bits=bits, group_size=group_size)
    expected = ref_dequantize(unpack(q, n, bits), scales, group_size, dtype)
    for offset in (0, 1, 7, 64):
        unit = torch.full((offset + n + 33,), 123.0, dtype=dtype)  # e.g. a gathered unit; our rank's part
        before = _bits(unit.clone())
        result = ops.dequantize(q, scales, n, bits, group_size, out=unit[offset : offset + n])
        assert result.data_ptr() == unit[offset:].data_ptr()
        assert_bitwise_equal(unit[offset : offset + n], expected, f"offset {offset}")
        assert torch.equal(_bits(unit[:offset]), before[:offset])
        assert torch.equal(_bits(unit[offset + n :]), before[offset + n :])


def test_dequantize_into_a_shaped_out_and_dtype_rules():
    x = torch.randn(6, 5)
    q, scales = ops.quantize(x, bits=8, group_size=8)
    out = torch.empty(3, 10, dtype=torch.bfloat16)
    assert ops.dequantize(q, scales, 30, 8, 8, out=out) is out
    assert ops.dequantize(q, scales, 30, 8, 8, out=out, dtype=torch.bfloat16) is out
    with pytest.raises(ValueError, match="dtype is torch.float16 but out is torch.bfloat16"):
        ops.dequantize(q, scales, 30, 8, 8, out=out, dtype=torch.float16)
    assert ops.dequantize(q, scales, 30, 8, 8).dtype == torch.float32


def test_written_tensors_get_a_version_bump():
    x = torch.randn(10)
    q, scales = torch.empty(10, dtype=torch.int8), torch.empty(2)
    versions = (q._version, scales._version)
    _C.quantize(x, 8, 5, q, scales)
    assert (q._version, scales._version) == (versions[0] + 1, versions[1] + 1)
    out = torch.empty(10)
    _C.dequantize(q, scales, 10, 8, 5, out)
    assert out._version == 1


# -------------------------------------------------------------------------------------------------------------
# Bad arguments
# -------------------------------------------------------------------------------------------------------------


def _buffers(n=10, bits=8, group_size=4):
    return (torch.empty((n if bits == 8 else (n + 1) // 2,), dtype=torch.int8 if bits == 8 else torch.uint8),
            torch.empty(_groups(n, group_size)))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ops.quantize(torch.randn(10), bits=5), "bits must be 8 .int8. or 4 .int4., got 5"),
        (lambda: ops.quantize(torch.randn(10), group_size=0), "group_size must be > 0, got 0"),
        (lambda: ops.quantize(torch.randn(10), group_size=-2), "group_size must be > 0"),
        (lambda: ops.quantize(torch.randn(10), bits=4, group_size=3), "group_size must be even for bits = 4"),
        (lambda: ops.quantize(torch.arange(10)), "must be float32, bfloat16 or float16, got Long"),
        (lambda: ops.quantize(torch.randn(10).double()), "must be float32, bfloat16 or float16, got Double"),
        (lambda: _C.quantize(torch.randn(10), 8, 4, *_buffers(11)), "q_out must have 10 elements"),
        (lambda: _C.quantize(torch.randn(10), 8, 4, _buffers()[0], torch.empty(2)), "scales_out must have 3 elements"),
        (lambda: _C.quantize(torch.randn(10), 8, 4, _buffers()[0].view(torch.uint8), _buffers()[1]),
         "q_out must be Char, got Byte"),
        (lambda: _C.quantize(torch.randn(10), 4, 4, torch.empty(5, dtype=torch.int8), _buffers()[1]),
         "q_out must be Byte, got Char"),
        (lambda: _C.quantize(torch.randn(10), 8, 4, _buffers()[0], torch.empty(3).half()),
         "scales_out must be Float, got Half"),
        (lambda: _C.quantize(torch.randn(20)[::2], 8, 4, *_buffers()), "input must be contiguous"),
        (lambda: _C.quantize(torch.randn(10), 8, 4, torch.empty(20, dtype=torch.int8)[::2], _buffers()[1]),
         "q_out must be contiguous"),
        (lambda: _C.quantize(torch.randn(10), 8, 4, _buffers()[0], torch.empty(3, device="meta")),
         "scales_out must be on cpu, got meta"),
        (lambda: _C.quantize(torch.randn(10, device="meta"), 8, 4, *_buffers()), "input must be on the CPU"),
        (lambda: ops.dequantize(*_buffers(), 10, 8, 4, out=torch.empty(9)), "out must have 10 elements"),
        (lambda: ops.dequantize(*_buffers(), -1, 8, 4), "numel must be >= 0, got -1"),
        (lambda: _C.dequantize(*_buffers(), -1, 8, 4, torch.empty(0)), "n must be >= 0, got -1"),
        (lambda: ops.dequantize(*_buffers(), 10, 8, 4, out=torch.empty(10, dtype=torch.int32)),
         "must be float32, bfloat16 or float16, got Int"),
        (lambda: ops.dequantize(*_buffers(), 10, 8, 4, out=torch.empty(20)[::2]), "out must be contiguous"),
        (lambda: ops.dequantize(*_buffers(), 12, 8, 4), "q must have 12 elements"),
        (lambda: ops.dequantize(*_buffers(), 2**62, 8, 4), "q must have 4611686018427387904 elements"),
        (lambda: ops.dequantize(*_buffers(10, 4, 4), 2**40, 4, 4), "q must have 549755813888 elements"),
        (lambda: ops.dequantize(*_buffers(10, 4, 4), 10, 4, 5), "group_size must be even for bits = 4"),
        (lambda: ops.dequantize(*_buffers(), 10, 8, 2), "scales must have 5 elements"),
        (lambda: ops.dequantize(*_buffers(), 10, 6, 4), "bits must be 8 .int8. or 4 .int4., got 6"),
    ],
)
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_overlapping_buffers_raise_value_error():
    storage = torch.empty(64)
    x = storage[:10]
    scales = storage[8:11]
    with pytest.raises(ValueError, match="overlap"):
        _C.quantize(x, 8, 4, torch.empty(10, dtype=torch.int8), scales)
    q, s = ops.quantize(torch.randn(10), group_size=4)
    with pytest.raises(ValueError, match="overlap"):
        _C.dequantize(q[:1], s[:1], 1, 8, 16, s[:1])


def test_writing_a_tensor_that_requires_grad_raises():
    x = torch.randn(10)
    out = torch.empty(10, requires_grad=True)
    q, s = ops.quantize(x, group_size=4)
    with pytest.raises(ValueError, match="requires grad"):
        _C.dequantize(q, s, 10, 8, 4, out)
    with torch.no_grad():
        _C.dequantize(q, s, 10, 8, 4, out)


def test_empty_input():
    for bits in (8, 4):
        q, scales = ops.quantize(torch.empty(0), bits=bits, group_size=4)
        assert q.numel() == 0 and scales.numel() == 0
        assert ops.dequantize(q, scales, 0, bits, 4).numel() == 0


def test_size_helpers():
    assert [_C.quantized_bytes(n, 4) for n in (0, 1, 2, 3)] == [0, 1, 1, 2]
    assert [_C.quantized_bytes(n, 8) for n in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert [_C.quantize_num_groups(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    with pytest.raises(ValueError, match="bits must be"):
        _C.quantized_bytes(4, 2)
    with pytest.raises(ValueError, match="n must be >= 0"):
        _C.quantize_num_groups(-1, 4)
