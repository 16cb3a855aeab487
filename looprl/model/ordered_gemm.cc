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
// reassociated).  A bf16 weight is widened to fp32 (exact) as it is read.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOOPRL_AVX2 1
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

float* aligned_floats(std::unique_ptr<float[]>& owner, int64_t count) {
  owner.reset(new float[count + 16]);
  auto p = reinterpret_cast<uintptr_t>(owner.get());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

// Columns [n0, n0 + nc) of the output, every row, every k chunk.
void column_block(const Problem& p, int64_t n0, int64_t width) {
  const int64_t nc = std::min(width, p.n - n0);
  const int64_t panels = (nc + NR - 1) / NR;
  std::unique_ptr<float[]> wown, xown;
  float* wbuf = aligned_floats(wown, KC * panels * NR);
  float* xbuf = aligned_floats(xown, MC * KC);
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
  std::unique_ptr<float[]> aown, wown;
  float* acc = aligned_floats(aown, p.m * nc);
  float* wide = aligned_floats(wown, nc);
  for (int64_t k0 = 0; k0 < p.k; k0 += KC) {
    const int64_t kc = std::min(KC, p.k - k0);
    std::fill(acc, acc + p.m * nc, -0.0f);
    for (int64_t kk = 0; kk < kc; ++kk) {
      const int64_t row = (k0 + kk) * p.n + n0;
      const float* w = static_cast<const float*>(p.w) + row;
      if (p.w_bf16) {
        const uint16_t* s = static_cast<const uint16_t*>(p.w) + row;
        for (int64_t j = 0; j < nc; ++j) wide[j] = widen_bf16(s[j]);
        w = wide;
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

struct Shared {
  Problem p;
  int64_t tasks;
  int64_t width;  // columns per task
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;
};

void drain(const std::shared_ptr<Shared>& s) {
  for (;;) {
    const int64_t t = s->next.fetch_add(1);
    if (t >= s->tasks) return;
    if (s->p.m <= MR)
      few_rows_block(s->p, t * s->width, s->width);
    else
      column_block(s->p, t * s->width, s->width);
    std::lock_guard<std::mutex> lock(s->mu);
    if (++s->done == s->tasks) s->cv.notify_all();
  }
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
  auto s = std::make_shared<Shared>();
  s->p = Problem{x.typed_data(), w.untyped_data(), bf16, out->typed_data(), xd[0], xd[1], wd[1]};
  if (s->p.m == 0 || s->p.n == 0) return ffi::Error::Success();
  if (s->p.k == 0) {
    std::fill(s->p.out, s->p.out + s->p.m * s->p.n, -0.0f);
    return ffi::Error::Success();
  }
  s->width = s->p.m <= MR ? NC_ONE_STEP : s->p.m <= FEW_ROWS ? NC_FEW_ROWS : NC;
  s->tasks = (s->p.n + s->width - 1) / s->width;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), s->tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([s] { drain(s); });
  drain(s);
  std::unique_lock<std::mutex> lock(s->mu);
  s->cv.wait(lock, [&] { return s->done == s->tasks; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LooprlOrderedMatmul, OrderedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
