// y = x @ w.T (+ bias) for the few rows of a decode step (1-64 rows), one pass over the weight.
//
// At a handful of rows a linear layer is a pass over its weight: each weight element is
// loaded once and used by every row. MKL and oneDNN read the weight well below the machine's
// bandwidth at these shapes (bench/engine/REPORT.md). Here the weight is prepacked (pack())
// into panels of kPanel output columns, each a contiguous [K][kPanel] block, so a thread reads
// its panels as one sequential stream; for each k it broadcasts x[m, k] and multiplies it into
// kMR x kVecs vector accumulators held in registers (no horizontal sums). Further rows run as
// more passes over a panel while it is still in cache, so the weight leaves memory once; the
// panel is prefetched 4 KB ahead of the loop.
// Accumulation is float32 in both dtypes.
//
// Two instruction sets, chosen when the library is compiled (agents/engine/skinny.py passes
// the flags for the CPU it runs on):
// - AVX-512 with AVX512-BF16: 16 lanes, panels of 48 columns, 8 rows a pass; bfloat16 panels
//   are [K/2][48][2], the pairs AVX512-BF16's dot product takes, and AMX's tile dot product
//   where the CPU has it (chosen when the library loads; see amx_panels).
// - AVX2 with FMA: 8 lanes, panels of 8 columns, 8 rows a pass;
//   bfloat16 is widened to float32 as it is loaded (exact) and multiplied with FMA, x rows in
//   float32.
//
// The rest of a decode step's kernels live here too: decode_attention (one pass over each
// request's keys and values), rms_norm, rope and silu_mul (one call where torch makes several).
// Registered as torch.ops.baton.* (CPU); built and loaded by agents/engine/skinny.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cpuid.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#define BATON_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define BATON_AVX512 0
#else
#error "skinny_linear.cpp needs AVX-512 with AVX512-BF16, or AVX2 with FMA"
#endif

