// sluice's weight-only kernels for GGUF block quantizations (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K):
// y = x w^T + b with w kept in the file's own blocks and dequantized in registers, 32 values at
// a time, never written out. Aimed at decoding (few rows of x), where a linear layer is bound by
// the bytes of weight it reads: 4.5-6.6 bits a weight instead of 16 or 32.
//
// Layout: w is a uint8 tensor [N, K / block_values * block_bytes], output row n's blocks in
// order, each block exactly as GGUF stores it (ggml's block_q8_0 / _q4_0 / _q4_1 / _q4_K / _q6_K):
//   Q8_0: fp16 d, int8 q[32]                    value j = d * q[j]
//   Q4_0: fp16 d, uint8 qs[16]                  value j = d * (nibble_j - 8)
//   Q4_1: fp16 d, fp16 m, uint8 qs[16]          value j = d * nibble_j + m
// where nibble_j is the low half of qs[j] for j < 16 and the high half of qs[j - 16] after.
// The K-quants hold 256 values a block, in 8 groups of 32 (g = j / 32, l = j % 32):
//   Q4_K (144 bytes): fp16 d, fp16 dmin, uint8 scales[12], uint8 qs[128]
//        value j = d * sc[g] * nibble - dmin * mn[g], the nibble the low half of qs[g/2*32 + l]
//        for even g and the high half for odd g; sc, mn six bits each: for g < 4 the low six
//        bits of scales[g] and scales[g + 4]; for g >= 4 the low (sc) and high (mn) halves of
//        scales[g + 4], with the top two bits of scales[g - 4] (sc) and scales[g] (mn) above them.
//   Q6_K (210 bytes): uint8 ql[128], uint8 qh[64], int8 scales[16], fp16 d
//        value j = d * scales[j / 16] * (q - 32), q six bits: with h = g / 4, r = g % 4, the
//        low four bits are ql[h*64 + (r%2)*32 + l] >> 4*(r/2), the high two qh[h*32 + l] >> 2*r.
// One output row is one sequential stream of bytes; rows are independent, so whole rows may be
// permuted (the loader reorders the q/k rows of llama.cpp's rotary layout) and concatenated
// (fused q/k/v and gate/up projections).
//
// Arithmetic is float32: x (float32 or bfloat16) is converted to float32 once per call, each
// block is dequantized to two 16-lane float vectors and multiplied into up to ROWS rows of x at
// once (the block read once for all of them), the output rounded to x's dtype. Vectors are GCC
// vector extensions of 16 floats: one AVX-512 register, or two AVX2 ones where the CPU has no
// AVX-512 (the build is -march=native, keyed by the CPU's flags, so the instruction set is the
// running CPU's). Work is split over output rows by sluice::parallel_for (parallel.h).
//
// bfloat16 x may instead take the integer path (`int8_activations`, below; the K-quants on
// AVX-512 VNNI builds only, elsewhere they take the float path): x rounded to int8 per 32 values, integer dot products (AVX-512 VNNI, AVX-VNNI, AVX2 maddubs or scalar),
// 1.6-1.8x the float path's speed on Q4_1 at one row (1.1-1.3x on Q8_0; one thread of the Xeon
// model 207, weights streamed), within sum_k |w_k| dx_b(k) / 2 of its result.
// float32 x always takes the float path, so float32 results stay exact up to float rounding.
//
// On AVX-512 VNNI builds the integer path of Q4_0, Q4_1 and Q8_0 has a second layout, made at
// load (`interleave`, QuantLinear.interleave) in place of GGUF's, the same bytes in number: 16
// output rows woven together per block, so that one dpbusd on 4 bytes of x makes 4 products for
// each of the 16 rows and one vcvtph2ps converts their 16 scales (see "The row-interleaved
// layout" below; `gguf_blocks` puts it back). Its kernel takes the same exact integer sums as the
// per-row one, the float terms summed in another order. Zen 4, one thread, weights streamed
// (`benchmarks/quant_kernels.py`): Q4_1 at one row 17-23 GB/s against 11.6-15.6 (memory gives
// ~24), at four rows 13-18 against 6.5-7.7; Q8_0 at one row 20-25 against 14-17. Past four rows
// both are bound by dpbusd, which Zen 4 runs at about one 512-bit op per 0.7 ns: 64 a record of
// 16 rows x 32 values at eight rows of x. A type id with INTERLEAVED set names the layout; every
// other path (float x, dequantize, repack) reads such a weight through a GGUF copy.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: half the build time, for nothing used here
#include <ATen/Parallel.h>

#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "little-endian CPUs only");

namespace {

constexpr int64_t QK = 32;   // values a group: a whole block, or one eighth of a K-quant's
constexpr int ROWS = 8;      // rows of x computed together (one pass over the weight)
// How far ahead of its reads a weight row is prefetched, into L1 and (further) into L2: the
// hardware's prefetchers alone left one core at about half its streaming speed here (Xeon model
// 207; 2048-4096 measured alike for L1, 6144 and 12288 for L2).
constexpr int64_t PREFETCH_L1_BYTES = 2048, PREFETCH_L2_BYTES = 6144;

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int8_t v16s8 __attribute__((vector_size(16)));
typedef uint32_t v4u32 __attribute__((vector_size(16)));

enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };  // ggml's type ids

constexpr bool is_k_quant(int64_t type) { return type == Q4_K || type == Q6_K; }
constexpr int64_t block_values(int64_t type) { return is_k_quant(type) ? 256 : QK; }
constexpr int64_t block_bytes(int64_t type) {
  return type == Q8_0 ? 34 : type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q4_K ? 144 : 210;
}
// Row-interleaved weights (`interleave`) go by an internal type id: ggml's | INTERLEAVED.
constexpr int64_t INTERLEAVED = 0x100, ILV_ROWS = 16;  // ILV_ROWS: output rows a tile
constexpr bool is_interleaved(int64_t type) { return (type & INTERLEAVED) != 0; }
constexpr int64_t base_type(int64_t type) { return type & ~INTERLEAVED; }

