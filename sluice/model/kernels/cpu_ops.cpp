// sluice's CPU kernels: attention over the token-slot KV pool (decode, and prefill in groups of
// a request's queries), linear layers of a few rows (decode of one or a few requests), and the fused
// elementwise steps of a decoder layer (residual add + RMSNorm, SiLU-and-multiply, rotary
// embedding), each one pass over its rows instead of the dozen small PyTorch ops they replace.
//
// Storage is float32 or bfloat16; arithmetic is float32 throughout, but on AMX tiles, where the
// probabilities are rounded to bfloat16 for their products with V (as PyTorch's attention does).
// Vectors are GCC/Clang vector extensions of W floats, one AVX-512 or AVX2 register: W = 16 where
// the CPU has AVX-512,
// else 8 (the build is -march=native; 16-lane vectors split over AVX2 registers ran 1.7x slower
// than 8-lane ones; -DSLUICE_LANES=8 forces 8, which the tests build too). Work is split over
// at::get_num_threads() threads by sluice::parallel_for (parallel.h).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: half the build time, for nothing used here
#include <ATen/Parallel.h>

#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// load_row() splits bfloat16 pairs by the halves of a 32-bit word
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "little-endian CPUs only");

#ifndef SLUICE_LANES
#if defined(__AVX512F__)
#define SLUICE_LANES 16
#else
#define SLUICE_LANES 8
#endif
#endif
static_assert(SLUICE_LANES == 8 || SLUICE_LANES == 16, "SLUICE_LANES: 8 or 16");

namespace {

constexpr int W = SLUICE_LANES;  // floats per vector
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));  // W bfloat16 bit patterns

inline vf bits_to_float(vu w) {
  vf v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline void from_float(float x, float* p) { *p = x; }
inline void from_float(float x, at::BFloat16* p) { *p = at::BFloat16(x); }  // round to nearest

// ---------------------------------------------------------------------------------------------
// Rows of D = W * C values as C vectors. float32 keeps their order. bfloat16 reads each 2W
// values as W 32-bit words and splits them into the even and the odd values (a shift and a
// mask, no shuffles), so the lanes hold a fixed permutation of the row, the same for q, K and V:
// dot products are unchanged, and store_row() puts the output back in order.
// ---------------------------------------------------------------------------------------------
template <int C>
inline void load_row(const float* p, vf* v) {
  for (int c = 0; c < C; ++c) std::memcpy(&v[c], p + W * c, sizeof(vf));
}

template <int C>
inline void load_row(const at::BFloat16* p, vf* v) {
  int c = 0;
  for (; c + 1 < C; c += 2) {
    vu w;
    std::memcpy(&w, p + W * c, sizeof w);
    v[c] = bits_to_float(w << 16);
    v[c + 1] = bits_to_float(w & 0xffff0000u);
  }
  if (c < C) {
    vh h;
    std::memcpy(&h, p + W * c, sizeof h);
    v[c] = bits_to_float(__builtin_convertvector(h, vu) << 16);
  }
}

template <int C>
inline void store_row(const vf* v, float scale, float* p) {
  for (int c = 0; c < C; ++c)
    for (int i = 0; i < W; ++i) p[W * c + i] = v[c][i] * scale;
}

template <int C>
inline void store_row(const vf* v, float scale, at::BFloat16* p) {
  int c = 0;
  for (; c + 1 < C; c += 2)
    for (int i = 0; i < W; ++i) {
      p[W * c + 2 * i] = at::BFloat16(v[c][i] * scale);
      p[W * c + 2 * i + 1] = at::BFloat16(v[c + 1][i] * scale);
    }
  if (c < C)
    for (int i = 0; i < W; ++i) p[W * c + i] = at::BFloat16(v[c][i] * scale);
}

// W consecutive values, in order
inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// 16 lanes with AVX-512: one widening and one narrowing instruction, where GCC 12 lowers the
// generic conversions below to two 8-lane halves and a word permute (bfloat16 add-RMS-norm ran
// at a third of float32's speed in L1); the same bits either way
#if SLUICE_LANES == 16 && defined(__AVX512F__) && defined(__AVX512BW__)
#define SLUICE_BF16_AVX512 1
#endif
inline vf load(const at::BFloat16* p) {
#if defined(SLUICE_BF16_AVX512)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
  vu u;
  std::memcpy(&u, &w, sizeof u);
  return bits_to_float(u);
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  return bits_to_float(__builtin_convertvector(h, vu) << 16);
#endif
}
inline void store(vf v, float* p) { std::memcpy(p, &v, sizeof v); }
inline void store(vf v, at::BFloat16* p) {  // round to nearest even, as at::BFloat16 does
  vu w;
  std::memcpy(&w, &v, sizeof w);
  const vu rounded = (w + 0x7fffu + ((w >> 16) & 1u)) >> 16;
  const vu bits = v != v ? vu{} + 0x7fc0u : rounded;  // NaN stays NaN
#if defined(SLUICE_BF16_AVX512)
  __m512i b;
  std::memcpy(&b, &bits, sizeof b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(b));
#else
  const vh h = __builtin_convertvector(bits, vh);
  std::memcpy(p, &h, sizeof h);
#endif
}
// what storing to T and loading back gives: rounding to T's precision
inline vf round_to(vf v, const float*) { return v; }
inline vf round_to(vf v, const at::BFloat16*) {  // store() then load(), in registers
  vu w;
  std::memcpy(&w, &v, sizeof w);
  const vu rounded = (w + 0x7fffu + ((w >> 16) & 1u)) & 0xffff0000u;
  return bits_to_float(v != v ? vu{} + 0x7fc00000u : rounded);
}

// Lane j of the result is the sum of the W lanes of a[j]: a transposing tree of two-source
// shuffles and adds (30 and 15 for W = 16), instead of W separate horizontal sums.
#if SLUICE_LANES == 16
inline vf reduce(const vf* a) {
  vf r1[8], r2[4], r3[2];
  for (int i = 0; i < 8; ++i)
    r1[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1],
                                    0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a[2 * i], a[2 * i + 1],
                                    8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    r2[i] = __builtin_shufflevector(r1[2 * i], r1[2 * i + 1],
                                    0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(r1[2 * i], r1[2 * i + 1],
                                    4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    r3[i] = __builtin_shufflevector(r2[2 * i], r2[2 * i + 1],
                                    0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            __builtin_shufflevector(r2[2 * i], r2[2 * i + 1],
                                    2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(r3[0], r3[1],
                                 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(r3[0], r3[1],
                                 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
inline vf reduce(const vf* a) {
  vf r1[4], r2[2];
  for (int i = 0; i < 4; ++i)
    r1[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
            __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    r2[i] = __builtin_shufflevector(r1[2 * i], r1[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
            __builtin_shufflevector(r1[2 * i], r1[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(r2[0], r2[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(r2[0], r2[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

// e^x, x clamped to [-87, 88]: 2^t = 2^n * 2^f with n the integer nearest t = x log2(e), so
// |f| <= 1/2, and 2^f = e^(f ln 2) by its Taylor series to degree 6 (relative error < 2e-7,
// about float32 rounding of x log2(e)); unlike std::exp, it vectorizes.
inline vf vexp(vf x) {
  x = x < -87.f ? vf{} - 87.f : x;
  x = x > 88.f ? vf{} + 88.f : x;
  const vf t = x * 1.44269504f;
  const vi n = __builtin_convertvector(t + (t < 0.f ? vf{} - 0.5f : vf{} + 0.5f), vi);
  const vf y = (t - __builtin_convertvector(n, vf)) * 0.693147181f;  // |y| <= ln(2) / 2
  const vf p = 1.f + y * (1.f + y * (0.5f + y * (0.166666672f + y * (0.0416666679f +
               y * (0.00833333377f + y * 0.00138888892f)))));
  vf scale;
  const vu bits = (__builtin_convertvector(n, vu) + 127u) << 23;  // unsigned: no signed overflow
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Every cache line of a row, with locality 1 (prefetcht2 on x86) rather than 3 (prefetcht0):
// decode rows are scattered over the pool, and on the AMD Zen 4 this was measured on, attention
// over 64 requests of ~200 interleaved slots ran 1.3x faster, one request of 2000 slots 1.8x.
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64)
    __builtin_prefetch(c + i, 0, 1);
}

// ---------------------------------------------------------------------------------------------
// Attention over the token-slot pool, read in place (no gather): out[i, h] = softmax(q[i, h] . K
// * scale) . V over the first lens[i] slots of query i's request. Query head h uses KV head h / G
// (grouped-query attention). In float32; each query's sums in the same order whether it is
// attended alone or in a group of its request's queries (attend_group).
// ---------------------------------------------------------------------------------------------
constexpr int64_t BLK = W;  // slots per block (one reduce)
constexpr int64_t AHEAD = 32 / W;  // blocks of rows prefetched ahead: 32 rows

// One query head's scores s[0, L) (s holds L rounded up to BLK): replaced by e^(score -
// largest), the block's padding by 0; returns 1 / their sum and writes the largest score.
// `top`: the scores' lane-wise largest, as the score passes keep it.
inline float softmax_numerators(float* s, vf top, int64_t L, float* largest) {
  const int64_t Lp = (L + BLK - 1) / BLK * BLK;
  float m = top[0];
  for (int i = 1; i < W; ++i) m = std::max(m, top[i]);
  for (int64_t l = L; l < Lp; ++l) s[l] = m;  // block padding: any finite value, zeroed below
  for (int64_t l = 0; l < Lp; l += W) store(vexp(load(s + l) - m), s + l);
  for (int64_t l = L; l < Lp; ++l) s[l] = 0.f;
  vf sum{};
  for (int64_t l = 0; l < Lp; l += W) sum += load(s + l);
  float total = 0.f;
  for (int i = 0; i < W; ++i) total += sum[i];
  *largest = m;
  return 1.f / total;
}

// A query's attention over part of its slots, for one range of heads, unnormalized: per query
// head its largest score, the sum of e^(score - largest), and sum_l e^(score_l - largest) v_l
// (C vectors, in load_row()'s lane order). Parts of one query combine into the softmax over all.
struct Partial {
  float* max_sum;  // [QH, 2]
  vf* acc;         // [QH, C]
};

// KV heads [kh0, kh0 + nkv) of one query over part of its slots, slots[0, L) (L >= 1): q points
// at its first query head, kb, vb at the KV head's part of slot 0. Writes the unnormalized
// result to `part` (flash-decoding; whole queries go through attend_group). Scratch: scores
// [QH, L rounded up to BLK], acc [QH, C], inv [2 QH].
template <typename T, int C>
void attend(const T* q, const T* kb, const T* vb, const int64_t* slots, int64_t L,
            int64_t row_len, int64_t nkv, int64_t G, float scale, Partial part,
            std::vector<float>& scores_buf, std::vector<vf>& acc_buf, std::vector<float>& inv) {
  constexpr int64_t D = W * C;
  const int64_t QH = nkv * G, Lp = (L + BLK - 1) / BLK * BLK, span = nkv * D;
  scores_buf.resize(QH * Lp);
  acc_buf.resize(QH * (C + 1));
  inv.resize(2 * QH);
  float* scores = scores_buf.data();
  vf* acc = acc_buf.data();
  vf* top = acc + QH * C;  // per query head, lane-wise largest score so far
  const T* rows[BLK];

  for (int64_t h = 0; h < QH; ++h) {  // the scaled queries, kept in acc until the V pass
    load_row<C>(q + h * D, acc + h * C);
    for (int c = 0; c < C; ++c) acc[h * C + c] *= scale;
  }
  for (int64_t l = 0; l < std::min(L, AHEAD * BLK); ++l) prefetch_row(kb + slots[l] * row_len, span);
  for (int64_t l0 = 0; l0 < L; l0 += BLK) {  // scores[h, l] = q_h . k_l
    const int64_t n = std::min(BLK, L - l0);
    for (int64_t j = 0; j < BLK; ++j) rows[j] = kb + slots[l0 + std::min(j, n - 1)] * row_len;
    for (int64_t l = l0 + AHEAD * BLK; l < std::min(L, l0 + (AHEAD + 1) * BLK); ++l)
      prefetch_row(kb + slots[l] * row_len, span);
    for (int64_t kh = 0; kh < nkv; ++kh) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kh * G + g;
        vf qv[C], a[BLK];
        for (int c = 0; c < C; ++c) qv[c] = acc[h * C + c];
        for (int64_t j = 0; j < BLK; ++j) {
          vf k[C];
          load_row<C>(rows[j] + kh * D, k);
          vf s = qv[0] * k[0];
          for (int c = 1; c < C; ++c) s += qv[c] * k[c];
          a[j] = s;
        }
        const vf r = reduce(a);  // lanes past the last slot repeat its score
        std::memcpy(scores + h * Lp + l0, &r, sizeof r);
        top[h] = l0 == 0 ? r : (r > top[h] ? r : top[h]);
      }
    }
  }

  for (int64_t l = 0; l < std::min(L, AHEAD * BLK); ++l) prefetch_row(vb + slots[l] * row_len, span);
  for (int64_t h = 0; h < QH; ++h)  // softmax numerators in place, and 1 / their sum
    inv[h] = softmax_numerators(scores + h * Lp, top[h], L, &inv[QH + h]);

  for (int64_t i = 0; i < QH * C; ++i) acc[i] = vf{};
  for (int64_t l0 = 0; l0 < L; l0 += BLK) {  // acc[h] = sum_l p[h, l] v_l
    const int64_t n = std::min(BLK, L - l0);
    for (int64_t j = 0; j < n; ++j) rows[j] = vb + slots[l0 + j] * row_len;
    for (int64_t l = l0 + AHEAD * BLK; l < std::min(L, l0 + (AHEAD + 1) * BLK); ++l)
      prefetch_row(vb + slots[l] * row_len, span);
    for (int64_t kh = 0; kh < nkv; ++kh) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kh * G + g;
        const float* p = scores + h * Lp + l0;
        vf a[C];
        for (int c = 0; c < C; ++c) a[c] = acc[h * C + c];
        for (int64_t j = 0; j < n; ++j) {
          vf v[C];
          load_row<C>(rows[j] + kh * D, v);
          for (int c = 0; c < C; ++c) a[c] += p[j] * v[c];
        }
        for (int c = 0; c < C; ++c) acc[h * C + c] = a[c];
      }
    }
  }
  for (int64_t h = 0; h < QH; ++h) {
    part.max_sum[2 * h] = inv[QH + h];
    part.max_sum[2 * h + 1] = 1.f / inv[h];
    for (int c = 0; c < C; ++c) part.acc[h * C + c] = acc[h * C + c];
  }
}

// Up to this many queries that read the same slots (an extend's tokens of one request) are
// attended together by attend_group: each block of K and V rows is converted to float32 once
// for all of them instead of once per query head.
constexpr int64_t QUERY_GROUP = 8;
// ... and fewer where their scores would pass this many floats (4 MB a thread; a long context)
constexpr int64_t GROUP_SCORES = int64_t{1} << 20;

// attend() for nq consecutive queries over the same slots, query qi over slots[0, lens[qi])
// (each >= 1): q, out point at the first query's first head, the next query q_stride values
// further. Each query's arithmetic is attend()'s, operation for operation (the same float32
// rows, the same sums in the same order), so its result does not depend on the group it is in.
// Scratch as attend()'s, and rows [nkv, BLK, C] for one block of converted K or V rows.
template <typename T, int C>
void attend_group(const T* q, T* out, int64_t q_stride, const int64_t* lens, int64_t nq,
                  const T* kb, const T* vb, const int64_t* slots, int64_t row_len, int64_t nkv,
                  int64_t G, float scale, std::vector<float>& scores_buf,
                  std::vector<vf>& acc_buf, std::vector<float>& inv, std::vector<vf>& rows) {
  constexpr int64_t D = W * C;
  const int64_t QH = nkv * G, R = nq * QH, span = nkv * D;
  const int64_t L = *std::max_element(lens, lens + nq), Lp = (L + BLK - 1) / BLK * BLK;
  scores_buf.resize(R * Lp);
  acc_buf.resize(R * (C + 1));
  inv.resize(2 * R);
  rows.resize(nkv * BLK * C);
  float* scores = scores_buf.data();
  vf* acc = acc_buf.data();
  vf* top = acc + R * C;  // per row (query, head), lane-wise largest score so far
  auto row = [&](int64_t kh, int64_t j) { return rows.data() + (kh * BLK + j) * C; };

  for (int64_t qi = 0; qi < nq; ++qi)
    for (int64_t h = 0; h < QH; ++h) {
      vf* a = acc + (qi * QH + h) * C;
      load_row<C>(q + qi * q_stride + h * D, a);
      for (int c = 0; c < C; ++c) a[c] *= scale;
    }
  for (int64_t l = 0; l < std::min(L, AHEAD * BLK); ++l) prefetch_row(kb + slots[l] * row_len, span);
  for (int64_t l0 = 0; l0 < L; l0 += BLK) {  // scores[r, l] = q_r . k_l
    const int64_t n = std::min(BLK, L - l0);
    for (int64_t l = l0 + AHEAD * BLK; l < std::min(L, l0 + (AHEAD + 1) * BLK); ++l)
      prefetch_row(kb + slots[l] * row_len, span);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t kh = 0; kh < nkv; ++kh) load_row<C>(kb + slots[l0 + j] * row_len + kh * D, row(kh, j));
    for (int64_t qi = 0; qi < nq; ++qi) {
      if (l0 >= lens[qi]) continue;
      const int64_t last = std::min(BLK, lens[qi] - l0) - 1;  // lanes past it repeat its score
      for (int64_t kh = 0; kh < nkv; ++kh) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = qi * QH + kh * G + g;
          vf qv[C], a[BLK];
          for (int c = 0; c < C; ++c) qv[c] = acc[r * C + c];
          for (int64_t j = 0; j < BLK; ++j) {
            const vf* k = row(kh, std::min(j, last));
            vf s = qv[0] * k[0];
            for (int c = 1; c < C; ++c) s += qv[c] * k[c];
            a[j] = s;
          }
          const vf v = reduce(a);
          std::memcpy(scores + r * Lp + l0, &v, sizeof v);
          top[r] = l0 == 0 ? v : (v > top[r] ? v : top[r]);
        }
      }
    }
  }

  for (int64_t l = 0; l < std::min(L, AHEAD * BLK); ++l) prefetch_row(vb + slots[l] * row_len, span);
  float largest;
  for (int64_t r = 0; r < R; ++r)  // softmax numerators in place, and 1 / their sum
    inv[r] = softmax_numerators(scores + r * Lp, top[r], lens[r / QH], &largest);

  for (int64_t i = 0; i < R * C; ++i) acc[i] = vf{};
  for (int64_t l0 = 0; l0 < L; l0 += BLK) {  // acc[r] = sum_l p[r, l] v_l
    const int64_t n = std::min(BLK, L - l0);
    for (int64_t l = l0 + AHEAD * BLK; l < std::min(L, l0 + (AHEAD + 1) * BLK); ++l)
      prefetch_row(vb + slots[l] * row_len, span);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t kh = 0; kh < nkv; ++kh) load_row<C>(vb + slots[l0 + j] * row_len + kh * D, row(kh, j));
    for (int64_t qi = 0; qi < nq; ++qi) {
      if (l0 >= lens[qi]) continue;
      const int64_t nr = std::min(BLK, lens[qi] - l0);
      for (int64_t kh = 0; kh < nkv; ++kh) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = qi * QH + kh * G + g;
          const float* p = scores + r * Lp + l0;
          vf a[C];
          for (int c = 0; c < C; ++c) a[c] = acc[r * C + c];
          for (int64_t j = 0; j < nr; ++j) {
            const vf* v = row(kh, j);
            for (int c = 0; c < C; ++c) a[c] += p[j] * v[c];
          }
          for (int c = 0; c < C; ++c) acc[r * C + c] = a[c];
        }
      }
    }
  }
  for (int64_t qi = 0; qi < nq; ++qi)
    for (int64_t h = 0; h < QH; ++h)
      store_row<C>(acc + (qi * QH + h) * C, inv[qi * QH + h], out + qi * q_stride + h * D);
}

// Writes the softmax-weighted sum of `parts` partials (empty ones have sum 0) to out [QH, D];
// NaN scores make NaN outputs, as without parts.
template <typename T, int C>
void combine(const Partial* parts, int64_t num_parts, int64_t QH, T* out) {
  constexpr int64_t D = W * C;
  for (int64_t h = 0; h < QH; ++h) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < num_parts; ++p)
      if (parts[p].max_sum[2 * h + 1] != 0.f) m = std::max(m, parts[p].max_sum[2 * h]);
    float total = 0.f;
    vf acc[C] = {};
    for (int64_t p = 0; p < num_parts; ++p) {
      if (parts[p].max_sum[2 * h + 1] == 0.f) continue;  // empty (a NaN sum goes through)
      const float w = std::exp(parts[p].max_sum[2 * h] - m);
      total += w * parts[p].max_sum[2 * h + 1];
      for (int c = 0; c < C; ++c) acc[c] += w * parts[p].acc[h * C + c];
    }
    store_row<C>(acc, 1.f / total, out + h * D);
  }
}

// Query i (of N) attends over the first lens[i] slots of kv_indices[rows[i]] (rows null: row i).
template <typename T, int C>
void attention_impl(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                    const at::Tensor& kv_indices, const int64_t* rows, const at::Tensor& lens_t,
                    at::Tensor& out, double scale) {
  constexpr int64_t D = W * C;
  const int64_t N = q.size(0), H = q.size(1), Hkv = k_pool.size(1), G = H / Hkv;
  const int64_t max_kv = kv_indices.size(1), row_len = Hkv * D;  // a slot: [Hkv, D], contiguous
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  const int64_t* lens = lens_t.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // A task is one query (or a group of an extend's queries of one request, which share each
  // converted K and V row) and a range of its KV heads: all of them (each slot row read once)
  // when there are enough queries to keep every thread busy, else one head per task. Too few
  // of those for the threads (one long request decoding) split each query's slots into parts
  // of at least MIN_PART slots, combined after (flash-decoding).
  constexpr int64_t MIN_PART = 256;
  const int64_t threads = at::get_num_threads();
  const int64_t nkv = N >= 2 * threads ? Hkv : 1, QH = nkv * G;
  const int64_t tasks_per_query = Hkv / nkv, heads_tasks = N * tasks_per_query;
  int64_t longest = 0;
  for (int64_t i = 0; i < N; ++i) longest = std::max(longest, lens[i]);
  const int64_t parts = heads_tasks >= 2 * threads ? 1
      : std::max<int64_t>(1, std::min((2 * threads + heads_tasks - 1) / heads_tasks,
                                      longest / MIN_PART));
  if (parts == 1) {  // groups of queries over the same slots (attend_group), a task per group
    // small enough that there are at least 4 tasks a thread where the queries allow it, and
    // that a group's scores stay within GROUP_SCORES
    const int64_t most = std::clamp<int64_t>(heads_tasks / (4 * threads), 1, QUERY_GROUP);
    std::vector<int64_t> first{0};  // first query of each group, then N
    int64_t group_len = (lens[0] + BLK - 1) / BLK * BLK;  // the group's longest query, whole blocks
    for (int64_t i = 1; i < N; ++i) {
      const int64_t len = std::max(group_len, (lens[i] + BLK - 1) / BLK * BLK);
      if (rows == nullptr || rows[i] != rows[first.back()] || i - first.back() == most ||
          (i - first.back() + 1) * QH * len > GROUP_SCORES) {
        first.push_back(i);
        group_len = (lens[i] + BLK - 1) / BLK * BLK;
      } else {
        group_len = len;
      }
    }
    first.push_back(N);
    const int64_t groups = static_cast<int64_t>(first.size()) - 1;
    sluice::parallel_for(0, groups * tasks_per_query, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, inv;
      std::vector<vf> acc, kv_rows;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t gi = task / tasks_per_query, kh0 = (task % tasks_per_query) * nkv;
        const int64_t i = first[gi], h0 = kh0 * G;
        const int64_t* slots = idx + (rows ? rows[i] : i) * max_kv;
        attend_group<T, C>(qp + (i * H + h0) * D, op + (i * H + h0) * D, H * D, lens + i,
                           first[gi + 1] - i, kp + kh0 * D, vp + kh0 * D, slots, row_len, nkv, G,
                           static_cast<float>(scale), scores, acc, inv, kv_rows);
      }
    });
    return;
  }
  std::vector<float> max_sum(heads_tasks * parts * QH * 2);  // parts > 1 from here
  std::vector<vf> part_acc(heads_tasks * parts * QH * C);
  auto partial = [&](int64_t task) {  // task = heads task * parts + part
    return Partial{max_sum.data() + task * QH * 2, part_acc.data() + task * QH * C};
  };
  sluice::parallel_for(0, heads_tasks * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv;
    std::vector<vf> acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t ht = task / parts, p = task % parts;
      const int64_t i = ht / tasks_per_query, kh0 = (ht % tasks_per_query) * nkv, h0 = kh0 * G;
      const int64_t* slots = idx + (rows ? rows[i] : i) * max_kv;
      const T* qh = qp + (i * H + h0) * D;
      const int64_t chunk = (lens[i] + parts - 1) / parts;
      const int64_t first = p * chunk, last = std::min(lens[i], first + chunk);
      if (first >= last) {  // nothing left for this part: an empty partial
        std::fill_n(partial(task).max_sum, QH * 2, 0.f);
        continue;
      }
      attend<T, C>(qh, kp + kh0 * D, vp + kh0 * D, slots + first, last - first, row_len, nkv, G,
                   static_cast<float>(scale), partial(task), scores, acc, inv);
    }
  });
  sluice::parallel_for(0, heads_tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ht = begin; ht < end; ++ht) {
      const int64_t i = ht / tasks_per_query, h0 = (ht % tasks_per_query) * nkv * G;
      std::vector<Partial> ps(parts);
      for (int64_t p = 0; p < parts; ++p) ps[p] = partial(ht * parts + p);
      combine<T, C>(ps.data(), parts, QH, op + (i * H + h0) * D);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// A shared prefix's part of the attention on AMX tiles (bfloat16, head_dim 64 or 128): R query
// rows per KV head over the same P keys. Per KV head, K is laid out once as the tiles' B operand
// (pairs of dimensions by 16 keys) and V as pairs of keys by 16 dimensions; then each block of
// 16 query rows takes its scores for all P keys in float32 (one tile a 16-key block), the exact
// softmax over them (largest score, e^(score - largest), their sum: no rescaling as it goes),
// and the probabilities, rounded to bfloat16, times V (as PyTorch's blocked attention on AMX
// rounds them). Writes the normalized output, bfloat16, and each row's log-sum-exp: what
// _scaled_dot_product_flash_attention_for_cpu gives. K and V are read from the pool by slot,
// not gathered first. On the Xeon (lscpu model 167, 2 threads), a decode step's 32 requests
// over 450 shared and 30 own slots (9 heads, 3 KV heads, head_dim 64), the whole cascade: 203
// µs a layer through PyTorch's attention, 124 through this.
// ---------------------------------------------------------------------------------------------
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && SLUICE_LANES == 16 && defined(__linux__)
#define SLUICE_AMX_PREFIX 1

// Whether this process may use AMX tiles: Linux grants their state on request, once a process.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile used here: 16 rows of 64 bytes (16 floats, or 32 bfloat16). A constant in memory:
// a configuration built on the stack made ldtilecfg fault in one build, where only part of its
// stores were left before it (the compiler need not see ldtilecfg read them).
alignas(64) constexpr TileConfig TILES_16x64 = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

inline void amx_configure() { _tile_loadconfig(&TILES_16x64); }

constexpr int64_t TILE_ELEMS = 512;  // bfloat16 values of a B tile

// r[i] holds row i of a 16 x 16 matrix of 32-bit values; afterwards, column i.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // each 128-bit lane of r[i] now holds a 4 x 4 block; gather the lanes across rows
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// e^x, 16 lanes, to about 3e-6 relative: 2^(x log2 e) as 2^n (scalef) times a degree-5
// polynomial of the fraction in [-1/2, 1/2]. A NaN stays a NaN; far below zero, about 1e-38.
inline __m512 exp512(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-126.f), _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.33335581e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The interleaving of two rows of 16 bfloat16 values into pairs: lane 2n the first row's n,
// 2n + 1 the second's (V's B tiles).
inline __m512i pair_lanes() {
  alignas(64) uint16_t index[32];
  for (int n = 0; n < 16; ++n) {
    index[2 * n] = static_cast<uint16_t>(n);
    index[2 * n + 1] = static_cast<uint16_t>(16 + n);
  }
  return _mm512_load_si512(index);
}

// Keys [32 b32, 32 b32 + 32) of L (key j of KV head h at pool + slots[j] * row_len + h * D) as
// B tiles: K's two 16-key blocks at kt, [block][32-dimension chunk], row r of a tile holding
// dimensions (2r, 2r + 1) of the chunk for each of the block's 16 keys; V's D / 16 tiles at vt,
// [16-dimension tile], row r holding keys (2r, 2r + 1) of the block for each of the tile's 16
// dimensions. Keys past L are zeros.
template <int D>
inline void amx_lay_keys(const uint16_t* k_pool, const uint16_t* v_pool, const int64_t* slots,
                         int64_t row_len, int64_t h, int64_t L, int64_t b32, uint16_t* kt,
                         uint16_t* vt, __m512i pairs) {
  constexpr int NC = D / 32;
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t first = b32 * 32 + half * 16;
    for (int c = 0; c < NC; ++c) {
      __m512i rows[16];
      for (int j = 0; j < 16; ++j)
        rows[j] = first + j < L
            ? _mm512_loadu_si512(k_pool + slots[first + j] * row_len + h * D + c * 32)
            : _mm512_setzero_si512();
      transpose16(rows);
      uint16_t* dst = kt + (half * NC + c) * TILE_ELEMS;
      for (int r = 0; r < 16; ++r) _mm512_storeu_si512(dst + r * 32, rows[r]);
    }
  }
  for (int64_t t = 0; t < D / 16; ++t) {
    uint16_t* dst = vt + t * TILE_ELEMS;
    for (int r = 0; r < 16; ++r) {
      const int64_t a = b32 * 32 + 2 * r;
      const __m256i lo = a < L ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                     v_pool + slots[a] * row_len + h * D + t * 16))
                               : _mm256_setzero_si256();
      const __m256i hi = a + 1 < L ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                         v_pool + slots[a + 1] * row_len + h * D + t * 16))
                                   : _mm256_setzero_si256();
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      _mm512_storeu_si512(dst + r * 32, _mm512_permutexvar_epi16(pairs, both));
    }
  }
}