namespace {

// ---- float32 vectors of W lanes, and bfloat16 <-> float32 -------------------------------------

#if BATON_AVX512
using vf = __m512;
constexpr int W = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float a) { return _mm512_set1_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline float vtop(vf v) { return _mm512_reduce_max_ps(v); }
inline vf vround(vf v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
inline vf vzero_below(vf v, vf x, float lo) {  // lanes where x < lo: 0
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(x, vset(lo), _CMP_LT_OQ)),
                             v);
}
inline vf vload(const uint16_t* p) {  // W bfloat16 -> float32: the bits, 16 places up
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void vstore(uint16_t* p, vf v) {  // rounded to nearest even
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
#else
using vf = __m256;
constexpr int W = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float a) { return _mm256_set1_ps(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline float vsum(vf v) {  // halves folded onto each other
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vtop(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vf vround(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2(__m256i n) {  // 2^n for -126 <= n <= 127
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
inline vf vscale2(vf p, vf n) {  // p * 2^n in two exact steps, so 2^n itself never overflows
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  return vmul(vmul(p, vpow2(half)), vpow2(_mm256_sub_epi32(ni, half)));
}
inline vf vzero_below(vf v, vf x, float lo) {
  return _mm256_andnot_ps(_mm256_cmp_ps(x, vset(lo), _CMP_LT_OQ), v);
}
inline vf vload(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline void vstore(uint16_t* p, vf v) {  // rounded to nearest even, NaN kept quiet (as c10)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  const __m128i out = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), out);
}
#endif

// The first n (< W) lanes, the rest zero / untouched: through a buffer (tails only).
template <typename T>
inline vf vload(const T* p, int64_t n) {
  if (n >= W) return vload(p);
  T buf[W] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(T));
  return vload(static_cast<const T*>(buf));
}
template <typename T>
inline void vstore(T* p, vf v, int64_t n) {
  if (n >= W) return vstore(p, v);
  T buf[W];
  vstore(buf, v);
  std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(T));
}
inline vf round_bf16(vf v) {  // float32 -> bfloat16 -> float32
  uint16_t buf[W];
  vstore(buf, v);
  return vload(static_cast<const uint16_t*>(buf));
}

// y = float32(x) * scale (exact widening, then one rounded product as torch's mul).
template <typename T>
void widen(const T* x, float* y, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i += W) vstore(y + i, vmul(vload(x + i, n - i), vset(scale)), n - i);
}

inline uint16_t* bf16_ptr(const at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

// ---- skinny linear ----------------------------------------------------------------------------

#if BATON_AVX512
constexpr int kVecs = 3;  // accumulator vectors per row
constexpr int kMR = 8;    // rows per pass: 24 accumulators, 3 weight vectors, 1 broadcast
#else
// 8 accumulators, 1 weight vector, 1 broadcast: all 8 rows of a decode batch in one pass, so
// the weight streams from memory while the FMAs run (4 rows a pass with 2 vectors each, the
// second pass from cache, read the weights at 9 GB/s from memory on one core here, this 11),
// with the prefetch below 13-14 GB/s (bench/engine/REPORT.md).
constexpr int kVecs = 1;
constexpr int kMR = 8;
#endif
// Both builds prefetch the panel 4 KB ahead of the loop: the hardware's streamers stop at 4 KB
// pages, and a core's few misses in flight then leave memory idle. On the Xeon with AMX, 8 rows
// of the step's 33 linears from memory, 2 threads: float32 12.0 -> 14.5 GB/s, bfloat16 7.8 ->
// 10.9 (on the AVX2 EPYC 11 -> 12.7-14.7, one core). BATON_PREFETCH=bytes overrides it (0: off).
#ifdef BATON_PREFETCH
constexpr int64_t kPrefetch = BATON_PREFETCH;
#else
constexpr int64_t kPrefetch = 4096;
#endif
constexpr int64_t kPanel = W * kVecs;  // output columns per panel
constexpr int kMaxRows = 64;
constexpr int64_t kTaskBytes = 2 << 20;
// bfloat16 panels hold (k, k+1) pairs side by side for AVX512-BF16's dot product.
constexpr bool kPairs = BATON_AVX512;

// The weight `kPrefetch` bytes ahead of what a step of a panel's loop reads (`bytes` from
// `at`), one prefetch per cache line.
inline void prefetch_ahead(const void* at, int64_t bytes) {
  if constexpr (kPrefetch > 0)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(static_cast<const char*>(at) + kPrefetch + b, _MM_HINT_T0);
}

// The bias's columns col.. (up to kPanel - col of them are real) added, and the rows stored.
template <int MR, typename T>
inline void store_panel(vf (&acc)[MR][kVecs], const T* bias, T* y, int64_t N, int64_t n0) {
  for (int j = 0; j < kVecs; j++) {
    const int64_t col = n0 + W * j;
    if (col >= N) break;
    const vf b = bias ? vload(bias + col, N - col) : vzero();
    for (int m = 0; m < MR; m++) vstore(y + m * N + col, vadd(acc[m][j], b), N - col);
  }
}

// MR rows of x (float32, [MR][K]) against one panel of weights in float32 or widened bfloat16.
template <int MR, typename T>
void panel_fma(const float* x, const T* wp, const T* bias, T* y, int64_t N, int64_t K,
               int64_t n0) {
  vf acc[MR][kVecs];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < kVecs; j++) acc[m][j] = vzero();
  for (int64_t k = 0; k < K; k++) {
    prefetch_ahead(wp + k * kPanel, kPanel * sizeof(T));
    vf wv[kVecs];
    for (int j = 0; j < kVecs; j++) wv[j] = vload(wp + k * kPanel + W * j);
    for (int m = 0; m < MR; m++) {
      const vf xv = vset(x[m * K + k]);
      for (int j = 0; j < kVecs; j++) acc[m][j] = vfma(xv, wv[j], acc[m][j]);
    }
  }
  store_panel<MR>(acc, bias, y, N, n0);
}

#if BATON_AVX512
// MR bfloat16 rows against one pair-packed bfloat16 panel, AVX512-BF16's dot product.
template <int MR>
void panel_dpbf16(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y,
                  int64_t N, int64_t K, int64_t n0) {
  vf acc[MR][kVecs];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < kVecs; j++) acc[m][j] = vzero();
  for (int64_t kp = 0; kp < K / 2; kp++) {
    prefetch_ahead(wp + kp * kPanel * 2, kPanel * 4);
    __m512bh wv[kVecs];
    for (int j = 0; j < kVecs; j++)
      wv[j] = (__m512bh)_mm512_loadu_si512(wp + (kp * kPanel + W * j) * 2);
    for (int m = 0; m < MR; m++) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * kp, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < kVecs; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  store_panel<MR>(acc, bias, y, N, n0);
}
#endif

#if BATON_AVX512
// ---- AMX: bfloat16 panels through the tile unit --------------------------------------------
//
// AVX512-BF16's dot product retires about one every 1.5 cycles here, so at 8 rows the pair
// kernel above is compute-bound near the memory's rate (13.5 GB/s from L2 on one core, where
// float32 FMA reaches 44): bfloat16 halved the bytes but not the time. Where the CPU has AMX
// (AMX-TILE and AMX-BF16, and the kernel lets the process use the tile state) the same pair-
// packed panels go through TDPBF16PS instead: per 32 k, one tile of up to 16 rows of x, three
// tiles of 16 pairs x 16 columns of the panel (row stride: the panel's 48 columns), three
// 16 x 16 float32 accumulators. float32 accumulation as above, summed in another order.
// BATON_AMX=0 in the environment keeps the AVX512-BF16 kernel.

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("BATON_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if (((d >> 22) & 1) == 0 || ((d >> 24) & 1) == 0) return false;  // AMX-BF16, AMX-TILE
    constexpr long kReqPerm = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
    return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
  }();
  return ready;
}

// Rows per tile pass: all of a batch up to 16, else 16 (the last pass from zero-padded rows).
constexpr int64_t kTileRows = 16;

__attribute__((target("amx-tile,amx-bf16"))) void amx_panels(
    int64_t p0, int64_t p1, int64_t M, const uint16_t* x, const uint16_t* wp,
    const uint16_t* bias, uint16_t* y, int64_t N, int64_t K) {
  static_assert(kPanel == 3 * 16, "three 16-column tiles a panel");
  const int64_t R = std::min(M, kTileRows), passes = (M + R - 1) / R;
  thread_local std::vector<uint16_t> padded;
  const uint16_t* xa = x;
  if (passes * R != M) {  // the last pass's missing rows read as zeros
    padded.assign(static_cast<size_t>(passes * R * K), 0);
    std::memcpy(padded.data(), x, static_cast<size_t>(M * K) * sizeof(uint16_t));
    xa = padded.data();
  }
  TileConfig cfg;
  for (int t = 0; t < 4; t++) cfg.rows[t] = static_cast<uint8_t>(R), cfg.colsb[t] = 64;
  for (int t = 4; t < 7; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  alignas(64) float acc[kTileRows][kPanel];
  const int64_t panel_elems = kPanel * K, pair_row = kPanel * 2 * sizeof(uint16_t);
  for (int64_t p = p0; p < p1; p++) {
    const uint16_t* panel = wp + p * panel_elems;
    for (int64_t pass = 0; pass < passes; pass++) {
      const uint16_t* rows = xa + pass * R * K;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const uint16_t* b = panel + k0 * kPanel;  // pair row k0 / 2
        prefetch_ahead(b, 16 * pair_row);
        _tile_loadd(3, rows + k0, K * sizeof(uint16_t));
        _tile_loadd(4, b, pair_row);
        _tile_loadd(5, b + 32, pair_row);
        _tile_loadd(6, b + 64, pair_row);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
      }
      _tile_stored(0, &acc[0][0], kPanel * sizeof(float));
      _tile_stored(1, &acc[0][16], kPanel * sizeof(float));
      _tile_stored(2, &acc[0][32], kPanel * sizeof(float));
      const int64_t real = std::min(R, M - pass * R);
      for (int64_t m = 0; m < real; m++) {  // each row as the vector kernels store theirs
        vf row[1][kVecs];
        for (int j = 0; j < kVecs; j++) row[0][j] = vload(&acc[m][W * j]);
        store_panel<1>(row, bias, y + (pass * R + m) * N, N, p * kPanel);
      }
    }
  }
  _tile_release();
}
#endif

// `rows` (1 to kMR) rows against one panel. xf: the rows in float32 (x itself for float32);
// x: the rows as given (the pair kernel takes bfloat16 rows).
template <typename T, int MR>
void panel(const float* xf, const T* x, const T* wp, const T* bias, T* y, int64_t N, int64_t K,
           int64_t n0) {
#if BATON_AVX512
  if constexpr (sizeof(T) == 2) return panel_dpbf16<MR>(x, wp, bias, y, N, K, n0);
#endif
  (void)x;
  panel_fma<MR, T>(xf, wp, bias, y, N, K, n0);
}

template <typename T, int MR = kMR>
void rows_panel(int64_t rows, const float* xf, const T* x, const T* wp, const T* bias, T* y,
                int64_t N, int64_t K, int64_t n0) {
  if constexpr (MR > 1) {
    if (rows < MR) return rows_panel<T, MR - 1>(rows, xf, x, wp, bias, y, N, K, n0);
  }
  panel<T, MR>(xf, x, wp, bias, y, N, K, n0);
}

// Panels p0 <= p < p1 of y = x @ w.T, every row.
template <typename T>
void run_panels(int64_t p0, int64_t p1, int64_t M, const float* xf, const T* x, const T* wp,
                const T* bias, T* y, int64_t N, int64_t K) {
#if BATON_AVX512
  if constexpr (sizeof(T) == 2) {
    if (K % 32 == 0 && p0 < p1 && amx_ready())
      return amx_panels(p0, p1, M, x, wp, bias, y, N, K);
  }
#endif
  const int64_t panel_elems = kPanel * K;
  for (int64_t p = p0; p < p1; p++)
    for (int64_t m0 = 0; m0 < M; m0 += kMR)
      rows_panel<T>(std::min<int64_t>(kMR, M - m0), xf + m0 * K, x + m0 * K,
                    wp + p * panel_elems, bias, y + m0 * N, N, K, p * kPanel);
}

template <typename T>
void run(int64_t M, const float* xf, const T* x, const T* wp, const T* bias, T* y, int64_t N,
         int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // A thread takes at least kTaskBytes of weight (~100 us of streaming): waking a waiting
  // thread costs tens of microseconds, more than a small layer's share of the work.
  const int64_t grain =
      std::max<int64_t>(1, kTaskBytes / (kPanel * K * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    run_panels<T>(p0, p1, M, xf, x, wp, bias, y, N, K);
  });
}

// The kernel's copy of w [N, K]: N padded with zero rows to whole panels, each panel [K][kPanel]
// (bfloat16 with pairs: [K/2][kPanel][2]).
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack: w must be [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "pack: float32 or bfloat16");
  const int64_t N = w.size(0), K = w.size(1);
  const bool pairs = kPairs && w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!pairs || K % 2 == 0, "pack: bfloat16 needs an even K");
  const int64_t padded = (N + kPanel - 1) / kPanel * kPanel;
  const at::Tensor full = padded == N ? w : at::constant_pad_nd(w, {0, 0, 0, padded - N});
  if (pairs) return full.reshape({-1, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  return full.reshape({-1, kPanel, K}).transpose(1, 2).contiguous();
}

// The rows x [n] as the kernel takes them: float32 rows as they are, bfloat16 rows for the
// pair kernel not at all (nullptr: it reads x), else widened to float32 into xf (n floats).
template <typename T>
const float* rows_f32(const T* x, float* xf, int64_t n) {
  if constexpr (sizeof(T) == 4) {
    return x;
  } else if constexpr (kPairs) {
    return nullptr;
  } else {
    widen<T>(x, xf, n, 1.0f);
    return xf;
  }
}

// y [M, N] = x [M, K] @ w.T (+ bias) from w's packed copy; xf: see rows_f32.
template <typename T>
void linear_rows(int64_t M, const T* x, float* xf, const T* wp, const T* bias, T* y, int64_t N,
                 int64_t K) {
  run<T>(M, rows_f32<T>(x, xf, M * K), x, wp, bias, y, N, K);
}

void check_packed(const at::Tensor& packed, int64_t N, int64_t K, at::ScalarType dtype,
                  const char* what) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.scalar_type() == dtype, what, ": dtypes differ");
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == panels * kPanel * K, what,
              ": packed weight does not match N and K");
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "skinny_linear: x must be [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "skinny_linear: 1 to ", kMaxRows, " rows, got ", M);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "skinny_linear: float32 or bfloat16");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!(bf16 && kPairs) || K % 2 == 0, "skinny_linear: bfloat16 needs an even K");
  check_packed(packed, N, K, x.scalar_type(), "skinny_linear");
  const at::Tensor xc = x.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type(),
                "skinny_linear: bias must be [N] in x's dtype");
    b = bias->contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (!bf16) {
    linear_rows<float>(M, xc.data_ptr<float>(), nullptr, packed.data_ptr<float>(),
                       b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), N, K);
  } else {
    std::vector<float> xf(kPairs ? 0 : static_cast<size_t>(M * K));
    linear_rows<uint16_t>(M, bf16_ptr(xc), xf.data(), bf16_ptr(packed),
                          b.defined() ? bf16_ptr(b) : nullptr, bf16_ptr(y), N, K);
  }
  return y;
}

