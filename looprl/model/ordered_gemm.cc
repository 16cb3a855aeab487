// looprl's row-invariant CPU matmul, an XLA FFI custom call (looprl/model/ordered_gemm.py).
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
// which of the identical code paths runs a row (few_rows_block for M <= MR, micro<R> for R
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
constexpr int64_t NC = 256;  // columns of a task: a packed [KC, NC] weight block is 256 KB (L2)
constexpr int64_t NC_FEW_ROWS = 1024;  // up to FEW_ROWS rows: longer contiguous weight reads
constexpr int64_t FEW_ROWS = 48;
constexpr int64_t NC_ONE_STEP = 4096;  // up to MR rows (few_rows_block): 16 KB weight reads
constexpr int64_t MC = 96;   // rows of a packed x block: [MC, KC] is 96 KB (L2)

inline float widen_bf16(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One chunk's chain c_j for R rows x NR columns: x panel xp is [kc][MR] (row r at
// xp[k * MR + r]), weight panel wp is [kc][NR]; c points at an [R, NR] tile of out (row stride
// ldc), which receives c_0 on the first chunk and out + c_j after it.
template <int R>
void micro(const float* xp, const float* wp, int64_t kc, float* c, int64_t ldc, bool first) {
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
    const __m256 w0 = _mm256_load_ps(wp + k * NR);
    const __m256 w1 = _mm256_load_ps(wp + k * NR + 8);
    LOOPRL_ROW(0) LOOPRL_ROW(1) LOOPRL_ROW(2) LOOPRL_ROW(3) LOOPRL_ROW(4) LOOPRL_ROW(5)
  }
#undef LOOPRL_ROW
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
  LOOPRL_STORE(0) LOOPRL_STORE(1) LOOPRL_STORE(2) LOOPRL_STORE(3) LOOPRL_STORE(4)
  LOOPRL_STORE(5)
#undef LOOPRL_STORE
#else
  float acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = -0.0f;
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = std::fma(xp[k * MR + r], wp[k * NR + j], acc[r][j]);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) c[r * ldc + j] = first ? acc[r][j] : c[r * ldc + j] + acc[r][j];
#endif
}

