// looprl's row-invariant CPU matmul, an XLA FFI custom call (looprl/kernels/ordered_gemm.py).
//
// The numerics, fixed by this program and by nothing else:
//   out[m, n] = ((c_0 + c_1) + c_2) + ... + c_{J-1},   J = ceil(K / KC),
//   c_j = fma(x[m, e-1], w[e-1, n], ... fma(x[m, s+1], w[s+1, n], fma(x[m, s], w[s, n], -0.0))),
// over the chunk's k = s .. e-1 (s = j * KC, e = min(K, s + KC)) in order.  Every value
// that enters an output is computed from row m of x and column n of w alone, by that chain:
// no code path adds two partial sums of one chunk, reorders k, splits a chunk, or lets the
// number of rows M, a row's position, the column blocking, the task split or the thread count
// choose the arithmetic.  Those only decide where an accumulator lives (a register, the `acc`
// buffer of few_rows_block, or `out` between chunks: fp32 stores and loads are exact) and
// which of the identical code paths runs a row (few_rows_block for M <= 2, micro<R> for R
// rows of a micro-panel).  fma and + are correctly rounded (IEEE 754), so the vector
// `vfmadd`/`vaddps` and the scalar std::fma / + give the same bits; the file is compiled with
// -ffp-contract=off (no other fused operation is formed) and without -ffast-math (nothing is
// reassociated).  A bf16 weight is widened to fp32 (exact) as it is read.  Subnormals: every
// task runs with flush-to-zero and denormals-are-zero set (MXCSR, restored after), the state XLA
// CPU's own threads run in, so a subnormal input counts as zero and a subnormal result becomes
// zero whichever thread runs the task (reference_matmul flushes the same way).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOOPRL_AVX2 1
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#define LOOPRL_MXCSR 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t MR = 6;    // rows of a micro-panel (6 x 2 accumulator vectors on AVX2)
constexpr int64_t NR = 16;   // columns of a panel
constexpr int64_t KC = 256;  // k chunk: a packed [KC, NR] weight panel is 16 KB (L1)
constexpr int64_t NC = 256;  // fewest columns of a task above FEW_ROWS rows (task_width)
constexpr int64_t NC_WIDE = 2048;  // most columns of such a task: [KC, NC_WIDE] packed is 2 MB
constexpr int64_t TASKS_PER_THREAD = 4;  // ... unless threads then get fewer tasks than this
constexpr int64_t NC_FEW_ROWS = 1024;  // up to FEW_ROWS rows: longer contiguous weight reads
constexpr int64_t FEW_ROWS = 48;
constexpr int64_t STREAM_ROWS = 2;  // up to here: few_rows_block
constexpr int64_t SMALL_ROWS = 16;  // up to here (above STREAM_ROWS): small_rows_block
// up to MR rows: 64 KB runs of a weight row (at 4096 columns the M = 1 lm_head ran at
// 1.3-1.6x stock, at 16384 about 1.2x: 2026-12-04, one thread)
constexpr int64_t NC_ONE_STEP = 16384;
constexpr int64_t PACK_COLS = 1024;  // small_rows_block's packed blocks: [KC, 1024] is 1 MB
constexpr int64_t IN_PLACE_MAX_N = 8192;  // up to here small_rows_block reads fp32 in place
constexpr int64_t MC = 96;   // rows of a packed x block: [MC, KC] is 96 KB (L2)

