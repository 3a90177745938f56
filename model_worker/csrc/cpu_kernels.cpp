// Fused float32 CPU kernels for the model's forward (model_worker/cpu_kernels.py builds and loads them).
//
// Every kernel computes each token row on its own, in an order that does not depend on how many rows the call
// has, so a token's hidden state and K/V are the same in a decode step of 1 or of 16 and in a prefill chunk:
// caching never changes output. Written for AVX2 and FMA (8 floats a vector); on a CPU without them this file
// does not compile, and the model runs on torch's ops instead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "radixserve's CPU kernels need AVX2 and FMA"
#endif

namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kCacheLine = 64;  // bytes
constexpr int64_t kLineFloats = kCacheLine / sizeof(float);

// Lanes [0, n) of a vector set, the rest clear: loads and stores of a row's last, partial vector.
inline __m256i lane_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float horizontal_sum(__m256 v) {
  const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in a high and a low part), e^r a polynomial of r (highest
// coefficient first), times 2^n. One set for exp8 and exp16, so that both give the same bits.
constexpr float kExpMin = -87.33654f, kExpMax = 88.f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPolynomial[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                   4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// e^x within 2 ulp. Inputs are clamped to [-87.3, 88]: -inf (a masked score) gives ~1e-38, not 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(kExpMax));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 y = _mm256_set1_ps(kExpPolynomial[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpPolynomial[i]));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

// exp8's operations 16 lanes at a time, y * 2^n in one scalef, for the softmax's x <= 0 (up to rounding; no upper
// clamp): each lane exp8's bits (a product by a power of two, rounded once either way).
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 y = _mm512_set1_ps(kExpPolynomial[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExpPolynomial[i]));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
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

// silu(gate) * up, with silu(g) = g / (1 + e^-g): the SiLU-times-up of the MLP, applied by `gate_up_silu` to the
// gate and up columns of each tile it multiplies.
inline __m256 silu_times(__m256 gate, __m256 up) {
  const __m256 one = _mm256_set1_ps(1.f);
  return _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate)))), up);
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

// -- paged attention ---------------------------------------------------------------------------------------------
// Each query row (one token, one query head) is computed by the same sequence of operations whatever the call
// holds beside it: its scores one FMA chain over the head dimension each, then block by block (kBlockPositions
// positions at fixed places 0, 64, ..., whatever the page size) an online softmax step and the weighted sum of V in
// position order. A token's attention, and so its K/V in the next layer, is the same in a decode step, in a prefill
// chunk of any length and over a cached prefix (caching never changes output). Blocking over rows only shares loads
// of K and V. Blocks of 64 rather than one 16-token page: a cold 2,048-token prefill's attention 8-10% faster (the
// softmax's per-block work, 1 thread).

// Query positions a task takes: each K/V block is read and transposed once for them all. 32 unless that leaves
// fewer than two tasks a thread (one short chunk: 3 tasks on 2 threads), then 16. Over 16, 32 made a restarted
// prefix hit's attention (112 positions over 1,888) 11% faster and two 24-token chunks over 640 12%; alone, one
// 29-token chunk over 700 took 0.33 instead of 0.28 ms (3 tasks on 2 threads).
constexpr int64_t kTilePositions = 32, kShortTilePositions = 16;
constexpr int64_t kBlockPositions = 64;  // context positions per online-softmax step, blocks at fixed positions

// Whether this CPU runs AVX-512 (the kernels pick their 16-lane variants at run time; the same bits either way).
bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

inline int64_t round_up8(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

inline float horizontal_max(__m256 v) {
  const __m128 halves = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_max_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// dst[d * dst_stride + t] = rows[t][offset + d] for t, d < 8.
inline void transpose8(const float* const* rows, int64_t offset, float* dst, int64_t dst_stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + offset);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// keys[t] [DIM] for t < count -> kt [DIM][width], lanes [count, width) zero.
template <int DIM>
void transpose_keys(const float* const* keys, int64_t count, float* kt, int64_t width) {
  int64_t t = 0;
  for (; t + kLanes <= count; t += kLanes)
    for (int d = 0; d < DIM; d += kLanes) transpose8(keys + t, d, kt + d * width + t, width);
  for (int d = 0; d < DIM; ++d)
    for (int64_t u = t; u < width; ++u) kt[d * width + u] = u < count ? keys[u][d] : 0.f;
}

// s[r][lane0 + l] = sum over d, in order, of q[r][d] * kt[d][lane0 + l], one FMA chain per score, for NV vectors.
template <int DIM, int NR, int NV>
inline void score_block(const float* const* q, const float* kt, int64_t width, int64_t lane0, float* s,
                        int64_t s_stride) {
  __m256 acc[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int d = 0; d < DIM; ++d) {
    __m256 k[NV];
    for (int v = 0; v < NV; ++v) k[v] = _mm256_loadu_ps(kt + d * width + lane0 + v * kLanes);
    for (int r = 0; r < NR; ++r) {
      const __m256 qd = _mm256_broadcast_ss(q[r] + d);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(qd, k[v], acc[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(s + r * s_stride + lane0 + v * kLanes, acc[r][v]);
}

template <int DIM, int NR>
void score_rows(const float* const* q, const float* kt, int64_t width, int64_t lanes, float* s, int64_t s_stride) {
  int64_t lane0 = 0;
  for (; lane0 + 2 * kLanes <= lanes; lane0 += 2 * kLanes) score_block<DIM, NR, 2>(q, kt, width, lane0, s, s_stride);
  if (lane0 < lanes) score_block<DIM, NR, 1>(q, kt, width, lane0, s, s_stride);
}

// A query row's online softmax: the largest score so far, the sum of e^(score - max), and the factor this block
// rescaled them by.
struct SoftmaxState {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.f;
  float rescale = 0.f;
};

// A block's softmax step done: the row's new max and the block's e^(x - max) summed in 8 lanes -> `state`.
inline void finish_softmax_block(float max, __m256 sum, SoftmaxState& state) {
  // e^0 is exactly 1 (exp8), so an unchanged max skips the exponential and gives the same bits
  state.rescale = state.sum == 0.f ? 0.f : max == state.max ? 1.f : _mm256_cvtss_f32(exp8(_mm256_set1_ps(state.max - max)));
  state.sum = state.sum * state.rescale + horizontal_sum(sum);
  state.max = max;
}

// One block of a row: s holds `lanes` raw scores q.k, of which the first `count` are its context; on return s
// holds e^(score * scale - max), one fused multiply-subtract rounded once (exactly 0 past `count`), and `state` is
// updated. The block's max is scale times its largest raw score (scale > 0: the same float). The sum keeps 16
// lanes, e[16 i + l] added in order of i to lane l, then the high 8 to the low 8: the lanes past `count` add
// zeros, so a row gives the same state whatever `lanes` its call used, and 16-lane code the same bits.
inline void softmax_block(float* s, int64_t count, int64_t lanes, float scale, SoftmaxState& state) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 top = minus_inf;
  for (int64_t t = 0; t < lanes; t += kLanes) {
    __m256 x = _mm256_loadu_ps(s + t);
    if (t + kLanes > count) x = _mm256_blendv_ps(minus_inf, x, _mm256_castsi256_ps(lane_mask(count - t)));
    top = _mm256_max_ps(top, x);
  }
  const float max = std::max(state.max, scale * horizontal_max(top));
  const __m256 factor = _mm256_set1_ps(scale), shift = _mm256_set1_ps(max);
  __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t t = 0; t < lanes; t += kLanes) {
    __m256 e = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(s + t), factor, shift));
    if (t + kLanes > count) e = _mm256_and_ps(e, _mm256_castsi256_ps(lane_mask(count - t)));
    _mm256_storeu_ps(s + t, e);
    sum[t / kLanes % 2] = _mm256_add_ps(sum[t / kLanes % 2], e);
  }
  finish_softmax_block(max, _mm256_add_ps(sum[0], sum[1]), state);
}

// `softmax_block` 16 lanes at a time (lanes <= kBlockPositions; s has room for a multiple of 16): the same bits.
__attribute__((target("avx512f"))) inline void softmax_block_avx512(float* s, int64_t count, int64_t lanes,
                                                                    float scale, SoftmaxState& state) {
  const int vectors = static_cast<int>((lanes + 15) / 16);
  const bool whole = count == vectors * 16;  // no lane to mask
  auto live = [count](int v) {
    const int64_t left = count - v * 16;
    return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
  };
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int v = 0; v < vectors; ++v) {
    const __m512 x = _mm512_loadu_ps(s + v * 16);
    top = whole ? _mm512_max_ps(top, x) : _mm512_mask_max_ps(top, live(v), top, x);
  }
  const float max = std::max(state.max, scale * _mm512_reduce_max_ps(top));
  const __m512 factor = _mm512_set1_ps(scale), shift = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();
  for (int v = 0; v < vectors; ++v) {
    __m512 e = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + v * 16), factor, shift));
    if (!whole) e = _mm512_maskz_mov_ps(live(v), e);
    _mm512_storeu_ps(s + v * 16, e);
    sum = _mm512_add_ps(sum, e);
  }
  finish_softmax_block(max, _mm256_add_ps(_mm512_castps512_ps256(sum),
                                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1))),
                       state);
}

