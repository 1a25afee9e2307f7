// sluice's weight-only kernels for GGUF block quantizations (Q8_0, Q4_0, Q4_1): y = x w^T + b
// with w kept in the file's own blocks and dequantized in registers, one 32-value block at a
// time, never written out. Aimed at decoding (few rows of x), where a linear layer is bound by
// the bytes of weight it reads: 4.5-5 bits a weight instead of 16 or 32.
//
// Layout: w is a uint8 tensor [N, K / 32 * block_bytes], output row n's blocks in order, each
// block exactly as GGUF stores it (ggml's block_q8_0 / block_q4_0 / block_q4_1):
//   Q8_0: fp16 d, int8 q[32]                    value j = d * q[j]
//   Q4_0: fp16 d, uint8 qs[16]                  value j = d * (nibble_j - 8)
//   Q4_1: fp16 d, fp16 m, uint8 qs[16]          value j = d * nibble_j + m
// where nibble_j is the low half of qs[j] for j < 16 and the high half of qs[j - 16] after.
// One output row is one sequential stream of bytes; rows are independent, so whole rows may be
// permuted (the loader reorders the q/k rows of llama.cpp's rotary layout) and concatenated
// (fused q/k/v and gate/up projections).
//
// Arithmetic is float32: x (float32 or bfloat16) is converted to float32 once per call, each
// block is dequantized to two 16-lane float vectors and multiplied into up to ROWS rows of x at
// once (the block read once for all of them), the output rounded to x's dtype. Vectors are GCC
// vector extensions of 16 floats: one AVX-512 register, or two AVX2 ones where the CPU has no
// AVX-512 (the build is -march=native, keyed by the CPU's flags, so the instruction set is the
// running CPU's). Work is split over output rows with torch's thread pool.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "little-endian CPUs only");

namespace {

constexpr int64_t QK = 32;   // values per block, all three types
constexpr int ROWS = 8;      // rows of x computed together (one pass over the weight)

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef int8_t v16s8 __attribute__((vector_size(16)));

enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml's type ids

constexpr int64_t block_bytes(int64_t type) {
  return type == Q8_0 ? 34 : type == Q4_0 ? 18 : 20;
}

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
template <int64_t T, int M, typename Out>
void gemv_rows(const float* x, const uint8_t* w, const float* bias, Out* y, int64_t K, int64_t N,
               int64_t n_begin, int64_t n_end) {
  constexpr int OUT_GROUP = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  const int64_t nb = K / QK, row_bytes = nb * block_bytes(T);
  int64_t n = n_begin;
  for (; n + OUT_GROUP <= n_end; n += OUT_GROUP) {
    v16f acc[OUT_GROUP][M] = {};
    const uint8_t* rows = w + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      v16f lo[OUT_GROUP], hi[OUT_GROUP];
      for (int g = 0; g < OUT_GROUP; ++g)
        dequant_block<T>(rows + g * row_bytes + b * block_bytes(T), lo[g], hi[g]);
      for (int m = 0; m < M; ++m) {
        const v16f xl = load16(x + m * K + b * QK), xh = load16(x + m * K + b * QK + 16);
        for (int g = 0; g < OUT_GROUP; ++g) acc[g][m] += lo[g] * xl + hi[g] * xh;
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
      v16f lo, hi;
      dequant_block<T>(row + b * block_bytes(T), lo, hi);
      for (int m = 0; m < M; ++m)
        acc[m] += lo * load16(x + m * K + b * QK) + hi * load16(x + m * K + b * QK + 16);
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

// Every row of x, ROWS at a time; the threads split the output rows (in chunks of 64, so a
// chunk's weight bytes stay in cache while the tiles of x pass over them).
template <int64_t T, typename Out>
void gemm_impl(const float* x, const uint8_t* w, const float* bias, Out* y, int64_t M, int64_t K,
               int64_t N) {
  constexpr int64_t CHUNK = 64;
  const int64_t chunks = (N + CHUNK - 1) / CHUNK;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * CHUNK, n1 = std::min(N, n0 + CHUNK);
      for (int64_t m = 0; m < M; m += ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(ROWS, M - m));
        gemv_tile<T>(rows, x + m * K, w, bias, y + m * N, K, N, n0, n1);
      }
    }
  });
}

