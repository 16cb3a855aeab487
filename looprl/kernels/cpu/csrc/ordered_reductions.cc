// The softmaxes' row reductions and the sampler's argmax in the ordered numerics
// (cpu/ffi.py: row_sum, row_max, row_argmax).
#include "ordered_common.h"

namespace {

using namespace looprl_kernels;  // NOLINT: the shared kernel helpers

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