// acc[r] = acc[r] * states[r].rescale (unless states is null) + sum over begin <= j < end, in order, of
// e[r][j] * values[j], for NR rows (DIM floats each); values rows `stride` apart.
template <int DIM, int NR>
void weigh_rows(float* const* acc, const float* e, int64_t e_stride, const SoftmaxState* states,
                const float* const* values, int64_t begin, int64_t end) {
  constexpr int kVectors = 4;
  for (int c = 0; c < DIM; c += kVectors * kLanes) {
    __m256 a[NR][kVectors];
    for (int r = 0; r < NR; ++r) {
      for (int v = 0; v < kVectors; ++v) {
        a[r][v] = _mm256_loadu_ps(acc[r] + c + v * kLanes);
        if (states != nullptr && states[r].rescale != 1.f)  // x * 1 is x
          a[r][v] = _mm256_mul_ps(a[r][v], _mm256_set1_ps(states[r].rescale));
      }
    }
    for (int64_t j = begin; j < end; ++j) {
      const float* value = values[j] + c;
      __m256 w[NR];
      for (int r = 0; r < NR; ++r) w[r] = _mm256_broadcast_ss(e + r * e_stride + j);
      for (int v = 0; v < kVectors; ++v) {
        const __m256 x = _mm256_loadu_ps(value + v * kLanes);
        for (int r = 0; r < NR; ++r) a[r][v] = _mm256_fmadd_ps(w[r], x, a[r][v]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(acc[r] + c + v * kLanes, a[r][v]);
  }
}

// The same score chains 16 lanes at a time: NR rows x NV vectors of 16 positions from lane0.
template <int DIM, int NR, int NV>
__attribute__((target("avx512f"))) inline void score_block_avx512(const float* const* q, const float* kt,
                                                                  int64_t width, int64_t lane0, float* s,
                                                                  int64_t s_stride) {
  __m512 acc[NR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int d = 0; d < DIM; ++d) {
    __m512 k[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) k[v] = _mm512_loadu_ps(kt + d * width + lane0 + v * 16);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m512 qd = _mm512_set1_ps(q[r][d]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(qd, k[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s + r * s_stride + lane0 + v * 16, acc[r][v]);
}

// The same weighted sums 16 lanes at a time, up to 4 vectors of a row at once.
template <int DIM, int NR>
__attribute__((target("avx512f"))) inline void weigh_rows_avx512(float* const* acc, const float* e,
                                                                 int64_t e_stride, const SoftmaxState* states,
                                                                 const float* const* values, int64_t begin,
                                                                 int64_t end) {
  constexpr int kVectors = 4;
  for (int c = 0; c < DIM; c += kVectors * 16) {
    __m512 a[NR][kVectors];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
#pragma GCC unroll 8
      for (int v = 0; v < kVectors; ++v) {
        a[r][v] = _mm512_loadu_ps(acc[r] + c + v * 16);
        if (states != nullptr && states[r].rescale != 1.f)  // x * 1 is x
          a[r][v] = _mm512_mul_ps(a[r][v], _mm512_set1_ps(states[r].rescale));
      }
    }
    for (int64_t j = begin; j < end; ++j) {
      const float* value = values[j] + c;
      __m512 w[NR];
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) w[r] = _mm512_set1_ps(e[r * e_stride + j]);
#pragma GCC unroll 8
      for (int v = 0; v < kVectors; ++v) {
        const __m512 x = _mm512_loadu_ps(value + v * 16);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) a[r][v] = _mm512_fmadd_ps(w[r], x, a[r][v]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(acc[r] + c + v * 16, a[r][v]);
  }
}

// The score and weighted-sum micro-kernels of one instruction set, for up to kScoreRows / kWeighRows rows at once.
// A score is one FMA chain over the head dimension and an output element one over the block's positions in order
// (from the rescaled accumulator), whichever rows share a call: both sets give the same bits. AVX-512 made a cold
// 2,048-token prefill's attention 8-10% faster (Zen 4, where a 16-lane FMA costs two 8-lane ones' issue slots).
struct Avx2Attention {
  static constexpr int kScoreRows = 6, kWeighRows = 3;  // x 2 and x 4 vectors of 8 in registers
  template <int DIM, int NR>
  static void score(const float* const* q, const float* kt, int64_t width, int64_t lanes, float* s,
                    int64_t s_stride) {
    score_rows<DIM, NR>(q, kt, width, lanes, s, s_stride);
  }
  template <int DIM, int NR>
  static void weigh(float* const* acc, const float* e, int64_t e_stride, const SoftmaxState* states,
                    const float* const* values, int64_t begin, int64_t end) {
    weigh_rows<DIM, NR>(acc, e, e_stride, states, values, begin, end);
  }
  static void softmax(float* s, int64_t count, int64_t lanes, float scale, SoftmaxState& state) {
    softmax_block(s, count, lanes, scale, state);
  }
};

struct Avx512Attention {
  static constexpr int kScoreRows = 6, kWeighRows = 6;  // x up to 4 vectors of 16
  template <int DIM, int NR>
  __attribute__((target("avx512f"))) static void score(const float* const* q, const float* kt, int64_t width,
                                                       int64_t lanes, float* s, int64_t s_stride) {
    switch ((lanes + 15) / 16) {  // kt's lanes past `lanes` are zeros, and scores past them are never read
      case 1: score_block_avx512<DIM, NR, 1>(q, kt, width, 0, s, s_stride); break;
      case 2: score_block_avx512<DIM, NR, 2>(q, kt, width, 0, s, s_stride); break;
      case 3: score_block_avx512<DIM, NR, 3>(q, kt, width, 0, s, s_stride); break;
      default: score_block_avx512<DIM, NR, 4>(q, kt, width, 0, s, s_stride); break;
    }
  }
  template <int DIM, int NR>
  __attribute__((target("avx512f"))) static void weigh(float* const* acc, const float* e, int64_t e_stride,
                                                       const SoftmaxState* states, const float* const* values,
                                                       int64_t begin, int64_t end) {
    weigh_rows_avx512<DIM, NR>(acc, e, e_stride, states, values, begin, end);
  }
  __attribute__((target("avx512f"))) static void softmax(float* s, int64_t count, int64_t lanes, float scale,
                                                         SoftmaxState& state) {
    softmax_block_avx512(s, count, lanes, scale, state);
  }
};

// Isa's micro-kernels for the run-time row count `rows` (1 to Isa::kScoreRows / kWeighRows), a template argument
// in them.
template <typename Isa, int DIM, int NR = Isa::kScoreRows>
void score_group(int64_t rows, const float* const* q, const float* kt, int64_t width, int64_t lanes, float* s,
                 int64_t s_stride) {
  if constexpr (NR > 1) {
    if (rows < NR) return score_group<Isa, DIM, NR - 1>(rows, q, kt, width, lanes, s, s_stride);
  }
  Isa::template score<DIM, NR>(q, kt, width, lanes, s, s_stride);
}

template <typename Isa, int DIM, int NR = Isa::kWeighRows>
void weigh_group(int64_t rows, float* const* acc, const float* e, int64_t e_stride, const SoftmaxState* states,
                 const float* const* values, int64_t begin, int64_t end) {
  if constexpr (NR > 1) {
    if (rows < NR) return weigh_group<Isa, DIM, NR - 1>(rows, acc, e, e_stride, states, values, begin, end);
  }
  Isa::template weigh<DIM, NR>(acc, e, e_stride, states, values, begin, end);
}

// One (chunk, KV head, tile of up to kTilePositions consecutive query positions) of `paged_attention`: rows
// (position p, head g of the group) in that order, row p * group + g.
struct AttentionTask {
  const float* q;  // the tile's first position, the group's first head
  int64_t q_token, q_head;
  const float* k;  // this KV head's position t: k + table[t / page_size] * k_page + (t % page_size) * k_token
  const float* v;  // likewise with v_page, v_token
  int64_t k_page, k_token, v_page, v_token;
  const int64_t* table;
  int64_t page_size, first_position, positions, group;
  float scale;
  float* out;  // the tile's first position, the group's first head; positions `out_token` apart
  int64_t out_token;
  // This KV head's keys of the chunk, transposed once for all its tiles by `paged_attention`: block b at
  // kt + b * DIM * kBlockPositions. Null: the task transposes each block itself.
  const float* kt;
};

// The row of `position` of paged rows: base + table[position / page_size] * page_stride + (position % page_size) *
// token_stride.
inline const float* paged_row(const float* base, int64_t page_stride, int64_t token_stride, const int64_t* table,
                              int64_t page_size, int64_t position) {
  return base + table[position / page_size] * page_stride + (position % page_size) * token_stride;
}

// rows[t] = the row of position first + t (t < count) of paged rows (`paged_row`).
inline void paged_rows(const float* base, int64_t page_stride, int64_t token_stride, const int64_t* table,
                       int64_t page_size, int64_t first, int64_t count, const float** rows) {
  for (int64_t t = 0; t < count; ++t) rows[t] = paged_row(base, page_stride, token_stride, table, page_size, first + t);
}

// Asks the L2 cache for the rows of positions [first, first + count) of paged rows (as `paged_rows` finds them), DIM
// floats each. `attend_tile` asks for a block's K and V while it computes the block before: a decode row's task
// reads 32 KB a block from pages scattered over the pool, and waited on them (4 decode rows over 280 positions,
// cache-cold, 7 alternating runs: median 147 us a layer before, 131 with the next block asked for; 54 with every
// page in the cache; asking for the first block too, and asking the L1 cache, were no faster).
template <int DIM>
inline void prefetch_paged_rows(const float* base, int64_t page_stride, int64_t token_stride, const int64_t* table,
                                int64_t page_size, int64_t first, int64_t count) {
  for (int64_t t = 0; t < count; ++t) {
    const char* row = reinterpret_cast<const char*>(
        paged_row(base, page_stride, token_stride, table, page_size, first + t));
    for (int64_t byte = 0; byte < DIM * static_cast<int64_t>(sizeof(float)); byte += kCacheLine)
      _mm_prefetch(row + byte, _MM_HINT_T1);
  }
}

template <int DIM>
inline void prefetch_block(const AttentionTask& task, int64_t first, int64_t count) {
  prefetch_paged_rows<DIM>(task.v, task.v_page, task.v_token, task.table, task.page_size, first, count);
  if (task.kt == nullptr)  // else its keys come transposed
    prefetch_paged_rows<DIM>(task.k, task.k_page, task.k_token, task.table, task.page_size, first, count);
}

struct AttentionScratch {
  std::vector<float> kt, e, acc;
  std::vector<SoftmaxState> states;
  std::vector<const float*> q;
  std::vector<float*> acc_rows;
  std::vector<const float*> keys, values;  // a block's K and V rows
};

template <typename Isa, int DIM>
void attend_tile(const AttentionTask& task, AttentionScratch& scratch) {
  const int64_t group = task.group, rows = task.positions * group, page_size = task.page_size;
  const int64_t width = kBlockPositions, last_context = task.first_position + task.positions;
  scratch.kt.resize(DIM * width);
  scratch.e.resize(rows * width);
  scratch.acc.assign(rows * DIM, 0.f);
  scratch.states.assign(rows, SoftmaxState{});
  scratch.q.resize(rows);
  scratch.acc_rows.resize(rows);
  scratch.keys.resize(width);
  scratch.values.resize(width);
  for (int64_t r = 0; r < rows; ++r) {
    scratch.q[r] = task.q + (r / group) * task.q_token + (r % group) * task.q_head;
    scratch.acc_rows[r] = scratch.acc.data() + r * DIM;
  }
  auto context = [&](int64_t r) { return task.first_position + r / group + 1; };
  for (int64_t first = 0; first < last_context; first += width) {
    const int64_t count = std::min(width, last_context - first), lanes = round_up8(count);
    if (const int64_t next = std::min(width, last_context - first - width); next > 0)
      prefetch_block<DIM>(task, first + width, next);  // on its way while this block is computed
    paged_rows(task.v, task.v_page, task.v_token, task.table, page_size, first, count, scratch.values.data());
    // A shared block may hold later positions of the chunk past `count`: like the lanes past a row's reach below,
    // their scores never enter a softmax.
    const float* kt = scratch.kt.data();
    if (task.kt != nullptr) {
      kt = task.kt + first * DIM;  // block first / width
    } else {
      paged_rows(task.k, task.k_page, task.k_token, task.table, page_size, first, count, scratch.keys.data());
      transpose_keys<DIM>(scratch.keys.data(), count, scratch.kt.data(), width);
    }
    // rows whose context reaches this block: positions from first - first_position on
    const int64_t begin = std::max<int64_t>(0, first - task.first_position) * group;
    float* e = scratch.e.data();
    for (int64_t r = begin; r < rows; r += Isa::kScoreRows)  // the rows' raw scores
      score_group<Isa, DIM>(std::min<int64_t>(Isa::kScoreRows, rows - r), scratch.q.data() + r, kt, width, lanes,
                            e + r * width, width);
    // A row reads only its own `reach` positions of the block: the lanes past it (later positions of its chunk)
    // never enter its softmax or its sum, so its operations are those of the row computed alone.
    auto reach = [&](int64_t r) { return std::min(width, context(r) - first); };
    for (int64_t r = begin; r < rows; ++r)
      Isa::softmax(e + r * width, reach(r), round_up8(reach(r)), task.scale, scratch.states[r]);
    const float* const* values = scratch.values.data();
    for (int64_t r = begin; r < rows; r += Isa::kWeighRows) {
      const int64_t n = std::min<int64_t>(Isa::kWeighRows, rows - r), shared = reach(r);  // rows' reaches grow with r
      weigh_group<Isa, DIM>(n, scratch.acc_rows.data() + r, e + r * width, width, scratch.states.data() + r, values, 0,
                            shared);
      for (int64_t i = r + 1; i < r + n; ++i)  // the rest of a longer row's reach, in order
        if (reach(i) > shared)
          weigh_group<Isa, DIM>(1, scratch.acc_rows.data() + i, e + i * width, width, nullptr, values, shared,
                                reach(i));
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 inverse = _mm256_set1_ps(1.f / scratch.states[r].sum);
    float* out = task.out + (r / group) * task.out_token + (r % group) * DIM;
    for (int d = 0; d < DIM; d += kLanes)
      _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(scratch.acc_rows[r] + d), inverse));
  }
}

// Causal attention of chunks of new tokens over their sequences' pages, read in place (no gather, no mask).
//   q [T, Hq, D]: chunk i's lengths[i] rows follow chunk i - 1's, its row j at position starts[i] + j;
//   k_cache, v_cache [pages, page_size, Hkv, D] (a layer's strided views of the pool, the chunks' new K/V already
//   written); block_tables [chunks, max_pages] int64; starts, lengths [chunks] int64.
// Row (token at position p, query head) attends to positions [0, p] of its sequence with its KV head (Hq / Hkv
// query heads share one). A decode row is a chunk of length 1. Tasks: (chunk, KV head, up to 32 positions), the
// longest first, spread over the threads as they free up. D is 64 or 128 (`supports_head_dim`). Returns
// out [T, Hq * D]. `avx512`: its micro-kernels where the CPU has it (the same bits; false lets a test compare).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& starts, const at::Tensor& lengths,
                           double scale, bool avx512) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3, "q must be float32 [T, Hq, D]");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be float32 [pages, page_size, Hkv, D]");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && block_tables.device().is_cpu() &&
                  starts.device().is_cpu() && lengths.device().is_cpu(),
              "every tensor must be on the CPU");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && q.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be contiguous int64 [chunks, max_pages]");
  const int64_t chunks = block_tables.size(0);
  for (const at::Tensor* t : {&starts, &lengths})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == chunks,
                "starts and lengths must be int64, one per chunk");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t page_size = k_cache.size(1), kv_heads = k_cache.size(2), num_pages = k_cache.size(0);
  TORCH_CHECK(dim == 64 || dim == 128, "head_dim must be 64 or 128, got ", dim);
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);
  TORCH_CHECK(page_size >= 1 && kv_heads >= 1, "the cache needs pages of at least one token and one KV head");
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "head shapes do not match");
  const int64_t group = heads / kv_heads, max_pages = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* first = starts.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  int64_t rows = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    TORCH_CHECK(first[c] >= 0 && length[c] >= 1, "a chunk needs a start >= 0 and at least one token");
    TORCH_CHECK(length[c] <= max_pages * page_size - first[c], "context length out of the block table");
    const int64_t context = first[c] + length[c];
    for (int64_t p = 0; p < (context + page_size - 1) / page_size; ++p)
      TORCH_CHECK(tables[c * max_pages + p] >= 0 && tables[c * max_pages + p] < num_pages, "page out of range");
    rows += length[c];
  }
  TORCH_CHECK(rows == tokens, "the chunks' lengths must sum to q's ", tokens, " rows, got ", rows);
  auto out = at::empty({tokens, heads * dim}, q.options());
  const float* qs = q.data_ptr<float>();
  const float* ks = k_cache.data_ptr<float>();
  const float* vs = v_cache.data_ptr<float>();
  float* os = out.data_ptr<float>();
  int64_t long_tiles = 0;
  for (int64_t c = 0; c < chunks; ++c) long_tiles += (length[c] + kTilePositions - 1) / kTilePositions;
  const int64_t tile = long_tiles * kv_heads >= 2 * at::get_num_threads() ? kTilePositions : kShortTilePositions;
  // A chunk of two tiles or more has its keys transposed once, block by block, for all its tiles (a restarted
  // prefix hit's 112 positions over 1,888: 4 tiles a KV head, each transposing all 31 blocks before).
  auto blocks = [&](int64_t c) { return (first[c] + length[c] + kBlockPositions - 1) / kBlockPositions; };
  std::vector<int64_t> shared_offset(chunks, -1);
  int64_t shared_blocks = 0;
  for (int64_t c = 0; c < chunks; ++c)
    if (length[c] > tile) {
      shared_offset[c] = shared_blocks;
      shared_blocks += blocks(c) * kv_heads;
    }
  auto transposed = at::empty({shared_blocks, dim, kBlockPositions}, q.options());
  auto shared_keys = [&, kts = transposed.data_ptr<float>()](int64_t c, int64_t h) {  // its first transposed block
    return kts + (shared_offset[c] + h * blocks(c)) * dim * kBlockPositions;
  };
  struct KeyBlock {  // one block to transpose: its chunk and KV head, first position and destination
    int64_t chunk, head, position;
    float* kt;
  };
  std::vector<KeyBlock> key_blocks;
  key_blocks.reserve(shared_blocks);
  for (int64_t c = 0; c < chunks; ++c)
    if (shared_offset[c] >= 0)
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t b = 0; b < blocks(c); ++b)
          key_blocks.push_back(KeyBlock{c, h, b * kBlockPositions, shared_keys(c, h) + b * dim * kBlockPositions});
  std::vector<AttentionTask> tasks;
  for (int64_t c = 0, row = 0; c < chunks; row += length[c], ++c)
    for (int64_t j = 0; j < length[c]; j += tile)
      for (int64_t h = 0; h < kv_heads; ++h)
        tasks.push_back(AttentionTask{qs + (row + j) * q.stride(0) + h * group * q.stride(1), q.stride(0),
                                      q.stride(1), ks + h * k_cache.stride(2), vs + h * v_cache.stride(2),
                                      k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                                      tables + c * max_pages, page_size, first[c] + j,
                                      std::min(tile, length[c] - j), group, static_cast<float>(scale),
                                      os + (row + j) * heads * dim + h * group * dim, heads * dim,
                                      shared_offset[c] >= 0 ? shared_keys(c, h) : nullptr});
  auto cost = [](const AttentionTask& t) { return t.positions * (t.first_position + t.positions); };
  std::stable_sort(tasks.begin(), tasks.end(),
                   [&](const AttentionTask& a, const AttentionTask& b) { return cost(a) > cost(b); });
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count)));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    AttentionScratch scratch;
    scratch.keys.resize(kBlockPositions);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < static_cast<int64_t>(key_blocks.size()); ++i) {
      const auto [c, h, position, kt] = key_blocks[i];
      const int64_t n = std::min(kBlockPositions, first[c] + length[c] - position);
      paged_rows(ks + h * k_cache.stride(2), k_cache.stride(0), k_cache.stride(1), tables + c * max_pages, page_size,
                 position, n, scratch.keys.data());
      dim == 64 ? transpose_keys<64>(scratch.keys.data(), n, kt, kBlockPositions)
                : transpose_keys<128>(scratch.keys.data(), n, kt, kBlockPositions);
    }  // (the loop's barrier: every block transposed before a task reads one)
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) {
      if (avx512 && cpu_has_avx512()) {
        dim == 64 ? attend_tile<Avx512Attention, 64>(tasks[i], scratch)
                  : attend_tile<Avx512Attention, 128>(tasks[i], scratch);
      } else {
        dim == 64 ? attend_tile<Avx2Attention, 64>(tasks[i], scratch)
                  : attend_tile<Avx2Attention, 128>(tasks[i], scratch);
      }
    }
  }
  return out;
}

