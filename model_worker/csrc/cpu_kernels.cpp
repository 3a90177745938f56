// Fused float32 CPU kernels for the model's decode path (model_worker/cpu_kernels.py builds and loads them).
//
// Every kernel computes each token row on its own, in an order that does not depend on how many rows the call
// has, so a token's hidden state and K/V are the same in a decode step of 1 or of 16 and in a prefill chunk:
// caching never changes output. Written for AVX2 and FMA (8 floats a vector); on a CPU without them this file
// does not compile, and the model runs on torch's ops instead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "radixserve's CPU kernels need AVX2 and FMA"
#endif

namespace {

constexpr int64_t kLanes = 8;

// Lanes [0, n) of a vector set, the rest clear: loads and stores of a row's last, partial vector.
inline __m256i lane_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float horizontal_sum(__m256 v) {
  const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// e^x within 2 ulp (Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a polynomial of r, times 2^n). Inputs are
// clamped to [-87.3, 88]: -inf (a masked score) gives ~1e-38, not 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

void check_float_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

void check_norm_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be float32, contiguous, [H]");
}

// out = in * (1 / sqrt(mean(in^2) + eps)) * weight over one row of n (out may be in).
void normalize_row(const float* in, float* out, const float* weight, int64_t n, float eps) {
  __m256 squares = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 x = _mm256_loadu_ps(in + i);
    squares = _mm256_fmadd_ps(x, x, squares);
  }
  if (i < n) {
    const __m256 x = _mm256_maskload_ps(in + i, lane_mask(n - i));
    squares = _mm256_fmadd_ps(x, x, squares);
  }
  const __m256 inverse = _mm256_set1_ps(1.f / std::sqrt(horizontal_sum(squares) / static_cast<float>(n) + eps));
  for (i = 0; i + kLanes <= n; i += kLanes)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(in + i), inverse)));
  if (i < n) {
    const __m256i mask = lane_mask(n - i);
    _mm256_maskstore_ps(out + i, mask, _mm256_mul_ps(_mm256_maskload_ps(weight + i, mask),
                                                     _mm256_mul_ps(_mm256_maskload_ps(in + i, mask), inverse)));
  }
}

// rms_norm(x) * weight, rows of x [T, H]; a new tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float_rows(x, "x");
  check_norm_weight(weight, x);
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), stride = x.stride(0);
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize_row(in + r * stride, o + r * n, w, n, static_cast<float>(eps));
  });
  return out;
}

// residual += x, then x = rms_norm(residual) * weight; both [T, H], in place (one pass instead of an add and a
// norm). The sum is x + residual in float32, as torch adds.
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_float_rows(x, "x");
  check_float_rows(residual, "residual");
  check_norm_weight(weight, x);
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have one shape");
  const int64_t n = x.size(1), x_stride = x.stride(0), r_stride = residual.stride(0);
  const float* w = weight.data_ptr<float>();
  float* xs = x.data_ptr<float>();
  float* rs = residual.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* sum = rs + r * r_stride;
      float* fresh = xs + r * x_stride;
      for (int64_t i = 0; i < n; ++i) sum[i] = fresh[i] + sum[i];
      normalize_row(sum, fresh, w, n, static_cast<float>(eps));
    }
  });
}

// silu(gate) * up of gate_up [T, 2I] -> [T, I], with silu(g) = g / (1 + e^-g).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float_rows(gate_up, "gate_up");
  const int64_t half = gate_up.size(1) / 2, stride = gate_up.stride(0);
  TORCH_CHECK(gate_up.size(1) == 2 * half, "gate_up must have an even width");
  auto out = at::empty({gate_up.size(0), half}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.f);
  auto silu_mul8 = [&](__m256 gate, __m256 up) {
    return _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate)))),
                         up);
  };
  at::parallel_for(0, gate_up.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * stride;
      const float* up = gate + half;
      float* row = o + r * half;
      int64_t i = 0;
      for (; i + kLanes <= half; i += kLanes)
        _mm256_storeu_ps(row + i, silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
      if (i < half) {
        const __m256i mask = lane_mask(half - i);
        _mm256_maskstore_ps(row + i, mask, silu_mul8(_mm256_maskload_ps(gate + i, mask),
                                                     _mm256_maskload_ps(up + i, mask)));
      }
    }
  });
  return out;
}