inline float fp16_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf, NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: value man * 2^-24
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// 16 bytes widened to 16 floats. GCC 12 turns __builtin_convertvector of byte vectors into
// scalar code (4x slower kernels here), so the widening is written with intrinsics.
#if defined(__AVX512F__)
inline v16f to_v16f(v16u8 q) { return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)q)); }
inline v16f to_v16f(v16s8 q) { return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)q)); }
#elif defined(__AVX2__)
inline v16f join(__m256 lo, __m256 hi) {
  v16f v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
}
inline v16f to_v16f(v16u8 q) {
  const __m128i b = (__m128i)q;
  return join(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
}
inline v16f to_v16f(v16s8 q) {
  const __m128i b = (__m128i)q;
  return join(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
}
#else
template <typename V>
inline v16f to_v16f(V q) {
  v16f v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(q[i]);
  return v;
}
#endif

// One block as values 0..15 (lo) and 16..31 (hi).
template <int64_t T>
inline void dequant_block(const uint8_t* b, v16f& lo, v16f& hi) {
  const float d = fp16_to_float(b);
  if constexpr (T == Q8_0) {
    v16s8 q0, q1;
    std::memcpy(&q0, b + 2, 16);
    std::memcpy(&q1, b + 18, 16);
    lo = to_v16f(q0) * d;
    hi = to_v16f(q1) * d;
  } else if constexpr (T == Q4_0) {
    v16u8 q;
    std::memcpy(&q, b + 2, 16);
    lo = (to_v16f(q & 0xf) - 8.f) * d;
    hi = (to_v16f(q >> 4) - 8.f) * d;
  } else {
    const float m = fp16_to_float(b + 2);
    v16u8 q;
    std::memcpy(&q, b + 4, 16);
    lo = to_v16f(q & 0xf) * d + m;
    hi = to_v16f(q >> 4) * d + m;
  }
}

// What the 32-value groups of one block share, decoded once a block: nothing for the 32-value
// types (a block is one group with its own header), each group's scale (and minimum) for the
// K-quants, as the float products gguf computes (exact: d * sc fits float32's 24 bits).
template <int64_t T>
struct Scales {
  void load(const uint8_t*) {}
};

template <>
struct Scales<Q4_K> {
  alignas(64) float d[16];  // d * sc[g] for g = 0..7, then dmin * mn[g] at d[8 + g]
  void load(const uint8_t* b) {
    // the 12 scale bytes as words a (sc[0..3]), m (mn[0..3]), c (their low halves for g >= 4),
    // and 4 bytes of qs after them; all four built in one vector register
    v4u32 s;
    std::memcpy(&s, b + 4, 16);
    const v4u32 acmc = __builtin_shufflevector(s, s, 0, 2, 1, 2), aamm = __builtin_shufflevector(s, s, 0, 0, 1, 1);
    const v4u32 shift = {0, 0, 0, 4}, keep = {0x3f3f3f3fu, 0x0f0f0f0fu, 0x3f3f3f3fu, 0x0f0f0f0fu};
    const v4u32 top2 = {0, 0x30303030u, 0, 0x30303030u};  // bytewise: (x >> 2) & 0x30 is each
                                                          // byte's top two bits at bits 4-5
    // [a & 63.., (c & 15..) | top2(a), m & 63.., ((c >> 4) & 15..) | top2(m)]: sc[0..7], mn[0..7]
    const v16u8 q = (v16u8)(((acmc >> shift) & keep) | ((aamm >> 2) & top2));
    const float d0 = fp16_to_float(b), dmin = fp16_to_float(b + 2);
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16f zero = {}, dd = lane < 8 ? zero + d0 : zero + dmin;  // a blend, not a stack trip
    const v16f v = to_v16f(q) * dd;
    std::memcpy(d, &v, sizeof v);
  }
};

template <>
struct Scales<Q6_K> {
  alignas(64) float d[16];  // d * scales[i], one per 16 values
  void load(const uint8_t* b) {
    v16s8 q;
    std::memcpy(&q, b + 192, 16);
    const v16f v = to_v16f(q) * fp16_to_float(b + 208);
    std::memcpy(d, &v, sizeof v);
  }
};

// Group g of a block as values 0..15 (lo) and 16..31 (hi); s: the block's decoded Scales.
template <int64_t T>
inline __attribute__((always_inline)) void dequant_group(const uint8_t* b, const Scales<T>& s,
                                                         int g, v16f& lo, v16f& hi) {
  if constexpr (T == Q4_K) {
    v16u8 q0, q1;
    std::memcpy(&q0, b + 16 + g / 2 * 32, 16);
    std::memcpy(&q1, b + 16 + g / 2 * 32 + 16, 16);
    if (g & 1) {
      q0 = q0 >> 4;
      q1 = q1 >> 4;
    } else {
      q0 = q0 & 0xf;
      q1 = q1 & 0xf;
    }
    lo = to_v16f(q0) * s.d[g] - s.d[8 + g];
    hi = to_v16f(q1) * s.d[g] - s.d[8 + g];
  } else if constexpr (T == Q6_K) {
    const int h = g / 4, r = g % 4;
    v16u8 l0, l1, h0, h1;
    std::memcpy(&l0, b + h * 64 + (r & 1) * 32, 16);
    std::memcpy(&l1, b + h * 64 + (r & 1) * 32 + 16, 16);
    std::memcpy(&h0, b + 128 + h * 32, 16);
    std::memcpy(&h1, b + 128 + h * 32 + 16, 16);
    const int shift_l = (r >> 1) * 4, shift_h = 2 * r;
    const v16s8 q0 = (v16s8)((((l0 >> shift_l) & 0xf) | (((h0 >> shift_h) & 3) << 4)) - 32);
    const v16s8 q1 = (v16s8)((((l1 >> shift_l) & 0xf) | (((h1 >> shift_h) & 3) << 4)) - 32);
    lo = to_v16f(q0) * s.d[2 * g];
    hi = to_v16f(q1) * s.d[2 * g + 1];
  } else {
    (void)s;
    (void)g;
    dequant_block<T>(b, lo, hi);
  }
}

// The weight bytes ahead of p (never faults, even past the end of the weight).
inline __attribute__((always_inline)) void prefetch(const uint8_t* p) {
#if defined(__x86_64__)
  _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_L1_BYTES, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_L2_BYTES, _MM_HINT_T1);
#else
  __builtin_prefetch(p + PREFETCH_L1_BYTES);
  __builtin_prefetch(p + PREFETCH_L2_BYTES, 0, 2);
#endif
}

// The line at p, into L1 now.
inline __attribute__((always_inline)) void prefetch_now(const uint8_t* p) {
#if defined(__x86_64__)
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
#else
  __builtin_prefetch(p);
#endif
}

inline float hsum(v16f v) {
  const v16f a = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  const v16f b = a + __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  const v16f c = b + __builtin_shufflevector(b, b, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return c[0] + c[1];
}

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_out(float v, float* p) { *p = v; }
inline void store_out(float v, at::BFloat16* p) { *p = at::BFloat16(v); }  // round to nearest

// y[m, n_begin:n_end] for M rows of x (float32, [M, K]): G output rows at a time, their blocks
// interleaved so each x vector is loaded once for G rows (G * M accumulators in registers).
// A block is GROUPS groups of 32 values, their shared scales decoded once (Scales).
template <int64_t T, int M, typename Out>
void gemv_rows(const float* x, const uint8_t* w, const float* bias, Out* y, int64_t K, int64_t N,
               int64_t n_begin, int64_t n_end) {
  constexpr int OUT_GROUP = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  constexpr int64_t BV = block_values(T), BB = block_bytes(T), GROUPS = BV / QK;
  const int64_t nb = K / BV, row_bytes = nb * BB;
  int64_t n = n_begin;
  for (; n + OUT_GROUP <= n_end; n += OUT_GROUP) {
    v16f acc[OUT_GROUP][M] = {};
    const uint8_t* rows = w + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      Scales<T> sc[OUT_GROUP];
      for (int g = 0; g < OUT_GROUP; ++g) sc[g].load(rows + g * row_bytes + b * BB);
#pragma GCC unroll 8
      for (int j = 0; j < GROUPS; ++j) {
        v16f lo[OUT_GROUP], hi[OUT_GROUP];
        for (int g = 0; g < OUT_GROUP; ++g) {
          const uint8_t* blk = rows + g * row_bytes + b * BB;
          prefetch(blk + j * (BB / GROUPS));  // about one a 32 bytes, whatever the type
          dequant_group<T>(blk, sc[g], j, lo[g], hi[g]);
        }
        for (int m = 0; m < M; ++m) {
          const float* xm = x + m * K + b * BV + j * QK;
          const v16f xl = load16(xm), xh = load16(xm + 16);
          for (int g = 0; g < OUT_GROUP; ++g) acc[g][m] += lo[g] * xl + hi[g] * xh;
        }
      }
    }
    for (int g = 0; g < OUT_GROUP; ++g)
      for (int m = 0; m < M; ++m)
        store_out(hsum(acc[g][m]) + (bias ? bias[n + g] : 0.f), y + m * N + n + g);
  }
  for (; n < n_end; ++n) {  // the last N % OUT_GROUP rows of this range
    v16f acc[M] = {};
    const uint8_t* row = w + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      Scales<T> sc;
      sc.load(row + b * BB);
#pragma GCC unroll 8
      for (int j = 0; j < GROUPS; ++j) {
        v16f lo, hi;
        dequant_group<T>(row + b * BB, sc, j, lo, hi);
        for (int m = 0; m < M; ++m) {
          const float* xm = x + m * K + b * BV + j * QK;
          acc[m] += lo * load16(xm) + hi * load16(xm + 16);
        }
      }
    }
    for (int m = 0; m < M; ++m) store_out(hsum(acc[m]) + (bias ? bias[n] : 0.f), y + m * N + n);
  }
}

template <int64_t T, typename Out>
void gemv_tile(int rows, const float* x, const uint8_t* w, const float* bias, Out* y, int64_t K,
               int64_t N, int64_t n0, int64_t n1) {
  switch (rows) {  // template argument: the accumulators stay in registers
    case 1: return gemv_rows<T, 1>(x, w, bias, y, K, N, n0, n1);
    case 2: return gemv_rows<T, 2>(x, w, bias, y, K, N, n0, n1);
    case 3: return gemv_rows<T, 3>(x, w, bias, y, K, N, n0, n1);
    case 4: return gemv_rows<T, 4>(x, w, bias, y, K, N, n0, n1);
    case 5: return gemv_rows<T, 5>(x, w, bias, y, K, N, n0, n1);
    case 6: return gemv_rows<T, 6>(x, w, bias, y, K, N, n0, n1);
    case 7: return gemv_rows<T, 7>(x, w, bias, y, K, N, n0, n1);
    default: return gemv_rows<T, 8>(x, w, bias, y, K, N, n0, n1);
  }
}

// Every row of x, ROWS at a time: tile(rows, m, n0, n1) for each tile of rows m.. and output
// columns n0..n1. Up to ROWS rows (decoding) every output column costs the same and each weight
// byte is read once, so the threads split the columns into equal contiguous ranges, in units of
// SPLIT_UNIT columns (a multiple of every kernel's group of output rows): chunks of 64 left one
// of two threads idle a fifth of a 576-column layer (9 chunks, 5 and 4). The first bytes of a
// range are prefetched as it starts, the kernels' own prefetch running ahead of their reads only.
// Past ROWS rows the threads split chunks of 64 columns, so a chunk's weight bytes stay in cache
// while the tiles of x pass over them.
template <typename Tile>
void for_each_tile(int64_t M, int64_t N, const uint8_t* w, int64_t row_bytes, const Tile& tile) {
  constexpr int64_t CHUNK = 64, SPLIT_UNIT = 4;
  if (M <= ROWS) {
    const int64_t units = (N + SPLIT_UNIT - 1) / SPLIT_UNIT;
    sluice::parallel_for(0, units, CHUNK / SPLIT_UNIT, [&](int64_t u0, int64_t u1) {
      const int64_t n0 = u0 * SPLIT_UNIT, n1 = std::min(N, u1 * SPLIT_UNIT);
      const uint8_t* first = w + n0 * row_bytes;
      const int64_t ahead = std::min<int64_t>(PREFETCH_L1_BYTES, (n1 - n0) * row_bytes);
      for (int64_t off = 0; off < ahead; off += 64) prefetch_now(first + off);
      tile(static_cast<int>(M), 0, n0, n1);
    });
    return;
  }
  const int64_t chunks = (N + CHUNK - 1) / CHUNK;
  sluice::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * CHUNK, n1 = std::min(N, n0 + CHUNK);
      for (int64_t m = 0; m < M; m += ROWS) {
        tile(static_cast<int>(std::min<int64_t>(ROWS, M - m)), m, n0, n1);
      }
    }
  });
}

template <int64_t T, typename Out>
void gemm_impl(const float* x, const uint8_t* w, const float* bias, Out* y, int64_t M, int64_t K,
               int64_t N) {
  const int64_t row_bytes = K / block_values(T) * block_bytes(T);
  for_each_tile(M, N, w, row_bytes, [&](int rows, int64_t m, int64_t n0, int64_t n1) {
    gemv_tile<T>(rows, x + m * K, w, bias, y + m * N, K, N, n0, n1);
  });
}

template <typename Out>
void gemm_dispatch(int64_t type, const float* x, const uint8_t* w, const float* bias, Out* y,
                   int64_t M, int64_t K, int64_t N) {
  switch (type) {
    case Q8_0: return gemm_impl<Q8_0>(x, w, bias, y, M, K, N);
    case Q4_0: return gemm_impl<Q4_0>(x, w, bias, y, M, K, N);
    case Q4_1: return gemm_impl<Q4_1>(x, w, bias, y, M, K, N);
    case Q4_K: return gemm_impl<Q4_K>(x, w, bias, y, M, K, N);
    case Q6_K: return gemm_impl<Q6_K>(x, w, bias, y, M, K, N);
    default: TORCH_CHECK(false, "unsupported quantization type ", type);
  }
}