// Per thread: the scores and probabilities of 16 rows (row stride `cap` keys) and their output.
struct AmxScratch {
  int64_t cap = 0;
  std::unique_ptr<float[]> scores, out;
  std::unique_ptr<uint16_t[]> probs;
  void reserve(int64_t keys) {
    if (keys <= cap) return;
    cap = (keys + 31) / 32 * 32;
    scores.reset(new float[16 * cap]);
    probs.reset(new uint16_t[16 * cap]);
    if (!out) out.reset(new float[16 * 128]);  // head_dim up to 128
  }
};

// 16 query rows (row i at q + i * D, bfloat16, finite) over the first lim[i] >= 1 keys laid out
// by amx_lay_keys (kt, vt: the first block's tiles, blocks consecutive): each row's softmax of
// its scaled scores, exact (largest score first), the probabilities rounded to bfloat16 for the
// products with V. Writes sc.out [16][D], normalized, and (lse not null) lse[i], the natural
// log-sum-exp of the scaled scores. The tiles are configured (amx_configure).
template <int D>
inline void amx_rows(const at::BFloat16* q, const uint16_t* kt, const uint16_t* vt,
                     const int64_t* lim, float scale, AmxScratch& sc, float* lse) {
  constexpr int NC = D / 32;
  int64_t most = 1;
  for (int i = 0; i < 16; ++i) most = std::max(most, lim[i]);
  const int64_t n32 = (most + 31) / 32, P32 = n32 * 32;
  sc.reserve(P32);
  const int64_t cap = sc.cap;
  float* scores = sc.scores.get();
  uint16_t* probs = sc.probs.get();
  _tile_loadd(4, q, D * 2);
  _tile_loadd(5, q + 32, D * 2);
  if constexpr (NC == 4) {
    _tile_loadd(6, q + 64, D * 2);
    _tile_loadd(7, q + 96, D * 2);
  }
  for (int64_t b = 0; b < n32; ++b) {  // scores[i, key] = q_i . k_key, 32 keys a step
    const uint16_t* k0 = kt + 2 * b * NC * TILE_ELEMS;
    const uint16_t* k1 = k0 + NC * TILE_ELEMS;
    _tile_zero(0);
    _tile_zero(2);
    _tile_loadd(1, k0, 64);
    _tile_loadd(3, k1, 64);
    _tile_dpbf16ps(0, 4, 1);
    _tile_dpbf16ps(2, 4, 3);
    _tile_loadd(1, k0 + TILE_ELEMS, 64);
    _tile_loadd(3, k1 + TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 5, 1);
    _tile_dpbf16ps(2, 5, 3);
    if constexpr (NC == 4) {
      _tile_loadd(1, k0 + 2 * TILE_ELEMS, 64);
      _tile_loadd(3, k1 + 2 * TILE_ELEMS, 64);
      _tile_dpbf16ps(0, 6, 1);
      _tile_dpbf16ps(2, 6, 3);
      _tile_loadd(1, k0 + 3 * TILE_ELEMS, 64);
      _tile_loadd(3, k1 + 3 * TILE_ELEMS, 64);
      _tile_dpbf16ps(0, 7, 1);
      _tile_dpbf16ps(2, 7, 3);
    }
    _tile_stored(0, scores + b * 32, cap * 4);
    _tile_stored(2, scores + b * 32 + 16, cap * 4);
  }
  float inv[16];
  for (int64_t i = 0; i < 16; ++i) {  // each row's softmax, to bfloat16 probabilities
    const float* s = scores + i * cap;
    const int64_t full = lim[i] / 16 * 16;  // keys in whole vectors; the rest masked
    const __mmask16 tail = static_cast<__mmask16>((1u << (lim[i] - full)) - 1);
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t l = 0; l < full; l += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + l));
    if (tail) top = _mm512_mask_max_ps(top, tail, top, _mm512_loadu_ps(s + full));
    const float m = _mm512_reduce_max_ps(top) * scale;
    const __m512 vscale = _mm512_set1_ps(scale), vm = _mm512_set1_ps(-m);
    __m512 sum = _mm512_setzero_ps();
    uint16_t* pr = probs + i * cap;
    for (int64_t l = 0; l < P32; l += 32) {
      __m512 e[2];
      for (int x = 0; x < 2; ++x) {
        const int64_t at = l + 16 * x;
        const __mmask16 keep = at < full ? __mmask16(0xffff) : at == full ? tail : 0;
        e[x] = keep ? _mm512_maskz_mov_ps(keep, exp512(_mm512_fmadd_ps(_mm512_loadu_ps(s + at),
                                                                       vscale, vm)))
                    : _mm512_setzero_ps();
        sum = _mm512_add_ps(sum, e[x]);
      }
      _mm512_storeu_si512(pr + l, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
    const float total = _mm512_reduce_add_ps(sum);
    inv[i] = 1.f / total;
    if (lse) lse[i] = m + std::log(total);
  }
  for (int64_t half = 0; half < D / 64; ++half) {  // out = probs . V, 64 dimensions at once
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < n32; ++b) {
      const uint16_t* vt_b = vt + (b * (D / 16) + half * 4) * TILE_ELEMS;
      _tile_loadd(4, probs + b * 32, cap * 2);
      _tile_loadd(5, vt_b, 64);
      _tile_loadd(6, vt_b + TILE_ELEMS, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, vt_b + 2 * TILE_ELEMS, 64);
      _tile_loadd(6, vt_b + 3 * TILE_ELEMS, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 6);
    }
    float* oh = sc.out.get() + half * 64;
    _tile_stored(0, oh, D * 4);
    _tile_stored(1, oh + 16, D * 4);
    _tile_stored(2, oh + 32, D * 4);
    _tile_stored(3, oh + 48, D * 4);
  }
  for (int64_t i = 0; i < 16; ++i) {
    float* row = sc.out.get() + i * D;
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(row + d, _mm512_mul_ps(_mm512_loadu_ps(row + d), _mm512_set1_ps(inv[i])));
  }
}

