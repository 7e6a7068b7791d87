# Row encoders/decoders shared by every CPU kernel (implemented in _quant.pyx).
#
# A row is D float32 values, contiguous. `codes` points at the row's codes of the
# format's code dtype (D of them, or D/2 bytes of two 4-bit codes for q4_0/q4_1) and
# `scales` at S scales (formats.py): nothing for f32/f16/bf16, one float32 for int8/fp8,
# D/32 float16 bit patterns for q8_0 and q4_0, D/32 (d, m) pairs for q4_1. Callers
# guarantee finite input and D % 32 == 0 for q8_0/q4_0/q4_1. Format ids are those of
# kvcore/formats.py; q4_1ch's id is q4_1's rule on a row that its caller made of one
# channel of a group (quant.py: the 32 positions of a channel, one block).
from libc.stdint cimport int8_t, uint8_t, uint16_t, uint32_t

cdef enum:
    # format ids (kvcore/formats.py)
    F32 = 0
    F16 = 1
    BF16 = 2
    INT8 = 3
    FP8_E4M3 = 4
    FP8_E5M2 = 5
    Q8_0 = 6                # from here on the block formats
    Q4_0 = 7
    Q4_1 = 8
    Q4_1CH = 9              # q4_1's rule over a channel of a group: the caller hands its
                            # channels in as rows (quant.py), so rows of it are q4_1 rows

cdef void encode_row(int fmt, const float* x, Py_ssize_t d, void* codes, void* scales) noexcept nogil
# The smallest |x| (float32 bits) a format refuses: past it the value, or q8_0's float16
# block scale, would round to infinity (f16 65520, bf16 0x1.ffp127, q8_0 Q8_0_LIMIT,
# q4_0 524160; q4_1 65520, a bound under which its float16 min and scale are finite), or
# an int8 row would decode to infinity (127 * (x / 127) overflows from FLT_MAX on); inf
# for fp8 and f32. NaN and inf are refused by every format.
cdef uint32_t input_limit_bits(int fmt) noexcept nogil
cdef void decode_row(int fmt, const void* codes, const void* scales, Py_ssize_t d, float* out) noexcept nogil

# Scalar conversions: round to nearest even; FP8 saturates to the largest finite value.
cdef uint16_t f32_to_f16(float x) noexcept nogil
cdef uint16_t f32_to_bf16(float x) noexcept nogil
cdef float f16_to_f32(uint16_t h) noexcept nogil
cdef float bf16_to_f32(uint16_t h) noexcept nogil
cdef uint8_t f32_to_e4m3(float x) noexcept nogil
cdef uint8_t f32_to_e5m2(float x) noexcept nogil
cdef float e4m3_to_f32(uint8_t c) noexcept nogil
cdef float e5m2_to_f32(uint8_t c) noexcept nogil