// ----------------------------------------------------------------------------------------------
// The integer path (bfloat16 x only, when asked): each 32-value block of each row of x is
// rounded to int8 with a float scale, dx = max|x| / 127 and xq = round(x / dx) in [-127, 127],
// as llama.cpp's q8 activations, and each weight block is written as y_j = d * u_j + m with u_j
// an unsigned integer: Q4_1 (nibble, m), Q4_0 (nibble, -8 d), Q8_0 (q + 128, -128 d). Then
//   sum_j w_j x_j ~ sum_b d_b dx_b (sum_j u_j xq_j) + m_b (dx_b sum_j xq_j),
// the inner sums exact in int32 (VNNI's dpbusd, or AVX2's maddubs), the rest in float32. What it
// gives is exactly the float result for x rounded to int8 per block (up to float32 rounding of
// the few terms a block adds): |error| <= sum_k |w_k| dx_b(k) / 2 on top of the float path's.
// The m_b terms are collected per output row and summed with the x-side dx_b sum_j xq_j at the
// end (one dot product over blocks), not per block.
//
// Three builds: AVX-512 VNNI (two blocks a 512-bit register), AVX2 (one block a 256-bit register,
// with AVX-VNNI's dpbusd where the CPU has it, else maddubs, where Q8_0 takes llama.cpp's sign
// trick |q| * sign(xq, q) and m = 0, since (q + 128) * xq would saturate its int16 pairs), and a
// scalar one. x's blocks are padded with zero blocks to an even count.

struct QuantX {  // rows of x rounded to int8 per block; one allocation, 64-byte aligned
  int64_t M = 0, nbp = 0;  // rows, blocks a row (even)
  int8_t* q = nullptr;     // [M, nbp * 32] the int8 values
  float* d = nullptr;      // [M, nbp * 8] each block's dx, 8 times (the lanes of one block)
  float* s = nullptr;      // [M, nbp] dx * sum of the block's int8 values
  std::unique_ptr<char[]> mem;
  QuantX(int64_t M_, int64_t nb) : M(M_), nbp(nb + (nb & 1)) {
    const int64_t qb = M * nbp * 32, db = M * nbp * 8 * 4, sb = M * nbp * 4;
    mem.reset(new char[qb + db + sb + 64]);
    char* p = mem.get() + (64 - reinterpret_cast<uintptr_t>(mem.get()) % 64) % 64;
    q = reinterpret_cast<int8_t*>(p);
    d = reinterpret_cast<float*>(p + qb);
    s = reinterpret_cast<float*>(p + qb + db);
  }
};

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// x's 32 values of one block rounded to int8: q[i] = round(x[i] * 127 / amax) (to nearest,
// ties to even), amax = max |x[i]|; d[0..7] = amax / 127; *s = d * sum q. The vector versions
// compute each value as the scalar one does (one float32 multiply, one rounding), so every
// build rounds a finite x alike, bit for bit (`quantize_activations` shows the results).
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load16f(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16f(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <typename In>
inline void quantize_block(const In* x, int8_t* q, float* d, float* s) {
  const __m512 v0 = load16f(x), v1 = load16f(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 vi = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  constexpr int RND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(
      hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(v0, vi), RND))));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(
      hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(v1, vi), RND))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  _mm256_storeu_ps(d, _mm256_set1_ps(dx));
  *s = dx * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
}
#elif defined(__AVX2__)
inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8f(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <typename In>
inline void quantize_block(const In* x, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8f(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 vi = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i qi[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], vi),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    sum = _mm256_add_epi32(sum, qi[i]);
  }
  // packs work within 128-bit lanes: the bytes come out as dwords 0 4 1 5 2 6 3 7
  const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                       _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  _mm256_storeu_ps(d, _mm256_set1_ps(dx));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *s = dx * static_cast<float>(_mm_cvtsi128_si32(s4));
}
#else
template <typename In>
inline void quantize_block(const In* x, int8_t* q, float* d, float* s) {
  float v[QK], amax = 0.f;
  for (int i = 0; i < QK; ++i) {
    v[i] = to_float(x[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int i = 0; i < QK; ++i) {
    const float r = std::min(127.f, std::max(-127.f, std::nearbyint(v[i] * inv)));
    q[i] = static_cast<int8_t>(r);
    sum += q[i];
  }
  for (int i = 0; i < 8; ++i) d[i] = dx;
  *s = dx * static_cast<float>(sum);
}
#endif

template <typename In>
void quantize_x(const In* x, int64_t K, QuantX& qx) {
  const int64_t nb = K / QK;
  sluice::parallel_for(0, qx.M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t row = m * qx.nbp;
      for (int64_t b = 0; b < nb; ++b)
        quantize_block(x + m * K + b * QK, qx.q + (row + b) * QK, qx.d + (row + b) * 8,
                       qx.s + row + b);
      if (nb < qx.nbp) {  // the padding block
        std::memset(qx.q + (row + nb) * QK, 0, QK);
        std::fill_n(qx.d + (row + nb) * 8, 8, 0.f);
        qx.s[row + nb] = 0.f;
      }
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SLUICE_I8_ISA "avx512-vnni"
#define SLUICE_I8_K_QUANTS 1  // this build's integer path takes Q4_K and Q6_K too

// Blocks b and b + 1 of a row (`second` false: block b alone, the other half zero) as 64 u8
// values, and their scales: d = [d_b x8, d_b+1 x8]; m_b, m_b+1 written to m (Q4_1), or d_b,
// d_b+1 (Q4_0, Q8_0: m = MIN_PER_D * d).
template <int64_t T>
inline __attribute__((always_inline)) __m512i load_pair(const uint8_t* blk, bool second, __m512& d, float* m) {
  const uint8_t* b1 = blk + block_bytes(T);
  __m512i z;
  if constexpr (T == Q8_0) {
    const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    const __m256i q1 = second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2))
                              : _mm256_set1_epi8(-128);  // u = 0 after the flip below
    z = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1),
                         _mm512_set1_epi8(-128));  // q + 128
  } else {
    const int off = T == Q4_1 ? 4 : 2;
    const __m256i q0 = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + off)));
    const __m256i q1 = second ? _mm256_broadcastsi128_si256(_mm_loadu_si128(
                                    reinterpret_cast<const __m128i*>(b1 + off)))
                              : _mm256_setzero_si256();
    z = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);  // [qs0, qs0, qs1, qs1]
    z = _mm512_and_si512(_mm512_mask_srli_epi16(z, 0xff00ff00u, z, 4), _mm512_set1_epi8(0x0f));
  }
  // the scales as fp16 [d0, d1, m0, m1] put together in general registers (idle ports here)
  uint64_t h;
  if constexpr (T == Q4_1) {
    uint32_t h0, h1 = 0;
    std::memcpy(&h0, blk, 4);
    if (second) std::memcpy(&h1, b1, 4);
    h = (h0 & 0xffffu) | ((h1 & 0xffffu) << 16) | (uint64_t{h0 >> 16} << 32) |
        (uint64_t{h1 >> 16} << 48);
  } else {  // [d0, d1]; their m = -8 d or -128 d is applied to the sum at the end
    uint16_t h0, h1 = 0;
    std::memcpy(&h0, blk, 2);
    if (second) std::memcpy(&h1, b1, 2);
    h = h0 | (uint32_t{h1} << 16);
  }
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(h)));
  d = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                            _mm512_castps128_ps512(f));
  if constexpr (T == Q4_1) _mm_storeh_pi(reinterpret_cast<__m64*>(m), f);
  else _mm_storel_pi(reinterpret_cast<__m64*>(m), f);
  return z;
}

// sum_b m[b] * s[b] over n values, as 16 lanes (added to an accumulator before its final sum).
inline __m512 dot_lanes(const float* m, const float* s, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(m + i), _mm512_loadu_ps(s + i), acc);
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + i), _mm512_maskz_loadu_ps(k, s + i), acc);
  }
  return acc;
}

// One pair of blocks (b, b + 1) of G output rows into their G x M accumulators.
template <int64_t T, int G, int M, bool SECOND>
inline __attribute__((always_inline)) void ipair(const uint8_t* const* blk, float* const* mrow,
                                                 const int8_t* xq, const float* xd,
                                                 int64_t q_stride, int64_t d_stride,
                                                 __m512 (&acc)[G][M]) {
  __m512i z[G];
  __m512 d[G];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    prefetch(blk[g]);
    z[g] = load_pair<T>(blk[g], SECOND, d[g], mrow[g]);
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    const __m512i xv = _mm512_load_si512(xq + m * q_stride);
    const __m512 dx = _mm512_load_ps(xd + m * d_stride);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z[g], xv);
      acc[g][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d[g], dx), acc[g][m]);
    }
  }
}

// The K-quants on the integer path: groups g and g + 1 (g even) of a block in one register, as
// 64 unsigned values u with w = d_lane * u + m: Q4_K's nibbles (m = -dmin * mn_g, per group,
// collected as the 32-value types' minimums are), Q6_K's six-bit q (m = -32 d_lane, applied
// exactly in the integer sums: each lane starts at -32 times its four xq). d_lane: Q4_K's
// d * sc_g for the 8 lanes of a group; Q6_K's d * scales[i] for the 4 lanes of 16 values.
// sc: the block's Scales as one register (read once a block: loads of parts of it at offsets
// not a multiple of 16 bytes missed store forwarding, a third of Q4_K's speed).
template <int64_t T>
inline __attribute__((always_inline)) __m512i load_k_pair(const uint8_t* blk, __m512 sc, int pair,
                                                          __m512& d) {
  if constexpr (T == Q4_K) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + pair * 32));
    const __m256i lo = _mm256_and_si256(q, _mm256_set1_epi8(0x0f));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0f));
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    d = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(2 * pair)), sc);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  } else {
    const int h = pair / 2, shift = 4 * (pair % 2);  // groups 2 pair + (0, 1): r = shift / 2 + (0, 1)
    const __m512i ql = _mm512_loadu_si512(blk + h * 64);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + h * 32));
    const __m512i low = _mm512_and_si512(_mm512_srl_epi16(ql, _mm_cvtsi32_si128(shift)),
                                         _mm512_set1_epi8(0x0f));
    const __m256i h0 = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift));
    const __m256i h1 = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift + 2));
    __m512i high = _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
    high = _mm512_slli_epi16(_mm512_and_si512(high, _mm512_set1_epi8(3)), 4);
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    d = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(4 * pair)), sc);
    return _mm512_or_si512(low, high);
  }
}

