// y = x @ w.T (+ bias) for the few rows of a decode step (1-16 rows), one pass over the weight.
//
// At a handful of rows a linear layer is a pass over its weight: each weight element is
// loaded once and used by every row. MKL and oneDNN read the weight well below the machine's
// bandwidth at these shapes (bench/engine/REPORT.md). Here the weight is prepacked into
// panels of 48 output columns, each panel a contiguous [K][48] block (bfloat16: [K/2][48][2],
// the pairs AVX512-BF16's dot product takes), so a thread reads its panels as one sequential
// stream; for each k it broadcasts x[m, k] and multiplies it into MR x 3 vector accumulators
// held in registers (no horizontal sums). Rows 9-16 run as a second pass over a panel while
// it is still in L2, so the weight leaves memory once. Accumulation is float32 in both dtypes.
//
// The rest of a decode step's kernels live here too: decode_attention (one pass over each
// request's keys and values), rms_norm, rope and silu_mul (one call where torch makes several).
// Registered as torch.ops.baton.* (CPU); built and loaded by agents/engine/skinny.py, which
// also packs the weights.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kVecs = 3;                 // accumulator vectors per row
constexpr int64_t kPanel = 16 * kVecs;   // output columns per panel
constexpr int kMaxRows = 16;
constexpr int64_t kTaskBytes = 2 << 20;

inline __mmask16 tail_mask(int64_t cols) {
  return cols >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1u);
}

template <int MR>
void panel_f32(const float* x, const float* wp, const float* bias, float* y, int64_t N,
               int64_t K, int64_t n0) {
  __m512 acc[MR][kVecs];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < kVecs; j++) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    __m512 wv[kVecs];
    for (int j = 0; j < kVecs; j++) wv[j] = _mm512_loadu_ps(wp + k * kPanel + 16 * j);
    for (int m = 0; m < MR; m++) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      for (int j = 0; j < kVecs; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int j = 0; j < kVecs; j++) {
    const int64_t col = n0 + 16 * j;
    if (col >= N) break;
    const __mmask16 mask = tail_mask(N - col);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int m = 0; m < MR; m++)
      _mm512_mask_storeu_ps(y + m * N + col, mask, _mm512_add_ps(acc[m][j], b));
  }
}

template <int MR>
void panel_bf16(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y,
                int64_t N, int64_t K, int64_t n0) {
  __m512 acc[MR][kVecs];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < kVecs; j++) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; kp++) {
    __m512bh wv[kVecs];
    for (int j = 0; j < kVecs; j++)
      wv[j] = (__m512bh)_mm512_loadu_si512(wp + (kp * kPanel + 16 * j) * 2);
    for (int m = 0; m < MR; m++) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * kp, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < kVecs; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < kVecs; j++) {
    const int64_t col = n0 + 16 * j;
    if (col >= N) break;
    const __mmask16 mask = tail_mask(N - col);
    __m512 b = _mm512_setzero_ps();
    if (bias) {  // bfloat16 -> float32: the bits, 16 places up
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + col);
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int m = 0; m < MR; m++) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], b));  // nearest even
      _mm256_mask_storeu_epi16(y + m * N + col, mask, (__m256i)out);
    }
  }
}

template <typename T, int MR>
void panel(const T* x, const T* wp, const T* bias, T* y, int64_t N, int64_t K, int64_t n0) {
  if constexpr (sizeof(T) == 4)
    panel_f32<MR>(x, wp, bias, y, N, K, n0);
  else
    panel_bf16<MR>(x, wp, bias, y, N, K, n0);
}

// `rows` (1-8) rows of x against one panel.
template <typename T>
void rows_panel(int64_t rows, const T* x, const T* wp, const T* bias, T* y, int64_t N,
                int64_t K, int64_t n0) {
  switch (rows) {
    case 1: return panel<T, 1>(x, wp, bias, y, N, K, n0);
    case 2: return panel<T, 2>(x, wp, bias, y, N, K, n0);
    case 3: return panel<T, 3>(x, wp, bias, y, N, K, n0);
    case 4: return panel<T, 4>(x, wp, bias, y, N, K, n0);
    case 5: return panel<T, 5>(x, wp, bias, y, N, K, n0);
    case 6: return panel<T, 6>(x, wp, bias, y, N, K, n0);
    case 7: return panel<T, 7>(x, wp, bias, y, N, K, n0);
    default: return panel<T, 8>(x, wp, bias, y, N, K, n0);
  }
}