// -- sharing items among the threads -----------------------------------------------------------------------------
// Runs item(i) once for each i in [0, count) on up to at::get_num_threads() OpenMP threads: thread t first takes
// its own contiguous share in order (the weights of a linear's panel groups stream as with a static split), and a
// thread that runs out takes the last items of the others' shares one by one. A thread the host preempts (the
// stack's other processes took about a tenth of a core in a traced run) then holds up only the item it is on, not its
// whole share behind a barrier: with a process busy 2 ms every 10 ms beside the engine (in process, 4 alternating
// runs), a decode step's forward took 4.1-5.9 ms longer with the static split and 1.0-4.1 ms with shares, a hit of
// 2 x 24 tokens over 640 7-10 ms and 3.5-7.5 ms. The stack's 4-row decode, 2 alternating runs: 22-38 ms between
// tokens before, 19-27 after (docs/design.md section 9).
template <typename Item>
void share_items(int64_t count, const Item& item) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count)));
  if (threads == 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < count; ++i) item(i);
    return;
  }
  // A share's next item (low 32 bits) and its end (high 32 bits), in one word so that its owner taking the front and
  // another thread taking the back never take the same item.
  std::vector<std::atomic<uint64_t>> shares(threads);
  for (int t = 0; t < threads; ++t)
    shares[t].store(static_cast<uint64_t>(count * (t + 1) / threads) << 32 | static_cast<uint64_t>(count * t / threads));
  auto take = [](std::atomic<uint64_t>& share, bool front) -> int64_t {
    uint64_t word = share.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t next = word & 0xFFFFFFFFu, end = word >> 32;
      if (next >= end) return -1;
      const uint64_t taken = front ? word + 1 : (end - 1) << 32 | next;
      if (share.compare_exchange_weak(word, taken, std::memory_order_relaxed))
        return static_cast<int64_t>(front ? next : end - 1);
    }
  };