using MicroFn = void (*)(const float*, const float*, int64_t, float*, int64_t, bool);
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
  thread_local std::vector<float> buffers[5];
  std::vector<float>& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < count + 16) b.resize(count + 16);
  auto p = reinterpret_cast<uintptr_t>(b.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

// Columns [n0, n0 + nc) of the output, every row, every k chunk.
void column_block(const Problem& p, int64_t n0, int64_t width) {
  const int64_t nc = std::min(width, p.n - n0);
  const int64_t panels = (nc + NR - 1) / NR;
  float* wbuf = scratch(0, KC * panels * NR);
  float* xbuf = scratch(1, MC * KC);
  float tile[MR * NR];
  for (int64_t k0 = 0; k0 < p.k; k0 += KC) {
    const int64_t kc = std::min(KC, p.k - k0);
    const bool first = k0 == 0;
    // pack w[k0:k0+kc, n0:n0+nc] as panels [panel][k][NR], zero past column n; a weight row
    // is read whole (nc contiguous values) before the next, so the reads stream
    for (int64_t kk = 0; kk < kc; ++kk) {
      const int64_t row = (k0 + kk) * p.n;
      for (int64_t q = 0; q < panels; ++q) {
        const int64_t c0 = n0 + q * NR;
        const int64_t cols = std::min(NR, p.n - c0);
        float* d = wbuf + (q * kc + kk) * NR;
        if (p.w_bf16) {
          const uint16_t* s = static_cast<const uint16_t*>(p.w) + row + c0;
          for (int64_t j = 0; j < cols; ++j) d[j] = widen_bf16(s[j]);
        } else {
          std::memcpy(d, static_cast<const float*>(p.w) + row + c0, cols * sizeof(float));
        }
        for (int64_t j = cols; j < NR; ++j) d[j] = 0.0f;
      }
    }
    for (int64_t m0 = 0; m0 < p.m; m0 += MC) {
      const int64_t mc = std::min(MC, p.m - m0);
      // pack x[m0:m0+mc, k0:k0+kc] as micro-panels [panel][k][MR]
      for (int64_t i0 = 0; i0 < mc; i0 += MR) {
        const int64_t rows = std::min(MR, mc - i0);
        float* dst = xbuf + i0 * kc;
        for (int64_t r = 0; r < rows; ++r) {
          const float* s = p.x + (m0 + i0 + r) * p.k + k0;
          for (int64_t kk = 0; kk < kc; ++kk) dst[kk * MR + r] = s[kk];
        }
      }
      for (int64_t q = 0; q < panels; ++q) {
        const float* wp = wbuf + q * kc * NR;
        const int64_t c0 = n0 + q * NR;
        const int64_t cols = std::min(NR, p.n - c0);
        for (int64_t i0 = 0; i0 < mc; i0 += MR) {
          const int rows = static_cast<int>(std::min(MR, mc - i0));
          float* c = p.out + (m0 + i0) * p.n + c0;
          if (cols == NR) {
            kMicro[rows](xbuf + i0 * kc, wp, kc, c, p.n, first);
          } else {  // a partial last panel runs on a full-width copy of its tile
            for (int r = 0; r < rows; ++r)
              for (int64_t j = 0; j < NR; ++j) tile[r * NR + j] = j < cols ? c[r * p.n + j] : 0.f;
            kMicro[rows](xbuf + i0 * kc, wp, kc, tile, NR, first);
            for (int r = 0; r < rows; ++r)
              std::memcpy(c + r * p.n, tile + r * NR, cols * sizeof(float));
          }
        }
      }
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

// Up to MR rows (a decode step's matmul): no packing; for each k the weight row's columns
// [n0, n0 + nc) are read in one contiguous sweep and fma'd into per-row accumulators held in a
// [rows, nc] buffer, so the weight streams from memory once, in order. The same chain per
// output as column_block: every chunk from -0.0, k in order, chunks added in order.
void few_rows_block(const Problem& p, int64_t n0, int64_t width) {
  const int64_t nc = std::min(width, p.n - n0);
  float* acc = scratch(2, p.m * nc);
  float* wide = scratch(3, nc);
  for (int64_t k0 = 0; k0 < p.k; k0 += KC) {
    const int64_t kc = std::min(KC, p.k - k0);
    std::fill(acc, acc + p.m * nc, -0.0f);
    for (int64_t kk = 0; kk < kc; ++kk) {
      const int64_t row = (k0 + kk) * p.n + n0;
      const float* w = wide;
      if (p.w_bf16) {
        const uint16_t* s = static_cast<const uint16_t*>(p.w) + row;
        for (int64_t j = 0; j < nc; ++j) wide[j] = widen_bf16(s[j]);
      } else {
        w = static_cast<const float*>(p.w) + row;
      }
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

// The columns a task covers: longer for fewer rows (module doc of ordered_gemm.py).
int64_t task_width(int64_t m) { return m <= MR ? NC_ONE_STEP : m <= FEW_ROWS ? NC_FEW_ROWS : NC; }

// Columns [n0, n0 + width) of one product, every row: the path is chosen by M alone.
void product_columns(const Problem& p, int64_t n0, int64_t width) {
  if (p.m <= MR)
    few_rows_block(p, n0, width);
  else
    column_block(p, n0, width);
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

ffi::Error OrderedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                         ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("looprl_ordered_matmul: expected x [M, K] and w [K, N]");
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if (!bf16 && w.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("looprl_ordered_matmul: w must be float32 or bfloat16");
  const Problem p{x.typed_data(), w.untyped_data(), bf16, out->typed_data(), xd[0], xd[1], wd[1]};
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {
    std::fill(p.out, p.out + p.m * p.n, -0.0f);
    return ffi::Error::Success();
  }
  const int64_t width = task_width(p.m);
  run_tasks(pool, (p.n + width - 1) / width,
            [&p, width](int64_t t) { product_columns(p, t * width, width); });
  return ffi::Error::Success();
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
    const int64_t width = task_width(m);
    for (int64_t n0 = 0; n0 < n; n0 += width) product_columns(p, n0, width);
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