inline float widen_bf16(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The d values at element `at` of base as fp32: in place, or (bf16) widened into `wide`.
inline const float* as_fp32(const void* base, bool bf16, int64_t at, int64_t d, float* wide) {
  if (!bf16) return static_cast<const float*>(base) + at;
  const uint16_t* src = static_cast<const uint16_t*>(base) + at;
  for (int64_t e = 0; e < d; ++e) wide[e] = widen_bf16(src[e]);
  return wide;
}

#ifdef LOOPRL_AVX2
// Row r's two accumulator vectors c<r>0, c<r>1 into c[r * ldc : + 16]: stored (first) or added
// to what is there (micro and chain16).
#define LOOPRL_STORE(r)                                                              \
  if constexpr (R > r) {                                                             \
    float* cr = c + r * ldc;                                                         \
    if (!first) {                                                                    \
      c##r##0 = _mm256_add_ps(_mm256_loadu_ps(cr), c##r##0);                         \
      c##r##1 = _mm256_add_ps(_mm256_loadu_ps(cr + 8), c##r##1);                     \
    }                                                                                \
    _mm256_storeu_ps(cr, c##r##0);                                                   \
    _mm256_storeu_ps(cr + 8, c##r##1);                                               \
  }
#endif

// One chunk's chain c_j for R rows x NR columns: x panel xp is [kc][MR] (row r at
// xp[k * MR + r]), weight panel wp is [kc][NR] with row stride ldw (a packed panel: NR; the
// weight itself: N); c points at an [R, NR] tile of out (row stride ldc), which receives c_0
// on the first chunk and out + c_j after it.
template <int R>
void micro(const float* xp, const float* wp, int64_t ldw, int64_t kc, float* c, int64_t ldc,
           bool first) {
#ifdef LOOPRL_AVX2
  // named accumulators (an array of __m256 is spilled to the stack by GCC at every k)
  const __m256 z = _mm256_set1_ps(-0.0f);
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z;
  __m256 c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
#define LOOPRL_ROW(r)                                                  \
  if constexpr (R > r) {                                               \
    const __m256 b = _mm256_broadcast_ss(xp + k * MR + r);             \
    c##r##0 = _mm256_fmadd_ps(b, w0, c##r##0);                         \
    c##r##1 = _mm256_fmadd_ps(b, w1, c##r##1);                         \
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_loadu_ps(wp + k * ldw);
    const __m256 w1 = _mm256_loadu_ps(wp + k * ldw + 8);
    LOOPRL_ROW(0) LOOPRL_ROW(1) LOOPRL_ROW(2) LOOPRL_ROW(3) LOOPRL_ROW(4) LOOPRL_ROW(5)
  }
#undef LOOPRL_ROW
  LOOPRL_STORE(0) LOOPRL_STORE(1) LOOPRL_STORE(2) LOOPRL_STORE(3) LOOPRL_STORE(4)
  LOOPRL_STORE(5)
#else
  float acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = -0.0f;
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = std::fma(xp[k * MR + r], wp[k * ldw + j], acc[r][j]);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) c[r * ldc + j] = first ? acc[r][j] : c[r * ldc + j] + acc[r][j];
#endif
}

using MicroFn = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t, bool);
constexpr MicroFn kMicro[MR + 1] = {nullptr,   micro<1>, micro<2>, micro<3>,
                                    micro<4>, micro<5>, micro<6>};

struct Problem {
  const float* x;     // [M, K]
  const void* w;      // [K, N], fp32 or bf16 bits
  bool w_bf16;
  float* out;         // [M, N]
  int64_t m, k, n;
};

// A 64-byte aligned scratch buffer of this thread (slot: which one), reused across calls, so a
// batched call of many small products allocates nothing per product.
float* scratch(int slot, int64_t count) {
  thread_local std::vector<float> buffers[8];
  std::vector<float>& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < count + 16) b.resize(count + 16);
  auto p = reinterpret_cast<uintptr_t>(b.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

// Runs micro<R> on row panels q (x at xbuf + q * MR * kc, output rows start[q] .. start[q] +
// rows[q] - 1) for one 16-column strip (columns [c0, c0 + cols), cols <= NR) whose [kc][NR]
// weight panel wp has row stride ldw.
void strip_panels(const Problem& p, const float* xbuf, int64_t kc, const int64_t* start,
                  const int64_t* rows, int64_t panels, const float* wp, int64_t ldw, int64_t c0,
                  int64_t cols, bool first) {
  float tile[MR * NR];
  for (int64_t q = 0; q < panels; ++q) {
    float* c = p.out + start[q] * p.n + c0;
    const int nr = static_cast<int>(rows[q]);
    if (cols == NR) {
      kMicro[nr](xbuf + q * MR * kc, wp, ldw, kc, c, p.n, first);
    } else {  // a partial last strip runs on a full-width copy of its tile
      for (int r = 0; r < nr; ++r)
        for (int64_t j = 0; j < NR; ++j) tile[r * NR + j] = j < cols ? c[r * p.n + j] : 0.f;
      kMicro[nr](xbuf + q * MR * kc, wp, NR, kc, tile, NR, first);
      for (int r = 0; r < nr; ++r) std::memcpy(c + r * p.n, tile + r * NR, cols * sizeof(float));
    }
  }
}

// w[k0:k0+kc, b0:b0+bw] packed as strips [strip][k][NR] (zero past column b0 + bw), each weight
// row's bw values read in one contiguous run.
void pack_strips(const Problem& p, int64_t k0, int64_t kc, int64_t b0, int64_t bw, float* wbuf) {
  const int64_t strips = (bw + NR - 1) / NR;
  for (int64_t kk = 0; kk < kc; ++kk) {
    const int64_t row = (k0 + kk) * p.n + b0;
    int64_t q = 0;
#ifdef LOOPRL_AVX2
    if (!p.w_bf16) {  // whole fp32 strips: two vector copies (a memcpy call each cost more)
      const float* src = static_cast<const float*>(p.w) + row;
      for (; (q + 1) * NR <= bw; ++q) {
        float* d = wbuf + (q * kc + kk) * NR;
        _mm256_storeu_ps(d, _mm256_loadu_ps(src + q * NR));
        _mm256_storeu_ps(d + 8, _mm256_loadu_ps(src + q * NR + 8));
      }
    }
#endif
    for (; q < strips; ++q) {
      const int64_t cols = std::min(NR, bw - q * NR);
      float* d = wbuf + (q * kc + kk) * NR;
      if (p.w_bf16) {
        const uint16_t* src = static_cast<const uint16_t*>(p.w) + row + q * NR;
        for (int64_t j = 0; j < cols; ++j) d[j] = widen_bf16(src[j]);
      } else {
        std::memcpy(d, static_cast<const float*>(p.w) + row + q * NR, cols * sizeof(float));
      }
      for (int64_t j = cols; j < NR; ++j) d[j] = 0.0f;
    }
  }
}

// Columns [n0, n0 + nc) of the output, rows [r0, r1), every k chunk.
void column_block(const Problem& p, int64_t r0, int64_t r1, int64_t n0, int64_t width) {
  const int64_t nc = std::min(width, p.n - n0);
  float* wbuf = scratch(0, KC * ((nc + NR - 1) / NR) * NR);
  float* xbuf = scratch(1, MC * KC);
  int64_t start[MC / MR], rows[MC / MR];
  for (int64_t k0 = 0; k0 < p.k; k0 += KC) {
    const int64_t kc = std::min(KC, p.k - k0);
    // a weight row is read whole (nc contiguous values) before the next, so the reads stream
    pack_strips(p, k0, kc, n0, nc, wbuf);
    for (int64_t m0 = r0; m0 < r1; m0 += MC) {
      const int64_t mc = std::min(MC, r1 - m0);
      const int64_t panels = (mc + MR - 1) / MR;
      // pack x[m0:m0+mc, k0:k0+kc] as micro-panels [panel][k][MR]
      for (int64_t q = 0; q < panels; ++q) {
        start[q] = m0 + q * MR;
        rows[q] = std::min(MR, mc - q * MR);
        float* dst = xbuf + q * MR * kc;
        for (int64_t r = 0; r < rows[q]; ++r) {
          const float* s = p.x + (start[q] + r) * p.k + k0;
          for (int64_t kk = 0; kk < kc; ++kk) dst[kk * MR + r] = s[kk];
        }
      }
      for (int64_t c0 = n0; c0 < n0 + nc; c0 += NR)
        strip_panels(p, xbuf, kc, start, rows, panels, wbuf + (c0 - n0) * kc, NR, c0,
                     std::min(NR, n0 + nc - c0), k0 == 0);
    }
  }
}

// acc[j] = fma(b, w[j], acc[j]) for j < n: the same fma per element, vector or scalar.
inline void axpy_fma(float b, const float* w, float* acc, int64_t n) {
  int64_t j = 0;
#ifdef LOOPRL_AVX2
  const __m256 vb = _mm256_set1_ps(b);
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(acc + j,
                     _mm256_fmadd_ps(vb, _mm256_loadu_ps(w + j), _mm256_loadu_ps(acc + j)));
#endif
  for (; j < n; ++j) acc[j] = std::fma(b, w[j], acc[j]);
}

// Four axpy_fma calls in a row, k, k + 1, k + 2, k + 3 (b[i] with weight row w[i]), fused per
// element: acc[j] = fma(b[3], w[3][j], fma(b[2], w[2][j], fma(b[1], w[1][j], fma(b[0], w[0][j],
// acc[j])))), the same four fmas in the same order as the four calls, with acc read and written
// once instead of four times and four weight rows streamed at once.
inline void axpy4_fma(const float* b, const float* const* w, float* acc, int64_t n) {
  int64_t j = 0;
#ifdef LOOPRL_AVX2
  const __m256 b0 = _mm256_set1_ps(b[0]), b1 = _mm256_set1_ps(b[1]);
  const __m256 b2 = _mm256_set1_ps(b[2]), b3 = _mm256_set1_ps(b[3]);
  for (; j + 8 <= n; j += 8) {
    __m256 a = _mm256_loadu_ps(acc + j);
    a = _mm256_fmadd_ps(b0, _mm256_loadu_ps(w[0] + j), a);
    a = _mm256_fmadd_ps(b1, _mm256_loadu_ps(w[1] + j), a);
    a = _mm256_fmadd_ps(b2, _mm256_loadu_ps(w[2] + j), a);
    a = _mm256_fmadd_ps(b3, _mm256_loadu_ps(w[3] + j), a);
    _mm256_storeu_ps(acc + j, a);
  }
#endif
  for (; j < n; ++j)
    acc[j] = std::fma(b[3], w[3][j], std::fma(b[2], w[2][j],
                      std::fma(b[1], w[1][j], std::fma(b[0], w[0][j], acc[j]))));
}

// Up to STREAM_ROWS rows (a decode step's matmul): no packing; for each k the weight row's columns
// [n0, n0 + nc) are read in one contiguous sweep and fma'd into per-row accumulators held in a
// [rows, nc] buffer, so the weight streams from memory once, in order; four k at a time
// (axpy4_fma: the accumulators read and written once per four fmas, four weight rows in flight;
// one thread, Ouro-1.4B fp32 gate/up at 1 row 1.36x -> 0.76x stock, lm_head 1.2-1.35x -> 0.84x,
// 2026-12-04, AVX-512 host). The same chain per output as column_block: every chunk from -0.0,
// k in order, chunks added in order.
void few_rows_block(const Problem& p, int64_t n0, int64_t width) {
  const int64_t nc = std::min(width, p.n - n0);
  float* acc = scratch(2, p.m * nc);
  float* wide = scratch(3, 4 * nc);
  for (int64_t k0 = 0; k0 < p.k; k0 += KC) {
    const int64_t kc = std::min(KC, p.k - k0);
    std::fill(acc, acc + p.m * nc, -0.0f);
    int64_t kk = 0;
    for (; kk + 4 <= kc; kk += 4) {  // four weight rows at a time: axpy4_fma
      const float* w4[4];
      for (int i = 0; i < 4; ++i)
        w4[i] = as_fp32(p.w, p.w_bf16, (k0 + kk + i) * p.n + n0, nc, wide + i * nc);
      for (int64_t r = 0; r < p.m; ++r)
        axpy4_fma(p.x + r * p.k + k0 + kk, w4, acc + r * nc, nc);
    }
    for (; kk < kc; ++kk) {
      const float* w = as_fp32(p.w, p.w_bf16, (k0 + kk) * p.n + n0, nc, wide);
      for (int64_t r = 0; r < p.m; ++r) axpy_fma(p.x[r * p.k + k0 + kk], w, acc + r * nc, nc);
    }
    for (int64_t r = 0; r < p.m; ++r) {
      float* o = p.out + r * p.n + n0;
      const float* a = acc + r * nc;
      if (k0 == 0) {
        std::memcpy(o, a, nc * sizeof(float));
      } else {
        for (int64_t j = 0; j < nc; ++j) o[j] = o[j] + a[j];
      }
    }
  }
}

// The columns a task covers (module doc of ordered_gemm.py): up to FEW_ROWS rows, longer for
// fewer rows; above, the widest of NC_WIDE, NC_WIDE / 2, ..., NC that still gives each of
// `threads` threads TASKS_PER_THREAD tasks of the `row_blocks` row blocks. column_block packs its x
// rows once per task and k chunk, so a task of NC columns packed x N / 256 times (22 times for
// the 5632-column gate/up weight): 12 % of the kernel's time at 1000-4096 rows (perf, one
// thread, 2026-12-04), against 3 % at 1024 columns. Side by side, one thread, gate/up fp32 per
// 1000 rows: 256 columns 250-258 ms at M = 1000, 272-274 ms at M = 4096; 1024: 235-242 / 250;
// 2048: 231 / 241. Which task covers an output never changes its chain (module header).
int64_t task_width(int64_t m, int64_t n, int64_t row_blocks, int64_t threads) {
  if (m <= MR) return NC_ONE_STEP;
  if (m <= FEW_ROWS) return NC_FEW_ROWS;
  int64_t w = NC_WIDE;
  while (w > NC && row_blocks * ((n + w - 1) / w) < TASKS_PER_THREAD * threads) w /= 2;
  return w;
}

// STREAM_ROWS + 1 .. SMALL_ROWS rows (a decode step of 3-16 rows). For each k chunk, x is
// packed into row panels of at most MR rows, balanced (7 rows: 4 + 3, 8: 4 + 4, 13: 5 + 4 + 4),
// and every row panel runs micro<R> on a 16-column strip of the weight while it is in L1. An
// fp32 weight of at most IN_PLACE_MAX_N columns is read in place, strip by strip (no packing);
// a wider one (the lm_head), or a bf16 one, is packed PACK_COLS columns at a time from
// contiguous row runs first (reading 16-column strips of a 49152-wide weight in place, 256 rows
// 192 KB apart, ran 3-5 rows at 1.4-1.8x stock; packed, 0.7x). The same chain per output as
// column_block (the same micro<R>, chunks in order): only where the operands are read from
// differs.
void small_rows_block(const Problem& p, int64_t n0, int64_t width) {
  const int64_t nc = std::min(width, p.n - n0);
  const int64_t panels = (p.m + MR - 1) / MR;
  int64_t start[SMALL_ROWS / MR + 2], rows[SMALL_ROWS / MR + 2];
  for (int64_t q = 0, at = 0; q < panels; ++q) {
    rows[q] = p.m / panels + (q < p.m % panels ? 1 : 0);
    start[q] = at;
    at += rows[q];
  }
  const bool in_place = !p.w_bf16 && p.n <= IN_PLACE_MAX_N;
  float* xbuf = scratch(1, panels * MR * KC);
  float* wbuf = scratch(0, KC * PACK_COLS);
  for (int64_t k0 = 0; k0 < p.k; k0 += KC) {
    const int64_t kc = std::min(KC, p.k - k0);
    const bool first = k0 == 0;
    for (int64_t q = 0; q < panels; ++q)
      for (int64_t r = 0; r < rows[q]; ++r) {
        const float* s = p.x + (start[q] + r) * p.k + k0;
        float* d = xbuf + q * MR * kc + r;
        for (int64_t kk = 0; kk < kc; ++kk) d[kk * MR] = s[kk];
      }
    for (int64_t b0 = n0; b0 < n0 + nc; b0 += PACK_COLS) {
      const int64_t bw = std::min(PACK_COLS, n0 + nc - b0);
      const bool packed = !in_place || bw % NR != 0;
      if (packed) pack_strips(p, k0, kc, b0, bw, wbuf);
      for (int64_t c0 = b0; c0 < b0 + bw; c0 += NR) {
        const int64_t cols = std::min(NR, b0 + bw - c0);
        const float* wp = packed ? wbuf + (c0 - b0) * kc
                                 : static_cast<const float*>(p.w) + k0 * p.n + c0;
        strip_panels(p, xbuf, kc, start, rows, panels, wp, packed ? NR : p.n, c0, cols, first);
      }
    }
  }
}

// Rows of a row block above SMALL_ROWS: the M rows in ceil(M / ROW_BLOCK) blocks of equal size
// rounded up to a multiple of MC (the last one shorter). A call's tasks run row block by row
// block (its column blocks inside), so a row block of x is read from memory once and then from
// cache by every column block, rather than the whole of x once per column block, and the weight
// block a task packs per k chunk serves up to ROW_BLOCK rows. At 2048-4096 rows x outgrows the
// cache (Ouro-1.4B fp32 and bf16 weights, one thread, AVX-512 host with a 32 MB L3, 4096 rows:
// all M rows as one block 1.26-1.36x stock; row blocks of 384 / 768 / 1024 rows 1.12-1.18 /
// 1.10-1.21 / 1.15-1.31x, 2026-12-04, noisy). The blocking only decides which rows a task covers:
// not a bit changes.
constexpr int64_t ROW_BLOCK = 8 * MC;
int64_t row_block(int64_t m) {
  const int64_t blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
  return ((m + blocks - 1) / blocks + MC - 1) / MC * MC;
}

// Columns [n0, n0 + width) of one product, rows [r0, r1) (all M rows up to SMALL_ROWS): the path
// is chosen by M alone.
void product_columns(const Problem& p, int64_t r0, int64_t r1, int64_t n0, int64_t width) {
  if (p.m <= STREAM_ROWS)
    few_rows_block(p, n0, width);
  else if (p.m <= SMALL_ROWS)
    small_rows_block(p, n0, width);
  else
    column_block(p, r0, r1, n0, width);
}

// Every output of one product as tasks of (row block, column block), row blocks outer; `run`
// gets the task count and the task body.
template <typename Run>
void product_tasks(const Problem& p, int64_t threads, Run&& run) {
  const int64_t rows = p.m <= SMALL_ROWS ? p.m : row_block(p.m);
  const int64_t row_blocks = (p.m + rows - 1) / rows;
  const int64_t width = task_width(p.m, p.n, row_blocks, threads);
  const int64_t blocks = (p.n + width - 1) / width;
  run(row_blocks * blocks, [&p, width, blocks, rows](int64_t t) {
    const int64_t r0 = t / blocks * rows;
    product_columns(p, r0, std::min(p.m, r0 + rows), t % blocks * width, width);
  });
}

// `tasks` calls of `run(t)` shared between this thread and up to pool.num_threads() - 1 pool
// threads; returns when all have run. The state is shared-owned, so a pool thread that starts
// after the last task finds none and touches nothing of the caller's.
struct Shared {
  std::function<void(int64_t)> run;
  int64_t tasks;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;
};

// Flush-to-zero and denormals-are-zero for the scope (module header), the caller's state after.
struct FlushSubnormals {
#ifdef LOOPRL_MXCSR
  unsigned int saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040u); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushSubnormals() { _mm_setcsr(saved); }
#endif
};

void drain(const std::shared_ptr<Shared>& s) {
  FlushSubnormals flush;
  for (;;) {
    const int64_t t = s->next.fetch_add(1);
    if (t >= s->tasks) return;
    s->run(t);
    std::lock_guard<std::mutex> lock(s->mu);
    if (++s->done == s->tasks) s->cv.notify_all();
  }
}

void run_tasks(ffi::ThreadPool& pool, int64_t tasks, std::function<void(int64_t)> run) {
  auto s = std::make_shared<Shared>();
  s->run = std::move(run);
  s->tasks = tasks;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([s] { drain(s); });
  drain(s);
  std::unique_lock<std::mutex> lock(s->mu);
  s->cv.wait(lock, [&] { return s->done == s->tasks; });
}

// One product on XLA's pool (OrderedMatmul, OrderedMatmulLayer): an empty output is done, a
// zero-length contraction is -0.0 (every chain's start).
ffi::Error run_product(ffi::ThreadPool& pool, const Problem& p) {
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {
    std::fill(p.out, p.out + p.m * p.n, -0.0f);
    return ffi::Error::Success();
  }
  product_tasks(p, pool.num_threads(), [&pool](int64_t tasks,
                                              std::function<void(int64_t)> one) {
    run_tasks(pool, tasks, std::move(one));
  });
  return ffi::Error::Success();
}

ffi::Error OrderedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                         ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("looprl_ordered_matmul: expected x [M, K] and w [K, N]");
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if (!bf16 && w.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("looprl_ordered_matmul: w must be float32 or bfloat16");
  return run_product(pool, {x.typed_data(), w.untyped_data(), bf16, out->typed_data(), xd[0],
                            xd[1], wd[1]});
}

// x @ w[layer] for a stack w [L, K, N]: layer `layer` read in place (the layer loop's slice of
// the stack would otherwise be a copy of the weight made for the call), the same values, so
// OrderedMatmul's bits. A layer outside [0, L) fails the call.
ffi::Error OrderedMatmulLayer(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1] || layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "looprl_ordered_matmul_layer: expected x [M, K], w [L, K, N] and a layer index");
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if (!bf16 && w.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("looprl_ordered_matmul_layer: w must be float32 or "
                                       "bfloat16");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0])
    return ffi::Error::InvalidArgument("looprl_ordered_matmul_layer: layer index outside the "
                                       "stack");
  const char* base = static_cast<const char*>(w.untyped_data());
  const void* wl = base + l * wd[1] * wd[2] * (bf16 ? 2 : 4);
  return run_product(pool, {x.typed_data(), wl, bf16, out->typed_data(), xd[0], xd[1], wd[2]});
}