#pragma omp parallel num_threads(threads)
  {
    const int self = omp_get_thread_num();
    for (int64_t i; (i = take(shares[self], true)) >= 0;) item(i);
    for (int other = 1; other < threads; ++other)
      for (int64_t i; (i = take(shares[(self + other) % threads], false)) >= 0;) item(i);
  }
}

// -- linear layers -----------------------------------------------------------------------------------------------
// out = x w^T + bias with w packed once (`pack_linear_weight`) into panels of 16 output columns, [panels][K][16].
// Every output element is one FMA chain over k = 0 .. K-1 in order, from +0, whatever the row count, the tile it
// falls in, the thread that computes it or the vector width: a token's projections are bit for bit the same in a
// decode step of 1 row and in a prefill of 2,000 (caching never changes output), on AVX2 and on AVX-512. A tile
// keeps its chains in registers: with AVX2 6 rows x 16 columns, or 1 x 64 / 2-3 x 32 for few rows (up to 12
// chains of 8 lanes); with AVX-512 (2 rows or more) 8 rows x 32 columns, 6 x 64 (wide weights, long prefills) or
// 2 x 64 (16-24 chains of 16 lanes). So a decode step streams the weights once at memory speed and a prefill runs at
// the cores' FMA rate.

constexpr int64_t kPanel = 16;      // output columns of a packed panel
constexpr int64_t kRowBlock = 192;  // rows whose activations stay in the cache while a group of panels passes
constexpr int64_t kStreamingRows = 8;  // up to this many rows, a linear is bound by reading its weights (`multiply`)

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "weight must be float32 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);  // columns past N are zero, computed and dropped
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

