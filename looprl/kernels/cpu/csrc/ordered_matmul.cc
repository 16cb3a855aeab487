// looprl's row-invariant CPU matmul (cpu/ffi.py: ordered_matmul, ordered_matmul_layer,
// ordered_batched_matmul): the chains of ordered_common.h, blocked for the cache.  Which path
// runs a call (few_rows_block up to STREAM_ROWS rows, small_rows_block up to SMALL_ROWS,
// column_block above) is chosen by M alone, and every path computes each output's chain
// with micro<R> or axpy_fma in k order.
#include "ordered_common.h"

namespace {

using namespace looprl_kernels;  // NOLINT: the shared kernel helpers

constexpr int64_t NC = 256;  // fewest columns of a task above FEW_ROWS rows (task_width)
constexpr int64_t NC_WIDE = 2048;  // most columns of such a task: [KC, NC_WIDE] packed is 2 MB
constexpr int64_t TASKS_PER_THREAD = 4;  // ... unless threads then get fewer tasks than this
constexpr int64_t NC_FEW_ROWS = 1024;  // up to FEW_ROWS rows: longer contiguous weight reads
constexpr int64_t FEW_ROWS = 48;
constexpr int64_t STREAM_ROWS = 2;  // up to here: few_rows_block
constexpr int64_t SMALL_ROWS = 16;  // up to here (above STREAM_ROWS): small_rows_block
constexpr int64_t NC_ONE_STEP = 16384;  // up to MR rows: 64 KB runs of a weight row
constexpr int64_t PACK_COLS = 1024;  // small_rows_block's packed blocks: [KC, 1024] is 1 MB
constexpr int64_t IN_PLACE_MAX_N = 8192;  // up to here small_rows_block reads fp32 in place
constexpr int64_t MC = 96;   // rows of a packed x block: [MC, KC] is 96 KB (L2)

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
// (axpy4_fma: the accumulators read and written once per four fmas). The same chain per
// output as column_block: every chunk from -0.0, k in order, chunks added in order.
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

// The columns a task covers: up to FEW_ROWS rows, longer for
// fewer rows; above, the widest of NC_WIDE, NC_WIDE / 2, ..., NC that still gives each of
// `threads` threads TASKS_PER_THREAD tasks of the `row_blocks` row blocks (column_block packs
// its x rows once per task and k chunk, so wider tasks pack x less often). Which task covers
// an output never changes its chain (ordered_common.h).
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
// a wider one (the lm_head, whose strips lie far apart), or a bf16 one, is packed PACK_COLS
// columns at a time from contiguous row runs first. The same chain per output as column_block
// (the same micro<R>, chunks in order): only where the operands are read from differs.
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
// block a task packs per k chunk serves up to ROW_BLOCK rows (`benchmarks/kernels.py` sets
// ROW_BLOCK). The blocking only decides which rows a task covers: not a bit changes.
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