// exp(x) for float32 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p of degree 6 (about
// 1 ulp); lanes below -87.3 (the scores of masked keys, -inf included) give 0, lanes above
// 88.76 infinity.
inline vf exp_ps(vf x) {
  const vf in = x;
  x = vmin(vmax(x, vset(-87.3f)), vset(88.76f));
  const vf n = vround(vmul(x, vset(1.44269504088896341f)));
  vf r = vfnma(n, vset(0.693359375f), x);
  r = vfnma(n, vset(-2.12194440e-4f), r);
  vf p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.0f)));
  return vzero_below(vscale2(p, n), in, -87.3f);
}

// One (request, KV head) of decode attention: G query rows against the first n keys.
void attend_one(const float* q, const float* k, const float* v, float* out, int64_t G,
                int64_t D, int64_t n, int64_t kv_stride, std::vector<float>& scores) {
  const int64_t chunks = D / W;
  const int64_t padded = (n + W - 1) / W * W;
  scores.assign(static_cast<size_t>(G * padded), -INFINITY);
  for (int64_t g = 0; g < G; g++) {
    const float* qg = q + g * D;
    float* sg = scores.data() + g * padded;
    for (int64_t t = 0; t < n; t++) {
      const float* kt = k + t * kv_stride;
      vf acc = vmul(vload(qg), vload(kt));
      for (int64_t c = 1; c < chunks; c++) acc = vfma(vload(qg + W * c), vload(kt + W * c), acc);
      sg[t] = vsum(acc);
    }
    vf mx = vset(-INFINITY);
    for (int64_t t = 0; t < padded; t += W) mx = vmax(mx, vload(sg + t));
    const vf top = vset(vtop(mx));
    vf sum = vzero();
    for (int64_t t = 0; t < padded; t += W) {
      const vf e = exp_ps(vsub(vload(sg + t), top));
      vstore(sg + t, e);
      sum = vadd(sum, e);
    }
    const float inv = 1.0f / vsum(sum);
    vf acc[256 / W];
    for (int64_t c = 0; c < chunks; c++) acc[c] = vzero();
    for (int64_t t = 0; t < n; t++) {
      const vf p = vset(sg[t]);
      const float* vt = v + t * kv_stride;
      for (int64_t c = 0; c < chunks; c++) acc[c] = vfma(p, vload(vt + W * c), acc[c]);
    }
    for (int64_t c = 0; c < chunks; c++) vstore(out + g * D + W * c, vmul(acc[c], vset(inv)));
  }
}