// q [Hkv, Rp, D] (Rp: R rounded up to 16, the padding rows finite); key j of KV head h at
// k_pool + slots[j] * row_len + h * D (its V likewise), j < P; writes o [Hkv, R, D] and lse
// [Hkv, R].
template <int D>
void amx_prefix_attention(const at::BFloat16* q, const at::BFloat16* k_pool,
                          const at::BFloat16* v_pool, const int64_t* slots, int64_t row_len,
                          int64_t Hkv, int64_t R, int64_t P, float scale, at::BFloat16* o,
                          float* lse) {
  static_assert(D % 64 == 0 && D <= 128, "head_dim 64 or 128");
  constexpr int NC = D / 32;
  const int64_t Rp = (R + 15) / 16 * 16, nq = Rp / 16, n32 = (P + 31) / 32;
  const int64_t k_tiles = 2 * n32 * NC, v_tiles = n32 * (D / 16);  // per KV head
  std::unique_ptr<uint16_t[]> kt(new uint16_t[Hkv * k_tiles * TILE_ELEMS]);
  std::unique_ptr<uint16_t[]> vt(new uint16_t[Hkv * v_tiles * TILE_ELEMS]);
  const auto* kb = reinterpret_cast<const uint16_t*>(k_pool);
  const auto* vb = reinterpret_cast<const uint16_t*>(v_pool);
  sluice::parallel_for(0, Hkv * n32, 1, [&](int64_t begin, int64_t end) {
    const __m512i pairs = pair_lanes();
    for (int64_t u = begin; u < end; ++u) {
      const int64_t h = u / n32, b32 = u % n32;
      amx_lay_keys<D>(kb, vb, slots, row_len, h, P, b32,
                      kt.get() + (h * k_tiles + 2 * b32 * NC) * TILE_ELEMS,
                      vt.get() + (h * v_tiles + b32 * (D / 16)) * TILE_ELEMS, pairs);
    }
  });
  sluice::parallel_for(0, Hkv * nq, 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    AmxScratch sc;
    int64_t lim[16];
    float row_lse[16];
    std::fill_n(lim, 16, P);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / nq, qb = task % nq;
      amx_rows<D>(q + (h * Rp + qb * 16) * D, kt.get() + h * k_tiles * TILE_ELEMS,
                  vt.get() + h * v_tiles * TILE_ELEMS, lim, scale, sc, row_lse);
      for (int64_t i = 0; i < 16 && qb * 16 + i < R; ++i) {
        const int64_t r = h * R + qb * 16 + i;
        lse[r] = row_lse[i];
        for (int64_t d = 0; d < D; d += 16) store(load(sc.out.get() + i * D + d), o + r * D + d);
      }
    }
    _tile_release();
  });
}

// Requests of many new tokens each, attended on AMX tiles, causal: span s = spans[s] = (its row
// b of kv_indices, its first query t0 in q, its n queries, its prefix p): query t0 + i sees the
// first p + i + 1 slots of row b (its new tokens' K and V already in the pool). q, out [T, H, D]
// bfloat16, q's rows q.stride(0) values apart; writes those queries' rows of out.
template <int D>
void amx_dense_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                         const at::Tensor& kv_indices, const at::Tensor& spans, double scale,
                         at::Tensor& out) {
  constexpr int NC = D / 32;
  const int64_t H = q.size(1), Hkv = k_pool.size(1), G = H / Hkv, row_len = Hkv * D;
  const int64_t q_row = q.stride(0);  // a query's values apart: H * D, or the qkv view's width
  const int64_t S = spans.size(0), max_kv = kv_indices.size(1);
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  const auto* qp = q.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const auto* kb = reinterpret_cast<const uint16_t*>(k_pool.data_ptr<at::BFloat16>());
  const auto* vb = reinterpret_cast<const uint16_t*>(v_pool.data_ptr<at::BFloat16>());
  // per span: its 32-key blocks, where its tiles start, and its 16-row blocks of queries
  std::vector<int64_t> n32(S), tile0(S + 1, 0), layout(S + 1, 0), tasks(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t L = sp[4 * s + 3] + sp[4 * s + 2];
    n32[s] = (L + 31) / 32;
    tile0[s + 1] = tile0[s] + Hkv * n32[s] * (2 * NC + D / 16);
    layout[s + 1] = layout[s] + Hkv * n32[s];
    tasks[s + 1] = tasks[s] + Hkv * ((sp[4 * s + 2] * G + 15) / 16);
  }
  std::unique_ptr<uint16_t[]> tiles(new uint16_t[tile0[S] * TILE_ELEMS]);
  // span s, KV head h: its K tiles, then its V tiles
  auto k_tiles = [&](int64_t s, int64_t h) {
    return tiles.get() + (tile0[s] + h * n32[s] * (2 * NC + D / 16)) * TILE_ELEMS;
  };
  auto v_tiles = [&](int64_t s, int64_t h) { return k_tiles(s, h) + 2 * n32[s] * NC * TILE_ELEMS; };
  sluice::parallel_for(0, layout[S], 1, [&](int64_t begin, int64_t end) {
    const __m512i pairs = pair_lanes();
    for (int64_t u = begin; u < end; ++u) {
      const int64_t s = std::upper_bound(layout.begin(), layout.end(), u) - layout.begin() - 1;
      const int64_t h = (u - layout[s]) / n32[s], b32 = (u - layout[s]) % n32[s];
      const int64_t L = sp[4 * s + 3] + sp[4 * s + 2];
      amx_lay_keys<D>(kb, vb, idx + sp[4 * s] * max_kv, row_len, h, L, b32,
                      k_tiles(s, h) + 2 * b32 * NC * TILE_ELEMS,
                      v_tiles(s, h) + b32 * (D / 16) * TILE_ELEMS, pairs);
    }
  });
  sluice::parallel_for(0, tasks[S], 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    AmxScratch sc;
    alignas(64) at::BFloat16 rows[16 * D];
    int64_t lim[16];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = std::upper_bound(tasks.begin(), tasks.end(), task) - tasks.begin() - 1;
      const int64_t blocks = (sp[4 * s + 2] * G + 15) / 16;
      const int64_t h = (task - tasks[s]) / blocks, qb = (task - tasks[s]) % blocks;
      const int64_t t0 = sp[4 * s + 1], n = sp[4 * s + 2], p = sp[4 * s + 3];
      for (int64_t i = 0; i < 16; ++i) {  // row r: query r / G, head h G + r % G
        const int64_t r = qb * 16 + i, t = r / G, g = r % G;
        if (t < n) {
          std::memcpy(rows + i * D, qp + (t0 + t) * q_row + (h * G + g) * D,
                      D * sizeof(at::BFloat16));
          lim[i] = p + t + 1;
        } else {
          std::memset(rows + i * D, 0, D * sizeof(at::BFloat16));
          lim[i] = 1;
        }
      }
      amx_rows<D>(rows, k_tiles(s, h), v_tiles(s, h), lim, static_cast<float>(scale), sc, nullptr);
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t r = qb * 16 + i, t = r / G, g = r % G;
        if (t >= n) break;
        at::BFloat16* dst = op + ((t0 + t) * H + h * G + g) * D;
        for (int64_t d = 0; d < D; d += 16) store(load(sc.out.get() + i * D + d), dst + d);
      }
    }
    _tile_release();
  });
}

// ---------------------------------------------------------------------------------------------
// A bfloat16 linear layer on AMX tiles for batches of many rows (prefills): y = x w^T + bias,
// float32 sums rounded once to bfloat16, as oneDNN's AMX GEMM gives them (on the Xeon model 207,
// SmolLM2's shapes, all but 0 to 5 in 10^5 outputs had the same bits). w is laid out once
// (amx_pack_linear) as the tiles' B operand: for each 32 outputs and each 32 values of K, two
// tiles of 16 outputs whose row j holds k = 2j and 2j + 1 of every output. Each 32 x 32 block
// of y takes 4 accumulator tiles over K, x's 32 rows read in place as A tiles and kept in L1 (K
// in passes of at most AMX_LINEAR_KC values), w's tiles streamed past L1 from L2 (TILELOADDT1).
// While a pass runs, its blocks fetch the x of the next pass (the same rows' next values of K, or
// the next row block) into L2, a line a row at each step. A block's sums are rounded into y (plus
// bias, or SiLU-and-multiply) a few rows at each step of the next block, so that the vector
// work runs beside the tile instructions instead of between blocks (SmolLM2's fused gate_up at
// 2048 rows: 0.70-0.78 of the time of rounding each block at once; the other layers 0.90-0.98).
//
// The work is cut in tasks, a slice of w (about AMX_LINEAR_SLICE_BYTES of B tiles, read into L2
// once, the first row block fetching each next block ahead) by a group of row blocks: x is read
// once for each slice, so the wider the slice, the less of it is read again. The threads claim
// the tasks one at a time rather than split them evenly up front: on a shared
// machine one core's AMX unit can run at a quarter of the other's speed for seconds at a time
// (Xeon model 207 under KVM, each core alone: 510 to 2300 GFLOP/s within a minute), and a fixed
// half would leave the fast core waiting for the slow one. Figures: benchmarks/README.md.
// ---------------------------------------------------------------------------------------------
constexpr int64_t AMX_LINEAR_SLICE_BYTES = 640 << 10;  // of the 2 MB L2 (Sapphire Rapids)
constexpr int64_t AMX_LINEAR_KC = 640;  // values of K a pass holds x's 32 rows of in L1 (40 KB)

void amx_pack_impl(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
  const int64_t NB = (N + 31) / 32, KS = K / 32;
  sluice::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t ks = 0; ks < KS; ++ks)
        for (int64_t h = 0; h < 2; ++h) {
          uint16_t* t = out + ((nb * KS + ks) * 2 + h) * TILE_ELEMS;
          for (int64_t c = 0; c < 16; ++c) {
            const int64_t n = nb * 32 + h * 16 + c;
            for (int64_t j = 0; j < 32; ++j)
              t[(j / 2) * 32 + c * 2 + j % 2] = n < N ? w[n * K + ks * 32 + j] : 0;
          }
        }
  });
}

// Adds `steps` 32-value steps of K to the 4 accumulator tiles: a, 32 rows of x (row stride lda
// values), b the B tiles of 32 outputs; `ahead`, if not null, the B tiles to fetch into L2;
// `xn`, if not null, `xn_rows` rows of the `xn_steps` steps of x that the next pass reads (row
// stride lda), their lines a row fetched into L2 a step at a time (step ks: lines ks, ks +
// steps, ...). between(ks) runs after each step's tile instructions are issued: vector work
// there overlaps the tiles' (the last block's rounding).
template <typename Between>
inline void amx_linear_steps(const at::BFloat16* a, int64_t lda, const uint16_t* b, int64_t steps,
                             const uint16_t* ahead, const at::BFloat16* xn, int64_t xn_rows,
                             int64_t xn_steps, const Between& between) {
  for (int64_t ks = 0; ks < steps; ++ks) {
    if (ahead)
      for (int64_t l = 0; l < 2 * TILE_ELEMS; l += 32)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + ks * 2 * TILE_ELEMS + l), _MM_HINT_T1);
    for (int64_t line = ks; line < xn_steps; line += steps)
      for (int64_t r = 0; r < xn_rows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(xn + r * lda + line * 32), _MM_HINT_T1);
    _tile_loadd(4, a + ks * 32, lda * 2);
    _tile_stream_loadd(6, b + ks * 2 * TILE_ELEMS, 64);
    _tile_stream_loadd(7, b + (ks * 2 + 1) * TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + 16 * lda + ks * 32, lda * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    between(ks);
  }
}