template <typename T>
void run(int64_t M, const T* x, const T* wp, const T* bias, T* y, int64_t N, int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t panel_elems = kPanel * K;
  // A thread takes at least kTaskBytes of weight (~100 us of streaming): waking a waiting
  // thread costs tens of microseconds, more than a small layer's share of the work.
  const int64_t grain =
      std::max<int64_t>(1, kTaskBytes / (panel_elems * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++)
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        rows_panel<T>(std::min<int64_t>(8, M - m0), x + m0 * K, wp + p * panel_elems, bias,
                      y + m0 * N, N, K, p * kPanel);
  });
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "skinny_linear: x must be [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "skinny_linear: 1 to ", kMaxRows, " rows, got ", M);
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "skinny_linear: dtypes differ");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "skinny_linear: float32 or bfloat16");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!bf16 || K % 2 == 0, "skinny_linear: bfloat16 needs an even K");
  const int64_t panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == panels * kPanel * K,
              "skinny_linear: packed weight does not match N and K");
  const at::Tensor xc = x.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type(),
                "skinny_linear: bias must be [N] in x's dtype");
    b = bias->contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (!bf16) {
    run<float>(M, xc.data_ptr<float>(), packed.data_ptr<float>(),
               b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), N, K);
  } else {
    auto p = [](const at::Tensor& t) {
      return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
    };
    run<uint16_t>(M, p(xc), p(packed), b.defined() ? p(b) : nullptr, p(y), N, K);
  }
  return y;
}

// exp(x) for float32 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p of degree 6 (about
// 1 ulp); lanes below -87.3 (the scores of masked keys, -inf included) give 0.
inline __m512 exp_ps(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~zero), _mm512_scalef_ps(p, n));
}

// One (request, KV head) of decode attention: G query rows against the first n keys.
void attend_one(const float* q, const float* k, const float* v, float* out, int64_t G,
                int64_t D, int64_t n, int64_t kv_stride, std::vector<float>& scores) {
  const int64_t chunks = D / 16;
  const int64_t padded = (n + 15) / 16 * 16;
  scores.assign(static_cast<size_t>(G * padded), -INFINITY);
  for (int64_t g = 0; g < G; g++) {
    const float* qg = q + g * D;
    float* sg = scores.data() + g * padded;
    for (int64_t t = 0; t < n; t++) {
      const float* kt = k + t * kv_stride;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(kt));
      for (int64_t c = 1; c < chunks; c++)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), _mm512_loadu_ps(kt + 16 * c), acc);
      sg[t] = _mm512_reduce_add_ps(acc);
    }
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < padded; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sg + t), top));
      _mm512_storeu_ps(sg + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(sum);
    __m512 acc[16];
    for (int64_t c = 0; c < chunks; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
      const __m512 p = _mm512_set1_ps(sg[t]);
      const float* vt = v + t * kv_stride;
      for (int64_t c = 0; c < chunks; c++)
        acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vt + 16 * c), acc[c]);
    }
    for (int64_t c = 0; c < chunks; c++)
      _mm512_storeu_ps(out + g * D + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
  }
}

// softmax(q k^T) v for a decode step, float32: q [B, H, G, D] (scaled), k and v [B, H, C, D]
// (the KV copy; its last dimension contiguous), request b attending to its first lengths[b]
// keys. The scores never leave the thread's cache; D a multiple of 16, at most 256.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& lengths) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: 4-d tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "decode_attention: float32");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  TORCH_CHECK(D % 16 == 0 && D <= 256, "decode_attention: head dim a multiple of 16, <= 256");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides() && k.size(0) == B &&
                  k.size(1) == H && k.size(3) == D && k.stride(3) == 1,
              "decode_attention: k and v must be [B, H, C, D] alike, last dim contiguous");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.scalar_type() == at::kLong,
              "decode_attention: lengths must be [B] int64");
  const at::Tensor qc = q.contiguous(), lens = lengths.contiguous();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; b++)
    TORCH_CHECK(len[b] >= 1 && len[b] <= k.size(2), "decode_attention: length out of range");
  at::Tensor out = at::empty({B, H, G, D}, q.options());
  const float *qp = qc.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sb = k.stride(0), sh = k.stride(1), st = k.stride(2);
  const int64_t task_bytes = 2 * k.size(2) * D * static_cast<int64_t>(sizeof(float));
  at::parallel_for(0, B * H, std::max<int64_t>(1, kTaskBytes / task_bytes),
                   [&](int64_t i0, int64_t i1) {
                     std::vector<float> scores;
                     for (int64_t i = i0; i < i1; i++) {
                       const int64_t b = i / H, h = i % H;
                       attend_one(qp + i * G * D, kp + b * sb + h * sh, vp + b * sb + h * sh,
                                  op + i * G * D, G, D, len[b], st, scores);
                     }
                   });
  return out;
}