// attend_one over every (request, KV head): q and out [B, H, G, D] contiguous; k and v's
// request, head and position strides sb, sh, st; C positions at most.
void attention_rows(const float* qp, const float* kp, const float* vp, float* op, int64_t B,
                    int64_t H, int64_t G, int64_t D, const int64_t* len, int64_t sb, int64_t sh,
                    int64_t st, int64_t C) {
  const int64_t task_bytes = 2 * C * D * static_cast<int64_t>(sizeof(float));
  at::parallel_for(0, B * H, std::max<int64_t>(1, kTaskBytes / task_bytes),
                   [&](int64_t i0, int64_t i1) {
                     std::vector<float> scores;
                     for (int64_t i = i0; i < i1; i++) {
                       const int64_t b = i / H, h = i % H;
                       attend_one(qp + i * G * D, kp + b * sb + h * sh, vp + b * sb + h * sh,
                                  op + i * G * D, G, D, len[b], st, scores);
                     }
                   });
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
  attention_rows(qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                 out.data_ptr<float>(), B, H, G, D, len, k.stride(0), k.stride(1), k.stride(2),
                 k.size(2));
  return out;
}

// x / rms(x) * w per row, the mean of squares in float32. float32: as F.rms_norm. bfloat16: as
// the engine's bfloat16 path, w * bf16(x / rms(x)), each product rounded to bfloat16.
template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; m++) {
    const T* xr = x + m * H;
    vf acc = vzero();
    for (int64_t h = 0; h < H; h += W) {
      const vf v = vload(xr + h, H - h);
      acc = vfma(v, v, acc);
    }
    const float scale = 1.0f / std::sqrt(vsum(acc) / static_cast<float>(H) + eps);
    const vf s = vset(scale);
    for (int64_t h = 0; h < H; h += W) {
      vf n = vmul(vload(xr + h, H - h), s);
      if constexpr (sizeof(T) == 2) n = round_bf16(n);
      vstore(y + m * H + h, vmul(n, vload(w + h, H - h)), H - h);
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
    rms_rows<uint16_t>(bf16_ptr(xc), bf16_ptr(wc), bf16_ptr(y), M, H, static_cast<float>(eps));
  }
  return y;
}

