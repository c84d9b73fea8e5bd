"""exp and log that LLVM can vectorise.

numba has no SVML on most installs, so `math.exp` inside a jitted loop is a scalar libm call (~4 ns) and the
whole loop stays scalar. These versions use only arithmetic, `floor`, int/float conversion and bit casts, which
LLVM turns into SIMD instructions; accuracy is ~1e-7 relative, the float32 rounding level.
"""
import math
from functools import partial

import numpy as np
from llvmlite import ir

from fsd_local.kernels import jit_cache  # noqa: F401  (sets numba's cache directory before any kernel is defined)
from numba import njit, types
from numba.extending import intrinsic

LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634
# ln 2 split so that n * LN2_HI is exact in float32 (Cody-Waite range reduction)
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)
EXP_MIN = np.float32(-87.33)  # below this float32 exp underflows; we return exactly 0
EXP_MAX = np.float32(88.7)

# reassoc lets LLVM keep SIMD partial sums; we do NOT allow nnan/ninf: -inf logits are real input.
# error_model="numpy": no ZeroDivisionError branch in divisions, which would stop vectorisation.
FLAGS = {"reassoc", "contract", "nsz", "arcp"}
kernel = partial(njit, fastmath=FLAGS, error_model="numpy", cache=True)


@intrinsic
def _f32_from_bits(typingctx, bits):
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _bits_from_f32(typingctx, x):
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(inline="always", fastmath=FLAGS, error_model="numpy")
def vexp(x):
    """exp of a float32; exactly 0 for x below the float32 range (-inf included), NaN stays NaN."""
    xc = min(max(x, EXP_MIN), EXP_MAX)
    n = math.floor(xc * np.float32(LOG2E) + np.float32(0.5))
    f = xc - n * LN2_HI - n * LN2_LO  # |f| <= ln2/2
    p = np.float32(1.0 / 720.0)
    p = p * f + np.float32(1.0 / 120.0)
    p = p * f + np.float32(1.0 / 24.0)
    p = p * f + np.float32(1.0 / 6.0)
    p = p * f + np.float32(0.5)
    p = p * f + np.float32(1.0)
    p = p * f + np.float32(1.0)
    scale = _f32_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))
    r = p * scale
    return np.float32(0.0) if x < EXP_MIN else r


@njit(inline="always", fastmath=FLAGS, error_model="numpy")
def vlog(x):
    """natural log of a positive normal float32; -inf for 0 (the callers only pass x >= 0)."""
    bits = _bits_from_f32(np.float32(x))
    e = ((bits >> np.int32(23)) & np.int32(0xFF)) - np.int32(127)
    m = _f32_from_bits((bits & np.int32(0x7FFFFF)) | np.int32(0x3F800000))  # mantissa in [1, 2)
    big = m > np.float32(1.41421356)
    m = m * np.float32(0.5) if big else m
    e = e + np.int32(1) if big else e
    s = (m - np.float32(1.0)) / (m + np.float32(1.0))  # |s| <= 0.172
    s2 = s * s
    poly = np.float32(1.0 / 9.0)
    poly = poly * s2 + np.float32(1.0 / 7.0)
    poly = poly * s2 + np.float32(1.0 / 5.0)
    poly = poly * s2 + np.float32(1.0 / 3.0)
    poly = poly * s2 + np.float32(1.0)
    r = np.float32(e) * np.float32(LN2) + np.float32(2.0) * s * poly
    return np.float32(-np.inf) if x <= np.float32(0.0) else r


@njit(inline="always")
def order_key(x):
    """An int32 that orders like the float32 x (NaN above +inf): integer max reductions vectorise,
    float ones do not without nnan."""
    b = _bits_from_f32(x)
    return b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF))


@njit(inline="always")
def from_order_key(k):
    return _f32_from_bits(k ^ ((k >> np.int32(31)) & np.int32(0x7FFFFFFF)))