template <int64_t T, int M, typename Out>
void igemv_rows_k(const QuantX& qx, int64_t m_first, const uint8_t* w, const float* bias, Out* y,
                  int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  constexpr int G = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  constexpr int64_t BB = block_bytes(T), GROUPS = 256 / QK;
  const int64_t nb = K / 256, row_bytes = nb * BB, nbp = qx.nbp;  // nbp = K / 32: no padding
  const int8_t* xq = qx.q + m_first * nbp * QK;
  const float* xd = qx.d + m_first * nbp * 8;
  const float* xs = qx.s + m_first * nbp;
  std::vector<float> mins(T == Q4_K ? G * nbp : 0);  // Q4_K: dmin * mn_g of each row's groups
  for (int64_t n = n_begin; n < n_end; n += G) {
    const int rows = static_cast<int>(std::min<int64_t>(G, n_end - n));
    __m512 acc[G][M];
    const uint8_t* blk[G];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[g][m] = _mm512_setzero_ps();
      blk[g] = w + (n + (g < rows ? g : 0)) * row_bytes;  // a short group repeats its first row
    }
    for (int64_t b = 0; b < nb; ++b) {
      __m512 sc[G];
      for (int g = 0; g < G; ++g) {
        Scales<T> s;
        s.load(blk[g] + b * BB);
        sc[g] = _mm512_load_ps(s.d);
        if constexpr (T == Q4_K) std::memcpy(&mins[g * nbp + b * GROUPS], s.d + 8, 32);
      }
#pragma GCC unroll 4
      for (int pair = 0; pair < GROUPS / 2; ++pair) {
        __m512i z[G];
        __m512 d[G];
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          prefetch(blk[g] + b * BB + pair * (BB / 4));
          z[g] = load_k_pair<T>(blk[g] + b * BB, sc[g], pair, d[g]);
        }
        const int64_t at = b * GROUPS + 2 * pair;  // x's block of group 2 pair
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const __m512i xv = _mm512_load_si512(xq + m * nbp * QK + at * QK);
          const __m512 dx = _mm512_load_ps(xd + m * nbp * 8 + at * 8);
          __m512i start = _mm512_setzero_si512();
          if constexpr (T == Q6_K)  // -32 * each lane's sum of xq
            start = _mm512_sub_epi32(start, _mm512_dpbusd_epi32(start, _mm512_set1_epi8(32), xv));
#pragma GCC unroll 8
          for (int g = 0; g < G; ++g) {
            const __m512i p = _mm512_dpbusd_epi32(start, z[g], xv);
            acc[g][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d[g], dx), acc[g][m]);
          }
        }
      }
    }
    float out[G][M];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        __m512 a = acc[g][m];
        if constexpr (T == Q4_K) a = _mm512_sub_ps(a, dot_lanes(mins.data() + g * nbp, xs + m * nbp, nbp));
        out[g][m] = _mm512_reduce_add_ps(a);
      }
    for (int g = 0; g < rows; ++g)
      for (int m = 0; m < M; ++m)
        store_out(out[g][m] + (bias ? bias[n + g] : 0.f), y + m * N + n + g);
  }
}

template <int64_t T, int M, typename Out>
void igemv_rows_q(const QuantX& qx, int64_t m_first, const uint8_t* w, const float* bias, Out* y,
                  int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  constexpr int G = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  constexpr float MIN_PER_D = T == Q4_1 ? 1.f : T == Q4_0 ? -8.f : -128.f;  // see load_pair
  constexpr int64_t MAX_NB = 2048 / QK + 2;  // blocks a row kept on the stack; more: the heap
  const int64_t nb = K / QK, bb = block_bytes(T), row_bytes = nb * bb, nbp = qx.nbp;
  const int8_t* xq = qx.q + m_first * nbp * QK;
  const float* xd = qx.d + m_first * nbp * 8;
  const float* xs = qx.s + m_first * nbp;
  alignas(64) float mins[G][MAX_NB];  // m_b of each of the G output rows
  std::vector<float> heap(nbp > MAX_NB ? G * nbp : 0);
  for (int64_t n = n_begin; n < n_end; n += G) {
    const int rows = static_cast<int>(std::min<int64_t>(G, n_end - n));
    __m512 acc[G][M];
    const uint8_t* blk[G];
    float* mrow[G];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) acc[g][m] = _mm512_setzero_ps();
      blk[g] = w + (n + (g < rows ? g : 0)) * row_bytes;  // a short group repeats its first row
      mrow[g] = heap.empty() ? mins[g] : heap.data() + g * nbp;
    }
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      ipair<T, G, M, true>(blk, mrow, xq + b * QK, xd + b * 8, nbp * QK, nbp * 8, acc);
      for (int g = 0; g < G; ++g) {
        blk[g] += 2 * bb;
        mrow[g] += 2;
      }
    }
    if (b < nb) ipair<T, G, M, false>(blk, mrow, xq + b * QK, xd + b * 8, nbp * QK, nbp * 8, acc);
    float out[G][M];  // every accumulator read with constant indices: they stay in registers
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const float* mg = heap.empty() ? mins[g] : heap.data() + g * nbp;
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
        out[g][m] = _mm512_reduce_add_ps(_mm512_fmadd_ps(
            dot_lanes(mg, xs + m * nbp, nb), _mm512_set1_ps(MIN_PER_D), acc[g][m]));
    }
    for (int g = 0; g < rows; ++g)
      for (int m = 0; m < M; ++m)
        store_out(out[g][m] + (bias ? bias[n + g] : 0.f), y + m * N + n + g);
  }
}

template <int64_t T, int M, typename Out>
void igemv_rows(const QuantX& qx, int64_t m_first, const uint8_t* w, const float* bias, Out* y,
                int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  if constexpr (is_k_quant(T))
    igemv_rows_k<T, M>(qx, m_first, w, bias, y, K, N, n_begin, n_end);
  else
    igemv_rows_q<T, M>(qx, m_first, w, bias, y, K, N, n_begin, n_end);
}

#if defined(__AVX512VL__)
#define SLUICE_INTERLEAVED 1  // the row-interleaved kernel below (`interleave`)

// 16 floats rounded to bfloat16 (to nearest even), as 16 16-bit lanes; a NaN stays a NaN.
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));  // a NaN may wrap to 0
  return _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), h,
                                 _mm256_set1_epi16(0x7fc0));
#endif
}

inline void store16(__m512 v, at::BFloat16* p) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}

// Whole tiles t_begin..t_end of a weight in the interleaved layout (see `interleave`), for M rows
// of x from m_first: per tile and block one record, its 8 registers of 4 values x 16 rows each
// multiplied into M rows of x by dpbusd with 4 bytes of x broadcast, the record's 16 scales
// converted by one vcvtph2ps. Per row of x and block, 16 lanes (the tile's rows) of
//   acc += float(sum_j u_j xq_j) * (d * dx) + m * (dx * sum_j xq_j),
// the integer sums exact (as igemv_rows_q's; only the float additions come in another order).
// Up to two rows of x, where the kernel waits on memory, it reads ILV_STREAMS tiles at once,
// block by block: one sequential stream a tile left the Xeon (lscpu model 167, 2 threads) at
// 36 GB/s on the Q8_0 LM head at one row; four streams 42, eight 46, and Q4_1's qkv went from
// 21 to 26-28 (two streams at four rows: no gain). Single-stream decode, in-process: 1.09-1.12x
// with four, eight another 0.99-1.10x. A range's last tiles (a thread's share need not be a
// multiple of ILV_STREAMS) take 4, then 2, then 1 at once.
// Each tile's sums are the same operations in the same order whatever the streams, so the
// output is too.
constexpr int ILV_STREAMS = 8;

// Record b of a tile (16 rows x 32 values) into acc[M], for M rows of x.
template <int64_t T, int M>
inline __attribute__((always_inline)) void ilv_record(const uint8_t* rec, int64_t b,
                                                      const int8_t* xq, const float* xd,
                                                      const float* xs, int64_t nbp,
                                                      __m512 (&acc)[M]) {
  constexpr int64_t REC = ILV_ROWS * block_bytes(T), QBYTES = T == Q8_0 ? 512 : 256;
  constexpr float MIN_PER_D = T == Q4_0 ? -8.f : -128.f;  // m = MIN_PER_D * d but for Q4_1
  // the record's lines ahead: into L2 up to 4 rows of x (without: down_proj at 2 rows 15%
  // slower, Zen 4), into L1 as well past that (bound by dpbusd, it stalls on loads). At one
  // row, Q8_0's none: Zen 4 read one stream a thread 4-20% faster without (L1 ones cost
  // more), and on the Xeon model 167 its LM head read eight streams at 46 GB/s without, 42
  // with. But Q4_0 and Q4_1 into L2 at one row too: with eight streams on the Xeon model 167,
  // Q4_1's qkv 26 -> 29 GB/s, o 20 -> 23, single-stream decode 1.05-1.12x (not measured on
  // Zen 4 with eight streams).
  if constexpr (M > 1 || T != Q8_0) {
#pragma GCC unroll 9
    for (int64_t line = 0; line < REC; line += 64) {
      if constexpr (M <= 4)
        _mm_prefetch(reinterpret_cast<const char*>(rec + line) + PREFETCH_L2_BYTES, _MM_HINT_T1);
      else
        prefetch(rec + line);
    }
  }
  __m512i u[8];
  if constexpr (T == Q8_0) {
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) u[g] = _mm512_loadu_si512(rec + 64 * g);
  } else {
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(rec + 64 * p);
      u[p] = _mm512_and_si512(v, _mm512_set1_epi8(0x0f));
      u[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
    }
  }
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + QBYTES)));
  __m512 mn;
  if constexpr (T == Q4_1)
    mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + QBYTES + 32)));
  else
    mn = _mm512_mul_ps(d, _mm512_set1_ps(MIN_PER_D));  // exact: a power of two
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r) {
    const int8_t* xb = xq + r * nbp * QK + b * QK;
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      int32_t lo, hi;
      std::memcpy(&lo, xb + 4 * g, 4);
      std::memcpy(&hi, xb + 16 + 4 * g, 4);
      s0 = _mm512_dpbusd_epi32(s0, u[g], _mm512_set1_epi32(lo));
      s1 = _mm512_dpbusd_epi32(s1, u[g + 4], _mm512_set1_epi32(hi));
    }
    const __m512 dx = _mm512_set1_ps(xd[(r * nbp + b) * 8]);
    const __m512 sx = _mm512_set1_ps(xs[r * nbp + b]);
    const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));  // exact: < 2^24
    acc[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(d, dx), acc[r]);
    acc[r] = _mm512_fmadd_ps(mn, sx, acc[r]);
  }
}

