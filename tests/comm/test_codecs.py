"""Wire codecs: exact byte counts, hand-derived encodings, unbiasedness, error feedback, keyed draws, NaN."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpifl.comm.codecs import (
    Codec,
    Qsgd,
    build_codec,
    codec_rng,
    encode_with_feedback,
    index_width,
    sparse_k,
)
from mpifl.comm.config import CodecConfig

SIZES = (1, 7, 255, 256, 257, 65537)
DTYPES = (np.float32, np.float64)
# fraction 0.1 of each size, rounded up (0.1·7 = 0.7 → 1, 0.1·255 = 25.5 → 26, 0.1·65537 = 6553.7 → 6554)
K_TENTH = {1: 1, 7: 1, 255: 26, 256: 26, 257: 26, 65537: 6554}
# the smallest of 1, 2, 4 bytes that holds numel - 1
WIDTH = {1: 1, 7: 1, 255: 1, 256: 1, 257: 2, 65537: 4}


def expected_nbytes(cfg: CodecConfig, n: int) -> int:
    """Each codec's byte formula written out independently of the module."""
    if cfg.codec in ("fp16", "bf16"):
        return 2 * n
    if cfg.codec == "qsgd":
        return 4 + (n * cfg.bits + 7) // 8
    if cfg.codec in ("topk", "randk"):
        assert cfg.fraction == 0.1
        return K_TENTH[n] * (WIDTH[n] + 4)
    assert cfg.codec == "sign"
    return 4 + (n + 7) // 8


ALL = [CodecConfig(codec="fp16"), CodecConfig(codec="bf16"), CodecConfig(codec="sign"),
       *(CodecConfig(codec="qsgd", bits=b) for b in (2, 3, 5, 8, 13, 16)),
       CodecConfig(codec="topk", fraction=0.1), CodecConfig(codec="randk", fraction=0.1)]


def codec(cfg: CodecConfig) -> Codec:
    built = build_codec(cfg)
    assert built is not None and built.name == cfg.codec
    return built


def roundtrip(c: Codec, row: np.ndarray, client: int = 0) -> np.ndarray:
    blob = c.encode(row, codec_rng(1, 2, client, "delta"))
    return c.decode(blob, row.size, row.dtype)


def test_none_builds_no_codec():
    assert build_codec(CodecConfig()) is None


@pytest.mark.parametrize("cfg", ALL, ids=lambda c: f"{c.codec}{c.bits if c.codec == 'qsgd' else ''}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_encoded_length_is_the_formula(cfg: CodecConfig, dtype: type):
    c = codec(cfg)
    rng = np.random.default_rng(0)
    for n in SIZES:
        row = rng.standard_normal(n).astype(dtype)
        blob = c.encode(row, codec_rng(0, 0, 0, "m"))
        assert blob.dtype == np.uint8 and blob.ndim == 1 and blob.flags.c_contiguous
        assert len(blob) == c.encoded_nbytes(n) == expected_nbytes(cfg, n)
        out = c.decode(blob, n, dtype)
        assert out.dtype == dtype and out.shape == (n,)
    with pytest.raises(ValueError, match="expected"):
        c.decode(np.zeros(c.encoded_nbytes(7) + 1, dtype=np.uint8), 7, dtype)


def test_sparse_k_and_index_width():
    assert sparse_k(0.07, 100) == 7  # the float product 0.07·100 is 7.000000000000001
    assert sparse_k(0.01, 700) == 7
    assert sparse_k(1e-9, 10) == 1 and sparse_k(1.0, 10) == 10 and sparse_k(0.5, 0) == 0
    assert [index_width(n) for n in (1, 256, 257, 65536, 65537, 2**32)] == [1, 1, 2, 2, 4, 4]


def test_fp16_rounds_to_nearest_even():
    row = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65504, 65520, -2.5, 1e-8, np.nan, np.inf, -np.inf])
    out = roundtrip(codec(CodecConfig(codec="fp16")), row)
    # ties go to the even mantissa; 65520 is halfway from fp16's largest (65504) to 2^16, so Inf
    np.testing.assert_array_equal(out, [1.0, 1 + 2**-9, 65504, np.inf, -2.5, 0.0, np.nan, np.inf, -np.inf])