template <typename Out>
void gemm_dispatch(int64_t type, const float* x, const uint8_t* w, const float* bias, Out* y,
                   int64_t M, int64_t K, int64_t N) {
  switch (type) {
    case Q8_0: return gemm_impl<Q8_0>(x, w, bias, y, M, K, N);
    case Q4_0: return gemm_impl<Q4_0>(x, w, bias, y, M, K, N);
    case Q4_1: return gemm_impl<Q4_1>(x, w, bias, y, M, K, N);
    default: TORCH_CHECK(false, "unsupported quantization type ", type);
  }
}

void check_weight(const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(type == Q8_0 || type == Q4_0 || type == Q4_1, "type must be Q8_0 (8), Q4_0 (2) or "
              "Q4_1 (3), not ", type);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 &&
              w.is_contiguous(), "w: a contiguous 2-D uint8 CPU tensor of blocks");
  TORCH_CHECK(K > 0 && K % QK == 0, "in_features must be a positive multiple of 32, not ", K);
  TORCH_CHECK(w.size(1) == K / QK * block_bytes(type), "w has ", w.size(1),
              " bytes a row; ", K, " values take ", K / QK * block_bytes(type));
}

// y = x w^T + bias: x [M, K] float32 or bfloat16, w [N, K / 32 * block_bytes] uint8 blocks of
// `type` (a ggml type id), bias [N] or None (any float dtype). Returns [M, N] in x's dtype.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t type,
                        const c10::optional<at::Tensor>& bias) {
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
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // no copy for contiguous float32
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    gemm_dispatch(type, xf.data_ptr<float>(), w.data_ptr<uint8_t>(), bp, y.data_ptr<float>(), M,
                  K, N);
  else
    gemm_dispatch(type, xf.data_ptr<float>(), w.data_ptr<uint8_t>(), bp,
                  y.data_ptr<at::BFloat16>(), M, K, N);
  return y;
}

template <int64_t T, typename Out>
void dequantize_impl(const uint8_t* w, Out* y, int64_t K, int64_t N) {
  const int64_t nb = K / QK, row_bytes = nb * block_bytes(T);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        v16f lo, hi;
        dequant_block<T>(w + n * row_bytes + b * block_bytes(T), lo, hi);
        Out* out = y + n * K + b * QK;
        for (int i = 0; i < 16; ++i) {
          store_out(lo[i], out + i);
          store_out(hi[i], out + 16 + i);
        }
      }
  });
}

// The float weight [N, K] (float32 or bfloat16, `dtype`) of blocks w of `type`.
at::Tensor dequantize(const at::Tensor& w, int64_t type, int64_t K, at::ScalarType dtype) {
  check_weight(w, type, K);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype: float32 or bfloat16");
  const int64_t N = w.size(0);
  auto y = at::empty({N, K}, w.options().dtype(dtype));
  const uint8_t* wp = w.data_ptr<uint8_t>();
#define SLUICE_DEQUANT(T)                                                               \
  if (dtype == at::kFloat) dequantize_impl<T>(wp, y.data_ptr<float>(), K, N);         \
  else dequantize_impl<T>(wp, y.data_ptr<at::BFloat16>(), K, N);
  switch (type) {
    case Q8_0: SLUICE_DEQUANT(Q8_0) break;
    case Q4_0: SLUICE_DEQUANT(Q4_0) break;
    default: SLUICE_DEQUANT(Q4_1) break;
  }
#undef SLUICE_DEQUANT
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("types") = pybind11::make_tuple(int64_t{Q4_0}, int64_t{Q4_1}, int64_t{Q8_0});
  m.attr("block_values") = QK;
#if defined(__AVX512F__)
  m.attr("isa") = "avx512";
#elif defined(__AVX2__)
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "generic";
#endif
  m.def("quant_linear", &quant_linear, pybind11::arg("x"), pybind11::arg("w"),
        pybind11::arg("type"), pybind11::arg("bias") = pybind11::none());
  m.def("dequantize", &dequantize, pybind11::arg("w"), pybind11::arg("type"), pybind11::arg("K"),
        pybind11::arg("dtype"));
}
