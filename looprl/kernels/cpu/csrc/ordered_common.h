// Shared by looprl's ordered CPU kernels (ordered_matmul.cc, ordered_attention.cc,
// ordered_reductions.cc), XLA FFI custom calls bound in looprl/kernels/cpu/ffi.py.
//
// The numerics, fixed by these programs and by nothing else:
//   out[m, n] = ((c_0 + c_1) + c_2) + ... + c_{J-1},   J = ceil(K / KC),
//   c_j = fma(x[m, e-1], w[e-1, n], ... fma(x[m, s+1], w[s+1, n], fma(x[m, s], w[s, n], -0.0))),
// over the chunk's k = s .. e-1 (s = j * KC, e = min(K, s + KC)) in order.  Every value that
// enters an output is computed from row m of x and column n of w alone, by that chain: no code
// path adds two partial sums of one chunk, reorders k or splits a chunk, and the number of
// rows, a row's place, the blocking, the task split and the thread count only decide where an
// accumulator lives and which of the identical code paths runs a row.  fma and + are
// correctly rounded (IEEE 754), so vector and scalar code give the same bits; the sources are
// compiled with -ffp-contract=off and without -ffast-math.  A bf16 operand is widened to fp32
// (exact) as it is read.  Every task runs with flush-to-zero and denormals-are-zero set (the
// state XLA CPU's threads run in), so subnormals count as zero whichever thread runs it.
// docs/NUMERICS.md gives the argument per kernel.
#ifndef LOOPRL_ORDERED_COMMON_H_
#define LOOPRL_ORDERED_COMMON_H_

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

namespace looprl_kernels {

constexpr int64_t MR = 6;    // rows of a micro-panel (6 x 2 accumulator vectors on AVX2)
constexpr int64_t NR = 16;   // columns of a panel
constexpr int64_t KC = 256;  // k chunk: a packed [KC, NR] weight panel is 16 KB (L1)

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

// A 64-byte aligned scratch buffer of this thread (slot: which one), reused across calls, so a
// batched call of many small products allocates nothing per product.
inline float* scratch(int slot, int64_t count) {
  thread_local std::vector<float> buffers[8];
  std::vector<float>& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < count + 16) b.resize(count + 16);
  auto p = reinterpret_cast<uintptr_t>(b.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
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

inline void drain(const std::shared_ptr<Shared>& s) {
  FlushSubnormals flush;
  for (;;) {
    const int64_t t = s->next.fetch_add(1);
    if (t >= s->tasks) return;
    s->run(t);
    std::lock_guard<std::mutex> lock(s->mu);
    if (++s->done == s->tasks) s->cv.notify_all();
  }
}

inline void run_tasks(ffi::ThreadPool& pool, int64_t tasks, std::function<void(int64_t)> run) {
  auto s = std::make_shared<Shared>();
  s->run = std::move(run);
  s->tasks = tasks;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([s] { drain(s); });
  drain(s);
  std::unique_lock<std::mutex> lock(s->mu);
  s->cv.wait(lock, [&] { return s->done == s->tasks; });
}

// dst[e * ld + i] = src[i][e] for i < 8, e < d (an exact copy; AVX2: 8 x 8 transposes).
inline void transpose_rows8(const float* const* src, int64_t d, float* dst, int64_t ld) {
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

}  // namespace looprl_kernels

#endif  // LOOPRL_ORDERED_COMMON_H_