// c[r][j] = sum over k in order of a[r][k] * b[k][j], one FMA chain from +0 each, for R rows x P panels.
template <int R, int P>
inline void linear_tile(const float* a, int64_t lda, const float* b, int64_t k_total, float* c, int64_t ldc) {
  __m256 acc[R][2 * P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < 2 * P; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_total; ++k) {
    __m256 w[2 * P];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      w[2 * p] = _mm256_loadu_ps(b + (p * k_total + k) * kPanel);
      w[2 * p + 1] = _mm256_loadu_ps(b + (p * k_total + k) * kPanel + kLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
#pragma GCC unroll 8
      for (int v = 0; v < 2 * P; ++v) acc[r][v] = _mm256_fmadd_ps(x, w[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < 2 * P; ++v) _mm256_storeu_ps(c + r * ldc + v * kLanes, acc[r][v]);
}

// Cache lines a tile asks for on the way, one every k: the next group's weights, a share of them per tile
// (`multiply`).
struct Ahead {
  const char* lines = nullptr;
  int64_t count = 0;
};

// The same chains 16 lanes at a time (one vector a panel), asking for `ahead` on the way.
template <int R, int P>
__attribute__((target("avx512f"))) inline void linear_tile_avx512(const float* a, int64_t lda, const float* b,
                                                                  int64_t k_total, float* c, int64_t ldc,
                                                                  const Ahead& ahead) {
  __m512 acc[R][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_total; ++k) {
    if (k < ahead.count) _mm_prefetch(ahead.lines + k * kCacheLine, _MM_HINT_T0);
    __m512 w[P];
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) w[p] = _mm512_loadu_ps(b + (p * k_total + k) * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(x, w[p], acc[r][p]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(c + r * ldc + p * kPanel, acc[r][p]);
}

// Tiles::tile<R, P> for the run-time row count `rows` (1 to R): the tiles keep their rows in registers, so the row
// count is a template argument.
template <typename Tiles, int P, int R = Tiles::kTileRows>
void run_tile(int rows, const float* a, int64_t lda, const float* b, int64_t k, float* c, int64_t ldc,
              const Ahead& ahead) {
  if constexpr (R > 1) {
    if (rows < R) return run_tile<Tiles, P, R - 1>(rows, a, lda, b, k, c, ldc, ahead);
  }
  Tiles::template tile<R, P>(a, lda, b, k, c, ldc, ahead);
}

// Tiles of up to kTileRows rows x P panels.
struct Avx2Tiles {
  static constexpr int kTileRows = 6;
  static int panels(int64_t m) { return m == 1 ? 4 : m <= 3 ? 2 : 1; }  // enough independent chains for few rows
  template <int R, int P>
  static void tile(const float* a, int64_t lda, const float* b, int64_t k, float* c, int64_t ldc, const Ahead&) {
    linear_tile<R, P>(a, lda, b, k, c, ldc);
  }
};

template <int kRows, int kPanels>
struct Avx512Tiles {
  static constexpr int kTileRows = kRows;
  static int panels(int64_t m) { return m <= 2 ? 4 : kPanels; }
  template <int R, int P>
  __attribute__((target("avx512f"))) static void tile(const float* a, int64_t lda, const float* b, int64_t k,
                                                       float* c, int64_t ldc, const Ahead& ahead) {
    linear_tile_avx512<R, P>(a, lda, b, k, c, ldc, ahead);
  }
};
// 8 rows x 2 panels, or 6 x 4 for a wide weight or more than one row block (a layer's projections at 1,024 rows:
// 24 vs 28 ms, at 112 rows 2.67 vs 2.82-2.94, Xeon with AVX-512, 2026-12-05). On a narrow weight within one row
// block, 6 x 4 leaves too few items for the threads (576 columns: 9 groups of 4 on 2 threads, 10% slower at 112).
using Avx512NarrowTiles = Avx512Tiles<8, 2>;
using Avx512WideTiles = Avx512Tiles<6, 4>;
constexpr int64_t kWidePanels = 64;  // 1,024 columns

// Rows [0, rows) x `spans` panels from b into dst (row stride ldc): as one tile where the group size allows it (up
// to `group` panels a tile, Tiles::panels), else panel by panel.
template <typename Tiles>
void multiply_tile(int rows, const float* a, int64_t lda, const float* b, int64_t k, int64_t spans, int group,
                   float* dst, int64_t ldc, const Ahead& ahead) {
  if (spans == 4 && group == 4) {
    run_tile<Tiles, 4>(rows, a, lda, b, k, dst, ldc, ahead);
  } else if (spans == 2 && group >= 2) {
    run_tile<Tiles, 2>(rows, a, lda, b, k, dst, ldc, ahead);
  } else {
    for (int64_t q = 0; q < spans; ++q)
      run_tile<Tiles, 1>(rows, a, lda, b + q * k * kPanel, k, dst + q * kPanel, ldc, q == 0 ? ahead : Ahead{});
  }
}

// out[r][j] = silu(gate + gate_bias) * (up + up_bias) for the `pairs` (gate panel, up panel) pairs of a tile's
// `rows` rows in `tile` (row stride 2 * pairs panels); biases null or one panel a pair, in pair order.
void silu_epilogue(const float* tile, int rows, int64_t pairs, const float* gate_bias, const float* up_bias,
                   float* out, int64_t ldo) {
  for (int r = 0; r < rows; ++r) {
    for (int64_t q = 0; q < pairs; ++q) {
      const float* gate = tile + (r * 2 * pairs + 2 * q) * kPanel;
      for (int64_t l = 0; l < kPanel; l += kLanes) {
        __m256 g = _mm256_loadu_ps(gate + l), u = _mm256_loadu_ps(gate + kPanel + l);
        if (gate_bias != nullptr) {
          g = _mm256_add_ps(g, _mm256_loadu_ps(gate_bias + q * kPanel + l));
          u = _mm256_add_ps(u, _mm256_loadu_ps(up_bias + q * kPanel + l));
        }
        _mm256_storeu_ps(out + r * ldo + q * kPanel + l, silu_times(g, u));
      }
    }
  }
}

// The threads share out (group of panels, block of rows) items, group by group (`share_items`): a thread's groups of
// weights stay in its cache over the row blocks, and each item passes all its block's rows (one block at 192 rows or
// fewer).
// kSiluMul: b is `pack_gate_up_weight`'s (gate and up panels alternate), groups hold whole pairs, and each tile goes
// through `silu_epilogue` into c (panels / 2 panels wide) instead of straight into c (panels wide); bias then holds
// the gate biases, then the up biases, each padded to panels / 2 panels.
template <typename Tiles, bool kSiluMul>
void multiply(const float* a, int64_t lda, int64_t m, const float* b, int64_t k, int64_t panels, const float* bias,
              float* c) {
  const int group = Tiles::panels(m);
  const int step = kSiluMul ? std::max(group, 2) : group;
  const int64_t groups = (panels + step - 1) / step, out_panels = kSiluMul ? panels / 2 : panels;
  const int64_t width = out_panels * kPanel;
  const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  share_items(blocks * groups, [&](int64_t i) {
    const int64_t m0 = i % blocks * kRowBlock, m1 = std::min(m, m0 + kRowBlock);
    const int64_t g = i / blocks, p0 = g * step, spans = std::min<int64_t>(step, panels - p0);
    // In a group's last row block of two tiles or more, each tile asks for its share of the next group's weights,
    // so that group's first tile does not wait on memory. A layer's projections at 48 rows, weights cache-cold, 3
    // alternating runs: 997-1,150 us before, 790-870 with (16 rows 635-666 and 504-516; 112 rows 4-8% faster); a
    // hit of 2 x 24 tokens over 640 in the engine, 5 alternating runs: median 43-55 ms before, 39-47 with. Up to
    // `kStreamingRows` rows (decode steps) the weights stream at memory speed without it, and asking ahead was
    // slower (8 rows: 450-502 us a layer without, 495-531 with; 12 rows: 554-637 without, 367-521 with).
    const int64_t tiles = (m1 - m0 + Tiles::kTileRows - 1) / Tiles::kTileRows;
    const int64_t next_p0 = p0 + step;
    const bool look_ahead = m1 == m && m > kStreamingRows && tiles >= 2 && next_p0 < panels;
    const int64_t next_lines = look_ahead ? std::min<int64_t>(step, panels - next_p0) * k * kPanel / kLineFloats : 0;
    const char* next = reinterpret_cast<const char*>(b + next_p0 * k * kPanel);
    for (int64_t r = m0; r < m1; r += Tiles::kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(Tiles::kTileRows, m1 - r));
      const float* ar = a + r * lda;
      const float* bp = b + p0 * k * kPanel;
      const int64_t share = (next_lines + tiles - 1) / tiles, first_line = (r - m0) / Tiles::kTileRows * share;
      const Ahead ahead{next + first_line * kCacheLine,
                        std::max<int64_t>(0, std::min(share, next_lines - first_line))};
      if constexpr (kSiluMul) {
        alignas(64) float tile[Tiles::kTileRows * 4 * kPanel];
        multiply_tile<Tiles>(rows, ar, lda, bp, k, spans, group, tile, spans * kPanel, ahead);
        const int64_t pair0 = p0 / 2;
        silu_epilogue(tile, rows, spans / 2, bias == nullptr ? nullptr : bias + pair0 * kPanel,
                      bias == nullptr ? nullptr : bias + (out_panels + pair0) * kPanel,
                      c + r * width + pair0 * kPanel, width);
      } else {
        multiply_tile<Tiles>(rows, ar, lda, bp, k, spans, group, c + r * width + p0 * kPanel, width, ahead);
      }
    }
  });
}

// `multiply` with the instruction set this CPU and `avx512` allow. One row streams the weights faster in AVX2's
// 8-lane chains (a step's projections 12.9 vs 14.8 ms, Zen 4).
template <bool kSiluMul>
void multiply_on_cpu(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& out,
                     bool avx512) {
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  if (avx512 && cpu_has_avx512() && m > 1 && (panels >= kWidePanels || m > kRowBlock)) {
    multiply<Avx512WideTiles, kSiluMul>(x.data_ptr<float>(), x.stride(0), m, packed.data_ptr<float>(), k, panels,
                                        bias, out.data_ptr<float>());
  } else if (avx512 && cpu_has_avx512() && m > 1) {
    multiply<Avx512NarrowTiles, kSiluMul>(x.data_ptr<float>(), x.stride(0), m, packed.data_ptr<float>(), k, panels,
                                          bias, out.data_ptr<float>());
  } else {
    multiply<Avx2Tiles, kSiluMul>(x.data_ptr<float>(), x.stride(0), m, packed.data_ptr<float>(), k, panels, bias,
                                  out.data_ptr<float>());
  }
}

void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n, const char* packer) {
  check_float_rows(x, "x");
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == kPanel && packed.size(1) == x.size(1) && n > (packed.size(0) - 1) * kPanel &&
                  n <= packed.size(0) * kPanel,
              "packed must come from ", packer, " of an [N, K] weight with x's K");
}

// x [M, K] (contiguous rows), packed from `pack_linear_weight` of an [N, K] weight, bias [N] or None -> [M, N].
// `avx512`: use AVX-512 where the CPU has it (the same bits either way; false lets a test compare the two).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                  bool avx512) {
  check_packed(x, packed, n, "pack_linear_weight");
  auto out = at::empty({x.size(0), packed.size(0) * kPanel}, x.options());
  multiply_on_cpu<false>(x, packed, nullptr, out, avx512);
  auto result = out.size(1) == n ? out : out.narrow(1, 0, n).contiguous();
  if (bias.has_value() && bias->defined()) result.add_(*bias);
  return result;
}

// The MLP's gate and up projections, [2I, K] (gate rows first), packed as `pack_linear_weight` packs each half, with
// the halves' panels alternating: gate panel j, then up panel j.
at::Tensor pack_gate_up_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0, "gate_up weight must be [2I, K]");
  const int64_t half = weight.size(0) / 2;
  auto gate = pack_linear_weight(weight.narrow(0, 0, half)), up = pack_linear_weight(weight.narrow(0, half, half));
  return at::stack({gate, up}, 1).view({2 * gate.size(0), gate.size(1), kPanel});
}