template <int64_t T, int M, typename Out, int S = (M <= 2 ? ILV_STREAMS : 1)>
void igemv_interleaved(const QuantX& qx, int64_t m_first, const uint8_t* w, const float* bias,
                       Out* y, int64_t K, int64_t N, int64_t t_begin, int64_t t_end) {
  constexpr int64_t REC = ILV_ROWS * block_bytes(T);
  const int64_t nb = K / QK, nbp = qx.nbp;
  const int8_t* xq = qx.q + m_first * nbp * QK;
  const float* xd = qx.d + m_first * nbp * 8;
  const float* xs = qx.s + m_first * nbp;
  int64_t t = t_begin;
  for (; t + S <= t_end; t += S) {
    const uint8_t* rec[S];
    __m512 acc[S][M];
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      rec[s] = w + (t + s) * nb * REC;
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) acc[s][r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) ilv_record<T, M>(rec[s] + b * REC, b, xq, xd, xs, nbp, acc[s]);
    }
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const __m512 bv = bias ? _mm512_loadu_ps(bias + (t + s) * ILV_ROWS) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r)
        store16(_mm512_add_ps(acc[s][r], bv), y + r * N + (t + s) * ILV_ROWS);
    }
  }
  if constexpr (S > 1)  // the last tiles of the range: half as many streams, down to one
    if (t < t_end) igemv_interleaved<T, M, Out, S / 2>(qx, m_first, w, bias, y, K, N, t, t_end);
}
#endif

#elif defined(__AVX2__)
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define SLUICE_I8_ISA "avx-vnni"
#define SLUICE_I8_DPBUSD 1
#else
#define SLUICE_I8_ISA "avx2"
#endif

// One block as 32 u8 values (or, for Q8_0 without dpbusd, |q|, with *sign = q), d and m.
template <int64_t T>
inline __attribute__((always_inline)) __m256i load_block(const uint8_t* blk, float& d, float& m, __m256i* sign) {
  d = fp16_to_float(blk);
  if constexpr (T == Q8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
#if defined(SLUICE_I8_DPBUSD)
    m = -128.f * d;
    (void)sign;
    return _mm256_xor_si256(q, _mm256_set1_epi8(-128));
#else
    m = 0.f;
    *sign = q;
    return _mm256_abs_epi8(q);
#endif
  } else {
    (void)sign;
    m = T == Q4_1 ? fp16_to_float(blk + 2) : -8.f * d;
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (T == Q4_1 ? 4 : 2)));
    const __m256i z = _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs);
    return _mm256_and_si256(z, _mm256_set1_epi8(0x0f));
  }
}

inline __m256i dot_u8s8(__m256i u, __m256i s) {  // 8 int32 sums of 4 products each
#if defined(SLUICE_I8_DPBUSD)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));  // |u*s| <= 32512
#endif
}

inline float hsum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

template <int64_t T, int M, typename Out>
void igemv_rows(const QuantX& qx, int64_t m_first, const uint8_t* w, const float* bias, Out* y,
                int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  constexpr int G = M <= 2 ? 2 : 1;
  const int64_t nb = K / QK, row_bytes = nb * block_bytes(T), nbp = qx.nbp;
  const int8_t* xq = qx.q + m_first * nbp * QK;
  const float* xd = qx.d + m_first * nbp * 8;
  const float* xs = qx.s + m_first * nbp;
  for (int64_t n = n_begin; n < n_end; n += G) {
    const int rows = static_cast<int>(std::min<int64_t>(G, n_end - n));
    __m256 acc[G][M];
    float macc[G][M] = {};
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < M; ++m) acc[g][m] = _mm256_setzero_ps();
    const uint8_t* base = w + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      __m256i z[G], sign[G];
      __m256 d[G];
      float mb[G];
      for (int g = 0; g < G; ++g) {
        float dv;
        z[g] = load_block<T>(base + (g < rows ? g : 0) * row_bytes + b * block_bytes(T), dv,
                             mb[g], &sign[g]);
        d[g] = _mm256_set1_ps(dv);
      }
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(xq + m * nbp * QK + b * QK));
        const __m256 dx = _mm256_load_ps(xd + m * nbp * 8 + b * 8);
        const float sx = xs[m * nbp + b];
        for (int g = 0; g < G; ++g) {
#if defined(SLUICE_I8_DPBUSD)
          const __m256i p = dot_u8s8(z[g], xv);
#else
          const __m256i p = dot_u8s8(z[g], T == Q8_0 ? _mm256_sign_epi8(xv, sign[g]) : xv);
#endif
          acc[g][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d[g], dx), acc[g][m]);
          macc[g][m] += mb[g] * sx;
        }
      }
    }
    for (int g = 0; g < rows; ++g)
      for (int m = 0; m < M; ++m)
        store_out(hsum8(acc[g][m]) + macc[g][m] + (bias ? bias[n + g] : 0.f), y + m * N + n + g);
  }
}

#else
#define SLUICE_I8_ISA "generic"

template <int64_t T, int M, typename Out>
void igemv_rows(const QuantX& qx, int64_t m_first, const uint8_t* w, const float* bias, Out* y,
                int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t nb = K / QK, row_bytes = nb * block_bytes(T), nbp = qx.nbp;
  for (int64_t n = n_begin; n < n_end; ++n) {
    float acc[M] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + n * row_bytes + b * block_bytes(T);
      const float d = fp16_to_float(blk);
      const float mb = T == Q4_1 ? fp16_to_float(blk + 2) : T == Q4_0 ? -8.f * d : -128.f * d;
      int32_t u[QK];
      for (int j = 0; j < QK; ++j)
        u[j] = T == Q8_0 ? static_cast<int8_t>(blk[2 + j]) + 128
               : j < 16  ? blk[(T == Q4_1 ? 4 : 2) + j] & 0xf
                         : blk[(T == Q4_1 ? 4 : 2) + j - 16] >> 4;
      for (int m = 0; m < M; ++m) {
        const int8_t* xq = qx.q + ((m_first + m) * nbp + b) * QK;
        int32_t isum = 0;
        for (int j = 0; j < QK; ++j) isum += u[j] * xq[j];
        const float dx = qx.d[((m_first + m) * nbp + b) * 8];
        acc[m] += d * dx * static_cast<float>(isum) + mb * qx.s[(m_first + m) * nbp + b];
      }
    }
    for (int m = 0; m < M; ++m) store_out(acc[m] + (bias ? bias[n] : 0.f), y + m * N + n);
  }
}
#endif

template <int64_t T, typename Out>
void igemv_tile(int rows, const QuantX& qx, int64_t m0, const uint8_t* w, const float* bias,
                Out* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  switch (rows) {
    case 1: return igemv_rows<T, 1>(qx, m0, w, bias, y, K, N, n0, n1);
    case 2: return igemv_rows<T, 2>(qx, m0, w, bias, y, K, N, n0, n1);
    case 3: return igemv_rows<T, 3>(qx, m0, w, bias, y, K, N, n0, n1);
    case 4: return igemv_rows<T, 4>(qx, m0, w, bias, y, K, N, n0, n1);
    case 5: return igemv_rows<T, 5>(qx, m0, w, bias, y, K, N, n0, n1);
    case 6: return igemv_rows<T, 6>(qx, m0, w, bias, y, K, N, n0, n1);
    case 7: return igemv_rows<T, 7>(qx, m0, w, bias, y, K, N, n0, n1);
    default: return igemv_rows<T, 8>(qx, m0, w, bias, y, K, N, n0, n1);
  }
}

#if defined(SLUICE_INTERLEAVED)
template <int64_t T, typename Out>
void interleaved_tile(int rows, const QuantX& qx, int64_t m0, const uint8_t* w, const float* bias,
                      Out* y, int64_t K, int64_t N, int64_t t0, int64_t t1) {
  switch (rows) {
    case 1: return igemv_interleaved<T, 1>(qx, m0, w, bias, y, K, N, t0, t1);
    case 2: return igemv_interleaved<T, 2>(qx, m0, w, bias, y, K, N, t0, t1);
    case 3: return igemv_interleaved<T, 3>(qx, m0, w, bias, y, K, N, t0, t1);
    case 4: return igemv_interleaved<T, 4>(qx, m0, w, bias, y, K, N, t0, t1);
    case 5: return igemv_interleaved<T, 5>(qx, m0, w, bias, y, K, N, t0, t1);
    case 6: return igemv_interleaved<T, 6>(qx, m0, w, bias, y, K, N, t0, t1);
    case 7: return igemv_interleaved<T, 7>(qx, m0, w, bias, y, K, N, t0, t1);
    default: return igemv_interleaved<T, 8>(qx, m0, w, bias, y, K, N, t0, t1);
  }
}