// Z independent products x[z] @ w[z] (TRANSPOSED: x[z] @ w[z]^T, w[z] given as [N, K], copied
// to [K, N] first: a copy moves no bits), one task per z, each product exactly as a single
// call of that shape computes it: the same numerics per output, whatever Z.
template <bool TRANSPOSED>
ffi::Error OrderedBatchedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 3 || wd.size() != 3 || xd[0] != wd[0] ||
      xd[2] != wd[TRANSPOSED ? 2 : 1])
    return ffi::Error::InvalidArgument(
        "looprl_ordered_batched_matmul: expected x [Z, M, K] and w [Z, K, N] ([Z, N, K] "
        "transposed)");
  const int64_t z = xd[0], m = xd[1], k = xd[2], n = wd[TRANSPOSED ? 1 : 2];
  const float* xs = x.typed_data();
  const float* ws = w.typed_data();
  float* os = out->typed_data();
  if (z == 0 || m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(os, os + z * m * n, -0.0f);
    return ffi::Error::Success();
  }
  run_tasks(pool, z, [=](int64_t b) {
    const float* wb = ws + b * k * n;
    if (TRANSPOSED) {
      float* t = scratch(4, k * n);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < k; ++j) t[j * n + i] = wb[i * k + j];
      wb = t;
    }
    const Problem p{xs + b * m * k, wb, false, os + b * m * n, m, k, n};
    product_tasks(p, 1, [](int64_t tasks, const std::function<void(int64_t)>& one) {
      for (int64_t t = 0; t < tasks; ++t) one(t);
    });
  });
  return ffi::Error::Success();
}