def test_bf16_rounds_to_nearest_even():
    f32max = float(np.finfo(np.float32).max)
    row = np.array([1.00390625, 1.01171875, 1 + 2**-8 + 2**-20, -2.0, f32max, 3.3895313892515355e38,
                    np.nan, np.inf, -np.inf], dtype=np.float32)
    c = codec(CodecConfig(codec="bf16"))
    out = roundtrip(c, row)
    # 1 + 2^-8 is a tie onto an even mantissa (stays 1); 1 + 3·2^-8 a tie onto an odd one (goes up to 1 + 2^-6);
    # just above a tie rounds up; float32's largest rounds past bfloat16's largest (0x7F7F) to Inf
    np.testing.assert_array_equal(out, [1.0, 1.015625, 1.0078125, -2.0, np.inf, 3.3895313892515355e38,
                                        np.nan, np.inf, -np.inf])
    assert c.encode(row, codec_rng(0, 0, 0, "m"))[:2].tolist() == [0x80, 0x3F]  # 1.0 = 0x3F80, little-endian
    # a NaN whose payload sits only in the dropped 16 bits must stay NaN, not become Inf
    payload_nan = np.array([0x7F800001, 0xFF800100], dtype=np.uint32).view(np.float32)
    assert np.isnan(roundtrip(c, payload_nan)).all()


def test_qsgd_hand_example():
    c = Qsgd(bits=3)  # s = 3 levels; |x|/‖x‖ = 1/3, 2/3, 2/3 are on the grid, so no draw can move them
    blob = c.encode(np.array([-1.0, 2.0, 2.0]), codec_rng(0, 0, 0, "m"))
    # codes (sign on top): 0b101, 0b010, 0b010 → bit stream 101 010 010 (LSB first) → bytes 0b10010101, 0
    assert blob.tolist() == [*np.array([3.0], "<f4").view(np.uint8).tolist(), 0b10010101, 0]
    np.testing.assert_array_equal(c.decode(blob, 3, "float64"), [-1.0, 2.0, 2.0])


@pytest.mark.parametrize("bits", range(2, 17))
def test_qsgd_values_on_the_level_grid(bits: int):
    c = Qsgd(bits=bits)
    row = np.random.default_rng(bits).standard_normal(300)
    blob = c.encode(row, codec_rng(0, 0, 0, "m"))
    norm = float(blob[:4].view("<f4")[0])
    exact = float(np.linalg.norm(row))
    assert exact <= norm < exact + float(np.spacing(np.float32(exact)))  # rounded up to float32
    levels = c.decode(blob, row.size, "float64") * c.levels / norm
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-9)
    scaled = np.abs(row) * c.levels / norm  # each level is this rounded down or up
    assert np.all((np.abs(levels) >= np.floor(scaled) - 1e-9) & (np.abs(levels) <= np.ceil(scaled) + 1e-9))
    assert np.all(np.sign(levels[levels != 0]) == np.sign(row[levels != 0]))


def test_qsgd_is_unbiased():
    c, n, draws = Qsgd(bits=3), 20, 4000
    row = np.random.default_rng(5).standard_normal(n)
    decoded = np.array([roundtrip(c, row, client=t) for t in range(draws)])
    norm = float(np.float32(np.linalg.norm(row)))  # within one float32 ulp of the header
    step = norm / c.levels  # each entry's decodes take two values one level (norm/s) apart
    # Hoeffding on a mean of `draws` variables of range `step`, union over n entries, failure odds 1e-9
    bound = step * math.sqrt(math.log(2 * n / 1e-9) / (2 * draws))
    assert np.abs(decoded.mean(axis=0) - row).max() <= bound
    assert decoded.std(axis=0).max() > 0.1 * step  # the draws do move the levels


@pytest.mark.parametrize("dtype", DTYPES)
def test_qsgd_zero_row(dtype: type):
    c = Qsgd(bits=8)
    blob = c.encode(np.zeros(10, dtype=dtype), codec_rng(0, 0, 0, "m"))
    assert blob.tolist() == [0] * 14  # norm 0.0, every level 0 with sign bit 0
    out = c.decode(blob, 10, dtype)
    assert out.dtype == dtype and not out.any()


def test_topk_hand_example():
    c = codec(CodecConfig(codec="topk", fraction=0.375))  # k = 3 of 8
    row = np.array([0.5, -3, 2, 3, -0.1, 2, 0, 1], dtype=np.float32)
    blob = c.encode(row, codec_rng(0, 0, 0, "m"))
    # |-3| and |3| first, then the tie between the 2s at indices 2 and 5 goes to the lower index
    assert blob.tolist() == [1, 2, 3, *np.array([-3, 2, 3], "<f4").view(np.uint8).tolist()]
    np.testing.assert_array_equal(c.decode(blob, 8, "float32"), [0, -3, 2, 3, 0, 0, 0, 0])