// The integer path on an interleaved weight: units of work are its whole tiles, then (one more
// unit) the last N % 16 rows, which keep GGUF's layout and take igemv_rows. The threads split
// contiguous ranges of units in chunks of CHUNK tiles (igemv_interleaved's streams); past ROWS
// rows of x, each chunk's tiles pass over all the rows, ROWS at a time, while in cache.
template <int64_t T, typename Out>
void igemm_interleaved(const QuantX& qx, const uint8_t* w, const float* bias, Out* y, int64_t M,
                       int64_t K, int64_t N) {
  constexpr int64_t CHUNK = ILV_STREAMS;
  const int64_t tiles = N / ILV_ROWS, units = tiles + (N % ILV_ROWS != 0);
  const int64_t tile_bytes = ILV_ROWS * (K / QK) * block_bytes(T);
  sluice::parallel_for(0, units, CHUNK, [&](int64_t u0, int64_t u1) {
    const int64_t ahead = std::min<int64_t>(PREFETCH_L1_BYTES, (u1 - u0) * tile_bytes);
    for (int64_t off = 0; off < ahead; off += 64) prefetch_now(w + u0 * tile_bytes + off);
    for (int64_t c = u0; c < u1; c += CHUNK) {
      const int64_t ce = std::min(u1, c + CHUNK), te = std::min(ce, tiles);
      for (int64_t m = 0; m < M; m += ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(ROWS, M - m));
        if (c < te) interleaved_tile<T>(rows, qx, m, w, bias, y + m * N, K, N, c, te);
        if (ce > tiles) igemv_tile<T>(rows, qx, m, w, bias, y + m * N, K, N, tiles * ILV_ROWS, N);
      }
    }
  });
}
#endif

template <int64_t T, typename Out>
void igemm_impl(const QuantX& qx, const uint8_t* w, const float* bias, Out* y, int64_t M,
                int64_t K, int64_t N) {
  const int64_t row_bytes = K / block_values(T) * block_bytes(T);
  for_each_tile(M, N, w, row_bytes, [&](int rows, int64_t m, int64_t n0, int64_t n1) {
    igemv_tile<T>(rows, qx, m, w, bias, y + m * N, K, N, n0, n1);
  });
}

// y (bfloat16) = x (bfloat16, [M, K]) w^T + bias through the integer path.
void igemm_bf16(int64_t type, const at::BFloat16* x, const uint8_t* w, const float* bias,
                at::BFloat16* y, int64_t M, int64_t K, int64_t N) {
  QuantX qx(M, K / QK);
  quantize_x(x, K, qx);
  switch (type) {
    case Q8_0: return igemm_impl<Q8_0>(qx, w, bias, y, M, K, N);
    case Q4_0: return igemm_impl<Q4_0>(qx, w, bias, y, M, K, N);
#if defined(SLUICE_I8_K_QUANTS)
    case Q4_K: return igemm_impl<Q4_K>(qx, w, bias, y, M, K, N);
    case Q6_K: return igemm_impl<Q6_K>(qx, w, bias, y, M, K, N);
#endif
#if defined(SLUICE_INTERLEAVED)
    case Q8_0 | INTERLEAVED: return igemm_interleaved<Q8_0>(qx, w, bias, y, M, K, N);
    case Q4_0 | INTERLEAVED: return igemm_interleaved<Q4_0>(qx, w, bias, y, M, K, N);
    case Q4_1 | INTERLEAVED: return igemm_interleaved<Q4_1>(qx, w, bias, y, M, K, N);
#endif
    default: return igemm_impl<Q4_1>(qx, w, bias, y, M, K, N);
  }
}

// Whether this build's integer path takes `type`: the 32-value types always, the K-quants on
// AVX-512 VNNI only (elsewhere they take the float path, whatever int8_activations says).
constexpr bool has_int8_path(int64_t type) {
#if defined(SLUICE_I8_K_QUANTS)
  return true;
#else
  return !is_k_quant(type);
#endif
}

// Whether this build has the interleaved kernel for ggml type `type`.
constexpr bool has_interleaved(int64_t type) {
#if defined(SLUICE_INTERLEAVED)
  return type == Q8_0 || type == Q4_0 || type == Q4_1;
#else
  (void)type;
  return false;
#endif
}

void check_weight(const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(type == Q8_0 || type == Q4_0 || type == Q4_1 || type == Q4_K || type == Q6_K ||
                  (is_interleaved(type) && has_interleaved(base_type(type))),
              "type must be Q8_0 (8), Q4_0 (2), Q4_1 (3), Q4_K (12) or Q6_K (14), or one of ",
              "interleaved_types, not ", type);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 &&
              w.is_contiguous(), "w: a contiguous 2-D uint8 CPU tensor of blocks");
  type = base_type(type);
  const int64_t bv = block_values(type);
  TORCH_CHECK(K > 0 && K % bv == 0, "in_features must be a positive multiple of ", bv, " for ",
              "this type, not ", K);
  TORCH_CHECK(w.size(1) == K / bv * block_bytes(type), "w has ", w.size(1),
              " bytes a row; ", K, " values take ", K / bv * block_bytes(type));
}

// ----------------------------------------------------------------------------------------------
// The row-interleaved layout, for the integer path at a few rows (AVX-512 VNNI builds). The
// per-row kernel above decodes each block's scales and nibbles for one output row at a time, some
// 15 instructions per two blocks: compute-bound, at about half the speed memory allows. Here, at
// load, 16 output rows (a tile) are woven together so that per block one dpbusd on 4 bytes of x,
// broadcast, makes 4 products for each of the 16 rows, and the 16 rows' scales are converted by
// one vcvtph2ps. Per tile and 32-value block b, one record of 16 * block_bytes bytes:
//   Q4_0, Q4_1: 4 registers [p][row i][qs_i[4p..4p+3]] (64 bytes each), then d[16] fp16 and
//               (Q4_1) m[16] fp16: register p's low nibbles are values 4p..4p+3 of its 16 rows,
//               its high nibbles values 16+4p..16+4p+3 (GGUF's own nibble order);
//   Q8_0:       8 registers [g][row i][q_i[4g..4g+3] + 128 as u8], then d[16] fp16.
// A tile's records follow one another (one sequential stream over K), the tiles in order; the
// last N % 16 rows stay in GGUF's layout, at their GGUF offset (a tile takes exactly its 16 rows'
// bytes). The tensor keeps its shape and size; its type id says which layout it holds.

// Rewrites the tiles of w [N, K / 32 * block_bytes] of ggml type `type` between GGUF's layout
// and the interleaved one (TO_TILES: into it), src to dst; the tail rows are copied as they are.
template <bool TO_TILES>
void move_tiles(int64_t type, const uint8_t* src, uint8_t* dst, int64_t K, int64_t N) {
  const int64_t bb = block_bytes(type), nb = K / QK, row_bytes = nb * bb, tiles = N / ILV_ROWS;
  const int64_t head = type == Q4_1 ? 4 : 2, quads = (bb - head) / 4;  // scale bytes; 4-byte quants
  const uint8_t flip = type == Q8_0 ? 0x80 : 0;  // Q8_0's q as q + 128 (an involution)
  sluice::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < ILV_ROWS; ++i)
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t blk = (t * ILV_ROWS + i) * row_bytes + b * bb;  // GGUF's block
          const int64_t rec = t * ILV_ROWS * row_bytes + b * ILV_ROWS * bb;  // its tile's record
          auto move = [&](int64_t in_blk, int64_t in_rec, int64_t n, uint8_t x) {
            for (int64_t k = 0; k < n; ++k) {
              if (TO_TILES) dst[rec + in_rec + k] = src[blk + in_blk + k] ^ x;
              else dst[blk + in_blk + k] = src[rec + in_rec + k] ^ x;
            }
          };
          for (int64_t q = 0; q < quads; ++q) move(head + 4 * q, q * 64 + i * 4, 4, flip);
          move(0, quads * 64 + 2 * i, 2, 0);                           // d
          if (type == Q4_1) move(2, quads * 64 + 32 + 2 * i, 2, 0);  // m
        }
  });
  const int64_t done = tiles * ILV_ROWS * row_bytes;
  std::memcpy(dst + done, src + done, (N - tiles * ILV_ROWS) * row_bytes);
}

// w's blocks (ggml type `type`) in the interleaved layout: a new tensor of w's shape, for the
// type id type | INTERLEAVED (`interleaved_types[type]`).
at::Tensor interleave(const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(has_interleaved(type), "this build interleaves none of type ", type,
              " (interleaved_types)");
  check_weight(w, type, K);
  auto out = at::empty(w.sizes(), w.options());
  move_tiles<true>(type, w.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), K, w.size(0));
  return out;
}

// w's blocks in GGUF's layout: w itself, or, for an interleaved type, a new tensor.
at::Tensor gguf_blocks(const at::Tensor& w, int64_t type, int64_t K) {
  check_weight(w, type, K);
  if (!is_interleaved(type)) return w;
  auto out = at::empty(w.sizes(), w.options());
  move_tiles<false>(base_type(type), w.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), K, w.size(0));
  return out;
}

// x [M, K] (float32 or bfloat16, K a multiple of 32) rounded to int8 per block of 32 as the
// integer path rounds it: (q int8 [M, K], dx float32 [M, K / 32], dx * the sum of the block's
// q float32 [M, K / 32]), x ~ dx * q block by block.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) % QK == 0 &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: a 2-D float32 or bfloat16 CPU tensor of whole blocks of ", QK);
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  QuantX qx(M, nb);
  if (x.scalar_type() == at::kFloat) quantize_x(xc.data_ptr<float>(), K, qx);
  else quantize_x(xc.data_ptr<at::BFloat16>(), K, qx);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, nb}, x.options().dtype(at::kFloat));
  at::Tensor s = at::empty({M, nb}, x.options().dtype(at::kFloat));
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(q.data_ptr<int8_t>() + m * K, qx.q + m * qx.nbp * QK, K);
    for (int64_t b = 0; b < nb; ++b) {
      d.data_ptr<float>()[m * nb + b] = qx.d[(m * qx.nbp + b) * 8];
      s.data_ptr<float>()[m * nb + b] = qx.s[m * qx.nbp + b];
    }
  }
  return {q, d, s};
}