// ---- Attention's two products, the KV cache read in place (kernels._attention_cpu_impl) ----
//
// One query tile of M rows: q [M, H, R, D] fp32 (D = head dim), head h reading kv head
// h / (H / J). Row m's keys (values alike) are slot `slot` of the cache [N, B, S, J, D] at
// batch row rows[m], with the window win [M, C, J, D] written over slots [w0, w0 + C) (w0
// clamped to [0, S - C], as XLA's dynamic_update_slice clamps): what the layer's
// dynamic_update_slice of the slot would hold, read without making it. Cache and window are
// fp32, or bf16 widened exactly as read. The key axis is taken in blocks of KEY_BLOCK rotated
// slots: rotated slot t of row m holds key min((t + offset[m]) mod Sp, S - 1), Sp the mask's
// padded key axis (a multiple of KEY_BLOCK). Only the first n blocks are computed (n: the
// tile's live blocks, from the caller).
//   scores: out[m, h, r, j * 128 + s] = ordered_matmul's output for M = R, K = D, N = 128 on
//     q[m, h] and the block's keys (D in KC-chunks, each an fma chain from -0.0 in order, chunks
//     added in order); +0.0 in the slots of blocks >= n. Rotated slots at or past span[m] (no
//     query of row m sees them: the caller masks their scores) are computed only as far as
//     the 16-slot panel holding slot span[m] - 1 reaches, +0.0 after it.
//   values: out[m, h, r, d] = ((-0.0 + c_0) + c_1) + ... + c_{n-1}, c_j the fma chain in slot
//     order from -0.0 of p[m, h, r, j * 128 + s] * value[d] over the block's 128 slots
//     (ordered_matmul with M = R, K = 128, N = D: one chunk), the adds in block order. The
//     slots at or past span[m] are read only where that can change a bit (attention_values).
// These are the operations kernels.py's XLA-op form feeds to ordered_batched_matmul after
// gathering the rotated blocks (one product per (m, h) and block), so the bits are the same;
// only no K/V block, slot or sub-batch is copied out of the cache first. Every value of
// (m, h, r) comes from row m's keys and row r of its queries (or probabilities) alone.
constexpr int64_t KEY_BLOCK = 128;
constexpr int64_t RB = 4;  // rows of a register block: 4 x 2 accumulator vectors

// c[r, col:col+16] for r < R: the fma chain over t < len from -0.0 of a[r * lda + t] *
// brow[t][col:col+16], stored (first) or added to c (c + chain).
template <int R>
void chain16(const float* a, int64_t lda, const float* const* brow, int64_t col, int64_t len,
             float* c, int64_t ldc, bool first) {
#ifdef LOOPRL_AVX2
  const __m256 z = _mm256_set1_ps(-0.0f);
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z;
  c += col;
#define LOOPRL_ROW(r)                                                  \
  if constexpr (R > r) {                                               \
    const __m256 b = _mm256_broadcast_ss(a + r * lda + t);             \
    c##r##0 = _mm256_fmadd_ps(b, w0, c##r##0);                         \
    c##r##1 = _mm256_fmadd_ps(b, w1, c##r##1);                         \
  }
  for (int64_t t = 0; t < len; ++t) {
    const __m256 w0 = _mm256_loadu_ps(brow[t] + col);
    const __m256 w1 = _mm256_loadu_ps(brow[t] + col + 8);
    LOOPRL_ROW(0) LOOPRL_ROW(1) LOOPRL_ROW(2) LOOPRL_ROW(3)
  }
#undef LOOPRL_ROW
  LOOPRL_STORE(0) LOOPRL_STORE(1) LOOPRL_STORE(2) LOOPRL_STORE(3)
#else
  for (int r = 0; r < R; ++r)
    for (int64_t j = col; j < col + 16; ++j) {
      float acc = -0.0f;
      for (int64_t t = 0; t < len; ++t) acc = std::fma(a[r * lda + t], brow[t][j], acc);
      c[r * ldc + j] = first ? acc : c[r * ldc + j] + acc;
    }
#endif
}