// Rows [r0, r1) of a block of sums c [32 x 32] plus bias, rounded to bfloat16, into y (the
// block's first row; row stride N) from column n0 on, at most N - n0 of them; with silu_mul, c's
// first 16 columns are gates and the next 16 their ups, and 16 values of silu(gate) * up go to
// column n0 / 2 of a y of N / 2 columns, rounded as silu_and_mul rounds them on the plain output.
inline void amx_linear_out(const float* c, int64_t r0, int64_t r1, const float* bias, int64_t n0,
                           int64_t N, bool silu_mul, at::BFloat16* y) {
  constexpr const at::BFloat16* bf16 = nullptr;  // round_to's target type
  vf b0, b1;
  std::memcpy(&b0, bias + n0, sizeof b0);
  std::memcpy(&b1, bias + n0 + 16, sizeof b1);
  if (silu_mul) {
    for (int64_t r = r0; r < r1; ++r) {
      const vf g = round_to(load(c + r * 32) + b0, bf16);
      const vf u = round_to(load(c + r * 32 + 16) + b1, bf16);
      store(round_to(g / (1.f + vexp(vf{} - g)), bf16) * u, y + r * (N / 2) + n0 / 2);
    }
    return;
  }
  const int64_t cols = std::min<int64_t>(32, N - n0);
  const __mmask32 keep = cols == 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  for (int64_t r = r0; r < r1; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(c + r * 32), __m512(b0));
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), __m512(b1));
    _mm512_mask_storeu_epi16(y + r * N + n0, keep, __m512i(_mm512_cvtne2ps_pbh(hi, lo)));
  }
}

void amx_linear_impl(const at::BFloat16* x, int64_t M, int64_t K, const uint16_t* wp, int64_t N,
                     const float* bias, bool silu_mul, at::BFloat16* y) {
  const int64_t NB = (N + 31) / 32, MB = (M + 31) / 32, KS = K / 32;
  // slices and passes over K as even as whole blocks and steps allow
  const int64_t max_width = std::max<int64_t>(1, AMX_LINEAR_SLICE_BYTES / (64 * K));
  const int64_t slices = (NB + max_width - 1) / max_width;
  const int64_t width = (NB + slices - 1) / slices;
  const int64_t passes = (K + AMX_LINEAR_KC - 1) / AMX_LINEAR_KC;
  const int64_t per_pass = (KS + passes - 1) / passes;
  // row groups as long as leave about 16 tasks a thread: the fewer slices and row blocks, the
  // shorter (one block at the least), all of a few rows' blocks in one task for a layer of many
  // slices (the vocabulary's projection)
  const int64_t threads = at::get_num_threads();
  const int64_t group = std::clamp<int64_t>(slices * MB / (16 * threads), 1, MB);
  const int64_t groups = (MB + group - 1) / group, tasks = slices * groups;
  const int64_t out_cols = silu_mul ? N / 2 : N;
  std::atomic<int64_t> next{0};
  sluice::parallel_for(0, std::min(tasks, threads), 1, [&](int64_t, int64_t) {
    amx_configure();
    // the slice's sums between passes over K (one pass: two blocks', the one being summed and
    // the one being rounded), 64-byte aligned
    std::vector<float> sums_buf((passes > 1 ? width : 2) * 1024 + 16);
    const uintptr_t misaligned = reinterpret_cast<uintptr_t>(sums_buf.data()) % 64;
    float* sums = sums_buf.data() + (64 - misaligned) % 64 / 4;
    std::vector<at::BFloat16> tail;  // the last row block, zero-padded to 32 rows
    // the last block summed, rounded into y a few rows at each step of the next block: rows
    // [done, rows) of its sums c are still to do
    const float* pend_c = nullptr;
    int64_t pend_rows = 0, pend_done = 0, pend_n0 = 0;
    at::BFloat16* pend_y = nullptr;
    auto round_pending = [&](int64_t upto) {
      const int64_t r1 = std::min(upto, pend_rows);
      if (pend_done >= r1) return;
      amx_linear_out(pend_c, pend_done, r1, bias, pend_n0, N, silu_mul, pend_y);
      pend_done = r1;
    };
    int64_t toggle = 0;
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t nb0 = task / groups * width, nb1 = std::min(NB, nb0 + width);
      const int64_t mb0 = task % groups * group, mb1 = std::min(MB, mb0 + group);
      for (int64_t mb = mb0; mb < mb1; ++mb) {
        const int64_t rows = std::min<int64_t>(32, M - mb * 32);
        const at::BFloat16* a = x + mb * 32 * K;
        if (rows < 32) {
          if (tail.empty()) {
            tail.assign(32 * K, at::BFloat16(0.f));
            std::copy(a, a + rows * K, tail.begin());
          }
          a = tail.data();
        }
        for (int64_t k0 = 0; k0 < KS; k0 += per_pass) {
          const int64_t steps = std::min(per_pass, KS - k0);
          // the x that the next pass reads: this row block's next values of K, or the next row
          // block's first (a whole one: the tail is read from its copy)
          const at::BFloat16* xn = nullptr;
          int64_t xn_steps = 0;
          if (k0 + steps < KS) {
            xn = a + (k0 + steps) * 32;
            xn_steps = std::min(per_pass, KS - k0 - steps);
          } else if (mb + 1 < mb1 && M - (mb + 1) * 32 >= 32) {
            xn = x + (mb + 1) * 32 * K;
            xn_steps = std::min(per_pass, KS);
          }
          const int64_t xn_rows = (32 + (nb1 - nb0) - 1) / (nb1 - nb0);  // a block's share
          const int64_t per_step = (32 + steps - 1) / steps;  // rows of the last block rounded
          for (int64_t nb = nb0; nb < nb1; ++nb) {
            float* c = sums + (passes > 1 ? nb - nb0 : toggle ^= 1) * 1024;
            if (k0 == 0) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_zero(2);
              _tile_zero(3);
            } else {
              _tile_loadd(0, c, 128);
              _tile_loadd(1, c + 16, 128);
              _tile_loadd(2, c + 512, 128);
              _tile_loadd(3, c + 528, 128);
            }
            const uint16_t* ahead =
                mb == mb0 && nb + 1 < nb1 ? wp + ((nb + 1) * KS + k0) * 2 * TILE_ELEMS : nullptr;
            const int64_t r0 = std::min<int64_t>(32, (nb - nb0) * xn_rows);
            const int64_t r1 = std::min<int64_t>(32, r0 + xn_rows);
            const bool fetch = xn != nullptr && r1 > r0;  // a slice past 32 blocks: some none
            amx_linear_steps(a + k0 * 32, K, wp + (nb * KS + k0) * 2 * TILE_ELEMS, steps, ahead,
                             fetch ? xn + r0 * K : nullptr, fetch ? r1 - r0 : 0, xn_steps,
                             [&](int64_t ks) { round_pending((ks + 1) * per_step); });
            round_pending(32);  // before c is written: with one block a slice, it may be pend_c
            _tile_stored(0, c, 128);
            _tile_stored(1, c + 16, 128);
            _tile_stored(2, c + 512, 128);
            _tile_stored(3, c + 528, 128);
            if (k0 + steps == KS) {
              pend_c = c;
              pend_rows = rows;
              pend_done = 0;
              pend_n0 = nb * 32;
              pend_y = y + mb * 32 * out_cols;
            }
          }
        }
      }
    }
    round_pending(32);
    _tile_release();
  });
}
#endif

// A batch's shared prefix: the first P slots that the member requests (`members`, count of them,
// in increasing order; null: every request) all read alike. P == 0: none.
struct SharedPrefix {
  int64_t P = 0;
  const int64_t* members = nullptr;
  int64_t count = 0;
};

// Queries whose requests' first P slots are the same (cascade attention: a common system prompt,
// which the radix cache holds once). The member requests' queries (a decode step's one each, or
// an extend's new tokens on that cached prefix) attend over those P slots together, G per query
// and KV head: in bfloat16 at head_dim 64 or 128 on a CPU with AMX, amx_prefix_attention, else
// PyTorch's blocked CPU attention over the gathered slots; both also give each query's
// log-sum-exp. Each of them then attends over the rest of
// its slots, [P, len), in attend(), and the two parts combine as flash-decoding's parts do (the
// prefix's part normalized, weight 1 at its log-sum-exp). The prefix's part is rounded to the
// dtype before the combination: the plain kernel's result up to rounding. Other queries attend
// over all their slots in attend() alone. Query i belongs to request rows[i] (rows null: i).
template <typename T, int C>
void shared_prefix_impl(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& kv_indices, const int64_t* rows, const at::Tensor& lens_t,
                        const SharedPrefix& sp, at::Tensor& out, double scale) {
  constexpr int64_t D = W * C;
  const int64_t N = q.size(0), H = q.size(1), Hkv = k_pool.size(1), G = H / Hkv, P = sp.P;
  const int64_t B = kv_indices.size(0), max_kv = kv_indices.size(1), row_len = Hkv * D;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  const int64_t* lens = lens_t.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // whether each request is a member, and each query's index among the members' queries (-1:
  // not a member's)
  std::vector<char> member(B, sp.members ? 0 : 1);
  for (int64_t m = 0; sp.members && m < sp.count; ++m) member[sp.members[m]] = 1;
  std::vector<int64_t> member_query(N, -1);
  int64_t M = 0;
  for (int64_t i = 0; i < N; ++i)
    if (member[rows ? rows[i] : i]) member_query[i] = M++;
  if (M == 0) return attention_impl<T, C>(q, k_pool, v_pool, kv_indices, rows, lens_t, out, scale);
  const int64_t* prefix = idx + (sp.members ? sp.members[0] : 0) * max_kv;
  // the members' queries [1, Hkv, Rp, D], gathered (Rp: M * G rounded up to 16, the rows past
  // M * G zeros, for amx_prefix_attention's tiles)
  const int64_t R = M * G, Rp = (R + 15) / 16 * 16;
  at::Tensor qq = at::empty({1, Hkv, Rp, D}, q.options());
  T* qd = qq.data_ptr<T>();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t m = member_query[i];
    for (int64_t kh = 0; m >= 0 && kh < Hkv; ++kh)
      std::memcpy(qd + (kh * Rp + m * G) * D, qp + (i * H + kh * G) * D, G * D * sizeof(T));
  }
  for (int64_t kh = 0; kh < Hkv; ++kh) std::memset(qd + (kh * Rp + R) * D, 0, (Rp - R) * D * sizeof(T));
  // the prefix's part of each member query's attention: normalized, in the dtype [Hkv, R, D], and
  // its log-sum-exp [Hkv, R]
  at::Tensor po, lse;
#if defined(SLUICE_AMX_PREFIX)
  if constexpr (std::is_same_v<T, at::BFloat16> && (D == 64 || D == 128)) {
    if (amx_permitted()) {
      po = at::empty({Hkv, R, D}, q.options());
      lse = at::empty({Hkv, R}, q.options().dtype(at::kFloat));
      amx_prefix_attention<D>(qd, kp, vp, prefix, row_len, Hkv, R, P, static_cast<float>(scale),
                              po.data_ptr<T>(), lse.data_ptr<float>());
    }
  }
#endif
  if (!po.defined()) {  // PyTorch's blocked attention over the prefix's K and V, gathered
    at::Tensor kq = at::empty({1, Hkv, P, D}, q.options()), vq = at::empty_like(kq);
    T* kd = kq.data_ptr<T>();
    T* vd = vq.data_ptr<T>();
    for (int64_t l = 0; l < P; ++l)
      for (int64_t kh = 0; kh < Hkv; ++kh) {
        std::memcpy(kd + (kh * P + l) * D, kp + prefix[l] * row_len + kh * D, D * sizeof(T));
        std::memcpy(vd + (kh * P + l) * D, vp + prefix[l] * row_len + kh * D, D * sizeof(T));
      }
    const auto [out, logsumexp] = at::_scaled_dot_product_flash_attention_for_cpu(
        qq.narrow(2, 0, R), kq, vq, 0.0, false, std::nullopt, scale);  // [1, Hkv, R, D], [1, Hkv, R]
    TORCH_CHECK(out.scalar_type() == q.scalar_type() && logsumexp.scalar_type() == at::kFloat,
                "shared prefix: unexpected SDPA outputs");
    po = out.squeeze(0).contiguous();
    lse = logsumexp.squeeze(0).contiguous();
  }
  const T* pd = po.data_ptr<T>();
  const float* ld = lse.data_ptr<float>();
  const int64_t threads = at::get_num_threads();
  const int64_t nkv = N >= 2 * threads ? Hkv : 1, QH = nkv * G, tasks_per_query = Hkv / nkv;
  sluice::parallel_for(0, N * tasks_per_query, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv, max_sum(4 * QH);
    std::vector<vf> acc, part_acc(2 * QH * C);
    const Partial parts[2] = {{max_sum.data(), part_acc.data()},
                              {max_sum.data() + 2 * QH, part_acc.data() + QH * C}};
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / tasks_per_query, kh0 = (task % tasks_per_query) * nkv;
      const int64_t m = member_query[i], first = m >= 0 ? P : 0;  // the slots attend() takes
      for (int64_t h = 0; m >= 0 && h < QH; ++h) {
        const int64_t kh = kh0 + h / G, r = m * G + h % G;
        parts[0].max_sum[2 * h] = ld[kh * R + r];
        parts[0].max_sum[2 * h + 1] = 1.f;
        load_row<C>(pd + (kh * R + r) * D, parts[0].acc + h * C);
      }
      attend<T, C>(qp + (i * H + kh0 * G) * D, kp + kh0 * D, vp + kh0 * D,
                   idx + (rows ? rows[i] : i) * max_kv + first, lens[i] - first, row_len, nkv, G,
                   static_cast<float>(scale), parts[1], scores, acc, inv);
      if (m >= 0) combine<T, C>(parts, 2, QH, op + (i * H + kh0 * G) * D);
      else combine<T, C>(parts + 1, 1, QH, op + (i * H + kh0 * G) * D);
    }
  });
}

// shared.P > 0: a batch whose (member) requests share their first P slots (check_shared_prefix),
// through shared_prefix_impl
template <typename T>
void attention_dispatch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& idx, const int64_t* rows, const at::Tensor& lens,
                        at::Tensor& out, double scale, const SharedPrefix& shared = {}) {
#define SLUICE_ATTEND(DIM)                                                               \
  if (shared.P > 0)                                                                      \
    return shared_prefix_impl<T, DIM / W>(q, k, v, idx, rows, lens, shared, out, scale); \
  return attention_impl<T, DIM / W>(q, k, v, idx, rows, lens, out, scale);
  switch (q.size(2)) {  // template argument: vectors per head
    case 16: SLUICE_ATTEND(16)
    case 32: SLUICE_ATTEND(32)
    case 64: SLUICE_ATTEND(64)
    case 80: SLUICE_ATTEND(80)
    case 96: SLUICE_ATTEND(96)
    case 128: SLUICE_ATTEND(128)
    default: TORCH_CHECK(false, "attention: head_dim ", q.size(2), " is not supported");
  }
#undef SLUICE_ATTEND
}

// The shared prefix of kv_indices [B, max_kv]: shared_prefix P slots, read alike by the requests
// `shared_requests` names (int64, increasing, at least one; None: all of them), each of whose
// queries (query i of request rows[i], or of request i for rows null) sees more than P of its
// lens[i] slots. The view points into shared_requests, which must outlive it.
SharedPrefix check_shared_prefix(const at::Tensor& kv_indices, const int64_t* rows,
                                 const at::Tensor& lens, int64_t P,
                                 const std::optional<at::Tensor>& shared_requests) {
  TORCH_CHECK(P >= 0, "shared_prefix must be >= 0");
  TORCH_CHECK(P > 0 || !shared_requests, "shared_requests needs a shared_prefix");
  if (P == 0) return {};
  const int64_t B = kv_indices.size(0), max_kv = kv_indices.size(1);
  TORCH_CHECK(P < max_kv, "shared_prefix ", P, " leaves no slot of kv_indices' ", max_kv);
  SharedPrefix sp{P, nullptr, B};
  std::vector<char> member(B, 1);
  if (shared_requests) {
    const at::Tensor& r = *shared_requests;
    TORCH_CHECK(r.device().is_cpu() && r.dim() == 1 && r.is_contiguous() &&
                r.scalar_type() == at::kLong && r.size(0) >= 1,
                "shared_requests: [N >= 1] contiguous int64 on the CPU");
    sp.members = r.data_ptr<int64_t>();
    sp.count = r.size(0);
    std::fill(member.begin(), member.end(), 0);
    for (int64_t m = 0; m < sp.count; ++m) {
      TORCH_CHECK(sp.members[m] >= 0 && sp.members[m] < B &&
                      (m == 0 || sp.members[m] > sp.members[m - 1]),
                  "shared_requests: increasing request indices below ", B);
      member[sp.members[m]] = 1;
    }
  }
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < lens.size(0); ++i) {
    const int64_t b = rows ? rows[i] : i;
    TORCH_CHECK(!member[b] || lp[i] > P, "shared_prefix ", P, ": a query of request ", b,
                " sees only ", lp[i], " slots");
  }
  const int64_t* first = idx + (sp.members ? sp.members[0] : 0) * max_kv;
  for (int64_t m = 0; m < sp.count; ++m) {
    const int64_t b = sp.members ? sp.members[m] : m;
    TORCH_CHECK(std::equal(first, first + P, idx + b * max_kv), "shared_prefix ", P,
                ": request ", b, "'s first slots differ from the first shared request's");
  }
  return sp;
}

