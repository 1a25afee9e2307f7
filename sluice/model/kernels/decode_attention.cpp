// Decode attention over a token-slot KV pool, read in place (no gather).
//
// One query token per request: out[b, h] = softmax(q[b, h] . K[slots of b] * scale) . V[same].
// Request b reads the first seq_lens[b] slots of kv_indices[b] from the pool; query head h uses
// KV head h / (H / Hkv) (grouped-query attention). Work is split over torch's thread pool
// (at::parallel_for) by request, or by (request, KV head) when requests are fewer than twice the
// threads; a task reads its part of each K and V slot row once, computing in float32 whatever
// the storage dtype (float32 or bfloat16).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }

inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }

inline void store_row(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = at::BFloat16(src[i]);
}

// exp(x) for x <= 0 (softmax after subtracting the max): 2^t = 2^n * 2^f with n the integer
// nearest t = x log2(e), so |f| <= 1/2, and 2^f = e^(f ln 2) by its Taylor series to degree 6
// (absolute error < 2e-7, about float32 rounding of x log2(e)); unlike std::exp, it vectorizes.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.f) * 1.44269504f;
  const float n = static_cast<float>(static_cast<int32_t>(t - 0.5f));  // round(t): t - 0.5 < 0
  const float y = (t - n) * 0.693147181f;                               // |y| <= ln(2) / 2
  const float p =
      1.f + y * (1.f + y * (0.5f + y * (0.166666672f + y * (0.0416666679f +
      y * (0.00833333377f + y * 0.00138888892f)))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& kv_indices, const at::Tensor& seq_lens,
                           at::Tensor& out, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_pool.size(1), G = H / Hkv, max_kv = kv_indices.size(1);
  const int64_t row_len = Hkv * D;  // one slot of the pool: [Hkv, D], contiguous
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  // A task is one request and a range of its KV heads: all of them (each slot row read once)
  // when there are enough requests to keep every thread busy, else one head per task.
  const int64_t heads_per_task = B >= 2 * at::get_num_threads() ? Hkv : 1;
  const int64_t tasks_per_req = Hkv / heads_per_task;
  at::parallel_for(0, B * tasks_per_req, 1, [&](int64_t begin, int64_t end) {
    const int64_t QH = heads_per_task * G, span = heads_per_task * D;  // query heads, row part
    std::vector<float> qf(QH * D), acc(QH * D), row(span), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_req, kh0 = (task % tasks_per_req) * heads_per_task;
      const int64_t L = lens[b], h0 = kh0 * G, off = kh0 * D;  // first query head, row offset
      const int64_t* slots = idx + b * max_kv;
      load_row(qp + (b * H + h0) * D, qf.data(), QH * D);
      for (int64_t i = 0; i < QH * D; ++i) qf[i] *= static_cast<float>(scale);
      scores.resize(QH * L);
      for (int64_t l = 0; l < L; ++l) {  // scores[h, l] = q_h . k_l (KV head h / G)
        if (l + 4 < L) __builtin_prefetch(kp + slots[l + 4] * row_len + off);
        load_row(kp + slots[l] * row_len + off, row.data(), span);
        for (int64_t h = 0; h < QH; ++h) {
          const float* qh = qf.data() + h * D;
          const float* kh = row.data() + (h / G) * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[h * L + l] = s;
        }
      }
      for (int64_t h = 0; h < QH; ++h) {  // softmax over l, in place
        float* s = scores.data() + h * L;
        const float m = *std::max_element(s, s + L);
        float sum = 0.f;
        for (int64_t l = 0; l < L; ++l) {
          s[l] = exp_nonpositive(s[l] - m);
          sum += s[l];
        }
        const float inv = 1.f / sum;
        for (int64_t l = 0; l < L; ++l) s[l] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {  // acc[h] = sum_l p[h, l] v_l
        if (l + 4 < L) __builtin_prefetch(vp + slots[l + 4] * row_len + off);
        load_row(vp + slots[l] * row_len + off, row.data(), span);
        for (int64_t h = 0; h < QH; ++h) {
          const float p = scores[h * L + l];
          const float* vh = row.data() + (h / G) * D;
          float* a = acc.data() + h * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
        }
      }
      store_row(acc.data(), op + (b * H + h0) * D, QH * D);
    }
  });
}

}  // namespace

// q [B, H, D]; k_pool, v_pool [S, Hkv, D] (one layer); kv_indices [B, max_kv] int64;
// seq_lens [B] int64 (>= 1 each). Returns [B, H, D] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& kv_indices, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "bad ranks");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "not contiguous");
  TORCH_CHECK(kv_indices.is_contiguous() && seq_lens.is_contiguous(), "indices not contiguous");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "q and the pool differ in dtype");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0, "heads not a multiple of KV heads");
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    decode_attention_impl<float>(q, k_pool, v_pool, kv_indices, seq_lens, out, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_attention_impl<at::BFloat16>(q, k_pool, v_pool, kv_indices, seq_lens, out, scale);
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode_attention", &decode_attention); }