// y = x w^T + bias: x [M, K] float32 or bfloat16, w [N, K / 32 * block_bytes] uint8 blocks of
// `type` (a ggml type id), bias [N] or None (any float dtype). Returns [M, N] in x's dtype.
// int8_activations: bfloat16 x takes the integer path (x rounded to int8 per block) for the
// 32-value types; float32 x, and the K-quants, always take the float path, exact up to float32
// rounding.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t type,
                        const c10::optional<at::Tensor>& bias, bool int8_activations) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x: a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16, not ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, type, K);
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias: [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  if (int8_activations && x.scalar_type() == at::kBFloat16 && has_int8_path(type)) {
    const at::Tensor xc = x.contiguous();
    igemm_bf16(type, xc.data_ptr<at::BFloat16>(), w.data_ptr<uint8_t>(), bp,
               y.data_ptr<at::BFloat16>(), M, K, N);
    return y;
  }
  const at::Tensor wg = gguf_blocks(w, type, K);  // the float path reads GGUF's layout
  type = base_type(type);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // no copy for contiguous float32
  if (x.scalar_type() == at::kFloat)
    gemm_dispatch(type, xf.data_ptr<float>(), wg.data_ptr<uint8_t>(), bp, y.data_ptr<float>(), M,
                  K, N);
  else
    gemm_dispatch(type, xf.data_ptr<float>(), wg.data_ptr<uint8_t>(), bp,
                  y.data_ptr<at::BFloat16>(), M, K, N);
  return y;
}

// The type id that `linear_rows` reads as `repack`'s layout (any 32-value type): neither a ggml
// id nor one with INTERLEAVED set.
constexpr int64_t PACKED = 0x200;

// packed_linear on raw rows (defined with it, below): bfloat16 x [M, K] and y [M, N], w packed
// by `repack`, bias float32 [N] or null.
void packed_gemm(const at::BFloat16* x, const uint8_t* packed, const float* bias, at::BFloat16* y,
                 int64_t M, int64_t K, int64_t N);

// quant_linear on raw rows, for the decoder layers of cpu_ops.cpp (`decode_layers`), which
// get it through `_linear_capsule()`: x [M, K] float32 or bfloat16 (x_bf16), y [M, N] of x's
// dtype, bias float32 [N] or null; the same paths and results as quant_linear for the same x.
// type PACKED: w is `repack`'s layout, x bfloat16, the same results as packed_linear.
void linear_rows(const void* x, bool x_bf16, const uint8_t* w, int64_t type, bool int8_activations,
                 const float* bias, void* y, int64_t M, int64_t K, int64_t N) {
  if (M == 0) return;
  if (type == PACKED) {
    TORCH_CHECK(x_bf16, "the packed GEMM takes bfloat16 x");
    return packed_gemm(static_cast<const at::BFloat16*>(x), w, bias,
                       static_cast<at::BFloat16*>(y), M, K, N);
  }
  const auto* xb = static_cast<const at::BFloat16*>(x);
  auto* yb = static_cast<at::BFloat16*>(y);
  if (x_bf16 && int8_activations && has_int8_path(type))
    return igemm_bf16(type, xb, w, bias, yb, M, K, N);
  std::vector<uint8_t> gguf;  // the float path reads GGUF's layout
  if (is_interleaved(type)) {
    type = base_type(type);
    gguf.resize(N * (K / QK) * block_bytes(type));
    move_tiles<false>(type, w, gguf.data(), K, N);
    w = gguf.data();
  }
  if (!x_bf16) {
    gemm_dispatch(type, static_cast<const float*>(x), w, bias, static_cast<float*>(y), M, K, N);
    return;
  }
  std::vector<float> xf(M * K);  // exact: as x.to(float32)
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xb[i]);
  gemm_dispatch(type, xf.data(), w, bias, yb, M, K, N);
}
using LinearRowsFn = void (*)(const void*, bool, const uint8_t*, int64_t, bool, const float*,
                              void*, int64_t, int64_t, int64_t);
constexpr LinearRowsFn LINEAR_ROWS = &linear_rows;

template <int64_t T, typename Out>
void dequantize_impl(const uint8_t* w, Out* y, int64_t K, int64_t N) {
  constexpr int64_t BV = block_values(T), BB = block_bytes(T);
  const int64_t nb = K / BV, row_bytes = nb * BB;
  sluice::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + n * row_bytes + b * BB;
        Scales<T> sc;
        sc.load(blk);
        for (int j = 0; j < BV / QK; ++j) {
          v16f lo, hi;
          dequant_group<T>(blk, sc, j, lo, hi);
          Out* out = y + n * K + b * BV + j * QK;
          for (int i = 0; i < 16; ++i) {
            store_out(lo[i], out + i);
            store_out(hi[i], out + 16 + i);
          }
        }
      }
  });
}

// The float weight [N, K] (float32 or bfloat16, `dtype`) of blocks w of `type`.
at::Tensor dequantize(const at::Tensor& w, int64_t type, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype: float32 or bfloat16");
  const at::Tensor wg = gguf_blocks(w, type, K);
  type = base_type(type);
  const int64_t N = w.size(0);
  auto y = at::empty({N, K}, w.options().dtype(dtype));
  const uint8_t* wp = wg.data_ptr<uint8_t>();
#define SLUICE_DEQUANT(T)                                                               \
  if (dtype == at::kFloat) dequantize_impl<T>(wp, y.data_ptr<float>(), K, N);         \
  else dequantize_impl<T>(wp, y.data_ptr<at::BFloat16>(), K, N);
  switch (type) {
    case Q8_0: SLUICE_DEQUANT(Q8_0) break;
    case Q4_0: SLUICE_DEQUANT(Q4_0) break;
    case Q4_1: SLUICE_DEQUANT(Q4_1) break;
    case Q4_K: SLUICE_DEQUANT(Q4_K) break;
    default: SLUICE_DEQUANT(Q6_K) break;
  }
#undef SLUICE_DEQUANT
  return y;
}

// ----------------------------------------------------------------------------------------------
// The integer GEMM for many rows (bfloat16 x, AVX-512 VNNI): prefill and large decode batches.
// The per-row kernels above decode each weight block again for every 8 rows of x, so past a few
// rows they are bound by that decoding; here the weight is repacked once, at load, into the form
// dpbusd takes, and each packed tile is then reused across all rows of x from the cache.
//
// Every block value is y_j = d * u_j + m with u_j an unsigned byte (as in the integer path
// above: Q4_1 nibble and m, Q4_0 nibble and -8 d, Q8_0 q + 128 and -128 d), so the repacking is
// exact. Packed layout, per tile of 16 output rows (the last tile padded with zero rows) and per
// 32-value block b, PACK_BYTES bytes: 8 groups of [16 rows x 4 values] u8 (one 512-bit register
// each: lane i holds row i's values 4g..4g+3), then d[16] and m[16] as float32. A tile's blocks
// follow one another, so one tile over all of K is one sequential stream.
//
// x is rounded to int8 per block as in the integer path (quantize_x); for a tile pair and R rows
// of x, each block gives R x 2 int32 sums (8 dpbusd each), turned into float once per block:
//   acc += float(isum) * (d * dx) + m * (dx * sum_j xq_j).
constexpr int64_t PACK_TILE = 16;
constexpr int64_t PACK_BYTES = 8 * 64 + 2 * PACK_TILE * 4;

template <int64_t T>
void unpack_block(const uint8_t* blk, uint8_t* u, float& d, float& m) {
  d = fp16_to_float(blk);
  if constexpr (T == Q8_0) {
    m = -128.f * d;
    for (int j = 0; j < QK; ++j) u[j] = static_cast<uint8_t>(static_cast<int8_t>(blk[2 + j]) + 128);
  } else {
    const uint8_t* qs = blk + (T == Q4_1 ? 4 : 2);
    m = T == Q4_1 ? fp16_to_float(blk + 2) : -8.f * d;
    for (int j = 0; j < 16; ++j) {
      u[j] = qs[j] & 0x0f;
      u[j + 16] = qs[j] >> 4;
    }
  }
}

template <int64_t T>
void repack_impl(const uint8_t* w, uint8_t* out, int64_t K, int64_t N) {
  const int64_t nb = K / QK, row_bytes = nb * block_bytes(T);
  const int64_t tiles = (N + PACK_TILE - 1) / PACK_TILE;
  sluice::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* p = out + (t * nb + b) * PACK_BYTES;
        float* d = reinterpret_cast<float*>(p + 512);
        float* m = d + PACK_TILE;
        std::memset(p, 0, PACK_BYTES);
        for (int64_t i = 0; i < PACK_TILE && t * PACK_TILE + i < N; ++i) {
          uint8_t u[QK];
          unpack_block<T>(w + (t * PACK_TILE + i) * row_bytes + b * block_bytes(T), u, d[i], m[i]);
          for (int j = 0; j < QK; ++j) p[(j / 4) * 64 + i * 4 + j % 4] = u[j];
        }
      }
  });
}

// The packed form of blocks w [N, K / 32 * block_bytes] of `type`: uint8 [tiles, nb * PACK_BYTES].
at::Tensor repack(const at::Tensor& w, int64_t type, int64_t K) {
  const at::Tensor wg = gguf_blocks(w, type, K);  // checks w
  type = base_type(type);
  TORCH_CHECK(type == Q8_0 || type == Q4_0 || type == Q4_1, "repack takes Q8_0 (8), Q4_0 (2) "
              "or Q4_1 (3), not ", type);
  const int64_t N = w.size(0), nb = K / QK, tiles = (N + PACK_TILE - 1) / PACK_TILE;
  auto out = at::empty({tiles, nb * PACK_BYTES}, w.options());
  const uint8_t* wp = wg.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  switch (type) {
    case Q8_0: repack_impl<Q8_0>(wp, op, K, N); break;
    case Q4_0: repack_impl<Q4_0>(wp, op, K, N); break;
    default: repack_impl<Q4_1>(wp, op, K, N); break;
  }
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define SLUICE_PACKED_GEMM 1

// R rows of x (from row m0) times TL tiles (from pointer tile[0..TL)): out[r][t] = 16 sums.
template <int R, int TL>
inline void packed_micro(const QuantX& qx, int64_t m0, const uint8_t* const* tile, int64_t nb,
                         __m512 (&acc)[R][TL]) {
  const int64_t qs = qx.nbp * QK;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < TL; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i isum[R][TL];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int t = 0; t < TL; ++t) isum[r][t] = _mm512_setzero_si512();
    const uint8_t* p[TL];
#pragma GCC unroll 2
    for (int t = 0; t < TL; ++t) {
      p[t] = tile[t] + b * PACK_BYTES;
      // 4 blocks ahead, past the tile's end into the next one's start (as an integer: past the
      // buffer's end at its last tile, which a prefetch may touch but a pointer may not)
      const uintptr_t ahead = reinterpret_cast<uintptr_t>(p[t]) + 4 * PACK_BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      __m512i wv[TL];
#pragma GCC unroll 2
      for (int t = 0; t < TL; ++t) wv[t] = _mm512_load_si512(p[t] + g * 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, qx.q + (m0 + r) * qs + b * QK + g * 4, 4);
        const __m512i xb = _mm512_set1_epi32(x4);
#pragma GCC unroll 2
        for (int t = 0; t < TL; ++t) isum[r][t] = _mm512_dpbusd_epi32(isum[r][t], wv[t], xb);
      }
    }
    __m512 dw[TL], mw[TL];
