"""exp and log that LLVM can vectorise (float32 arithmetic, `np.floor` and bit casts; ~2e-7 relative), the compiler
hints `wide()` (full-width vectors on AVX-512) and `radd` (reassociation on a reduction's one addition), and
`kernel`, njit with the project's fastmath flags (docs/design.md, "Where the time goes")."""

from functools import partial

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from fsd_local.kernels.jit_cache import jit

LN2 = 0.6931471805599453
LOG2E = np.float32(1.4426950408889634)
# ln 2 split so that n * LN2_HI is exact in float32 (Cody-Waite range reduction)
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)
EXP_MIN = np.float32(-87.33)  # below this float32 exp underflows; we return exactly 0
EXP_MAX = np.float32(88.7)
# exp(f) ~ 1 + f*(E1 + f*(E2 + ...)) on |f| <= ln2/2: minimax for relative error, 1.7e-7 evaluated in float32
E1, E2, E3, E4, E5 = (
    np.float32(c)
    for c in (0.9999997019767761, 0.4999915063381195, 0.1666763573884964, 0.04189793020486832, 0.008290315046906471)
)

# No reassoc (docs/design.md, "Where the time goes") and no nnan/ninf: -inf logits are real input. contract: FMAs.
# error_model="numpy": no ZeroDivisionError branch in divisions, which would stop vectorisation.
FLAGS = {"contract", "nsz", "arcp"}
kernel = partial(jit, fastmath=FLAGS, error_model="numpy")
REDUCE_FLAGS = ("reassoc", "nsz", "contract")


@intrinsic
def wide(typingctx):
    """Let LLVM vectorise the calling function at the CPU's full width (512-bit with AVX-512). Call it first
    thing in a kernel; it emits no code."""

    def codegen(context, builder, signature, args):
        # llvmlite knows only keyword attributes; a string attribute goes in verbatim
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def radd(typingctx, acc, v):
    """acc + v with reassociation allowed on this one addition: a reduction LLVM may split into SIMD partial
    sums. Both float32."""
    if acc != types.float32 or v != types.float32:
        return None

    def codegen(context, builder, signature, args):
        # IRBuilder.fadd takes no fast-math flags; the generic instruction does
        instr = ir.instructions.Instruction(builder.block, args[0].type, "fadd", (args[0], args[1]), "", REDUCE_FLAGS)
        builder._insert(instr)
        return instr

    return types.float32(types.float32, types.float32), codegen


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
def vexp_finite(x):
    """exp of a float32 x in [EXP_MIN, EXP_MAX], nothing else checked (the fastest form)."""
    n = np.floor(x * LOG2E + np.float32(0.5))  # float32: math.floor would give an int64, and double math
    f = (x - n * LN2_HI) - n * LN2_LO  # |f| <= ln2/2
    p = E5
    p = p * f + E4
    p = p * f + E3
    p = p * f + E2
    p = p * f + E1
    p = p * f + np.float32(1.0)
    # numba types int32 + int32 as int64: np.int32(...) around each step keeps the lanes 32-bit
    return p * _f32_from_bits(np.int32(np.int32(np.int32(n) + np.int32(127)) << np.int32(23)))


@njit(inline="always", fastmath=FLAGS, error_model="numpy")
def vexp(x):
    """exp of a float32; exactly 0 for x below the float32 range (-inf included), NaN stays NaN."""
    r = vexp_finite(min(max(x, EXP_MIN), EXP_MAX))
    return np.float32(0.0) if x < EXP_MIN else r


# log((1 + e) / 2) = (e - 1) * R(e) on e in [0, 1]: minimax for R, 1.9e-7 relative evaluated in float32
_R = tuple(
    np.float32(c)
    for c in (
        0.6931471824645996,
        -0.3068501651287079,
        0.1930721551179886,
        -0.13935674726963043,
        0.10508429259061813,
        -0.0742846205830574,
        0.042266324162483215,
        -0.015893075615167618,
        0.002814671490341425,
    )
)
R0, R1, R2, R3, R4, R5, R6, R7, R8 = _R


@njit(inline="always", fastmath=FLAGS, error_model="numpy")
def log_mid(e):
    """log((1 + e) / 2) for a float32 e in [0, 1] (the JS forms' log m - log max(p, q), e = min/max):
    one polynomial, no division, no exponent handling, exactly 0 at e == 1 and accurate relative to its
    value near there (no cancellation)."""
    r = R8
    r = r * e + R7
    r = r * e + R6
    r = r * e + R5
    r = r * e + R4
    r = r * e + R3
    r = r * e + R2
    r = r * e + R1
    r = r * e + R0
    return (e - np.float32(1.0)) * r


INT32_MIN = np.int32(-2147483647 - 1)  # below every order key


@njit(inline="always")
def order_key(x):
    """An int32 that orders like the float32 x: +0 and -0 share key 0, a positive NaN sorts above +inf and a
    negative one below -inf. Integer max reductions and compares vectorise; float max does not without nnan."""
    b = _bits_from_f32(x)
    s = b >> np.int32(31)  # 0 or -1
    return np.int32(np.int32(b ^ (s & np.int32(0x7FFFFFFF))) - s)  # negative x: minus its magnitude bits


@njit(inline="always")
def from_order_key(k):
    """The float32 of an order key (key 0 gives +0)."""
    return _f32_from_bits(np.int32(-k) | INT32_MIN if k < np.int32(0) else k)