// One row, columns [col, col + 8 NV_): chain16's chain with NV_ independent accumulator
// vectors, so that a single query row (a decode step) keeps the fma pipeline full.
template <int NV_>
void chain_row(const float* a, const float* const* brow, int64_t col, int64_t len, float* c,
               bool first) {
#ifdef LOOPRL_AVX2
  const __m256 z = _mm256_set1_ps(-0.0f);
  __m256 c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z, c6 = z, c7 = z;
#define LOOPRL_V(i) \
  if constexpr (NV_ > i) c##i = _mm256_fmadd_ps(b, _mm256_loadu_ps(w + 8 * i), c##i);
  for (int64_t t = 0; t < len; ++t) {
    const __m256 b = _mm256_broadcast_ss(a + t);
    const float* w = brow[t] + col;
    LOOPRL_V(0) LOOPRL_V(1) LOOPRL_V(2) LOOPRL_V(3) LOOPRL_V(4) LOOPRL_V(5) LOOPRL_V(6)
    LOOPRL_V(7)
  }
#undef LOOPRL_V
#define LOOPRL_STORE_V(i)                                                              \
  if constexpr (NV_ > i) {                                                           \
    float* ci = c + col + 8 * i;                                                     \
    if (!first) c##i = _mm256_add_ps(_mm256_loadu_ps(ci), c##i);                     \
    _mm256_storeu_ps(ci, c##i);                                                      \
  }
  LOOPRL_STORE_V(0) LOOPRL_STORE_V(1) LOOPRL_STORE_V(2) LOOPRL_STORE_V(3) LOOPRL_STORE_V(4)
  LOOPRL_STORE_V(5) LOOPRL_STORE_V(6) LOOPRL_STORE_V(7)
#undef LOOPRL_STORE_V
#else
  for (int64_t j = col; j < col + 8 * NV_; ++j) {
    float acc = -0.0f;
    for (int64_t t = 0; t < len; ++t) acc = std::fma(a[t], brow[t][j], acc);
    c[j] = first ? acc : c[j] + acc;
  }
#endif
}

#undef LOOPRL_STORE_V

using Chain16Fn = void (*)(const float*, int64_t, const float* const*, int64_t, int64_t, float*,
                           int64_t, bool);
constexpr Chain16Fn kChain16[RB + 1] = {nullptr, chain16<1>, chain16<2>, chain16<3>, chain16<4>};

// Columns [col, cols) of chain16's outputs, by scalar fma (the same chain per output).
__attribute__((noinline)) void chain_tail(const float* a, int64_t lda, int rows,
                                          const float* const* brow, int64_t col, int64_t cols,
                                          int64_t len, float* c, int64_t ldc, bool first) {
  for (int r = 0; r < rows; ++r)
    for (int64_t j = col; j < cols; ++j) {
      float acc = -0.0f;
      for (int64_t t = 0; t < len; ++t) acc = std::fma(a[r * lda + t], brow[t][j], acc);
      c[r * ldc + j] = first ? acc : c[r * ldc + j] + acc;
    }
}

// c[r, 0:cols] for r < rows: for each output the fma chain over t < len from -0.0 of
// a[r * lda + t] * brow[t][col], stored (first) or added to c. Register blocks of 4 rows x 16
// columns, a single row in blocks of 64, 32 or 16 columns, the rest by scalar fma: the same
// chain per output on every path.
void chain_product(const float* a, int64_t lda, int64_t rows, const float* const* brow,
                   int64_t cols, int64_t len, float* c, int64_t ldc, bool first) {
  for (int64_t r0 = 0; r0 < rows; r0 += RB) {
    const int rb = static_cast<int>(std::min(RB, rows - r0));
    const float* ar = a + r0 * lda;
    float* cr = c + r0 * ldc;
    int64_t j = 0;
    if (rb == 1) {
      for (; j + 64 <= cols; j += 64) chain_row<8>(ar, brow, j, len, cr, first);
      if (j + 32 <= cols) chain_row<4>(ar, brow, j, len, cr, first), j += 32;
    }
    for (; j + 16 <= cols; j += 16) kChain16[rb](ar, lda, brow, j, len, cr, ldc, first);
    if (j < cols) chain_tail(ar, lda, rb, brow, j, cols, len, cr, ldc, first);
  }
}

struct AttentionProblem {
  int64_t m, h, r, sp;           // rows, heads, query rows, Sp
  int64_t n, b, s, j, d;         // the cache [N, B, S, J, D]
  int64_t c, w0, slot, live;     // window length, its start (clamped), slot, live blocks
  const void* cache;
  bool cache_bf16;
  const void* win;               // [M, C, J, D]
  bool win_bf16;
  const int32_t* rows;           // [M]: batch row of the cache
  const int32_t* offset;         // [M]
  const int32_t* span;           // [M]: rotated slots any query of the row sees
};

// Where row m's key (or value) at (unclipped) slot `slot` lives: the window or the cache, and
// the element offset of its kv head 0 (kv head c is c * D further on).
struct SlotSource {
  const void* base;
  bool bf16;
  int64_t at;
};

inline SlotSource slot_source(const AttentionProblem& p, int64_t m, int64_t slot) {
  slot = std::min(slot, p.s - 1);
  if (slot >= p.w0 && slot < p.w0 + p.c)
    return {p.win, p.win_bf16, (m * p.c + (slot - p.w0)) * p.j * p.d};
  return {p.cache, p.cache_bf16, ((p.slot * p.b + p.rows[m]) * p.s + slot) * p.j * p.d};
}

// Row m's keys (or values) of head h in rotated slot order (the comment above), as fp32.
struct KeyReader {
  const AttentionProblem& p;
  int64_t m, kv_at;  // kv_at: element offset of head h's kv head within a slot

  KeyReader(const AttentionProblem& p_, int64_t m_, int64_t h)
      : p(p_), m(m_), kv_at(h / (p_.h / p_.j) * p_.d) {}
  // The slot of rotated slot blk * KEY_BLOCK (then step with `next`).
  int64_t first(int64_t blk) const {
    int64_t slot = (blk * KEY_BLOCK + p.offset[m]) % p.sp;
    return slot < 0 ? slot + p.sp : slot;
  }
  int64_t next(int64_t slot) const { return slot + 1 == p.sp ? 0 : slot + 1; }
  // Key at (unclipped) slot: in place, or widened into `wide` (bf16).
  const float* at(int64_t slot, float* wide) const {
    const SlotSource src = slot_source(p, m, slot);
    return as_fp32(src.base, src.bf16, src.at + kv_at, p.d, wide);
  }
};

// dst[e * ld + i] = src[i][e] for i < 8, e < d (an exact copy; AVX2: 8 x 8 transposes).
void transpose_rows8(const float* const* src, int64_t d, float* dst, int64_t ld) {
  int64_t e = 0;
#ifdef LOOPRL_AVX2
  for (; e + 8 <= d; e += 8) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src[i] + e);
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_ps(dst + (e + i) * ld, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
      _mm256_storeu_ps(dst + (e + i + 4) * ld, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
  }
#endif
  for (; e < d; ++e)
    for (int i = 0; i < 8; ++i) dst[e * ld + i] = src[i][e];
}

// The scores of row m for kv heads [kv0, kv0 + kvn) and every query head reading them. Each
// group of 8 slots is read once for all kvn kv heads (a slot's heads are contiguous, so a small
// head dim reads whole cache lines, not a head's share of each), each kv head's keys transposed
// into its own [D][128] block, then each query head's chains run on its kv head's block: the
// same chain_product calls on the same values as one (row, head) at a time.
void attention_scores(const AttentionProblem& p, const float* q, float* out, int64_t m,
                      int64_t kv0, int64_t kvn) {
  const KeyReader order(p, m, 0);  // first / next: the rotated slot order
  const int64_t group = p.h / p.j;
  thread_local std::vector<const float*> rows;
  rows.resize(p.d);
  float* kt = scratch(5, kvn * p.d * KEY_BLOCK);  // kv head c's keys, transposed: [D][128]
  float* wide = scratch(6, kvn * 8 * p.d);
  const int64_t span = std::clamp<int64_t>(p.span[m], 0, p.live * KEY_BLOCK);
  for (int64_t blk = 0; blk * KEY_BLOCK < span; ++blk) {
    const int64_t cols = std::min(KEY_BLOCK, (span - blk * KEY_BLOCK + 15) / 16 * 16);
    int64_t slot = order.first(blk);
    for (int64_t t = 0; t < cols; t += 8) {
      SlotSource src[8];
      for (int i = 0; i < 8; ++i, slot = order.next(slot)) src[i] = slot_source(p, m, slot);
      for (int64_t c = 0; c < kvn; ++c) {
        const float* eight[8];
        for (int i = 0; i < 8; ++i)
          eight[i] = as_fp32(src[i].base, src[i].bf16, src[i].at + (kv0 + c) * p.d, p.d,
                             wide + (c * 8 + i) * p.d);
        transpose_rows8(eight, p.d, kt + c * p.d * KEY_BLOCK + t, KEY_BLOCK);
      }
    }
    for (int64_t c = 0; c < kvn; ++c) {
      for (int64_t e = 0; e < p.d; ++e) rows[e] = kt + (c * p.d + e) * KEY_BLOCK;
      for (int64_t h = (kv0 + c) * group; h < (kv0 + c + 1) * group; ++h) {
        const float* qm = q + (m * p.h + h) * p.r * p.d;
        float* om = out + (m * p.h + h) * p.r * p.sp;
        for (int64_t k0 = 0; k0 < p.d; k0 += KC)
          chain_product(qm + k0, p.d, p.r, rows.data() + k0, cols, std::min(KC, p.d - k0),
                        om + blk * KEY_BLOCK, p.sp, k0 == 0);
        for (int64_t r = 0; r < p.r; ++r)
          std::fill(om + r * p.sp + blk * KEY_BLOCK + cols,
                    om + r * p.sp + (blk + 1) * KEY_BLOCK, 0.0f);
      }
    }
  }
  const int64_t done = (span + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
  for (int64_t h = kv0 * group; h < (kv0 + kvn) * group; ++h) {
    float* om = out + (m * p.h + h) * p.r * p.sp;
    for (int64_t r = 0; r < p.r; ++r) std::fill(om + r * p.sp + done, om + (r + 1) * p.sp, 0.0f);
  }
}

// One query row of two heads at once, 32 columns each (a head dim of 32, the tiny presets'):
// for g = 0, 1 the fma chain over t < len from -0.0 of a[g][t] * brow[g][t][0:32], added to
// c[g] (c + chain) — chain_row<4>'s chain per output, two heads interleaved so that eight
// independent accumulators keep the fma pipeline full.
void chain_row_pair32(const float* const a[2], const float* const* const brow[2], int64_t len,
                      float* const c[2]) {
#ifdef LOOPRL_AVX2
  const __m256 z = _mm256_set1_ps(-0.0f);
  __m256 c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z, c6 = z, c7 = z;
  for (int64_t t = 0; t < len; ++t) {
    const __m256 b0 = _mm256_broadcast_ss(a[0] + t);
    const __m256 b1 = _mm256_broadcast_ss(a[1] + t);
    const float* w0 = brow[0][t];
    const float* w1 = brow[1][t];
    c0 = _mm256_fmadd_ps(b0, _mm256_loadu_ps(w0), c0);
    c1 = _mm256_fmadd_ps(b0, _mm256_loadu_ps(w0 + 8), c1);
    c2 = _mm256_fmadd_ps(b0, _mm256_loadu_ps(w0 + 16), c2);
    c3 = _mm256_fmadd_ps(b0, _mm256_loadu_ps(w0 + 24), c3);
    c4 = _mm256_fmadd_ps(b1, _mm256_loadu_ps(w1), c4);
    c5 = _mm256_fmadd_ps(b1, _mm256_loadu_ps(w1 + 8), c5);
    c6 = _mm256_fmadd_ps(b1, _mm256_loadu_ps(w1 + 16), c6);
    c7 = _mm256_fmadd_ps(b1, _mm256_loadu_ps(w1 + 24), c7);
  }
  const __m256 acc[8] = {c0, c1, c2, c3, c4, c5, c6, c7};
  for (int i = 0; i < 8; ++i) {
    float* ci = c[i / 4] + 8 * (i % 4);
    _mm256_storeu_ps(ci, _mm256_add_ps(_mm256_loadu_ps(ci), acc[i]));
  }
#else
  for (int g = 0; g < 2; ++g) chain_product(a[g], 0, 1, brow[g], 32, len, c[g], 32, false);
#endif
}

// Whether any probability of the g heads at pm[i] ([R, Sp] each), query rows r < R, slots
// [from, to) is not a zero of either sign.
bool any_probability(const float* const* pm, int64_t g, int64_t r, int64_t sp, int64_t from,
                     int64_t to) {
  uint32_t bits = 0;
  for (int64_t i = 0; i < g; ++i)
    for (int64_t q = 0; q < r; ++q) {
      const uint32_t* u = reinterpret_cast<const uint32_t*>(pm[i] + q * sp);
      for (int64_t t = from; t < to; ++t) bits |= u[t] & 0x7fffffffu;
    }
  return bits != 0;
}

// Whether any of x[0:n] is -0.0 (its bits, not its value).
bool any_negative_zero(const float* x, int64_t n) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(x);
  bool found = false;
  for (int64_t i = 0; i < n; ++i) found |= u[i] == 0x80000000u;
  return found;
}

// Heads [h0, h0 + heads) of row m: each head's out = ((-0.0 + c_0) + c_1) + ... (the comment
// above). A single query row with a head dim of 32 runs two heads at a time.
//
// Slots no query of the row sees are not read (issue 18: a decode step's row sees its live
// keys, a fraction of the block, and reading the rest of the values was most of the call).
// Block j's chain c_j runs over its first n slots, n = span[m] - 128 j clamped to [0, 128],
// and stops there when that gives the full chain's bits: the chain past slot n adds
// fma(p, v, acc) = acc + (p * v) with p a zero of either sign (checked: a probability there
// that is not a zero, e.g. a padding query row's uniform one, runs the whole block) and v
// finite (the masked slots' values, which the caller guarantees as for whole blocks, kernels.py
// module doc), so acc + (+-0) == acc for every acc but -0.0; an output that is -0.0 after n
// slots (or n = 0: every output -0.0) runs the whole block. So every output is the full
// chain's, bit for bit.
void attention_values(const AttentionProblem& p, const float* probs, float* out, int64_t m,
                      int64_t h0, int64_t heads) {
  thread_local std::vector<const float*> rows;
  rows.resize(2 * KEY_BLOCK);
  float* wide = scratch(5, 2 * KEY_BLOCK * p.d);
  float* part = scratch(7, 2 * p.r * p.d);  // c_j of the (one or two) heads, [g][R][D]
  const bool pairs = p.r == 1 && p.d == 32;
  const int64_t span = std::clamp<int64_t>(p.span[m], 0, p.live * KEY_BLOCK);
  const int64_t rd = p.r * p.d;
  for (int64_t h = h0; h < h0 + heads;) {
    const int64_t g = pairs && h + 1 < h0 + heads ? 2 : 1;
    const float* pm[2];
    float* om[2];
    const KeyReader values[2] = {KeyReader(p, m, h), KeyReader(p, m, h + g - 1)};
    for (int64_t i = 0; i < 2; ++i) {  // a lone head's second entries repeat its first
      pm[i] = probs + (m * p.h + h + std::min<int64_t>(i, g - 1)) * p.r * p.sp;
      om[i] = out + (m * p.h + h + std::min<int64_t>(i, g - 1)) * rd;
    }
    for (int64_t i = 0; i < g; ++i) std::fill(om[i], om[i] + rd, -0.0f);
    for (int64_t blk = 0; blk < p.live; ++blk) {
      const float* pb[2] = {pm[0] + blk * KEY_BLOCK, pm[1] + blk * KEY_BLOCK};
      int64_t n = std::clamp<int64_t>(span - blk * KEY_BLOCK, 0, KEY_BLOCK);
      if (n == 0 || any_probability(pb, g, p.r, p.sp, n, KEY_BLOCK)) n = KEY_BLOCK;
      int64_t slot[2] = {values[0].first(blk), values[1].first(blk)};
      for (int64_t read = 0;;) {
        for (int64_t i = 0; i < g; ++i)
          for (int64_t t = read; t < n; ++t, slot[i] = values[i].next(slot[i]))
            rows[i * KEY_BLOCK + t] = values[i].at(slot[i], wide + (i * KEY_BLOCK + t) * p.d);
        read = n;
        std::fill(part, part + g * rd, -0.0f);  // -0.0 + chain == chain, bit for bit
        if (g == 2) {
          float* c[2] = {part, part + rd};
          const float* const* b[2] = {rows.data(), rows.data() + KEY_BLOCK};
          chain_row_pair32(pb, b, n, c);
        } else {
          chain_product(pb[0], p.sp, p.r, rows.data(), p.d, n, part, p.d, /*first=*/false);
        }
        if (n == KEY_BLOCK || !any_negative_zero(part, g * rd)) break;
        n = KEY_BLOCK;  // an output is -0.0: the rest of the chain may make it +0.0
      }
      for (int64_t i = 0; i < g; ++i)  // om + c_j: the first add is -0.0 + c_0, as in kernels.py
        for (int64_t e = 0; e < rd; ++e) om[i][e] = om[i][e] + part[i * rd + e];
    }
    h += g;
  }
}

// Units of work ((m, h) pairs, or (m, head group)s) in contiguous shares, a few per pool thread.
void run_heads(ffi::ThreadPool& pool, int64_t units, std::function<void(int64_t)> one) {
  const int64_t tasks = std::min<int64_t>(units, 4 * std::max<int64_t>(1, pool.num_threads()));
  if (tasks == 0) return;
  run_tasks(pool, tasks, [&](int64_t t) {
    for (int64_t u = t * units / tasks; u < (t + 1) * units / tasks; ++u) one(u);
  });
}

ffi::Error attention_problem(const char* name, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& cache,
                             ffi::AnyBuffer& win, ffi::Buffer<ffi::S32>& rows,
                             ffi::Buffer<ffi::S32>& offset, ffi::Buffer<ffi::S32>& ints,
                             int64_t sp, AttentionProblem* p) {
  const auto xd = x.dimensions();
  const auto cd = cache.dimensions();
  const auto wd = win.dimensions();
  auto fp = [](ffi::AnyBuffer& a) {
    return a.element_type() == ffi::DataType::F32 || a.element_type() == ffi::DataType::BF16;
  };
  if (xd.size() != 4 || cd.size() != 5 || wd.size() != 4 || !fp(cache) || !fp(win) ||
      wd[0] != xd[0] || wd[2] != cd[3] || wd[3] != cd[4] || cd[3] == 0 || xd[1] % cd[3] != 0 ||
      cd[2] == 0 || wd[1] > cd[2] || xd[1] == 0 || cd[4] == 0 || rows.element_count() != xd[0] ||
      offset.element_count() != xd[0] || ints.element_count() != 3 || sp % KEY_BLOCK != 0 ||
      sp < cd[2])
    return ffi::Error::InvalidArgument(
        std::string(name) + ": expected x [M, H, R, *] float32, a cache [N, B, S, J, D] and a "
        "window [M, C, J, D] (float32 or bfloat16, H % J == 0, 1 <= S, C <= S), rows and "
        "offsets [M] and (slot, w0, live blocks) int32, and Sp (a multiple of 128, >= S) "
        "key slots");
  const int32_t* in = ints.typed_data();
  *p = AttentionProblem{};
  p->m = xd[0];
  p->h = xd[1];
  p->r = xd[2];
  p->sp = sp;
  p->n = cd[0];
  p->b = cd[1];
  p->s = cd[2];
  p->j = cd[3];
  p->d = cd[4];
  p->c = wd[1];
  p->w0 = std::clamp<int64_t>(in[1], 0, p->s - p->c);
  p->slot = in[0];
  p->live = std::clamp<int64_t>(in[2], 0, sp / KEY_BLOCK);
  p->cache = cache.untyped_data();
  p->cache_bf16 = cache.element_type() == ffi::DataType::BF16;
  p->win = win.untyped_data();
  p->win_bf16 = win.element_type() == ffi::DataType::BF16;
  p->rows = rows.typed_data();
  p->offset = offset.typed_data();
  if (p->slot < 0 || p->slot >= p->n)
    return ffi::Error::InvalidArgument(std::string(name) + ": slot out of the cache's range");
  for (int64_t i = 0; i < p->m; ++i)
    if (p->rows[i] < 0 || p->rows[i] >= p->b)
      return ffi::Error::InvalidArgument(std::string(name) + ": a row index outside the cache");
  return ffi::Error::Success();
}

ffi::Error OrderedAttentionScores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                  ffi::AnyBuffer k, ffi::AnyBuffer k_win,
                                  ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> offset,
                                  ffi::Buffer<ffi::S32> span, ffi::Buffer<ffi::S32> ints,
                                  ffi::ResultBuffer<ffi::F32> out) {
  AttentionProblem p;
  const auto od = out->dimensions();
  ffi::Error err = attention_problem("looprl_ordered_attention_scores", q, k, k_win, rows,
                                     offset, ints, od.size() == 4 ? od[3] : -1, &p);
  if (err.failure()) return err;
  if (q.dimensions()[3] != p.d || span.element_count() != p.m)
    return ffi::Error::InvalidArgument("looprl_ordered_attention_scores: q's head dim is not "
                                       "the cache's, or span is not [M]");
  p.span = span.typed_data();
  const float* qs = q.typed_data();
  float* os = out->typed_data();
  // units of (row, kv heads read together): up to 256 / D of them (a 1 KB slot share at most,
  // scratch of at most 128 KB), one when the rows alone give each pool thread few units
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t kvc = p.m >= 4 * threads ? std::clamp<int64_t>(256 / p.d, 1, p.j) : 1;
  const int64_t chunks = (p.j + kvc - 1) / kvc;
  run_heads(pool, p.m * chunks, [&](int64_t u) {
    const int64_t m = u / chunks, kv0 = (u % chunks) * kvc;
    attention_scores(p, qs, os, m, kv0, std::min(kvc, p.j - kv0));
  });
  return ffi::Error::Success();
}