// silu(gate) * up for gate_up = [gate | up] [M, 2I]; bfloat16: silu rounded to bfloat16 first,
// as torch computes F.silu(gate) * up in that dtype.
template <typename T>
void silu_mul_rows(const T* gu, T* y, int64_t M, int64_t I) {
  const vf one = vset(1.0f);
  for (int64_t m = 0; m < M; m++) {
    const T* g = gu + m * 2 * I;
    const T* u = g + I;
    for (int64_t i = 0; i < I; i += W) {
      const vf gv = vload(g + i, I - i);
      vf silu = vdiv(gv, vadd(one, exp_ps(vsub(vzero(), gv))));
      if constexpr (sizeof(T) == 2) silu = round_bf16(silu);
      vstore(y + m * I + i, vmul(silu, vload(u + i, I - i)), I - i);
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
    silu_mul_rows<uint16_t>(bf16_ptr(gu), bf16_ptr(y), M, I);
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
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < heads; h++) {
      const T* x = qkv + (b * NH + h) * D;
      T* y = out + (b * heads + h) * D;
      for (int64_t j = 0; j < D; j += W) {
        const vf rv = j < half ? vsub(vzero(), vload(x + j + half)) : vload(x + j - half);
        vf a = vmul(vload(x + j), vload(cos + b * D + j));
        vf c = vmul(rv, vload(sin + b * D + j));
        if constexpr (sizeof(T) == 2) {
          a = round_bf16(a);
          c = round_bf16(c);
        }
        vstore(y + j, vadd(a, c));
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
    rope_rows<uint16_t>(bf16_ptr(x), bf16_ptr(c), bf16_ptr(s), bf16_ptr(y), B, NH, heads, D);
  }
  return y;
}

// ---- the decoder layers of a decode step, one call ------------------------------------------

// x += y, rounded to x's dtype as torch's add; n elements.
template <typename T>
void add_into(T* x, const T* y, int64_t n) {
  for (int64_t i = 0; i < n; i += W)
    vstore(x + i, vadd(vload(x + i, n - i), vload(y + i, n - i)), n - i);
}

// y = x in T (bfloat16: rounded to nearest even, as torch's .to()).
template <typename T>
void narrow(const float* x, T* y, int64_t n) {
  for (int64_t i = 0; i < n; i += W) vstore(y + i, vload(x + i, n - i), n - i);
}

template <typename T>
const T* ptr_of(const at::Tensor& t) {
  if constexpr (sizeof(T) == 4) return t.data_ptr<float>();
  else return bf16_ptr(t);
}

struct Step {  // a decode step's shapes and state (see decode_layers)
  int64_t B, hidden, heads, kv_heads, D, I, L, slots, C;
  float eps, scale;
  const int64_t *write, *pos, *len;
};

// A barrier for the team that runs a decode step's layers: the threads meet ~8 times a layer,
// each wait a few microseconds when the work is split evenly, so a waiter spins (pause) for
// up to kSpins rounds, then yields its core to anyone else who wants it. (The OpenMP
// barrier, with OMP_WAIT_POLICY=PASSIVE, puts the waiter to sleep: tens of microseconds to
// wake, every time.)
class TeamBarrier {
 public:
  explicit TeamBarrier(int n) : n_(n) {}
  void wait() {
    if (n_ == 1) return;
    const int phase = phase_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; spins++) {
      if (spins < kSpins)
        _mm_pause();
      else
        std::this_thread::yield();
    }
  }

 private:
  static constexpr int kSpins = 100;  // a few microseconds of pause, then yield
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<int> phase_{0};
};

// [lo, hi) of n items for thread t of nt, contiguous and as even as can be.
inline std::pair<int64_t, int64_t> share(int64_t n, int t, int nt) {
  return {n * t / nt, n * (t + 1) / nt};
}

// The decoder layers of one decode step, as the engine's stream path computes them op by op
// (agents/engine/decode.py decode_forward): RMSNorm, QKV, RoPE, the new K/V into the pool and
// the KV copy, attention, o_proj + residual, RMSNorm, gate/up, silu * up, down + residual.
// One team of threads runs the whole step: each linear's panels, the attention's (request,
// KV head) pairs and the small ops' rows are split between them, and they meet at a barrier
// where the next stage reads what the others wrote. The same arithmetic, in the same order
// per output, as the op-by-op step.
template <typename T>
void layers(const Step& s, T* x, const std::vector<at::Tensor>& norms,
            const std::vector<at::Tensor>& packed, const std::vector<at::Tensor>& biases,
            const T* cos, const T* sin, T* k_pool, T* v_pool, float* k_copy, float* v_copy) {
  const int64_t B = s.B, H = s.heads, KVH = s.kv_heads, D = s.D, G = H / KVH;
  const int64_t NQK = (H + KVH) * D, NQKV = (H + 2 * KVH) * D;
  std::vector<T> h(B * s.hidden), qkv(B * NQKV), qk(B * NQK), y(B * s.hidden);
  std::vector<T> gu(B * 2 * s.I), act(B * s.I), att_t(B * H * D);
  std::vector<float> q(B * H * D), att(B * H * D);
  const int threads = std::max(1, at::get_num_threads());
  const int64_t widest = std::max({s.hidden, H * D, s.I});
  std::vector<std::vector<float>> xf(threads);  // per thread: rows widened for the FMA kernel
  std::vector<const T*> ws, bs;
  for (size_t j = 0; j < packed.size(); j++) {
    ws.push_back(ptr_of<T>(packed[j]));
    bs.push_back(biases[j].defined() ? ptr_of<T>(biases[j]) : nullptr);
  }
  const int64_t copy_layer = B * KVH * s.C * D;
  std::unique_ptr<TeamBarrier> barrier;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
    barrier = std::make_unique<TeamBarrier>(nt);  // the team as it is (an implied barrier)
    std::vector<float> scores;
    if constexpr (sizeof(T) == 2 && !kPairs) xf[t].resize(B * widest);
    auto lin = [&](int64_t j, const T* in, T* out, int64_t N, int64_t K) {
      const float* rows = rows_f32<T>(in, xf[t].data(), B * K);
      const auto [p0, p1] = share((N + kPanel - 1) / kPanel, t, nt);
      run_panels<T>(p0, p1, B, rows, in, ws[j], bs[j], out, N, K);
    };
    const auto [b0, b1] = share(B, t, nt);  // this thread's rows of the small ops
    const int64_t mine = b1 - b0;
    for (int64_t i = 0; i < s.L; i++) {
      if (mine > 0)
        rms_rows<T>(x + b0 * s.hidden, ptr_of<T>(norms[2 * i]), h.data() + b0 * s.hidden, mine,
                    s.hidden, s.eps);
      barrier->wait();
      lin(4 * i, h.data(), qkv.data(), NQKV, s.hidden);
      barrier->wait();
      if (mine > 0)
        rope_rows<T>(qkv.data() + b0 * NQKV, cos + b0 * D, sin + b0 * D, qk.data() + b0 * NQK,
                     mine, H + 2 * KVH, H + KVH, D);
      for (int64_t b = b0; b < b1; b++) {
        const T* k = qk.data() + b * NQK + H * D;
        const T* v = qkv.data() + b * NQKV + (H + KVH) * D;
        const int64_t slot = (i * s.slots + s.write[b]) * KVH * D;
        std::memcpy(k_pool + slot, k, KVH * D * sizeof(T));
        std::memcpy(v_pool + slot, v, KVH * D * sizeof(T));
        for (int64_t g = 0; g < KVH; g++) {
          const int64_t at = i * copy_layer + ((b * KVH + g) * s.C + s.pos[b]) * D;
          widen<T>(k + g * D, k_copy + at, D, 1.0f);
          widen<T>(v + g * D, v_copy + at, D, 1.0f);
        }
        widen<T>(qk.data() + b * NQK, q.data() + b * H * D, H * D, s.scale);
      }
      barrier->wait();
      const auto [a0, a1] = share(B * KVH, t, nt);
      for (int64_t a = a0; a < a1; a++) {
        const int64_t b = a / KVH, g = a % KVH;
        const int64_t kv = i * copy_layer + (b * KVH + g) * s.C * D;
        attend_one(q.data() + a * G * D, k_copy + kv, v_copy + kv, att.data() + a * G * D, G,
                   D, s.len[b], D, scores);
        narrow<T>(att.data() + a * G * D, att_t.data() + a * G * D, G * D);
      }
      barrier->wait();
      lin(4 * i + 1, att_t.data(), y.data(), s.hidden, H * D);
      barrier->wait();
      if (mine > 0) {
        add_into<T>(x + b0 * s.hidden, y.data() + b0 * s.hidden, mine * s.hidden);
        rms_rows<T>(x + b0 * s.hidden, ptr_of<T>(norms[2 * i + 1]), h.data() + b0 * s.hidden,
                    mine, s.hidden, s.eps);
      }
      barrier->wait();
      lin(4 * i + 2, h.data(), gu.data(), 2 * s.I, s.hidden);
      barrier->wait();
      if (mine > 0)
        silu_mul_rows<T>(gu.data() + b0 * 2 * s.I, act.data() + b0 * s.I, mine, s.I);
      barrier->wait();
      lin(4 * i + 3, act.data(), y.data(), s.hidden, s.I);
      barrier->wait();
      if (mine > 0) add_into<T>(x + b0 * s.hidden, y.data() + b0 * s.hidden, mine * s.hidden);
    }
  }
}