// silu(x gate^T + gate_bias) * (x up^T + up_bias) -> [M, I], packed from `pack_gate_up_weight` of a [2I, K] weight,
// bias [2I] or None: bit for bit `silu_times` of the halves of `linear`'s [M, 2I] result, without writing that
// result to memory and reading it back (a 1,328-token prefill's SiLU-times-up took 54 of ~800 ms as its own pass).
at::Tensor gate_up_silu(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate,
                        const c10::optional<at::Tensor>& bias, bool avx512) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) % 2 == 0, "packed must come from pack_gate_up_weight");
  check_packed(x, packed.narrow(0, 0, packed.size(0) / 2), intermediate, "pack_gate_up_weight");
  const int64_t half_width = packed.size(0) / 2 * kPanel;
  at::Tensor padded_bias;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == 2 * intermediate, "bias must be float32 [2I]");
    padded_bias = at::zeros({2, half_width}, x.options());
    padded_bias.narrow(1, 0, intermediate).copy_(bias->view({2, intermediate}));
  }
  auto out = at::empty({x.size(0), half_width}, x.options());
  multiply_on_cpu<true>(x, packed, padded_bias.defined() ? padded_bias.data_ptr<float>() : nullptr, out, avx512);
  return half_width == intermediate ? out : out.narrow(1, 0, intermediate).contiguous();
}

