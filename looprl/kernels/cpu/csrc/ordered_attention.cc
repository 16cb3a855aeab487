// Attention's two products in the ordered numerics, the KV cache read in place
// (cpu/ffi.py: ordered_attention_scores, ordered_attention_values; the caller is
// looprl/kernels/cpu/attention.py).
//
// One query tile of M rows: q [M, H, R, D] fp32 (D = head dim), head h reading kv head
// h / (H / J). Row m's keys (values alike) are slot `slot` of the cache [N, B, S, J, D] at
// batch row rows[m], with the window win [M, C, J, D] written over slots [w0, w0 + C) (w0
// clamped to [0, S - C], as XLA's dynamic_update_slice clamps), fp32 or bf16 widened as read.
// Rotated slot t of row m holds key min((t + offset[m]) mod Sp, S - 1), Sp the mask's padded
// key axis; the key axis is taken in KEY_BLOCK-slot blocks, the first n (live) computed.
//   scores: out[m, h, r, j * 128 + s] = ordered_matmul's output for M = R, K = D, N = 128 on
//     q[m, h] and the block's keys; +0.0 in blocks >= n and past the 16-slot panel holding
//     rotated slot span[m] - 1 (slots no query of row m sees: the caller masks them).
//   values: out[m, h, r, d] = ((-0.0 + c_0) + c_1) + ... + c_{n-1}, c_j the fma chain in slot
//     order from -0.0 of p[m, h, r, j * 128 + s] * value[d] over the block's slots.
// Every value of (m, h, r) comes from row m's keys and row r of its queries (or
// probabilities) alone (docs/NUMERICS.md, "Attention").
#include "ordered_chains.h"
#include "ordered_common.h"

namespace {

using namespace looprl_kernels;  // NOLINT: the shared kernel helpers

constexpr int64_t KEY_BLOCK = 128;
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
// above). A single query row with a head dim of 32 runs two heads at a time. Block j's chain
// runs over its first n = span[m] - 128 j slots (clamped to [0, 128]) and stops there only
// when that gives the full chain's bits: every probability past them is a zero (checked) and
// no output is -0.0 (else the whole block runs); the values past them are finite (the
// caller's promise), so the rest would add +-0 to each output (docs/NUMERICS.md).
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
      for (int64_t i = 0; i < g; ++i)  // om + c_j: the first add is -0.0 + c_0 (cpu/attention.py)
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

}  // namespace

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