ffi::Error OrderedAttentionValues(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs,
                                  ffi::AnyBuffer v, ffi::AnyBuffer v_win,
                                  ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> offset,
                                  ffi::Buffer<ffi::S32> span, ffi::Buffer<ffi::S32> ints,
                                  ffi::ResultBuffer<ffi::F32> out) {
  AttentionProblem p;
  const auto pd = probs.dimensions();
  ffi::Error err = attention_problem("looprl_ordered_attention_values", probs, v, v_win, rows,
                                     offset, ints, pd.size() == 4 ? pd[3] : -1, &p);
  if (err.failure()) return err;
  if (span.element_count() != p.m)
    return ffi::Error::InvalidArgument("looprl_ordered_attention_values: span is not [M]");
  p.span = span.typed_data();
  const float* ps = probs.typed_data();
  float* os = out->typed_data();
  const int64_t group = std::min<int64_t>(p.h, 4);  // heads per unit of work (an even count)
  const int64_t groups = (p.h + group - 1) / group;
  run_heads(pool, p.m * groups, [&](int64_t u) {
    const int64_t m = u / groups, h0 = (u % groups) * group;
    attention_values(p, ps, os, m, h0, std::min(group, p.h - h0));
  });
  return ffi::Error::Success();
}

// The index of each row's first maximum of x [R, N] (the first NaN where a row has one),
// int32 [R]: `jnp.argmax(x, axis=-1)` (-0.0 and +0.0 are equal, the lower index wins). The
// sampler's Gumbel-max draw runs it on materialised scores (kernels.row_argmax).
ffi::Error RowArgmax(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto d = x.dimensions();
  if (d.size() != 2 || d[1] == 0)
    return ffi::Error::InvalidArgument("looprl_row_argmax: expected x [R, N] with N >= 1");
  const float* v = x.typed_data();
  int32_t* o = out->typed_data();
  for (int64_t r = 0; r < d[0]; ++r, v += d[1]) {
    int64_t best = 0;
    float bv = v[0];
    for (int64_t j = 1; j < d[1]; ++j) {
      const float a = v[j];
      if (a > bv || (a != a && bv == bv)) {
        best = j;
        bv = a;
      }
    }
    o[r] = static_cast<int32_t>(best);
  }
  return ffi::Error::Success();
}