// x [B, hidden] through every decoder layer of a decode step (returns the new x). Per layer
// (l): norms[2l], norms[2l + 1] (input / post-attention RMSNorm weights); packed[4l .. 4l + 3]
// and biases (qkv, o, gate/up, down; pack()ed, biases or None) with out_features. cos, sin
// [B, D] at each request's position; the pools [L, slots, KVH, D] take the new K/V at
// write_slots; the KV copy [L, B, KVH, C, D] (float32) at positions; request b attends to
// its first lengths[b] keys. Everything in x's dtype but the copy.
at::Tensor decode_layers(const at::Tensor& x, at::TensorList norms, at::TensorList packed,
                         const c10::List<std::optional<at::Tensor>>& biases,
                         at::IntArrayRef out_features, double eps, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& k_pool, at::Tensor& v_pool,
                         const at::Tensor& write_slots, at::Tensor& k_copy, at::Tensor& v_copy,
                         const at::Tensor& positions, const at::Tensor& lengths, int64_t heads,
                         int64_t kv_heads, double scale) {
  const char* what = "decode_layers";
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows, what,
              ": x must be [B, hidden], 1 to ", kMaxRows, " rows");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, what, ": float32 or bfloat16");
  const int64_t L = static_cast<int64_t>(norms.size()) / 2;
  TORCH_CHECK(L >= 1 && static_cast<int64_t>(norms.size()) == 2 * L &&
                  static_cast<int64_t>(packed.size()) == 4 * L &&
                  static_cast<int64_t>(biases.size()) == 4 * L &&
                  static_cast<int64_t>(out_features.size()) == 4 * L,
              what, ": 2 norms and 4 linears per layer");
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(0) == L && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.scalar_type() == dtype && v_pool.scalar_type() == dtype,
              what, ": the pools must be [L, slots, KVH, D], contiguous, in x's dtype");
  Step s{};
  s.B = x.size(0), s.hidden = x.size(1), s.heads = heads, s.kv_heads = kv_heads;
  s.D = k_pool.size(3), s.L = L, s.slots = k_pool.size(1);
  s.eps = static_cast<float>(eps), s.scale = static_cast<float>(scale);
  TORCH_CHECK(kv_heads == k_pool.size(2) && heads >= kv_heads && heads % kv_heads == 0, what,
              ": heads a multiple of the pools' KV heads");
  TORCH_CHECK(s.D % 32 == 0 && s.D <= 256, what, ": head dim a multiple of 32, <= 256");
  TORCH_CHECK(k_copy.dim() == 5 && k_copy.size(0) == L && k_copy.size(1) == s.B &&
                  k_copy.size(2) == kv_heads && k_copy.size(4) == s.D &&
                  k_copy.sizes() == v_copy.sizes() && k_copy.is_contiguous() &&
                  v_copy.is_contiguous() && k_copy.scalar_type() == at::kFloat &&
                  v_copy.scalar_type() == at::kFloat,
              what, ": the KV copy must be [L, B, KVH, C, D] float32, contiguous");
  s.C = k_copy.size(3);
  for (const at::Tensor* t : {&write_slots, &positions, &lengths})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == s.B && t->scalar_type() == at::kLong &&
                    t->is_contiguous(),
                what, ": write_slots, positions and lengths must be [B] int64");
  s.write = write_slots.data_ptr<int64_t>(), s.pos = positions.data_ptr<int64_t>();
  s.len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < s.B; b++) {
    TORCH_CHECK(s.write[b] >= 0 && s.write[b] < s.slots, what, ": write slot out of range");
    TORCH_CHECK(s.pos[b] >= 0 && s.pos[b] < s.len[b] && s.len[b] <= s.C, what,
                ": position or length out of range");
  }
  TORCH_CHECK(cos.numel() == s.B * s.D && sin.numel() == s.B * s.D &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              what, ": cos and sin [B, D] in x's dtype");
  const int64_t qkv_n = (heads + 2 * kv_heads) * s.D;
  s.I = out_features[2] / 2;
  std::vector<at::Tensor> ns, ps, bs;
  for (int64_t j = 0; j < 2 * L; j++) {
    TORCH_CHECK(norms[j].numel() == s.hidden && norms[j].scalar_type() == dtype, what,
                ": norm weights [hidden] in x's dtype");
    ns.push_back(norms[j].contiguous());
  }
  for (int64_t j = 0; j < 4 * L; j++) {
    const int64_t role = j % 4;
    const int64_t n = role == 0 ? qkv_n : role == 2 ? 2 * s.I : s.hidden;
    const int64_t k = role == 1 ? heads * s.D : role == 3 ? s.I : s.hidden;
    TORCH_CHECK(out_features[j] == n, what, ": linear ", j, " has ", out_features[j],
                " outputs, expected ", n);
    check_packed(packed[j], n, k, dtype, what);
    ps.push_back(packed[j]);
    const std::optional<at::Tensor> bias = biases.get(j);
    at::Tensor b;
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->numel() == n && bias->scalar_type() == dtype, what,
                  ": biases [N] in x's dtype");
      b = bias->contiguous();
    }
    bs.push_back(b);
  }
  at::Tensor out = x.contiguous().clone();
  const at::Tensor c = cos.contiguous(), sn = sin.contiguous();
  if (dtype == at::kFloat) {
    layers<float>(s, out.data_ptr<float>(), ns, ps, bs, c.data_ptr<float>(),
                  sn.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                  k_copy.data_ptr<float>(), v_copy.data_ptr<float>());
  } else {
    layers<uint16_t>(s, bf16_ptr(out), ns, ps, bs, bf16_ptr(c), bf16_ptr(sn), bf16_ptr(k_pool),
                     bf16_ptr(v_pool), k_copy.data_ptr<float>(), v_copy.data_ptr<float>());
  }
  return out;
}

// The panel width this build packs for (skinny.py sizes its checks by it).
int64_t panel_width() { return kPanel; }

// Whether bfloat16 linears run on AMX here (with K a multiple of 32).
bool amx_in_use() {
#if BATON_AVX512
  return amx_ready();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(baton, m) {
  m.def("pack(Tensor w) -> Tensor");
  m.def("panel_width() -> int");
  m.def("amx_in_use() -> bool");
  m.def("skinny_linear(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor lengths) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor qkv, Tensor cos, Tensor sin, int heads) -> Tensor");
  m.def(
      "decode_layers(Tensor x, Tensor[] norms, Tensor[] packed, Tensor?[] biases, "
      "int[] out_features, float eps, Tensor cos, Tensor sin, Tensor(a!) k_pool, "
      "Tensor(b!) v_pool, Tensor write_slots, Tensor(c!) k_copy, Tensor(d!) v_copy, "
      "Tensor positions, Tensor lengths, int heads, int kv_heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton, CatchAll, m) {
  m.impl("panel_width", &panel_width);
  m.impl("amx_in_use", &amx_in_use);
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("pack", &pack);
  m.impl("skinny_linear", &skinny_linear);
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
  m.impl("decode_layers", &decode_layers);
}