#pragma GCC unroll 2
    for (int t = 0; t < TL; ++t) {
      dw[t] = _mm512_load_ps(reinterpret_cast<const float*>(p[t] + 512));
      mw[t] = _mm512_load_ps(reinterpret_cast<const float*>(p[t] + 512) + PACK_TILE);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(qx.d[((m0 + r) * qx.nbp + b) * 8]);
      const __m512 sx = _mm512_set1_ps(qx.s[(m0 + r) * qx.nbp + b]);
#pragma GCC unroll 2
      for (int t = 0; t < TL; ++t) {
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][t]), _mm512_mul_ps(dw[t], dx), acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(mw[t], sx, acc[r][t]);
      }
    }
  }
}

template <int R, int TL>
void packed_rows(const QuantX& qx, int64_t m0, const uint8_t* packed, int64_t t0, int64_t nb,
                 const float* bias, at::BFloat16* y, int64_t N) {
  const uint8_t* tile[TL];
  for (int t = 0; t < TL; ++t) tile[t] = packed + (t0 + t) * nb * PACK_BYTES;
  __m512 acc[R][TL];
  packed_micro<R, TL>(qx, m0, tile, nb, acc);
  for (int t = 0; t < TL; ++t) {
    const int64_t n0 = (t0 + t) * PACK_TILE, cols = std::min<int64_t>(PACK_TILE, N - n0);
    const __mmask16 k = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256i h = to_bf16(_mm512_add_ps(acc[r][t], bv));
      _mm256_mask_storeu_epi16(y + (m0 + r) * N + n0, k, h);
    }
  }
}

template <int TL>
void packed_tail(int rows, const QuantX& qx, int64_t m0, const uint8_t* packed, int64_t t0,
                 int64_t nb, const float* bias, at::BFloat16* y, int64_t N) {
  switch (rows) {
    case 1: return packed_rows<1, TL>(qx, m0, packed, t0, nb, bias, y, N);
    case 2: return packed_rows<2, TL>(qx, m0, packed, t0, nb, bias, y, N);
    case 3: return packed_rows<3, TL>(qx, m0, packed, t0, nb, bias, y, N);
    default: return packed_rows<4, TL>(qx, m0, packed, t0, nb, bias, y, N);
  }
}

// y (bfloat16 [M, N]) = x (bfloat16 [M, K]) w^T + bias with w packed by `repack`. The threads
// split pairs of tiles; rows of x go 4 at a time, in blocks of PACKED_M_BLOCK rows so that a
// block of x stays in cache while the tiles pass over it.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "x: a 2-D bfloat16 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK, tiles = (N + PACK_TILE - 1) / PACK_TILE;
  TORCH_CHECK(K % QK == 0 && packed.dim() == 2 && packed.size(0) == tiles &&
              packed.size(1) == nb * PACK_BYTES && packed.scalar_type() == at::kByte &&
              packed.is_contiguous(), "packed: the repacked blocks of [", N, ", ", K, "]");
  TORCH_CHECK(packed.device().is_cpu() &&
              reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "packed: a 64-byte aligned CPU tensor");
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N,
                "bias: [N] on the CPU");
    b = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  const at::Tensor xc = x.contiguous();
  packed_gemm(xc.data_ptr<at::BFloat16>(), packed.data_ptr<uint8_t>(),
              bias ? b.data_ptr<float>() : nullptr, y.data_ptr<at::BFloat16>(), M, K, N);
  return y;
}

void packed_gemm(const at::BFloat16* x, const uint8_t* pp, const float* bp, at::BFloat16* yp,
                 int64_t M, int64_t K, int64_t N) {
  if (M == 0) return;
  const int64_t nb = K / QK, tiles = (N + PACK_TILE - 1) / PACK_TILE;
  QuantX qx(M, nb);
  quantize_x(x, K, qx);
  constexpr int64_t PACKED_M_BLOCK = 256;
  const int64_t pairs = (tiles + 1) / 2, tile_bytes = nb * PACK_BYTES;
  sluice::parallel_for(0, pairs, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t mb = 0; mb < M; mb += PACKED_M_BLOCK) {
      const int64_t me = std::min(M, mb + PACKED_M_BLOCK), passes = (me - mb + 3) / 4;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t t0 = 2 * c;
        // While a pair is computed, the next pair of this chunk [c0, c1) is fetched into L2, a
        // slice at each pass over 4 rows of x (the first pair of a chunk is not): a decode
        // step's weights come from L3 or memory, and the first pass over a pair would otherwise
        // wait for them. The GEMMs of a 32-row decode step of SmolLM2-135M (Xeon model 207,
        // at::parallel_for's one chunk a thread): 5-9% less time; fetching the whole next pair
        // at the first pass instead gave nothing.
        const int64_t next_bytes =
            c + 1 < c1 ? std::min<int64_t>(2, tiles - t0 - 2) * tile_bytes : 0;
        const uint8_t* next = next_bytes ? pp + (t0 + 2) * tile_bytes : pp;
        const int64_t slice = (next_bytes + 64 * passes - 1) / (64 * passes) * 64;
        for (int64_t m = mb, k = 0; m < me; m += 4, ++k) {
          for (int64_t i = k * slice; i < std::min(next_bytes, (k + 1) * slice); i += 64)
            _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T1);
          const int rows = static_cast<int>(std::min<int64_t>(4, me - m));
          if (t0 + 1 < tiles) packed_tail<2>(rows, qx, m, pp, t0, nb, bp, yp, N);
          else packed_tail<1>(rows, qx, m, pp, t0, nb, bp, yp, N);
        }
      }
    }
  });
}
#else
void packed_gemm(const at::BFloat16*, const uint8_t*, const float*, at::BFloat16*, int64_t,
                 int64_t, int64_t) {
  TORCH_CHECK(false, "this build has no packed GEMM (it needs AVX-512 VNNI)");
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  sluice::bind_pool(m);
  m.attr("types") = pybind11::make_tuple(int64_t{Q4_0}, int64_t{Q4_1}, int64_t{Q8_0},
                                         int64_t{Q4_K}, int64_t{Q6_K});
#if defined(SLUICE_I8_K_QUANTS)
  m.attr("int8_types") = pybind11::make_tuple(int64_t{Q4_0}, int64_t{Q4_1}, int64_t{Q8_0},
                                              int64_t{Q4_K}, int64_t{Q6_K});
#else
  m.attr("int8_types") = pybind11::make_tuple(int64_t{Q4_0}, int64_t{Q4_1}, int64_t{Q8_0});
#endif
  m.attr("block_values") = QK;
#if defined(__AVX512F__)
  m.attr("isa") = "avx512";
#elif defined(__AVX2__)
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "generic";
#endif
  m.attr("int8_isa") = SLUICE_I8_ISA;
  m.attr("packed_type") = PACKED;  // linear_rows' type id for repack's layout
  m.def("quant_linear", &quant_linear, pybind11::arg("x"), pybind11::arg("w"),
        pybind11::arg("type"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("int8_activations") = false);
  m.def("quantize_activations", &quantize_activations, pybind11::arg("x"));
  m.def("dequantize", &dequantize, pybind11::arg("w"), pybind11::arg("type"), pybind11::arg("K"),
        pybind11::arg("dtype"));
  m.def("repack", &repack, pybind11::arg("w"), pybind11::arg("type"), pybind11::arg("K"));
  pybind11::dict interleaved;  // ggml type -> the type id of its interleaved layout
  for (int64_t t : {int64_t{Q4_0}, int64_t{Q4_1}, int64_t{Q8_0}})
    if (has_interleaved(t)) interleaved[pybind11::int_(t)] = pybind11::int_(t | INTERLEAVED);
  m.attr("interleaved_types") = interleaved;
  m.def("interleave", &interleave, pybind11::arg("w"), pybind11::arg("type"), pybind11::arg("K"));
  m.def("gguf_blocks", &gguf_blocks, pybind11::arg("w"), pybind11::arg("type"),
        pybind11::arg("K"));
  // the pointer to linear_rows, for cpu_ops' `_adopt_quant_linear` (its signature is the name)
  m.def("_linear_capsule", [] {
    return pybind11::capsule(const_cast<void*>(static_cast<const void*>(&LINEAR_ROWS)),
                             "sluice.kernels.linear_rows.v2");
  });
#if defined(SLUICE_PACKED_GEMM)
  m.attr("packed_gemm") = true;  // for the types repack takes
  m.attr("packed_types") = pybind11::make_tuple(int64_t{Q4_0}, int64_t{Q4_1}, int64_t{Q8_0});
  m.def("packed_linear", &packed_linear, pybind11::arg("x"), pybind11::arg("packed"),
        pybind11::arg("N"), pybind11::arg("bias") = pybind11::none());
#else
  m.attr("packed_gemm") = false;
  m.attr("packed_types") = pybind11::make_tuple();
#endif
}