def test_topk_matches_a_stable_sort_with_many_ties():
    n, cfg = 65537, CodecConfig(codec="topk", fraction=0.1)
    row = np.round(np.random.default_rng(1).standard_normal(n) * 3)  # few distinct magnitudes: many ties
    blob = codec(cfg).encode(row, codec_rng(0, 0, 0, "m"))
    k = K_TENTH[n]
    expected = np.sort(np.argsort(-np.abs(row), kind="stable")[:k])
    np.testing.assert_array_equal(blob[:4 * k].view("<u4"), expected)
    np.testing.assert_array_equal(blob[4 * k:].view("<f4"), row[expected])


def test_randk_draws_are_keyed():
    c = codec(CodecConfig(codec="randk", fraction=0.05))
    row = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    blob = c.encode(row, codec_rng(3, 4, 5, "delta"))
    assert np.array_equal(blob, c.encode(row, codec_rng(3, 4, 5, "delta")))
    index = blob[:100].view("<u2").astype(np.int64)  # k = 50 of 1000, two-byte indices
    other = c.encode(row, codec_rng(3, 4, 6, "delta"))[:100].view("<u2")
    assert np.all(np.diff(index) > 0) and not np.array_equal(index, other)
    np.testing.assert_array_equal(blob[100:].view("<f4"), row[index])  # unscaled values


def test_sign_hand_example():
    c = codec(CodecConfig(codec="sign"))
    blob = c.encode(np.array([1, -2, 3, -4, 0], dtype=np.float32), codec_rng(0, 0, 0, "m"))
    # scale = (1+2+3+4+0)/5 = 2.0 = 0x40000000; bits 1,0,1,0,1 (0 counts as non-negative) → 0b10101
    assert blob.tolist() == [0, 0, 0, 0x40, 0b10101]
    np.testing.assert_array_equal(c.decode(blob, 5, "float64"), [2, -2, 2, -2, 2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_error_feedback_tracks_the_sum_of_rows(dtype: type):
    c, steps = codec(CodecConfig(codec="topk", fraction=0.05)), 1000  # k = 5 of 100: δ = k/n = 0.05
    row = np.random.default_rng(3).standard_normal(100).astype(dtype)
    residual, sent, largest = None, np.zeros(100), 0.0
    for t in range(steps):
        blob, new = encode_with_feedback(c, row, residual, codec_rng(0, t, 0, "delta"))
        corrected = row if residual is None else row + residual
        decoded = c.decode(blob, 100, dtype)
        assert new.dtype == dtype and np.array_equal(new, corrected - decoded)
        residual, sent = new, sent + decoded
        largest = max(largest, float(np.linalg.norm(residual)))
    # top-k keeps ‖x - C(x)‖ ≤ √(1-δ)‖x‖, so e ← (g + e) - C(g + e) stays below √(1-δ)/(1 - √(1-δ))·‖g‖
    shrink = math.sqrt(1 - 0.05)
    bound = shrink / (1 - shrink) * float(np.linalg.norm(row)) * (1 + 1e-5)
    assert largest <= bound
    np.testing.assert_allclose(sent + residual, steps * row.astype(np.float64), rtol=1e-4)
    # so every entry whose total outgrew the bound got through, far more than the 5 largest
    due = np.abs(row) * steps > bound
    assert due.sum() > 50 and np.all(sent[due] != 0)


def test_codec_rng_keys():
    def draws(seed: int, round_: int, client: int, message: str) -> np.ndarray:
        return codec_rng(seed, round_, client, message).random(4)

    base = (7, 3, 11, "delta")
    assert np.array_equal(draws(*base), draws(*base))
    for changed in [(8, 3, 11, "delta"), (7, 4, 11, "delta"), (7, 3, 12, "delta"), (7, 3, 11, "deltb"),
                    (7, 3, -1, "delta")]:
        assert not np.array_equal(draws(*base), draws(*changed)), changed
    for client in (0, 1):  # a broadcast's key (-1) is no client's
        assert not np.array_equal(draws(7, 3, -1, "delta"), draws(7, 3, client, "delta"))


@pytest.mark.parametrize("cfg", [*ALL, CodecConfig(codec="randk", fraction=0.001)],
                         ids=lambda c: f"{c.codec}{c.bits if c.codec == 'qsgd' else c.fraction}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_decode_non_finite(cfg: CodecConfig, dtype: type, bad: float):
    c = codec(cfg)
    for where in (0, 517, 999):  # randk at 0.001 sends one entry: it almost always misses the bad one
        row = np.random.default_rng(where).standard_normal(1000).astype(dtype)
        row[where] = bad
        assert not np.isfinite(roundtrip(c, row)).all()
