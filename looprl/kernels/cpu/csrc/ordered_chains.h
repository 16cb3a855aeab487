// fma-chain products over rows given by pointers: attention's register blocks
// (ordered_attention.cc). Every output is the chain over t < len, from -0.0, in t order, of
// a[r * lda + t] * brow[t][col]; every path (register blocks, single rows, scalar tails)
// computes that chain.
#ifndef LOOPRL_ORDERED_CHAINS_H_
#define LOOPRL_ORDERED_CHAINS_H_

#include "ordered_common.h"

namespace looprl_kernels {

constexpr int64_t RB = 4;  // rows of a register block: 4 x 2 accumulator vectors

// c[r, col:col+16] for r < R: the fma chain over t < len from -0.0 of a[r * lda + t] *
// brow[t][col:col+16], stored (first) or added to c (c + chain).
template <int R>
inline void chain16(const float* a, int64_t lda, const float* const* brow, int64_t col,
                    int64_t len, float* c, int64_t ldc, bool first) {
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
inline void chain_row(const float* a, const float* const* brow, int64_t col, int64_t len,
                      float* c, bool first) {
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
__attribute__((noinline)) inline void chain_tail(const float* a, int64_t lda, int rows,
                                                 const float* const* brow, int64_t col,
                                                 int64_t cols, int64_t len, float* c, int64_t ldc,
                                                 bool first) {
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
inline void chain_product(const float* a, int64_t lda, int64_t rows, const float* const* brow,
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

}  // namespace looprl_kernels

#endif  // LOOPRL_ORDERED_CHAINS_H_