// RoPE in place on the first `rotated` heads of qkv [T, heads, D] (the q and k heads of a fused projection):
// x * cos + roll(x, D / 2) * sin at the token's position, with the tables' sine first half negated
// (`model_worker.model.rope_tables`). Products and sum are rounded as torch's ops round them, so the result is
// theirs bit for bit (the build disables contraction into fused multiply-adds).
void rope_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
           int64_t rotated) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 3, "qkv must be float32 "
              "[T, heads, D]");
  TORCH_CHECK(qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2), "qkv's heads must be contiguous");
  const int64_t tokens = qkv.size(0), dim = qkv.size(2), half = dim / 2;
  TORCH_CHECK(dim % (2 * kLanes) == 0, "head_dim must be a multiple of 16, got ", dim);
  TORCH_CHECK(rotated >= 0 && rotated <= qkv.size(1), "rotated heads out of range");
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->dim() == 2 &&
                    table->size(1) == dim && table->sizes() == cos.sizes(), "cos and sin must be float32 [positions, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == tokens,
              "one int64 position per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position out of the tables");
  float* x = qkv.data_ptr<float>();
  const float* cosines = cos.data_ptr<float>();
  const float* sines = sin.data_ptr<float>();
  const int64_t token_stride = qkv.stride(0);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cosines + pos[t] * dim;
      const float* s = sines + pos[t] * dim;
      for (int64_t h = 0; h < rotated; ++h) {
        float* head = x + t * token_stride + h * dim;
        for (int64_t i = 0; i < half; i += kLanes) {
          const __m256 low = _mm256_loadu_ps(head + i), high = _mm256_loadu_ps(head + half + i);
          _mm256_storeu_ps(head + i, _mm256_add_ps(_mm256_mul_ps(high, _mm256_loadu_ps(s + i)),
                                                   _mm256_mul_ps(low, _mm256_loadu_ps(c + i))));
          _mm256_storeu_ps(head + half + i, _mm256_add_ps(_mm256_mul_ps(low, _mm256_loadu_ps(s + half + i)),
                                                          _mm256_mul_ps(high, _mm256_loadu_ps(c + half + i))));
        }
      }
    }
  });
}

// dots[t] = dot(query, rows + t * stride) for t < 8 over DIM: eight 8-lane partial sums reduced together by a
// transpose of horizontal adds, instead of one horizontal sum per dot product.
template <int DIM>
inline __m256 dot8(const float* query, const float* rows, int64_t stride) {
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int d = 0; d < DIM; d += kLanes) {
    const __m256 q = _mm256_loadu_ps(query + d);
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(q, _mm256_loadu_ps(rows + t * stride + d), acc[t]);
  }
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

template <int DIM>
inline float dot(const float* a, const float* b) {
  __m256 acc = _mm256_setzero_ps();
  for (int d = 0; d < DIM; d += kLanes) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return horizontal_sum(acc);
}

// One (sequence, KV head) of `paged_decode_attention`.
struct DecodeTask {
  const float* q;  // the group's first query head; the others `q_head_stride` apart
  int64_t q_head_stride;
  const float* k;  // position t of this KV head: k + table[t / page_size] * k_page + (t % page_size) * k_token
  const float* v;  // likewise with v_page, v_token
  int64_t k_page, k_token, v_page, v_token;
  const int64_t* table;
  int64_t page_size, context, group;
  float scale;
  float* out;  // the group's first output head; the others DIM apart
};