// ---------------------------------------------------------------------------------------------
// Elementwise steps, over rows of a 2-D tensor
// ---------------------------------------------------------------------------------------------

// x = rms_norm(x + residual) * weight and residual = x + residual, in place (residual None: only
// the norm). The sum is rounded to the storage dtype before the norm, as separate ops would. W
// lanes at a time (the squares summed lane by lane, then across), the tail of a row past them
// value by value.
template <typename T>
void add_rms_norm_impl(at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps) {
  const int64_t N = x.size(0), width = x.size(1), body = width / W * W;
  T* xp = x.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  sluice::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t i = begin; i < end; ++i) {
      T* xr = xp + i * width;
      T* rr = rp ? rp + i * width : nullptr;
      vf squares{};
      for (int64_t j = 0; j < body; j += W) {
        vf v = load(xr + j);
        if (rr) {
          v = round_to(v + load(rr + j), rr);
          store(v, rr + j);
        }
        store(v, row.data() + j);
        squares += v * v;
      }
      float ss = 0.f;
      for (int l = 0; l < W; ++l) ss += squares[l];
      for (int64_t j = body; j < width; ++j) {
        float v = to_float(xr[j]);
        if (rr) {
          from_float(v + to_float(rr[j]), rr + j);
          v = to_float(rr[j]);
        }
        row[j] = v;
        ss += v * v;
      }
      const float r = 1.f / std::sqrt(ss / static_cast<float>(width) + static_cast<float>(eps));
      // as transformers: normalize in float32, round to the dtype, then scale by the weight
      for (int64_t j = 0; j < body; j += W)
        store(round_to(load(row.data() + j) * r, xr) * load(wp + j), xr + j);
      for (int64_t j = body; j < width; ++j) {
        T normed;
        from_float(row[j] * r, &normed);
        from_float(to_float(normed) * to_float(wp[j]), xr + j);
      }
    }
  });
}

// out[:, j] = silu(x[:, j]) * x[:, I + j] for x [N, 2I]: the gate and up halves of one matmul.
template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t N = x.size(0), I = x.size(1) / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  sluice::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* gate = xp + i * 2 * I;
      const T* up = gate + I;
      T* o = op + i * I;
      int64_t j = 0;
      for (; j + W <= I; j += W) {
        const vf g = load(gate + j);
        // silu is rounded to T on its own first, as F.silu(gate) * up does
        const vf s = round_to(g / (1.f + vexp(vf{} - g)), o);
        store(s * load(up + j), o + j);
      }
      for (; j < I; ++j) {
        const float g = to_float(gate[j]);
        T sk;
        from_float(g / (1.f + std::exp(-g)), &sk);
        from_float(to_float(sk) * to_float(up[j]), o + j);
      }
    }
  });
}

// Rotate-half rotary embedding, in place, of the first `heads` heads of every row of x
// [T, >= heads * D] (the q and k parts of a fused qkv output), at positions[t], with the float32
// tables cos, sin [max_pos, D / 2].
template <typename T>
void rope_impl(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
               const at::Tensor& sin, int64_t heads, int64_t D) {
  const int64_t N = x.size(0), stride = x.stride(0), half = D / 2;
  T* xp = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  sluice::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = xp + t * stride + h * D;
        T* x2 = x1 + half;
        for (int64_t j = 0; j < half; ++j) {
          const float a = to_float(x1[j]), b = to_float(x2[j]);
          from_float(a * c[j] - b * s[j], x1 + j);
          from_float(b * c[j] + a * s[j], x2 + j);
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Linear layers of a few rows (decoding one or a few requests): y = x w^T (+ bias), x [M, K],
// w [N, K]. Memory-bound: each weight row is read once for all M rows of x, W rows of w at a
// time, their dot products summed by reduce(). oneDNN's GEMV read the weights at about 20 GB/s
// here, this at about 28 (what a plain sum over memory reaches on two threads).
// ---------------------------------------------------------------------------------------------
constexpr int SMALL_LINEAR_MAX_ROWS = 4;
constexpr int64_t SMALL_LINEAR_K_MULTIPLE = 2 * W;

// 2W consecutive values as two vectors, in a lane order that is the same for every row
// (float32: in order; bfloat16: the even and the odd values, as load_row)
inline void load_pair(const float* p, vf& a, vf& b) {
  std::memcpy(&a, p, sizeof a);
  std::memcpy(&b, p + W, sizeof b);
}
inline void load_pair(const at::BFloat16* p, vf& a, vf& b) {
  vu w;
  std::memcpy(&w, p, sizeof w);
  a = bits_to_float(w << 16);
  b = bits_to_float(w & 0xffff0000u);
}

template <typename T, int M>
void small_linear_impl(const T* x, const T* w, const T* bias, T* y, int64_t K, int64_t N) {
  const int64_t KV = K / W;  // vectors per row, an even number
  sluice::parallel_for(0, (N + W - 1) / W, 1, [&](int64_t begin, int64_t end) {
    std::vector<vf> xv(M * KV);  // x's rows in load_pair's lane order
    for (int m = 0; m < M; ++m)
      for (int64_t c = 0; c < KV; c += 2)
        load_pair(x + m * K + c * W, xv[m * KV + c], xv[m * KV + c + 1]);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t o0 = blk * W, n = std::min<int64_t>(W, N - o0);
      vf dots[M][W];
      for (int64_t j = 0; j < W; ++j) {  // past the last row: repeat it (not stored)
        const T* row = w + (o0 + std::min(j, n - 1)) * K;
        vf even[M] = {}, odd[M] = {};  // two chains of adds
        for (int64_t c = 0; c < KV; c += 2) {
          vf lo, hi;
          load_pair(row + c * W, lo, hi);
          for (int m = 0; m < M; ++m) {
            even[m] += xv[m * KV + c] * lo;
            odd[m] += xv[m * KV + c + 1] * hi;
          }
        }
        for (int m = 0; m < M; ++m) dots[m][j] = even[m] + odd[m];
      }
      for (int m = 0; m < M; ++m) {
        const vf r = reduce(dots[m]);  // lane j: output o0 + j
        for (int64_t j = 0; j < n; ++j)
          from_float(r[j] + (bias ? to_float(bias[o0 + j]) : 0.f), y + m * N + o0 + j);
      }
    }
  });
}

template <typename T>
void small_linear_dispatch(const at::Tensor& x, const at::Tensor& w, const T* bias, at::Tensor& y) {
  const int64_t K = x.size(1), N = w.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  switch (x.size(0)) {  // template argument: rows of x
    case 1: return small_linear_impl<T, 1>(xp, wp, bias, yp, K, N);
    case 2: return small_linear_impl<T, 2>(xp, wp, bias, yp, K, N);
    case 3: return small_linear_impl<T, 3>(xp, wp, bias, yp, K, N);
    case 4: return small_linear_impl<T, 4>(xp, wp, bias, yp, K, N);
    default: TORCH_CHECK(false, "small_linear takes 1 to ", SMALL_LINEAR_MAX_ROWS, " rows");
  }
}

void check_storage(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              " must be float32 or bfloat16, not ", t.scalar_type());
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& kv_indices, const int64_t* rows, const at::Tensor& lens,
                     double scale, int64_t shared_prefix = 0,
                     const std::optional<at::Tensor>& shared_requests = std::nullopt) {
  check_storage(q, "q");
  for (const at::Tensor* t : {&k_pool, &v_pool, &kv_indices, &lens})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "attention takes contiguous CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && q.is_contiguous(), "bad ranks");
  TORCH_CHECK(v_pool.sizes() == k_pool.sizes(), "the K and V pools differ in shape");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "q and the pool differ in dtype");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0, "heads not a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_pool.size(2), "q and the pool differ in head_dim");
  TORCH_CHECK(kv_indices.dim() == 2 && kv_indices.scalar_type() == at::kLong &&
              lens.scalar_type() == at::kLong, "indices must be int64, kv_indices 2-D");
  TORCH_CHECK(lens.size(0) == q.size(0), "one length per query");
  // every slot a query reads must lie in the pool: check each row up to its longest query
  const int64_t B = kv_indices.size(0), max_kv = kv_indices.size(1), S = k_pool.size(0);
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<int64_t> need(B, 0);
  for (int64_t i = 0; i < lens.size(0); ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= max_kv, "query ", i, " sees ", lp[i],
                " slots; it must see 1 to ", max_kv);
    const int64_t row = rows ? rows[i] : i;
    need[row] = std::max(need[row], lp[i]);
  }
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < need[b]; ++l)
      TORCH_CHECK(idx[b * max_kv + l] >= 0 && idx[b * max_kv + l] < S, "slot ",
                  idx[b * max_kv + l], " is outside the pool of ", S);
  const SharedPrefix shared =
      check_shared_prefix(kv_indices, rows, lens, shared_prefix, shared_requests);
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    attention_dispatch<float>(q, k_pool, v_pool, kv_indices, rows, lens, out, scale, shared);
  } else {
    attention_dispatch<at::BFloat16>(q, k_pool, v_pool, kv_indices, rows, lens, out, scale, shared);
  }
  return out;
}

// One query token per request: q [B, H, D]; k_pool, v_pool [S, Hkv, D] (one layer);
// kv_indices [B, max_kv] int64; seq_lens [B] int64 (>= 1 each). Returns [B, H, D].
// shared_prefix P > 0: the first P slots of every request, or of those shared_requests names
// (increasing indices), are the same, and each of them sees more than P: the step goes through
// shared_prefix_impl.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& kv_indices, const at::Tensor& seq_lens, double scale,
                            int64_t shared_prefix,
                            const std::optional<at::Tensor>& shared_requests) {
  TORCH_CHECK(kv_indices.dim() == 2 && kv_indices.size(0) == q.size(0), "one row per request");
  return attention(q, k_pool, v_pool, kv_indices, nullptr, seq_lens, scale, shared_prefix,
                   shared_requests);
}

// Any number of query tokens per request (prefill; the new tokens' K/V already in the pool):
// q [T, H, D]; query t belongs to request q_rows[t] (a row of kv_indices [B, max_kv]) and sees
// its first q_lens[t] slots (its position + 1: causal). Returns [T, H, D]. shared_prefix and
// shared_requests as decode_attention's: each query of a member request sees more than P slots.
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& kv_indices, const at::Tensor& q_rows,
                            const at::Tensor& q_lens, double scale, int64_t shared_prefix,
                            const std::optional<at::Tensor>& shared_requests) {
  TORCH_CHECK(q_rows.device().is_cpu() && q_rows.is_contiguous() &&
              q_rows.scalar_type() == at::kLong && q_rows.size(0) == q.size(0), "q_rows: [T] int64");
  const int64_t* rows = q_rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < q_rows.size(0); ++t)
    TORCH_CHECK(rows[t] >= 0 && rows[t] < kv_indices.size(0), "q_rows out of range");
  return attention(q, k_pool, v_pool, kv_indices, rows, q_lens, scale, shared_prefix,
                   shared_requests);
}

// Whether dense_attention_ runs here: a build with AMX tiles, on a CPU whose kernel lets this
// process use them.
bool amx_attention() {
#if defined(SLUICE_AMX_PREFIX)
  return amx_permitted();
#else
  return false;
#endif
}

// Requests of many new tokens each (a prefill's long prompts), causal, on AMX tiles: spans [S, 4]
// int64, span s = (its row b of kv_indices [B, max_kv], its first query t0 in q, its n queries,
// its prefix p): query t0 + i sees the first p + i + 1 slots of row b, whose new tokens' K and V
// are in the pool already. q, out [T, H, D] (q's rows at any stride, as the qkv projection's
// view), pools [slots, Hkv, D], bfloat16, head_dim 64 or 128; writes those queries' rows of out,
// the others untouched. Only where amx_attention().
void dense_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_pool,
                      const at::Tensor& v_pool, const at::Tensor& kv_indices,
                      const at::Tensor& spans, double scale) {
  TORCH_CHECK(amx_attention(), "dense_attention_ needs AMX tiles (amx_attention())");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &q, &k_pool, &v_pool})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->scalar_type() == at::kBFloat16 &&
                (t == &q ? t->stride(2) == 1 && (t->size(1) == 1 || t->stride(1) == t->size(2))
                         : t->is_contiguous()),
                "dense_attention_: 3-D bfloat16 CPU tensors, contiguous (q's rows at any stride)");
  TORCH_CHECK(out.sizes() == q.sizes(), "out and q differ in shape");
  TORCH_CHECK(v_pool.sizes() == k_pool.sizes() && q.size(2) == k_pool.size(2) &&
              q.size(1) % k_pool.size(1) == 0, "q and the pools do not match");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "dense_attention_: head_dim 64 or 128");
  TORCH_CHECK(kv_indices.device().is_cpu() && kv_indices.is_contiguous() && kv_indices.dim() == 2 &&
              kv_indices.scalar_type() == at::kLong, "kv_indices: [B, max_kv] contiguous int64");
  TORCH_CHECK(spans.device().is_cpu() && spans.is_contiguous() && spans.dim() == 2 &&
              spans.size(1) == 4 && spans.scalar_type() == at::kLong, "spans: [S, 4] contiguous int64");
  const int64_t T = q.size(0), B = kv_indices.size(0), max_kv = kv_indices.size(1);
  const int64_t slots = k_pool.size(0);
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  for (int64_t s = 0; s < spans.size(0); ++s) {
    const int64_t b = sp[4 * s], t0 = sp[4 * s + 1], n = sp[4 * s + 2], p = sp[4 * s + 3];
    TORCH_CHECK(b >= 0 && b < B && t0 >= 0 && n >= 1 && t0 + n <= T && p >= 0 && p + n <= max_kv,
                "span ", s, " (", b, ", ", t0, ", ", n, ", ", p, ") is outside q or kv_indices");
    for (int64_t l = 0; l < p + n; ++l)
      TORCH_CHECK(idx[b * max_kv + l] >= 0 && idx[b * max_kv + l] < slots, "slot ",
                  idx[b * max_kv + l], " is outside the pool of ", slots);
  }
#if defined(SLUICE_AMX_PREFIX)
  if (q.size(2) == 64) amx_dense_attention<64>(q, k_pool, v_pool, kv_indices, spans, scale, out);
  else amx_dense_attention<128>(q, k_pool, v_pool, kv_indices, spans, scale, out);
#endif
}

// Whether amx_linear runs here: as amx_attention, a build with AMX tiles on a CPU that lets this
// process use them.
bool amx_linear_ok() { return amx_attention(); }

// w [N, K] bfloat16, K a multiple of 32 -> w laid out as amx_linear's B tiles ([ceil(N / 32) *
// K * 32] int16: bfloat16's bits, the outputs padded with zeros to a multiple of 32).
at::Tensor amx_pack_linear(const at::Tensor& w) {
  TORCH_CHECK(amx_linear_ok(), "amx_pack_linear needs AMX tiles (amx_linear_ok())");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "amx_pack_linear: a 2-D bfloat16 CPU weight");
  TORCH_CHECK(w.size(1) > 0 && w.size(1) % 32 == 0, "amx_pack_linear: in_features ", w.size(1),
              " is not a positive multiple of 32");
  const at::Tensor wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor out = at::empty({(N + 31) / 32 * 32 * K}, w.options().dtype(at::kShort));
#if defined(SLUICE_AMX_PREFIX)
  amx_pack_impl(reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>()), N, K,
                reinterpret_cast<uint16_t*>(out.data_ptr<int16_t>()));
#endif
  return out;
}