inline __m512 load_f32(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load_f32(const uint16_t* p, __mmask16 mask) {  // bfloat16 -> float32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
inline void store_f32(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
inline void store_f32(uint16_t* p, __m512 v, __mmask16 mask) {  // rounded to nearest even
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 round_bf16(__m512 v) {  // float32 -> bfloat16 -> float32
  const __m512i bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

// x / rms(x) * w per row, the mean of squares in float32. float32: as F.rms_norm. bfloat16: as
// the engine's bfloat16 path, w * bf16(x / rms(x)), each product rounded to bfloat16.
template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; m++) {
    const T* xr = x + m * H;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t h = 0; h < H; h += 16) {
      const __m512 v = load_f32(xr + h, tail_mask(H - h));
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(H) + eps);
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t h = 0; h < H; h += 16) {
      const __mmask16 mask = tail_mask(H - h);
      __m512 n = _mm512_mul_ps(load_f32(xr + h, mask), s);
      if constexpr (sizeof(T) == 2) n = round_bf16(n);
      store_f32(y + m * H + h, _mm512_mul_ps(n, load_f32(w + h, mask)), mask);
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0),
              "rms_norm: x [M, H] and w [H]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm: float32 or bfloat16, x and w alike");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t M = xc.size(0), H = xc.size(1);
  if (x.scalar_type() == at::kFloat) {
    rms_rows<float>(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), M, H,
                    static_cast<float>(eps));
  } else {
    auto p = [](const at::Tensor& t) {
      return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
    };
    rms_rows<uint16_t>(p(xc), p(wc), p(y), M, H, static_cast<float>(eps));
  }
  return y;
}

// silu(gate) * up for gate_up = [gate | up] [M, 2I]; bfloat16: silu rounded to bfloat16 first,
// as torch computes F.silu(gate) * up in that dtype.
template <typename T>
void silu_mul_rows(const T* gu, T* y, int64_t M, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t m = 0; m < M; m++) {
    const T* g = gu + m * 2 * I;
    const T* u = g + I;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 mask = tail_mask(I - i);
      const __m512 gv = load_f32(g + i, mask);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
      __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, e));
      if constexpr (sizeof(T) == 2) silu = round_bf16(silu);
      store_f32(y + m * I + i, _mm512_mul_ps(silu, load_f32(u + i, mask)), mask);
    }
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [M, 2I]");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16,
              "silu_mul: float32 or bfloat16");
  const at::Tensor gu = gate_up.contiguous();
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  at::Tensor y = at::empty({M, I}, gu.options());
  if (gu.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(gu.data_ptr<float>(), y.data_ptr<float>(), M, I);
  } else {
    silu_mul_rows<uint16_t>(reinterpret_cast<uint16_t*>(gu.data_ptr<at::BFloat16>()),
                            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, I);
  }
  return y;
}

// Rotary embedding of the first `heads` heads of qkv [B, NH, D]: x * cos + rotate_half(x) *
// sin, rotate_half(x) = [-x[D/2:], x[:D/2]], with torch's roundings (two products and a sum,
// no fused multiply-add; bfloat16: each rounded to bfloat16). cos and sin [B, D].
template <typename T>
void rope_rows(const T* qkv, const T* cos, const T* sin, T* out, int64_t B, int64_t NH,
               int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < heads; h++) {
      const T* x = qkv + (b * NH + h) * D;
      T* y = out + (b * heads + h) * D;
      for (int64_t j = 0; j < D; j += 16) {
        const __mmask16 all = 0xFFFF;
        const __m512 xv = load_f32(x + j, all);
        const __m512 rv = j < half ? _mm512_sub_ps(zero, load_f32(x + j + half, all))
                                   : load_f32(x + j - half, all);
        __m512 a = _mm512_mul_ps(xv, load_f32(cos + b * D + j, all));
        __m512 c = _mm512_mul_ps(rv, load_f32(sin + b * D + j, all));
        if constexpr (sizeof(T) == 2) {
          a = round_bf16(a);
          c = round_bf16(c);
        }
        store_f32(y + j, _mm512_add_ps(a, c), all);
      }
    }
}

at::Tensor rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3, "rope: qkv [B, NH, D]");
  const int64_t B = qkv.size(0), NH = qkv.size(1), D = qkv.size(2);
  TORCH_CHECK(D % 32 == 0, "rope: head dim a multiple of 32");
  TORCH_CHECK(heads >= 1 && heads <= NH, "rope: 1 to NH heads");
  TORCH_CHECK(cos.numel() == B * D && sin.numel() == B * D, "rope: cos and sin [B, D]");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && qkv.scalar_type() == sin.scalar_type() &&
                  (qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16),
              "rope: float32 or bfloat16, all alike");
  const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  at::Tensor y = at::empty({B, heads, D}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rope_rows<float>(x.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(),
                     y.data_ptr<float>(), B, NH, heads, D);
  } else {
    auto p = [](const at::Tensor& t) {
      return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
    };
    rope_rows<uint16_t>(p(x), p(c), p(s), p(y), B, NH, heads, D);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(baton, m) {
  m.def("skinny_linear(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor lengths) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor qkv, Tensor cos, Tensor sin, int heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
}