// Rows of x [R, N] (any rank: the last axis is a row) and out [R]: the caller's checks.
struct Rows {
  int64_t r, n;
};
Rows rows_of(ffi::Span<const int64_t> d) {
  Rows s{1, d.size() == 0 ? 1 : d.back()};
  for (size_t i = 0; i + 1 < d.size(); ++i) s.r *= d[i];
  return s;
}

// Runs `block(b)` for the 8-row blocks b of an [R, N] problem: inline for a small one (a
// softmax tile), else on the pool, tasks of whole blocks; FTZ/DAZ set either way.
void row_blocks(ffi::ThreadPool& pool, Rows s, const std::function<void(int64_t)>& block) {
  const int64_t blocks = (s.r + 7) / 8;
  constexpr int64_t INLINE_ELEMENTS = int64_t{1} << 18;  // 1 MB of fp32
  if (s.r * s.n <= INLINE_ELEMENTS || pool.num_threads() <= 1) {
    FlushSubnormals flush;
    for (int64_t b = 0; b < blocks; ++b) block(b);
    return;
  }
  const int64_t per_task = std::max<int64_t>(1, INLINE_ELEMENTS / (8 * s.n));
  run_tasks(pool, (blocks + per_task - 1) / per_task, [&](int64_t t) {
    for (int64_t b = t * per_task; b < std::min(blocks, (t + 1) * per_task); ++b) block(b);
  });
}