// y = x w^T + bias on AMX tiles: x [M, K] bfloat16, packed = amx_pack_linear(w) of w [N, K]
// (only its size is checked: the caller keeps w's N and K beside it), bias [N] (any float dtype)
// or None. Returns [M, N] bfloat16. silu_mul: w's rows alternate 16 gate rows and their 16 up
// rows (N a multiple of 32), and y is silu(gate) * up, [M, N / 2]: what silu_and_mul gives on
// this function's plain output for the unpaired w (the same bits, but where a sum plus its bias
// falls among float32's denormals, which the plain rounding flushes to zero).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                      const c10::optional<at::Tensor>& bias, bool silu_mul) {
  TORCH_CHECK(amx_linear_ok(), "amx_linear needs AMX tiles (amx_linear_ok())");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "amx_linear: x is a 2-D bfloat16 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0 && K % 32 == 0 && N > 0 && packed.is_contiguous() &&
              packed.scalar_type() == at::kShort &&
              packed.numel() == (N + 31) / 32 * 32 * K,
              "amx_linear: packed does not hold ", N, " outputs of ", K, " values");
  const int64_t padded = (N + 31) / 32 * 32;
  at::Tensor b = at::zeros({padded}, x.options().dtype(at::kFloat));
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "amx_linear: bias of ", N, " values");
    b.narrow(0, 0, N).copy_(*bias);
  }
  TORCH_CHECK(!silu_mul || N % 32 == 0, "amx_linear: silu_mul takes outputs in pairs of 16, not ",
              N);
  at::Tensor y = at::empty({M, silu_mul ? N / 2 : N}, x.options());
  if (M == 0) return y;
  const at::Tensor xc = x.contiguous();
#if defined(SLUICE_AMX_PREFIX)
  {
    pybind11::gil_scoped_release no_gil;
    amx_linear_impl(xc.data_ptr<at::BFloat16>(), M, K,
                    reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>()), N,
                    b.data_ptr<float>(), silu_mul, y.data_ptr<at::BFloat16>());
  }
#endif
  return y;
}

// In place: residual += x, then x = rms_norm(residual) * weight. x, residual [N, H]; weight [H].
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_storage(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "add_rms_norm_ takes contiguous 2-D rows");
  TORCH_CHECK(residual.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.size(0) == x.size(1), "shapes differ");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "dtypes differ");
  if (x.scalar_type() == at::kFloat) add_rms_norm_impl<float>(x, &residual, weight, eps);
  else add_rms_norm_impl<at::BFloat16>(x, &residual, weight, eps);
}

// Returns rms_norm(x) * weight. x [N, H]; weight [H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_storage(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.is_contiguous() && weight.size(0) == x.size(1), "bad shapes");
  TORCH_CHECK(weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "dtypes differ");
  auto out = x.contiguous().clone();
  if (x.scalar_type() == at::kFloat) add_rms_norm_impl<float>(out, nullptr, weight, eps);
  else add_rms_norm_impl<at::BFloat16>(out, nullptr, weight, eps);
  return out;
}

// x [N, 2I] -> silu(x[:, :I]) * x[:, I:], [N, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_storage(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "bad shape");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) silu_and_mul_impl<float>(x, out);
  else silu_and_mul_impl<at::BFloat16>(x, out);
  return out;
}

// In place: rotary embedding of heads [0, heads) of each row of x [T, >= heads * head_dim]
// (row stride free, inner dimension contiguous); positions [T] int64; cos, sin float32.
void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
           int64_t heads, int64_t head_dim) {
  check_storage(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) >= heads * head_dim, "bad shape");
  TORCH_CHECK(positions.device().is_cpu() && positions.is_contiguous() &&
              positions.scalar_type() == at::kLong && positions.size(0) == x.size(0),
              "positions: [T] int64");
  TORCH_CHECK(cos.device().is_cpu() && cos.is_contiguous() && sin.is_contiguous() &&
              cos.scalar_type() == at::kFloat && cos.dim() == 2 && sin.sizes() == cos.sizes() &&
              cos.size(1) * 2 == head_dim, "bad tables");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " is outside the ",
                cos.size(0), " positions of the rotary table");
  if (x.scalar_type() == at::kFloat) rope_impl<float>(x, positions, cos, sin, heads, head_dim);
  else rope_impl<at::BFloat16>(x, positions, cos, sin, heads, head_dim);
}

// Row t of K (at ks + t * k_step) and of V (vs + t * v_step), `row` bytes each, into slot
// slot[t] of each pool, t < T, on the threads (inline up to 256 rows: a decode step's).
inline void copy_kv_rows(char* kp, char* vp, const int64_t* slot, int64_t T, int64_t row,
                         const char* ks, int64_t k_step, const char* vs, int64_t v_step) {
  sluice::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kp + slot[t] * row, ks + t * k_step, row);
      std::memcpy(vp + slot[t] * row, vs + t * v_step, row);
    }
  });
}

// k and v [T, Hkv, D] (row stride free: the fused qkv projection's views; each row's Hkv * D
// values consecutive) into the pools [slots, Hkv, D] (one dtype, any) at the slots loc [T]
// int64, distinct (the allocator's), as k_pool.index_copy_(0, loc, k) and v's likewise: whole
// rows copied, on the threads. ATen's index_copy_ walks such strided views a value at a time
// (1950 rows of SmolLM2, K and V, 2 threads of the Xeon model 207: 262 µs a layer, this 48).
void store_kv_(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& loc, const at::Tensor& k,
               const at::Tensor& v) {
  TORCH_CHECK(loc.device().is_cpu() && loc.is_contiguous() && loc.dim() == 1 &&
              loc.scalar_type() == at::kLong, "loc: [T] contiguous int64");
  const int64_t T = loc.size(0), slots = k_pool.size(0);
  for (const auto& [pool, x] : {std::pair{&k_pool, &k}, std::pair{&v_pool, &v}}) {
    TORCH_CHECK(pool->device().is_cpu() && x->device().is_cpu(), "CPU tensors only");
    TORCH_CHECK(pool->dim() == 3 && pool->is_contiguous() && pool->sizes() == k_pool.sizes() &&
                pool->scalar_type() == k_pool.scalar_type(),
                "the pools: contiguous [slots, Hkv, D] of one shape and dtype");
    TORCH_CHECK(x->dim() == 3 && x->size(0) == T && x->size(1) == pool->size(1) &&
                x->size(2) == pool->size(2) && x->stride(2) == 1 &&
                (x->size(1) == 1 || x->stride(1) == x->size(2)),
                "k and v: [T, Hkv, D] with each row's values consecutive, T = loc's ", T);
    TORCH_CHECK(x->scalar_type() == pool->scalar_type(), "k and v in their pool's dtype");
  }
  const int64_t* slot = loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " is outside the pool of ",
                slots);
  const int64_t elem = k_pool.element_size();
  copy_kv_rows(static_cast<char*>(k_pool.data_ptr()), static_cast<char*>(v_pool.data_ptr()), slot,
               T, k_pool.size(1) * k_pool.size(2) * elem, static_cast<const char*>(k.data_ptr()),
               k.stride(0) * elem, static_cast<const char*>(v.data_ptr()), v.stride(0) * elem);
}

// y = x w^T + bias: x [M, K] with M <= small_linear_max_rows, w [N, K], K a multiple of
// small_linear_k_multiple; bias [N] or None. Returns [M, N] in x's dtype.
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w,
                        const c10::optional<at::Tensor>& bias) {
  check_storage(x, "x");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.is_contiguous() && w.is_contiguous(),
              "small_linear takes contiguous 2-D x and w");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == x.scalar_type(), "w: a CPU tensor of x's dtype");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= SMALL_LINEAR_MAX_ROWS, "small_linear takes 1 to ",
              SMALL_LINEAR_MAX_ROWS, " rows, not ", x.size(0));
  TORCH_CHECK(w.size(1) == x.size(1), "x has ", x.size(1), " columns, w ", w.size(1));
  TORCH_CHECK(x.size(1) % SMALL_LINEAR_K_MULTIPLE == 0, "small_linear needs a multiple of ",
              SMALL_LINEAR_K_MULTIPLE, " columns, not ", x.size(1));
  if (bias) {
    TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous() && bias->dim() == 1 &&
                bias->size(0) == w.size(0) && bias->scalar_type() == x.scalar_type(),
                "bias: [N] contiguous, of x's dtype");
  }
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.scalar_type() == at::kFloat)
    small_linear_dispatch<float>(x, w, bias ? bias->data_ptr<float>() : nullptr, y);
  else
    small_linear_dispatch<at::BFloat16>(x, w, bias ? bias->data_ptr<at::BFloat16>() : nullptr, y);
  return y;
}

// Binds the compute threads (at::parallel_for's team: thread 0 is the caller) one to a CPU,
// thread i to cpus[i], and returns their thread ids, in that order; an empty list where the
// platform cannot bind (then nothing was changed).
std::vector<int64_t> bind_compute_threads(const std::vector<int64_t>& cpus) {
#if defined(__linux__)
  const int64_t n = at::get_num_threads();
  TORCH_CHECK(static_cast<int64_t>(cpus.size()) >= n, n, " compute threads need as many CPUs, not ",
              cpus.size());
  for (int64_t c : cpus) TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "CPU ", c, " is out of range");
  std::vector<int64_t> tids(n, -1);
  std::vector<int> errors(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[i]), &set);
      errors[i] = sched_setaffinity(0, sizeof set, &set) == 0 ? 0 : errno;
      tids[i] = static_cast<int64_t>(syscall(SYS_gettid));
    }
  });
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(errors[i] == 0, "binding compute thread ", i, " to CPU ", cpus[i], " failed: ",
                std::strerror(errors[i]));
  std::vector<int64_t> distinct(tids);
  std::sort(distinct.begin(), distinct.end());
  TORCH_CHECK(std::adjacent_find(distinct.begin(), distinct.end()) == distinct.end(),
              "the parallel region ran on fewer than ", n, " threads: nothing is pinned one to a CPU");
  return tids;
#else
  (void)cpus;
  return {};
#endif
}

// ---------------------------------------------------------------------------------------------
// A llama-family decoder stack in one call, for decode steps and extends whose attention the
// kernels take (DecodeLayers, built once at load by sluice.model.fused_decode). It runs the
// per-op path's kernels in the same order on the same values (add + RMSNorm, the qkv linear,
// rotary, the KV write of every new token, then attention query by query as decode_attention
// or extend_attention, o_proj, add + RMSNorm, gate_up, SiLU-and-multiply, down; then the final
// norm), so
// its output equals that path's bit for bit; what it saves is the Python, pybind and ATen
// dispatch around each of the ~10 kernels of each layer. The linear layers are GGUF blocks,
// computed by quant_ops' kernels through the pointer that `_adopt_quant_linear` sets: the block
// kernel, or, for bfloat16 batches of at least `packed_min_rows` rows where QuantLinear keeps
// the blocks repacked for the integer GEMM (`packed`), that GEMM; and for batches of at least
// `dense_min_rows` rows where it keeps a float copy that oneDNN reordered (PackedLinear:
// `dense`), oneDNN's GEMM on it through the op PackedLinear calls (mkldnn::_linear_pointwise),
// or, for bfloat16 batches of at least `amx_min_rows` where that copy has one laid out for the
// AMX GEMM, amx_linear_impl (a gate_up's giving the SiLU, as LlamaMLP takes it), as
// QuantLinear.forward picks. FusedDecode keeps batches within the rows of oneDNN's copy where
// some layer's float copy has no AMX copy. Given `logits_rows`, the last layer runs o_proj, its
// MLP and the final norm on those rows alone and only their hidden states are returned, as
// LlamaModel.forward's `rows` (every row's K/V written; no rows: a prompt's chunk, K/V alone).
// ---------------------------------------------------------------------------------------------
using LinearRowsFn = void (*)(const void* x, bool x_bf16, const uint8_t* w, int64_t type,
                              bool int8_activations, const float* bias, void* y, int64_t M,
                              int64_t K, int64_t N);
LinearRowsFn linear_rows = nullptr;
constexpr const char* LINEAR_ROWS_CAPSULE = "sluice.kernels.linear_rows.v2";  // quant_ops'
// linear_rows.v2's type id for quant_ops' `repack` layout (its `packed_type`): per tile of 16
// output rows, per 32-value block, PACK_BLOCK_BYTES bytes
constexpr int64_t PACKED_TYPE = 0x200, PACK_TILE = 16, PACK_BLOCK_BYTES = 8 * 64 + 2 * 16 * 4;

struct BlockLinear {  // y [M, N] = x [M, K] w^T, w the blocks of `type`, no bias; the type as
                     // quant_ops takes it: ggml's id, or its row-interleaved layout's
  at::Tensor w;       // uint8 [N, row bytes], checked against K by QuantLinear when it was made
  int64_t type = 0, K = 0, N = 0;
  bool int8_activations = false;
  at::Tensor packed;  // w repacked for the integer GEMM, or undefined: never
  int64_t packed_min_rows = 0;  // bfloat16 batches of this many rows or more take `packed`
  at::Tensor dense;   // the float copy as oneDNN reordered it, or undefined: never
  int64_t dense_min_rows = 0;  // batches of this many rows or more take `dense` (before packed)
  at::Tensor amx;     // the float copy laid out for amx_linear (bfloat16), or undefined: never
  bool amx_gated = false;      // its rows paired by 16 (a gate_up's): it gives silu(gate) * up
  int64_t amx_min_rows = 0;    // bfloat16 batches of this many rows or more take `amx` (first)
  at::Tensor amx_bias;         // zeros, one a padded output (amx_linear_impl reads a bias)
};
// w, type, K, int8, packed (or None), packed_min_rows, dense (or None), dense_min_rows, amx (or
// None), amx_gated, amx_min_rows
using BlockLinearArgs =
    std::tuple<at::Tensor, int64_t, int64_t, bool, std::optional<at::Tensor>, int64_t,
               std::optional<at::Tensor>, int64_t, std::optional<at::Tensor>, bool, int64_t>;

// y = x w^T by oneDNN, w as torch.ops.mkldnn._reorder_linear_weight made it: PackedLinear's op.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return op.call(x, w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                 std::nullopt);
}

BlockLinear block_linear(const BlockLinearArgs& a, int64_t K, int64_t N, const char* what) {
  const auto& [w, type, k, int8, packed, packed_min_rows, dense, dense_min_rows, amx, amx_gated,
               amx_min_rows] = a;
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 &&
              w.is_contiguous(), what, ": contiguous 2-D uint8 blocks");
  TORCH_CHECK(k == K && (N < 0 || w.size(0) == N), what, ": [", w.size(0), ", ", k,
              "] does not fit [", N, ", ", K, "]");
  BlockLinear l{w, type, k, w.size(0), int8};
  if (packed) {
    const at::Tensor& p = *packed;
    TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == at::kByte && p.dim() == 2 &&
                p.is_contiguous() && reinterpret_cast<uintptr_t>(p.data_ptr()) % 64 == 0 &&
                p.size(0) == (l.N + PACK_TILE - 1) / PACK_TILE &&
                p.size(1) == K / 32 * PACK_BLOCK_BYTES && int8 && packed_min_rows >= 1,
                what, ": packed must be the blocks repacked for the integer GEMM (64-byte "
                "aligned), with int8 activations and packed_min_rows >= 1");
    l.packed = p;
    l.packed_min_rows = packed_min_rows;
  }
  if (dense) {  // QuantLinear gives the float copy the rows past the repacked blocks' own;
                // PackedLinear takes up to SMALL_LINEAR_MAX_ROWS rows by small_linear instead
    TORCH_CHECK(dense->device().is_cpu() && dense->dim() == 2 && dense->size(0) == l.N &&
                dense->size(1) == K && dense_min_rows > SMALL_LINEAR_MAX_ROWS &&
                (!packed || dense_min_rows > packed_min_rows), what,
                ": dense must be the [N, K] CPU weight oneDNN reordered, taken from more than ",
                SMALL_LINEAR_MAX_ROWS, " rows (and past packed_min_rows)");
    l.dense = *dense;
    l.dense_min_rows = dense_min_rows;
  }
  if (amx) {  // PackedLinear's AMX copy, which its bfloat16 batches of amx_min_rows or more take
    const at::Tensor& t = *amx;
    TORCH_CHECK(amx_linear_ok() && K % 32 == 0 && t.scalar_type() == at::kShort &&
                t.is_contiguous() && t.numel() == (l.N + 31) / 32 * 32 * K &&
                (!amx_gated || l.N % 32 == 0) && amx_min_rows > SMALL_LINEAR_MAX_ROWS &&
                (!packed || amx_min_rows > packed_min_rows), what,
                ": amx must be amx_pack_linear's [N, K] (a gate_up's paired: N a multiple of 32),"
                " taken from more than ", SMALL_LINEAR_MAX_ROWS, " rows (and past packed_min_rows)");
    l.amx = t;
    l.amx_gated = amx_gated;
    l.amx_min_rows = amx_min_rows;
    l.amx_bias = at::zeros({(l.N + 31) / 32 * 32}, t.options().dtype(at::kFloat));
  }
  return l;
}