// -- one decoder layer -------------------------------------------------------------------------------------------
// Stores k, v [T, Hkv, D] at (pages[i], offsets[i]) of k_cache, v_cache [pages, page_size, Hkv, D]: the bytes
// `KVPool.write` stores.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& pages, const at::Tensor& offsets) {
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2);
  TORCH_CHECK(pages.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && pages.is_contiguous() &&
                  offsets.is_contiguous() && pages.numel() == tokens && offsets.numel() == tokens,
              "one int64 page and offset per new token");
  TORCH_CHECK(k_cache.size(2) == heads && k_cache.size(3) == dim && k_cache.stride(3) == 1 &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.stride(3) == 1, "K/V shapes do not match the cache");
  const int64_t* page = pages.data_ptr<int64_t>();
  const int64_t* offset = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(page[t] >= 0 && page[t] < k_cache.size(0) && offset[t] >= 0 && offset[t] < k_cache.size(1),
                "slot out of the cache");
  for (auto [fresh, cache] : {std::pair<const at::Tensor*, at::Tensor*>{&k, &k_cache}, {&v, &v_cache}}) {
    const float* src = fresh->data_ptr<float>();
    float* dst = cache->data_ptr<float>();
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t h = 0; h < heads; ++h)
        std::copy_n(src + t * fresh->stride(0) + h * fresh->stride(1), dim,
                    dst + page[t] * cache->stride(0) + offset[t] * cache->stride(1) + h * cache->stride(2));
  }
}