// Scores of the group's query heads at every position (rows of `scores`, `width` apart, padded with zeros to a
// multiple of 8 after the softmax), softmax, then the weighted sum of V: K and V of each page read once for the
// whole group.
template <int DIM>
void decode_task(const DecodeTask& task, std::vector<float>& scores) {
  const int64_t context = task.context, group = task.group, width = (context + kLanes - 1) / kLanes * kLanes;
  scores.resize(group * width);
  const __m256 scale = _mm256_set1_ps(task.scale);
  for (int64_t first = 0, page = 0; first < context; first += task.page_size, ++page) {
    const float* keys = task.k + task.table[page] * task.k_page;
    const int64_t count = std::min(task.page_size, context - first);
    int64_t j = 0;
    for (; j + 8 <= count; j += 8)
      for (int64_t g = 0; g < group; ++g)
        _mm256_storeu_ps(scores.data() + g * width + first + j,
                         _mm256_mul_ps(dot8<DIM>(task.q + g * task.q_head_stride, keys + j * task.k_token,
                                                 task.k_token), scale));
    for (; j < count; ++j)
      for (int64_t g = 0; g < group; ++g)
        scores[g * width + first + j] = dot<DIM>(task.q + g * task.q_head_stride, keys + j * task.k_token) *
                                        task.scale;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * width;
    std::fill(row + context, row + width, -std::numeric_limits<float>::infinity());
    __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < width; t += kLanes) top = _mm256_max_ps(top, _mm256_loadu_ps(row + t));
    const __m128 halves = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    const __m128 pairs = _mm_max_ps(halves, _mm_movehl_ps(halves, halves));
    const __m256 max = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1))));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < width; t += kLanes) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), max));
      if (t + kLanes > context) e = _mm256_and_ps(e, _mm256_castsi256_ps(lane_mask(context - t)));
      _mm256_storeu_ps(row + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    const __m256 inverse = _mm256_set1_ps(1.f / horizontal_sum(sum));
    __m256 acc[DIM / kLanes];
    for (int d = 0; d < DIM / kLanes; ++d) acc[d] = _mm256_setzero_ps();
    for (int64_t first = 0, page = 0; first < context; first += task.page_size, ++page) {
      const float* values = task.v + task.table[page] * task.v_page;
      const int64_t count = std::min(task.page_size, context - first);
      for (int64_t j = 0; j < count; ++j) {
        const __m256 p = _mm256_set1_ps(row[first + j]);
        const float* value = values + j * task.v_token;
        for (int d = 0; d < DIM / kLanes; ++d) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + d * kLanes), acc[d]);
      }
    }
    float* out = task.out + g * DIM;
    for (int d = 0; d < DIM / kLanes; ++d) _mm256_storeu_ps(out + d * kLanes, _mm256_mul_ps(acc[d], inverse));
  }
}

// Attention of one new token per sequence over its pages, read in place (no gather, no mask).
//   q [B, Hq, D]; k_cache, v_cache [pages, page_size, Hkv, D] (a layer's strided views of the pool);
//   block_tables [B, max_pages] int64; context_lens [B] int64 (the token's own K/V already written).
// One task per (sequence, KV head) computes the Hq / Hkv query heads of its group from one read of K and V.
// Softmax in float32: the max, then e^(s - max) and their sum. D is 64 or 128 (`supports_head_dim`).
// Returns out [B, Hq * D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3, "q must be float32 [B, Hq, D]");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be float32 [pages, page_size, Hkv, D]");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && q.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be contiguous int64 [B, max_pages]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(), "context_lens must be int64");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t page_size = k_cache.size(1), kv_heads = k_cache.size(2), num_pages = k_cache.size(0);
  TORCH_CHECK(dim == 64 || dim == 128, "head_dim must be 64 or 128, got ", dim);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.size(0) == batch && context_lens.numel() == batch, "one table and length per row");
  const int64_t group = heads / kv_heads, max_pages = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_pages * page_size, "context length out of the block table");
    for (int64_t p = 0; p < (lens[b] + page_size - 1) / page_size; ++p)
      TORCH_CHECK(tables[b * max_pages + p] >= 0 && tables[b * max_pages + p] < num_pages, "page out of range");
  }
  auto out = at::empty({batch, heads * dim}, q.options());
  const float* qs = q.data_ptr<float>();
  const float* ks = k_cache.data_ptr<float>();
  const float* vs = v_cache.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads;
      const DecodeTask task{qs + b * q.stride(0) + h * group * q.stride(1), q.stride(1),
                            ks + h * k_cache.stride(2), vs + h * v_cache.stride(2),
                            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                            tables + b * max_pages, page_size, lens[b], group, static_cast<float>(scale),
                            os + (b * heads + h * group) * dim};
      if (dim == 64) {
        decode_task<64>(task, scores);
      } else {
        decode_task<128>(task, scores);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(radixserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &add_rms_norm_);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor positions, int rotated) -> ()", &rope_);
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor", &paged_decode_attention);
}