struct DecoderLayerWeights {
  at::Tensor input_norm, post_norm;  // [hidden], the activations' dtype
  BlockLinear qkv, o, gate_up, down;
  at::Tensor k_pool, v_pool;  // this layer's [slots, Hkv, D] of the KV pool
};

class DecodeLayers {
 public:
  // embed [vocab, hidden] and final_norm [hidden] fix the dtype (float32 or bfloat16);
  // cos, sin: the rotary tables [max_pos, head_dim / 2] in float32.
  DecodeLayers(at::Tensor embed, at::Tensor final_norm, at::Tensor cos, at::Tensor sin, double eps,
               int64_t heads, int64_t kv_heads, int64_t head_dim, double scale)
      : embed_(std::move(embed)), final_norm_(std::move(final_norm)), cos_(std::move(cos)),
        sin_(std::move(sin)), eps_(eps), H_(heads), Hkv_(kv_heads), D_(head_dim), scale_(scale) {
    check_storage(embed_, "embed");
    TORCH_CHECK(embed_.dim() == 2 && embed_.is_contiguous(), "embed: contiguous [vocab, hidden]");
    check_vector(final_norm_, "final_norm");
    TORCH_CHECK(cos_.scalar_type() == at::kFloat && cos_.dim() == 2 && cos_.is_contiguous() &&
                sin_.sizes() == cos_.sizes() && sin_.is_contiguous() &&
                sin_.scalar_type() == at::kFloat && cos_.size(1) * 2 == D_, "bad rotary tables");
    TORCH_CHECK(H_ >= 1 && Hkv_ >= 1 && H_ % Hkv_ == 0, "heads not a multiple of KV heads");
    const int64_t dims[] = {16, 32, 64, 80, 96, 128};  // attention_dispatch's
    TORCH_CHECK(std::find(std::begin(dims), std::end(dims), D_) != std::end(dims), "head_dim ", D_,
                " is not supported");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, const BlockLinearArgs& qkv,
                 const BlockLinearArgs& o, const BlockLinearArgs& gate_up,
                 const BlockLinearArgs& down, at::Tensor k_pool, at::Tensor v_pool) {
    const int64_t hidden = embed_.size(1), qkv_n = (H_ + 2 * Hkv_) * D_;
    check_vector(input_norm, "input_norm");
    check_vector(post_norm, "post_norm");
    DecoderLayerWeights l{std::move(input_norm), std::move(post_norm),
                          block_linear(qkv, hidden, qkv_n, "qkv"),
                          block_linear(o, H_ * D_, hidden, "o_proj"),
                          block_linear(gate_up, hidden, -1, "gate_up"), {}, std::move(k_pool),
                          std::move(v_pool)};
    TORCH_CHECK(l.gate_up.N % 2 == 0 && (layers_.empty() || l.gate_up.N == layers_[0].gate_up.N),
                "gate_up: an even width, the same in every layer");
    l.down = block_linear(down, l.gate_up.N / 2, hidden, "down_proj");
    for (const at::Tensor* pool : {&l.k_pool, &l.v_pool})
      TORCH_CHECK(pool->device().is_cpu() && pool->is_contiguous() &&
                  pool->scalar_type() == embed_.scalar_type() && pool->dim() == 3 &&
                  pool->size(1) == Hkv_ && pool->size(2) == D_ &&
                  pool->size(0) == l.k_pool.size(0), "k_pool, v_pool: [slots, Hkv, D] of x's dtype");
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The final-norm hidden states [B, hidden] of B decoding tokens: input_ids, positions and
  // out_cache_loc [B] int64, kv_indices [B, max_kv] int64, seq_lens [B] int64 (each token's
  // request attends to its first seq_lens[b] slots, this token's own among them).
  // One token a row: input_ids, positions, out_cache_loc, seq_lens [T]. Without q_rows, row t
  // is a request of its own (a decode step: kv_indices [T, max_kv]); with q_rows [T], token t
  // reads row q_rows[t] of kv_indices [B, max_kv], its first seq_lens[t] slots (an extend: a
  // request's new tokens are rows of their own, causal by their lengths, as extend_attention).
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions,
                     const at::Tensor& out_cache_loc, const at::Tensor& kv_indices,
                     const at::Tensor& seq_lens, const std::optional<at::Tensor>& q_rows,
                     int64_t shared_prefix,
                     const std::optional<at::Tensor>& shared_requests,
                     const std::optional<at::Tensor>& logits_rows) const {
    TORCH_CHECK(linear_rows != nullptr, "DecodeLayers needs quant_ops' linear (_adopt_quant_linear)");
    TORCH_CHECK(!layers_.empty(), "DecodeLayers has no layers");
    check_step(input_ids, positions, out_cache_loc, kv_indices, seq_lens, q_rows);
    const int64_t* rows = q_rows ? q_rows->data_ptr<int64_t>() : nullptr;
    const SharedPrefix shared =
        check_shared_prefix(kv_indices, rows, seq_lens, shared_prefix, shared_requests);
    const int64_t T = input_ids.size(0);
    if (logits_rows) {
      const at::Tensor& kept = *logits_rows;
      TORCH_CHECK(kept.device().is_cpu() && kept.is_contiguous() && kept.dim() == 1 &&
                  kept.scalar_type() == at::kLong, "logits_rows: [R] contiguous int64");
      const int64_t* kp = kept.data_ptr<int64_t>();
      for (int64_t r = 0; r < kept.size(0); ++r)
        TORCH_CHECK(kp[r] >= 0 && kp[r] < T, "logits_rows[", r, "] = ", kp[r],
                    " is outside the step's ", T, " tokens");
    }
    if (embed_.scalar_type() == at::kFloat)
      return run<float>(input_ids, positions, out_cache_loc, kv_indices, seq_lens, rows, shared,
                        logits_rows);
    return run<at::BFloat16>(input_ids, positions, out_cache_loc, kv_indices, seq_lens, rows,
                             shared, logits_rows);
  }

 private:
  void check_vector(const at::Tensor& t, const char* what) const {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 1 &&
                t.size(0) == embed_.size(1) && t.scalar_type() == embed_.scalar_type(), what,
                ": [hidden], contiguous, of embed's dtype");
  }

  // Every index the step reads or writes lies in its table: tokens, positions, pool slots.
  void check_step(const at::Tensor& ids, const at::Tensor& pos, const at::Tensor& loc,
                  const at::Tensor& kv_indices, const at::Tensor& lens,
                  const std::optional<at::Tensor>& q_rows) const {
    for (const at::Tensor* t : {&ids, &pos, &loc, &kv_indices, &lens})
      TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kLong,
                  "step metadata: contiguous int64 CPU tensors");
    const int64_t T = ids.size(0), slots = layers_[0].k_pool.size(0);
    TORCH_CHECK(T >= 1 && ids.dim() == 1 && pos.sizes() == ids.sizes() &&
                loc.sizes() == ids.sizes() && lens.sizes() == ids.sizes() &&
                kv_indices.dim() == 2, "step metadata: [T] each, kv_indices [B, max_kv]");
    const int64_t* rows = nullptr;
    if (q_rows) {
      TORCH_CHECK(q_rows->device().is_cpu() && q_rows->is_contiguous() &&
                  q_rows->scalar_type() == at::kLong && q_rows->sizes() == ids.sizes(),
                  "q_rows: [T] contiguous int64");
      rows = q_rows->data_ptr<int64_t>();
    } else {
      TORCH_CHECK(kv_indices.size(0) == T, "decode: one kv_indices row a token");
    }
    const int64_t B = kv_indices.size(0), max_kv = kv_indices.size(1);
    const int64_t *ip = ids.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>();
    const int64_t *lp = loc.data_ptr<int64_t>(), *np = lens.data_ptr<int64_t>();
    std::vector<int64_t> need(B, 0);  // slots each kv_indices row is read up to
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(ip[t] >= 0 && ip[t] < embed_.size(0), "token ", ip[t], " is outside the vocab");
      TORCH_CHECK(pp[t] >= 0 && pp[t] < cos_.size(0), "position ", pp[t], " is outside the ",
                  cos_.size(0), " positions of the rotary table");
      TORCH_CHECK(lp[t] >= 0 && lp[t] < slots, "slot ", lp[t], " is outside the pool");
      TORCH_CHECK(np[t] >= 1 && np[t] <= max_kv, "token ", t, " sees ", np[t],
                  " slots; it must see 1 to ", max_kv);
      const int64_t row = rows ? rows[t] : t;
      TORCH_CHECK(row >= 0 && row < B, "q_rows[", t, "] = ", row, " is outside kv_indices");
      need[row] = std::max(need[row], np[t]);
    }
    const int64_t* kp = kv_indices.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t l = 0; l < need[b]; ++l)
        TORCH_CHECK(kp[b * max_kv + l] >= 0 && kp[b * max_kv + l] < slots, "slot ",
                    kp[b * max_kv + l], " is outside the pool of ", slots);
  }

  // Whether x's M rows take the layer's AMX copy, as PackedLinear picks.
  template <typename T>
  static bool takes_amx(const BlockLinear& l, int64_t M) {
    return std::is_same_v<T, at::BFloat16> && l.amx.defined() && M >= l.amx_min_rows;
  }

  // y = x w^T on the AMX copy (x, y contiguous rows); with silu_mul (a gated copy), y is
  // silu(gate) * up, [M, N / 2].
  static void amx_into(const BlockLinear& l, const at::Tensor& x, at::Tensor& y, bool silu_mul) {
#if defined(SLUICE_AMX_PREFIX)
    amx_linear_impl(x.data_ptr<at::BFloat16>(), x.size(0), l.K,
                    reinterpret_cast<const uint16_t*>(l.amx.data_ptr<int16_t>()), l.N,
                    l.amx_bias.data_ptr<float>(), silu_mul, y.data_ptr<at::BFloat16>());
#else
    (void)l, (void)x, (void)y, (void)silu_mul;
    TORCH_CHECK(false, "this build has no AMX tiles");
#endif
  }

  template <typename T>
  static void linear(const BlockLinear& l, const at::Tensor& x, at::Tensor& y) {
    constexpr bool bf16 = std::is_same_v<T, at::BFloat16>;
    const int64_t M = x.size(0);
    if (takes_amx<T>(l, M) && !l.amx_gated) {
      amx_into(l, x, y, false);
      return;
    }
    if (l.dense.defined() && M >= l.dense_min_rows) {
      y.copy_(onednn_linear(x, l.dense));
      return;
    }
    const bool packed = bf16 && l.packed.defined() && M >= l.packed_min_rows;
    linear_rows(x.data_ptr<T>(), bf16, (packed ? l.packed : l.w).data_ptr<uint8_t>(),
                packed ? PACKED_TYPE : l.type, l.int8_activations, nullptr, y.data_ptr<T>(), M,
                l.K, l.N);
  }

  // This step's K and V rows (qkv's columns after q) into the layer's pool, as index_copy_.
  template <typename T>
  void write_kv(const at::Tensor& qkv, const at::Tensor& loc, const DecoderLayerWeights& l) const {
    const int64_t row = Hkv_ * D_ * sizeof(T), step = qkv.size(1) * sizeof(T);
    const char* k = reinterpret_cast<const char*>(qkv.data_ptr<T>() + H_ * D_);
    copy_kv_rows(static_cast<char*>(l.k_pool.data_ptr()), static_cast<char*>(l.v_pool.data_ptr()),
                 loc.data_ptr<int64_t>(), qkv.size(0), row, k, step, k + row, step);
  }

  // The rows `kept` of x [B, cols], in their order, as x[kept].
  template <typename T>
  static at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& kept) {
    const int64_t R = kept.size(0), cols = x.size(1);
    at::Tensor out = at::empty({R, cols}, x.options());
    const int64_t* kp = kept.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(out.data_ptr<T>() + r * cols, x.data_ptr<T>() + kp[r] * cols, cols * sizeof(T));
    return out;
  }

  // `kept` (if any): the rows whose hidden states are returned; the last layer runs o_proj,
  // its MLP and the final norm on them alone, as LlamaModel.forward's `rows`.
  template <typename T>
  at::Tensor run(const at::Tensor& ids, const at::Tensor& pos, const at::Tensor& loc,
                 const at::Tensor& kv_indices, const at::Tensor& lens, const int64_t* rows,
                 const SharedPrefix& shared, const std::optional<at::Tensor>& kept) const {
    const int64_t B = ids.size(0), hidden = embed_.size(1), q_size = H_ * D_;
    const int64_t inter = layers_[0].gate_up.N / 2;
    const auto opt = embed_.options();
    // x: the layer's input norm, then its attention output's; residual: the residual stream
    at::Tensor x = at::empty({B, hidden}, opt), residual = at::empty({B, hidden}, opt);
    at::Tensor qkv = at::empty({B, q_size + 2 * Hkv_ * D_}, opt);
    at::Tensor q = at::empty({B, H_, D_}, opt), attn = at::empty({B, H_, D_}, opt);
    at::Tensor gate_up = at::empty({B, 2 * inter}, opt), act = at::empty({B, inter}, opt);
    at::Tensor attn_rows = attn.view({B, q_size});
    const int64_t* ip = ids.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)  // the embeddings start the residual stream
      std::memcpy(residual.data_ptr<T>() + b * hidden, embed_.data_ptr<T>() + ip[b] * hidden,
                  hidden * sizeof(T));
    std::memcpy(x.data_ptr<T>(), residual.data_ptr<T>(), B * hidden * sizeof(T));
    add_rms_norm_impl<T>(x, nullptr, layers_[0].input_norm, eps_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecoderLayerWeights& l = layers_[i];
      if (i > 0) add_rms_norm_impl<T>(x, &residual, l.input_norm, eps_);  // x: the MLP's output
      linear<T>(l.qkv, x, qkv);
      rope_impl<T>(qkv, pos, cos_, sin_, H_ + Hkv_, D_);
      write_kv<T>(qkv, loc, l);
      const bool last = i + 1 == layers_.size();
      if (last && kept && kept->size(0) == 0)  // a prompt's chunk: its K/V, no hidden states
        return at::empty({0, hidden}, opt);
      for (int64_t b = 0; b < B; ++b)  // q's part of each row, as q.contiguous()
        std::memcpy(q.data_ptr<T>() + b * q_size, qkv.data_ptr<T>() + b * qkv.size(1),
                    q_size * sizeof(T));
      attention_dispatch<T>(q, l.k_pool, l.v_pool, kv_indices, rows, lens, attn, scale_, shared);
      if (last && kept) {  // the last layer past attention: those rows only
        const int64_t R = kept->size(0);
        attn_rows = gather_rows<T>(attn_rows, *kept);
        residual = gather_rows<T>(residual, *kept);
        x = at::empty({R, hidden}, opt);
        gate_up = at::empty({R, 2 * inter}, opt);
        act = at::empty({R, inter}, opt);
      }
      linear<T>(l.o, attn_rows, x);
      add_rms_norm_impl<T>(x, &residual, l.post_norm, eps_);
      if (takes_amx<T>(l.gate_up, x.size(0)) && l.gate_up.amx_gated) {
        amx_into(l.gate_up, x, act, true);  // the SiLU from the GEMM, as LlamaMLP takes it
      } else {
        linear<T>(l.gate_up, x, gate_up);
        silu_and_mul_impl<T>(gate_up, act);
      }
      linear<T>(l.down, act, x);
    }
    add_rms_norm_impl<T>(x, &residual, final_norm_, eps_);
    return x;
  }

  at::Tensor embed_, final_norm_, cos_, sin_;
  double eps_;
  int64_t H_, Hkv_, D_;
  double scale_;
  std::vector<DecoderLayerWeights> layers_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Grammar bitmasks over float32 logits, read as they are: no [G, V] float bias is built. Row g