// The attention chunks of some rows of a step: each run of consecutive `rows` within one chunk (a chunk's rows follow
// the chunk before's, `lengths` long) is a chunk of its own over the same pages, starting at its first row's position.
struct RowChunks {
  at::Tensor block_tables, starts, lengths;
};

RowChunks row_chunks(const at::Tensor& rows, int64_t tokens, const at::Tensor& block_tables, const at::Tensor& starts,
                     const at::Tensor& lengths) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() && rows.device().is_cpu(),
              "rows must be contiguous int64 [N] on the CPU");
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* first = starts.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  std::vector<int64_t> chunk_of_run, run_start, run_length;
  for (int64_t i = 0, c = 0, chunk_row = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < tokens && (i == 0 || row[i] > row[i - 1]),
                "rows must be strictly increasing rows of the step");
    while (c < lengths.numel() && row[i] >= chunk_row + length[c]) chunk_row += length[c++];
    TORCH_CHECK(c < lengths.numel(), "rows past the chunks' rows");
    if (i > 0 && row[i] == row[i - 1] + 1 && chunk_of_run.back() == c) {
      ++run_length.back();
    } else {
      chunk_of_run.push_back(c);
      run_start.push_back(first[c] + row[i] - chunk_row);
      run_length.push_back(1);
    }
  }
  auto as_tensor = [](const std::vector<int64_t>& values) {
    return at::tensor(at::ArrayRef<int64_t>(values), at::TensorOptions().dtype(at::kLong));
  };
  return RowChunks{block_tables.index_select(0, as_tensor(chunk_of_run)).contiguous(), as_tensor(run_start),
                   as_tensor(run_length)};
}

// One Llama decoder layer, the ops above in the order of model_worker.model's layer, so bit for bit its result
// (one call a layer instead of ~25 Python-level ones):
//   qkv = linear(hidden) [+ bias]; RoPE on the q and k heads; the new K/V into the layer's pages; attention;
//   x = linear(attention) [+ bias]; residual += x; x = post_norm(residual);
//   x = down(gate_up_silu(x)); residual += x; x = next_norm(residual).
// hidden [T, hidden] is the layer's normed input; returns x (the next sublayer's input) and updates residual.
// With `rows` (strictly increasing row indices), every row's K/V is written but only those rows go on past it:
// their attention, projections and norms, bit for bit theirs in the full layer (each row computed alone), and x is
// [len(rows), hidden] in their order. The model's last layer takes only its logits rows: a 2,048-token prefill
// computes one row's attention and MLP there instead of 2,048. residual is then left as it was.
at::Tensor decoder_layer(const at::Tensor& hidden, at::Tensor residual, const at::Tensor& qkv_packed,
                         const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o_packed,
                         const c10::optional<at::Tensor>& o_bias, const at::Tensor& post_norm,
                         const at::Tensor& gate_up_packed, const c10::optional<at::Tensor>& gate_up_bias,
                         const at::Tensor& down_packed, const c10::optional<at::Tensor>& down_bias,
                         const at::Tensor& next_norm, double eps, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& positions, int64_t num_heads, at::Tensor k_cache, at::Tensor v_cache,
                         const at::Tensor& write_pages, const at::Tensor& write_offsets,
                         const at::Tensor& block_tables, const at::Tensor& starts, const at::Tensor& lengths,
                         double scale, const c10::optional<at::Tensor>& rows) {
  const int64_t tokens = hidden.size(0), width = residual.size(1);
  const int64_t kv_heads = k_cache.size(2), dim = k_cache.size(3), rotated = num_heads + kv_heads;
  auto qkv = linear(hidden, qkv_packed, (rotated + kv_heads) * dim, qkv_bias, true)
                 .view({tokens, rotated + kv_heads, dim});
  rope_(qkv, cos, sin, positions, rotated);
  write_kv(qkv.narrow(1, num_heads, kv_heads), qkv.narrow(1, rotated, kv_heads), k_cache, v_cache, write_pages,
           write_offsets);
  at::Tensor attention;
  if (rows.has_value() && rows->defined()) {
    const RowChunks picked = row_chunks(*rows, tokens, block_tables, starts, lengths);
    attention = paged_attention(qkv.narrow(1, 0, num_heads).index_select(0, *rows), k_cache, v_cache,
                                picked.block_tables, picked.starts, picked.lengths, scale, true);
    residual = residual.index_select(0, *rows);  // a copy: the caller's residual stays as it was
  } else {
    attention = paged_attention(qkv.narrow(1, 0, num_heads), k_cache, v_cache, block_tables, starts, lengths, scale,
                                true);
  }
  auto x = linear(attention, o_packed, width, o_bias, true);
  add_rms_norm_(x, residual, post_norm, eps);
  x = linear(gate_up_silu(x, gate_up_packed, down_packed.size(1), gate_up_bias, true), down_packed, width, down_bias,
             true);
  add_rms_norm_(x, residual, next_norm, eps);
  return x;
}

}  // namespace

TORCH_LIBRARY(radixserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &add_rms_norm_);
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor positions, int rotated) -> ()", &rope_);
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &pack_linear_weight);
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias, bool avx512=True) -> Tensor", &linear);
  m.def("pack_gate_up_weight(Tensor weight) -> Tensor", &pack_gate_up_weight);
  m.def("gate_up_silu(Tensor x, Tensor packed, int intermediate, Tensor? bias, bool avx512=True) -> Tensor",
        &gate_up_silu);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor starts, "
        "Tensor lengths, float scale, bool avx512=True) -> Tensor", &paged_attention);
  m.def("decoder_layer(Tensor hidden, Tensor(a!) residual, Tensor qkv_packed, Tensor? qkv_bias, Tensor o_packed, "
        "Tensor? o_bias, Tensor post_norm, Tensor gate_up_packed, Tensor? gate_up_bias, Tensor down_packed, "
        "Tensor? down_bias, Tensor next_norm, float eps, Tensor cos, Tensor sin, Tensor positions, int num_heads, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor write_pages, Tensor write_offsets, Tensor block_tables, "
        "Tensor starts, Tensor lengths, float scale, Tensor? rows=None) -> Tensor", &decoder_layer);
}