// out[r] = the sum of row r in ordered_matmul's order with a weight column of ones:
// ((c_0 + c_1) + ...), c_j = (((-0.0 + x[r, s]) + x[r, s+1]) + ...) over chunk j's k = s ..
// min(N, s + KC) - 1 in order (fma(x, 1.0, acc) is x + acc rounded once: the same value), FTZ
// and DAZ as every task of the product. So each output is `ordered_matmul(x, ones)[r, 0]`
// bit for bit, for the 1/16 of the work (kernels.rowsum). Eight rows at a time: a chunk of
// the 8 rows is transposed (an exact copy) and each k adds one vector of the 8 rows' values,
// so every lane runs its own row's chain in k order.
ffi::Error RowSum(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs,
                  ffi::ResultBuffer<ffi::F32> out) {
  const Rows s = rows_of(x.dimensions());
  const float* v = x.typed_data();
  float* o = out->typed_data();
  row_blocks(pool, s, [&](int64_t b) {
    const int64_t r0 = b * 8, live = std::min<int64_t>(8, s.r - r0);
    const float* src[8];
    for (int i = 0; i < 8; ++i) src[i] = v + (r0 + (i < live ? i : 0)) * s.n;
    float* t = scratch(6, KC * 8);  // [KC][8]: the chunk, column k of the 8 rows at t + 8 k
    float total[8];
    for (int64_t k0 = 0; k0 < s.n || k0 == 0; k0 += KC) {
      const int64_t kc = std::min(KC, s.n - k0);
      const float* at[8];
      for (int i = 0; i < 8; ++i) at[i] = src[i] + k0;
      transpose_rows8(at, kc, t, 8);
      float c[8];
#ifdef LOOPRL_AVX2
      __m256 acc = _mm256_set1_ps(-0.0f);
      for (int64_t k = 0; k < kc; ++k) acc = _mm256_add_ps(acc, _mm256_loadu_ps(t + 8 * k));
      _mm256_storeu_ps(c, acc);
#else
      for (int i = 0; i < 8; ++i) c[i] = -0.0f;
      for (int64_t k = 0; k < kc; ++k)
        for (int i = 0; i < 8; ++i) c[i] = c[i] + t[8 * k + i];
#endif
      for (int i = 0; i < 8; ++i) total[i] = k0 == 0 ? c[i] : total[i] + c[i];
      if (s.n == 0) break;
    }
    for (int i = 0; i < live; ++i) o[r0 + i] = total[i];
  });
  return ffi::Error::Success();
}

// out[r] = the largest value of row r of x [R, N] (N >= 1), a NaN where the row has one. Where
// the order of a max could matter it does not here (kernels.softmax): the candidates it could
// pick between are +0.0, -0.0 and (DAZ) subnormals, and exp(x - m) is the same for each.
ffi::Error RowMax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  const Rows s = rows_of(x.dimensions());
  const float* v = x.typed_data();
  float* o = out->typed_data();
  row_blocks(pool, s, [&](int64_t b) {
    for (int64_t r = b * 8; r < std::min(s.r, b * 8 + 8); ++r) {
      const float* row = v + r * s.n;
      float m = -INFINITY;
      bool nan = false;
      int64_t j = 0;
#ifdef LOOPRL_AVX2
      __m256 acc = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
      for (; j + 8 <= s.n; j += 8) {
        const __m256 a = _mm256_loadu_ps(row + j);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        acc = _mm256_max_ps(acc, a);
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, acc);
      for (int i = 0; i < 8; ++i) m = lanes[i] > m ? lanes[i] : m;
      nan = _mm256_movemask_ps(bad) != 0;
#endif
      for (; j < s.n; ++j) {
        nan = nan || row[j] != row[j];
        m = row[j] > m ? row[j] : m;
      }
      o[r] = nan ? NAN : m;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LooprlOrderedMatmul, OrderedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LooprlOrderedMatmulLayer, OrderedMatmulLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#define LOOPRL_BATCHED_BINDING                \
  ffi::Ffi::Bind()                            \
      .Ctx<ffi::ThreadPool>()                 \
      .Arg<ffi::Buffer<ffi::F32>>()           \
      .Arg<ffi::Buffer<ffi::F32>>()           \
      .Ret<ffi::Buffer<ffi::F32>>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(LooprlOrderedBatchedMatmul, OrderedBatchedMatmul<false>,
                              LOOPRL_BATCHED_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(LooprlOrderedBatchedMatmulT, OrderedBatchedMatmul<true>,
                              LOOPRL_BATCHED_BINDING);

#define LOOPRL_ATTENTION_HEAD                  \
  ffi::Ffi::Bind()                            \
      .Ctx<ffi::ThreadPool>()                 \
      .Arg<ffi::Buffer<ffi::F32>>()           \
      .Arg<ffi::AnyBuffer>()                  \
      .Arg<ffi::AnyBuffer>()                  \
      .Arg<ffi::Buffer<ffi::S32>>()           \
      .Arg<ffi::Buffer<ffi::S32>>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(LooprlOrderedAttentionScores, OrderedAttentionScores,
                              LOOPRL_ATTENTION_HEAD
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(LooprlOrderedAttentionValues, OrderedAttentionValues,
                              LOOPRL_ATTENTION_HEAD
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(LooprlRowArgmax, RowArgmax,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(LooprlRowSum, RowSum,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(LooprlRowMax, RowMax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