// of masks [G, >= ceil(V / 32)] int32 belongs to logits row rows[g] (rows None: row g); bit t
// of word w allows token 32 w + t, bits at or past V are ignored. A word with no bit set (most
// of them where the grammar allows a few tokens) is skipped, one with all set read plainly.
// One thread: a batch's rows take about a millisecond on one core, and a fork-join over both
// cores of a busy machine waited ten times that for its preempted thread.
// ---------------------------------------------------------------------------------------------
namespace {

constexpr int64_t MASK_BITS = 32;

// the lanes of the k-th vector of a word's 32 tokens that its bits allow: all ones, or zero
inline vi allowed_lanes(uint32_t word, int k) {
  vu lane_bit;
  for (int i = 0; i < W; ++i) lane_bit[i] = 1u << i;
  const vu bits = vu{} + (word >> (k * W));
  return (vi)((bits & lane_bit) != 0);
}

inline vf ninf_vf() { return vf{} - std::numeric_limits<float>::infinity(); }

// the largest allowed logit of a row (-inf when none is allowed)
float masked_row_max(const float* x, const uint32_t* m, int64_t V) {
  const int64_t full = V / MASK_BITS;
  vf best = ninf_vf();
  for (int64_t w = 0; w < full; ++w) {
    const uint32_t word = m[w];
    if (word == 0) continue;
    const float* p = x + w * MASK_BITS;
    for (int k = 0; k < MASK_BITS / W; ++k) {
      const vf v = load(p + k * W);
      const vf allowed = word == ~0u ? v : (allowed_lanes(word, k) != 0 ? v : ninf_vf());
      best = allowed > best ? allowed : best;
    }
  }
  float b = best[0];
  for (int i = 1; i < W; ++i) b = std::max(b, best[i]);
  for (int64_t t = full * MASK_BITS; t < V; ++t)
    if ((m[t / MASK_BITS] >> (t % MASK_BITS)) & 1u) b = std::max(b, x[t]);
  return b;
}

// the first allowed token of a row whose logit is `value`, else 0
int64_t first_allowed_equal(const float* x, const uint32_t* m, int64_t V, float value) {
  for (int64_t w = 0; w * MASK_BITS < V; ++w) {
    for (uint32_t word = m[w]; word != 0; word &= word - 1) {
      const int64_t t = w * MASK_BITS + __builtin_ctz(word);
      if (t >= V) break;
      if (x[t] == value) return t;
    }
  }
  return 0;
}

// -inf on the disallowed tokens of a row, in place
void mask_row(float* x, const uint32_t* m, int64_t V) {
  const int64_t full = V / MASK_BITS;
  for (int64_t w = 0; w < full; ++w) {
    const uint32_t word = m[w];
    if (word == ~0u) continue;
    float* p = x + w * MASK_BITS;
    for (int k = 0; k < MASK_BITS / W; ++k) {
      const vf v = load(p + k * W);
      store(allowed_lanes(word, k) != 0 ? v : ninf_vf(), p + k * W);
    }
  }
  for (int64_t t = full * MASK_BITS; t < V; ++t)
    if (!((m[t / MASK_BITS] >> (t % MASK_BITS)) & 1u)) x[t] = -std::numeric_limits<float>::infinity();
}

// checks the shapes and returns the logits row of each mask row
std::vector<int64_t> mask_rows(const at::Tensor& logits, const at::Tensor& masks,
                               const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "grammar masks: logits must be 2-D float32 with contiguous rows");
  TORCH_CHECK(masks.dim() == 2 && masks.scalar_type() == at::kInt && masks.is_contiguous(),
              "grammar masks: masks must be 2-D contiguous int32");
  TORCH_CHECK(masks.size(1) * MASK_BITS >= logits.size(1), "grammar masks: ", masks.size(1),
              " words cannot cover ", logits.size(1), " tokens");
  const int64_t G = masks.size(0);
  std::vector<int64_t> out(G);
  if (rows) {
    TORCH_CHECK(rows->dim() == 1 && rows->size(0) == G && rows->scalar_type() == at::kLong,
                "grammar masks: rows must be int64 [", G, "]");
    const at::Tensor r = rows->contiguous();
    const int64_t* rp = r.data_ptr<int64_t>();
    for (int64_t g = 0; g < G; ++g) {
      TORCH_CHECK(rp[g] >= 0 && rp[g] < logits.size(0), "grammar masks: row ", rp[g],
                  " is outside the ", logits.size(0), " rows of the logits");
      out[g] = rp[g];
    }
  } else {
    TORCH_CHECK(G == logits.size(0), "grammar masks: ", G, " masks for ", logits.size(0), " rows");
    for (int64_t g = 0; g < G; ++g) out[g] = g;
  }
  return out;
}

// int64 [G]: the argmax of each row's allowed logits (the first index of the maximum, as
// torch.argmax of the logits with -inf on the disallowed tokens), for finite logits; 0 for a
// row that allows nothing.
at::Tensor masked_argmax(const at::Tensor& logits, const at::Tensor& masks,
                         const std::optional<at::Tensor>& rows) {
  const std::vector<int64_t> row_of = mask_rows(logits, masks, rows);
  const int64_t G = masks.size(0), V = logits.size(1), words = masks.size(1);
  auto out = at::empty({G}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  const auto* mp = reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>());
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0);
  for (int64_t g = 0; g < G; ++g) {
    const float* x = xp + row_of[g] * stride;
    const uint32_t* m = mp + g * words;
    op[g] = first_allowed_equal(x, m, V, masked_row_max(x, m, V));
  }
  return out;
}

// int64 [R]: the first index of each row's maximum, as torch.argmax for logits without NaN;
// float32 or bfloat16 logits (bfloat16 widens to float32 exactly: the same index either way).
// One thread, like the masked argmax above (the sampler calls it with the GIL released).
template <typename T>
void argmax_rows_impl(const T* xp, int64_t R, int64_t V, int64_t stride, int64_t* op) {
  const int64_t full = V / W * W;
  for (int64_t r = 0; r < R; ++r) {
    const T* x = xp + r * stride;
    vf best = ninf_vf();
    for (int64_t t = 0; t < full; t += W) {
      const vf v = load(x + t);
      best = v > best ? v : best;
    }
    float b = best[0];
    for (int i = 1; i < W; ++i) b = std::max(b, best[i]);
    for (int64_t t = full; t < V; ++t) b = std::max(b, to_float(x[t]));
    int64_t at = 0;
    while (at < V - 1 && to_float(x[at]) != b) ++at;
    op[r] = at;
  }
}

void check_logits(const at::Tensor& logits, const char* what) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 &&
              (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              what, ": logits must be 2-D float32 or bfloat16 with contiguous rows");
}

// int64 [R]: one index per row of logits [R, V] (float32 or bfloat16, checked as `what`), by
// F (float32) or B (bfloat16): (rows, R, V, row stride, out).
template <void (*F)(const float*, int64_t, int64_t, int64_t, int64_t*),
          void (*B)(const at::BFloat16*, int64_t, int64_t, int64_t, int64_t*)>
at::Tensor index_per_row(const at::Tensor& logits, const char* what) {
  check_logits(logits, what);
  const int64_t R = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(V > 0, what, ": rows of 0 logits have no argmax");
  TORCH_CHECK(V < INT32_MAX - 64, what, ": rows of ", V, " logits are too long");  // int32 lanes
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  if (logits.scalar_type() == at::kFloat) F(logits.data_ptr<float>(), R, V, stride, op);
  else B(logits.data_ptr<at::BFloat16>(), R, V, stride, op);
  return out;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  return index_per_row<argmax_rows_impl<float>, argmax_rows_impl<at::BFloat16>>(logits,
                                                                                "argmax_rows");
}

// Per row of logits [R, V] (float32 or bfloat16): whether all its values are finite, by their
// exponent bits (all ones for an infinity or NaN; a float test such as x * 0 == 0 is folded
// away under this build's flags). One call instead of the reduction, test and copy of PyTorch
// ops the step ran here, each slow right after a forward has streamed the weights through the
// caches.
template <typename T>
void finite_rows_impl(const T* xp, int64_t R, int64_t V, int64_t stride, std::vector<bool>& out) {
  constexpr int32_t EXP = 0x7f800000;
  const int64_t full = V / W * W;
  for (int64_t r = 0; r < R; ++r) {
    const T* x = xp + r * stride;
    vi bad = {};
    for (int64_t t = 0; t < full; t += W) {
      const vf v = load(x + t);  // bfloat16 widened: the same exponent bits
      vi bits;
      std::memcpy(&bits, &v, sizeof bits);
      bad |= (bits & EXP) == EXP;  // -1 in a lane whose value is not finite
    }
    bool ok = true;
    for (int i = 0; i < W; ++i) ok &= bad[i] == 0;
    for (int64_t t = full; t < V; ++t) ok &= std::isfinite(to_float(x[t]));
    out[r] = ok;
  }
}

std::vector<bool> finite_rows(const at::Tensor& logits) {
  check_logits(logits, "finite_rows");
  const int64_t R = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  std::vector<bool> out(R);
  if (logits.scalar_type() == at::kFloat) finite_rows_impl(logits.data_ptr<float>(), R, V, stride, out);
  else finite_rows_impl(logits.data_ptr<at::BFloat16>(), R, V, stride, out);
  return out;
}

// int64 [R]: per row of logits [R, V] (float32 or bfloat16), the first index of its maximum
// (argmax_rows') where every value is finite (finite_rows'), else -1: a greedy step's two
// passes over [R, vocab] in one, each lane keeping its first index of its maximum.
template <typename T>
void greedy_rows_impl(const T* xp, int64_t R, int64_t V, int64_t stride, int64_t* op) {
  constexpr int32_t EXP = 0x7f800000;
  const int64_t full = V / W * W;
  vi lane;
  for (int i = 0; i < W; ++i) lane[i] = i;
  // rows split over the threads past 8 rows (a decode step's batch); in a row, two chains of
  // compare-and-select over alternate vectors, so that each waits on its own last select only
  sluice::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = xp + r * stride;
      vf best = ninf_vf(), best2 = ninf_vf();
      vi best_at = lane, best_at2 = lane + W, at = lane, bad = {};
      // the vector at x + t into one chain: its non-finite lanes, and each lane's maximum
      auto take = [&](int64_t t, vi idx, vf& top, vi& top_at) {
        const vf v = load(x + t);  // bfloat16 widened: the same exponent bits, the same order
        vi bits;
        std::memcpy(&bits, &v, sizeof bits);
        bad |= (bits & EXP) == EXP;
        const vi more = v > top;
        top = more ? v : top;
        top_at = more ? idx : top_at;
      };
      int64_t t = 0;
      for (; t + 2 * W <= full; t += 2 * W, at += 2 * W) {
        take(t, at, best, best_at);
        take(t + W, at + W, best2, best_at2);
      }
      for (; t < full; t += W, at += W) take(t, at, best, best_at);
      // each lane's first index of its largest value over both chains
      const vi second = (best2 > best) | ((best2 == best) & (best_at2 < best_at));
      best = second ? best2 : best;
      best_at = second ? best_at2 : best_at;
      bool ok = true;
      float b = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < W; ++i) {
        ok &= bad[i] == 0;
        b = std::max(b, best[i]);
      }
      int64_t arg = V;
      for (int i = 0; i < W && full > 0; ++i)
        if (best[i] == b) arg = std::min<int64_t>(arg, best_at[i]);
      for (int64_t u = full; u < V; ++u) {  // past every lane's index: only a greater value wins
        const float v = to_float(x[u]);
        ok &= std::isfinite(v);
        if (v > b || arg == V) {
          b = v;
          arg = u;
        }
      }
      op[r] = ok ? arg : -1;
    }
  });
}

at::Tensor greedy_rows(const at::Tensor& logits) {
  return index_per_row<greedy_rows_impl<float>, greedy_rows_impl<at::BFloat16>>(logits,
                                                                                "greedy_rows");
}

// -inf, in place, on the tokens each mask row does not allow in its logits row
void grammar_mask_(at::Tensor& logits, const at::Tensor& masks,
                   const std::optional<at::Tensor>& rows) {
  const std::vector<int64_t> row_of = mask_rows(logits, masks, rows);
  const int64_t G = masks.size(0), V = logits.size(1), words = masks.size(1);
  float* xp = logits.data_ptr<float>();
  const auto* mp = reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>());
  const int64_t stride = logits.stride(0);
  for (int64_t g = 0; g < G; ++g) mask_row(xp + row_of[g] * stride, mp + g * words, V);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  sluice::bind_pool(m);
  m.attr("attention_head_dims") = pybind11::make_tuple(16, 32, 64, 80, 96, 128);  // the switch
  m.def("decode_attention", &decode_attention, pybind11::arg("q"), pybind11::arg("k_pool"),
        pybind11::arg("v_pool"), pybind11::arg("kv_indices"), pybind11::arg("seq_lens"),
        pybind11::arg("scale"), pybind11::arg("shared_prefix") = 0,
        pybind11::arg("shared_requests") = pybind11::none());
  m.def("extend_attention", &extend_attention, pybind11::arg("q"), pybind11::arg("k_pool"),
        pybind11::arg("v_pool"), pybind11::arg("kv_indices"), pybind11::arg("q_rows"),
        pybind11::arg("q_lens"), pybind11::arg("scale"), pybind11::arg("shared_prefix") = 0,
        pybind11::arg("shared_requests") = pybind11::none());
  m.def("amx_attention", &amx_attention);
  m.def("dense_attention_", &dense_attention_, pybind11::arg("out"), pybind11::arg("q"),
        pybind11::arg("k_pool"), pybind11::arg("v_pool"), pybind11::arg("kv_indices"),
        pybind11::arg("spans"), pybind11::arg("scale"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("amx_linear_ok", &amx_linear_ok);
  m.def("amx_pack_linear", &amx_pack_linear, pybind11::arg("w"));
  m.def("amx_linear", &amx_linear, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("N"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("silu_mul") = false);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("rms_norm", &rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rope_", &rope_);
  m.def("store_kv_", &store_kv_, pybind11::arg("k_pool"), pybind11::arg("v_pool"),
        pybind11::arg("loc"), pybind11::arg("k"), pybind11::arg("v"));
  m.def("masked_argmax", &masked_argmax, pybind11::arg("logits"), pybind11::arg("masks"),
        pybind11::arg("rows") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, pybind11::arg("logits"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("finite_rows", &finite_rows, pybind11::arg("logits"));
  m.def("greedy_rows", &greedy_rows, pybind11::arg("logits"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("grammar_mask_", &grammar_mask_, pybind11::arg("logits"), pybind11::arg("masks"),
        pybind11::arg("rows") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.attr("small_linear_max_rows") = SMALL_LINEAR_MAX_ROWS;
  m.attr("small_linear_k_multiple") = SMALL_LINEAR_K_MULTIPLE;
  m.def("bind_compute_threads", &bind_compute_threads, pybind11::arg("cpus"));
  m.def("small_linear", &small_linear, pybind11::arg("x"), pybind11::arg("w"),
        pybind11::arg("bias") = pybind11::none());
  // quant_ops' `_linear_capsule()`: the linear layers of DecodeLayers; false if it does not fit
  m.def("_adopt_quant_linear", [](const pybind11::capsule& c) {
    if (std::string(c.name() ? c.name() : "") != LINEAR_ROWS_CAPSULE) return false;
    linear_rows = *static_cast<const LinearRowsFn*>(c.get_pointer());
    return true;
  });
  m.def("_has_quant_linear", [] { return linear_rows != nullptr; });
  pybind11::class_<DecodeLayers>(m, "DecodeLayers")
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, int64_t, int64_t,
                          int64_t, double>(),
           pybind11::arg("embed"), pybind11::arg("final_norm"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("eps"), pybind11::arg("heads"),
           pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("scale"))
      .def("add_layer", &DecodeLayers::add_layer)
      .def_property_readonly("num_layers", &DecodeLayers::num_layers)
      .def("forward", &DecodeLayers::forward, pybind11::arg("input_ids"), pybind11::arg("positions"),
           pybind11::arg("out_cache_loc"), pybind11::arg("kv_indices"), pybind11::arg("seq_lens"),
           pybind11::arg("q_rows") = pybind11::none(), pybind11::arg("shared_prefix") = 0,
           pybind11::arg("shared_requests") = pybind11::none(),
           pybind11::arg("logits_rows") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
