"""Batch-invariant kernels: the numerics that make sampler and learner agree bit for bit.
One concept, kept in one file: every kernel shares the construction and its argument below.

Every matmul whose row count differs between the sampler (1 query per decode step, a chunk of
pending positions, a prefill) and the learner (the whole teacher-forced sequence, another
minibatch size, permuted rows) must give each row the same bits whatever the number of rows M
and wherever the row sits.

How XLA CPU computes a dot (jax/jaxlib 0.10.2, `--xla_cpu_experimental_ynn_fusion_type=` so no
YNNPACK dot fusions, one intra-op thread via `--xla_cpu_multi_thread_eigen=false`; see
`looprl.determinism`). A row-major `[M, I] x [I, O]` dot is one DotThunk, which hands Eigen the
transposed problem: Eigen's LHS is the weight (`O` rows), its RHS columns are *our rows*. Eigen's
tensor contraction (TSL's custom contraction kernel, built with oneDNN) blocks the problem into
`kc x mc` weight blocks and `kc x nc` row blocks, calls `dnnl_sgemm` once per block pair and adds
the K slices into the output in order (`C += slice`). Single-threaded, `kc` is a function of I
alone (Eigen's L1 heuristic splits K only when I exceeds what fits beside one micro-panel, then
TSL cuts I into equal slices rounded to 8), and the row blocks `nc` are multiples of 24 (TSL
rounds them up to its N unroll). Inside a `dnnl_sgemm` call our rows are the N side of the
AVX-512 sgemm micro-kernel (48 output columns x 8 rows per register block), where each row is
one broadcast operand with its own accumulators walking k in order. bf16 dots are converted to
fp32 by XLA before the DotThunk (products of bf16 values are exact in fp32), so they follow the
fp32 path. What broke invariance (issue 14, measured at `[M, 2048] x [2048, 5632]`, rows vs
the same rows of a 512-row call): M = 1 is rewritten to a matrix-vector product, M = 2..7 take
another sgemm path (all their rows differed), and M = 49 differed only in row 48, the one row
left over after a 48-row column block (a 1-row sgemm call). Every multiple of 8 rows agreed at
every position (on that AVX-512 machine; on AVX2 the block is 6 rows, see (3)). The old
128-long K slices (whole-M partial products, all alive at once: +1.4 GB per layer matmul at
4096 rows) were right in length but could not help rows that were never padded.

The CPU matmul (default, `LOOPRL_CPU_MATMUL=ordered`, kernel version KERNEL_VERSION_ORDERED):
`looprl.kernels.ordered_gemm`, an XLA FFI kernel of our own (`ordered_gemm.cc`). Each output is
the sum, in chunk order, of 256-long fma chains over k in order, each from -0.0; that order is
written in the kernel, so the argument is the program: no value that enters a row's output is
computed from anything but that row and the weight, and no blocking, thread or path choice
changes an operation (the .cc's header). No row padding, no K blocks of XLA dots, no row
quantum: a decode step's 1-16 rows cost about what stock's do (`benchmarks/kernels.py`), and
the bits do not depend on the ISA (IEEE fma). It replaced the XLA-op construction below
(2026-12-03), which stays selectable (`LOOPRL_CPU_MATMUL=xla`, kernel version KERNEL_VERSION) so
that rollouts sampled under it still verify. Attention keeps the construction below (rotated
128-key blocks, live blocks only, fixed block order), but its two products are ordered kernels
too (`ordered_gemm.ordered_attention_scores` / `ordered_attention_values`): per (b, h) and live
block, each output is the chain `ordered_matmul` gives the rotated block the XLA-op form
gathers (the .cc's attention comment), so neither B x H nor a row's place matters, and a
single query tile runs unpadded (C rows: the ordered products need no row quantum). The
kernels read keys and values where they lie: the cache's `[B, S, J, K]` layout (bf16 widened
as read, a GQA head's kv head by index), and in the sampler a slot of the whole `[T x L, B, S,
J, K]` cache at a sub-batch's batch rows with the chunk's window written over it (`CachedKV`,
`attention_cached`). So no K/V block, layer slot or sub-batch is copied: the block gathers were
60 % of a tiny-preset decode attention call at 128 rows, and once the blocks were read in
place, the slot copies XLA then made for the call were 40 % of the decode step (2026-12-03,
`benchmarks/attention_profile.py`, a trace of `generate`). Scores of rotated slots no query of
the row sees are +0.0 past the 16-slot panel holding its last seen slot (the softmax masks
them, so no output changes). The bits are those of the `ordered_batched_matmul` form this
replaced (same kernel version; tests/model/test_ordered_attention.py checks each product
against its chain written in numpy). `rowsum` and the softmax use
`matmul`, so they are ordered as well: no value of the invariant CPU path comes from a oneDNN
dot. A kernel version still names the ISA: XLA's elementwise code (exp, log) is the one part
not argued ISA-free.

The XLA-op construction (CPU, `LOOPRL_CPU_MATMUL=xla`):

* `matmul` (every projection, the MLP, the lm_head, the exit gate `[D, 1]` and `rowsum`): rows
  are zero-padded to a multiple of a row tile R = `_row_tile_for(M)`, the fewest tiles of at
  most ROW_TILE_MAX = 512 rows (504 where the quantum is 24), each the equal share of M rounded
  up to a multiple of ROW_QUANTUM, the sgemm register block of the machine (8 with AVX-512: M =
  300: one 304-row tile; 1000: two of 504; 4096: eight of 512; at most 7 padding rows per tile;
  24 elsewhere, below; a call of more than one K block and more rows than its tile pads
  nothing: its last tile starts at M - R and overlaps the one before, `_looped_matmul`),
  output columns to a multiple of `N_MIN` = 16 (zero columns; O = 1
  would be a matrix-vector product), the contraction is cut into `K_BLOCK` = 128 long blocks
  (zero-padded) whose fp32 partial products are summed in block order: every dot the compiler
  sees is `[R, 128] x [128, O16]`, whatever M. Argument: (1) Eigen's blocking and oneDNN's
  kernel choice are functions of the dot's shape; (2) a contraction of 128 is below every K
  split (Eigen's L1 heuristic keeps k up to >= 152 for any L1 >= 32 KB, TSL keeps kc = k, so
  one sgemm call accumulates each output over the whole block), so the only K order is the
  block order, which is ours and fixed; (3) every row block handed to `dnnl_sgemm` holds a
  multiple of the quantum (R and TSL's 24-multiple `nc` are multiples of it, so is R mod nc),
  so no row falls into a leftover-row or matrix-vector path, and inside a register block every
  row runs the same instruction stream on its own accumulators: neither a row's position in
  its tile nor the tile size can matter, which is why R need not come from a fixed ladder (the
  previous form used 8, 16, ..., 512; a 300-row call then padded to 3 x 128 rows). The columns
  are never split by us (one dot covers all O16 columns), so a column's place in the dot is a
  function of O alone; that the library's column blocking (Eigen's `mc`, oneDNN's 48-column
  register block and its leftovers) does not change with R is covered by the tests, not by an
  argument (a column-blocked variant, which would also need it, was measured slower: see
  Cost). Without (2) the tile size did matter: with unsplit contractions of 384 or 1024 (or
  the 2048-long exit gate) 8..32-row dots and 40..256-row dots disagreed, because the K split
  inside the library depends on the row count; with 128-long blocks all tiles agreed at every
  shape tested (tests/model/test_kernels_ouro_shapes.py forces tiles of 8..512 rows, most not
  powers of two). (3) depends on the ISA's register block, so the quantum is the machine's
  (`looprl.determinism.cpu_row_quantum`, recorded as `Schedule.row_tile` and in every report's
  environment): oneDNN's AVX-512 block is 8 rows; its AVX2 block is 6, and with the quantum of 8
  an AVX2 machine (AMD EPYC, 2026-12-02) gave the leftover rows 6k+1..6k+3 of a call other bits
  and broke replay, so every other machine uses 24, the least common multiple of the 4-, 6- and
  8-row blocks (a 6-row tile still differed at O = 5632; 12 and 24 agreed where tried). A row's
  bits are those of a whole register block either way, so a machine's quantum changes padding,
  not values. Two loop forms, same dots and adds in the same order, so the same bits: a small
  tile (R <= BATCHED_MAX_ROWS = 16: decode with the AVX-512 quantum; with the quantum of 24
  every tile is large) gets all its partials from one batched dot (nb matmuls of the same shape,
  weight read in place) and sums them from the first; a large tile runs one `fori_loop` step per
  (tile, K block), adding each partial into an fp32 accumulator that starts at -0.0 (-0.0 + p ==
  p bitwise for every p, including +-0 and NaN, so the sum is `p0 + p1 + ...` as in the small
  form); for fp32 output the accumulator is the output itself, updated in place through the loop
  carry. An fp32 weight is read in place; a bf16 weight is sliced as its uint16 bits and each
  `[128, O16]` block widened to fp32 where it is used (a small tile then takes its nb partials
  from a loop of the same nb dots), so no whole-weight fp32 copy exists (XLA's own bf16 dot
  widens the whole weight, and in a decode loop that copy is hoisted and held: 0.4 GB for
  Ouro-1.4B's lm_head, issue 19); x is cast per `[R, 128]` block. `jax.custom_vjp` gives the
  backward as plain dots (no invariance needed there).
* `attention` (the XLA form; the ordered form differs only in its dots and in running a single
  query tile unpadded, above): query rows are padded to the same row tiles (`_row_tile_for(C)`,
  several in one `lax.map`). The key axis is taken in 128-key blocks: the mask is padded to a
  multiple of 128 (masked slots, probability exactly 0; K/V are not padded, a block's slots past
  the cache read its last key, any finite value serving under probability +0), and each row's
  key axis is
  rotated (an exact gather) so that its first live key sits in slot 0: the blocks are then cut
  at the row's own token positions 0, 128, 256, ..., whatever its left padding or the batch's
  cache length. Both dots run per 128-key block, each block one step of a `fori_loop` over the
  blocks holding a key that any query of the tile may see (`_live_key_blocks`): block j's
  scores are `[R, K] x [K, 128]` per (b, h) (K = head_dim <= 128, one contraction block),
  written into an fp32 `[B, H, R, S']` buffer; the masked fp32 softmax runs over the whole key
  axis; block j's value partial is `[R, 128] x [128, K]` per (b, h), added in block order to an
  fp32 accumulator that starts at -0.0. So every dot has one shape, whatever the cache length,
  the batch or the live count (the DotThunk runs a batched dot as separate matmuls of that
  shape). Argument: a row's live keys meet the same block boundaries in the same dots in every
  batch; a slot after them is masked, so a block partly live adds `0 * v` for it and the
  softmax sum (a `rowsum`, 128-long blocks) adds 0; blocks past the tile's last live key are
  skipped, which drops only adds of exact zeros (`x + 0 = x`, for every x but -0); blocks live
  for another query of the tile but not this one add zeros likewise; the max is order-free.
  Without the rotation a prompt whose keys straddled slot 128 in a larger prompt bucket summed
  them in two blocks (the needle test, tests/sampling/test_needle.py). The queries are the row
  side, so the matmul argument applies. Each block of K/V is gathered from the cache's own
  `[B, S, H, K]` layout and cast to fp32 where a dot uses it, so no whole-cache copy is made
  (a head-major or padded copy, as the previous form made, costs the cache length at every
  call), and a decode step costs what its live keys cost. A bf16 block is gathered as its
  uint16 bits (XLA CPU widens a bf16 gather's whole operand to fp32 first, as it does a
  dynamic slice: `looprl.model.layers.layer_bits`). One layer of Ouro-1.4B width, one query
  per row, a 768-slot cache, this form over the previous whole-axis one (2026-12-03, AVX2, one
  XLA thread, `attention` on the same arguments): 16 rows fp32 2.48x faster at 200 live keys,
  1.47x at 500; bf16 with every block live (760) 1.23x; 64 rows bf16 at 300 live keys 1.87x;
  the learner's 4 x 512 fp32 and 2 x 1024 bf16 calls 0.99x and 1.09x; the main job's shapes
  (one block, which runs without a loop) 0.98-1.08x.
  Only a query row with no live key (a padding row) gets other bits than that form, and its
  output is never used. A single query tile (a decode step: C = 1 real row in a
  ROW_QUANTUM-row tile) runs the softmax on its C real rows alone and gives the padding rows
  probability 0: the softmax is row-invariant (below), so the real rows' bits are those of the
  whole tile, and the step pays for one softmax row instead of 8 or 24 (issue 18: 4.9 of 15.3
  ms per layer at 128 rows went there).
* `rowsum` (RMSNorm's mean of squares, softmax sums): `matmul` of x with a literal `[D, 16]`
  ones-in-column-0 matrix (a literal so XLA cannot rewrite it into a reduce); on the ordered
  kernel its column 0 comes from `ordered_gemm.row_sum`, the same chains without the 15 zero
  columns (same bits by construction; tested against the product at Ouro's widths).
* `softmax` / `log_softmax`: the max is order-free (on the ordered kernel `ordered_gemm.row_max`,
  an FFI reduction: XLA's reduce-window max cost 43 us on a `[320, 128]` tile); the sum is a
  `rowsum`; the elementwise code runs on fixed `[64k, 64j]` tiles (`_tiled_rows`) so it compiles
  the same way in every program. The padded tile is passed to the sum's call as well, so it
  stays alive until then: otherwise XLA writes `exp(x - max)` over it in place, and LLVM's
  vectorized loop refuses overlapping buffers and runs the scalar one (same operations per
  element, so same bits; 117 us against 14 us on that tile, the largest op of a decode layer
  pass at 64 rows: 2026-12-04, xprof).

Cost (`benchmarks/kernels.py`, one core; figures in its JSON line): the weight is streamed
(and packed by the library) once per row tile, which is why tiles are as large as 512 rows,
and each K block adds a `[R, O]` partial into the accumulator. Measured on 2 shared cores
(medians of 5-7, noisy): at `[R, 2048] x [2048, 2048]` fp32 the batched form of all 16
partials took 84 ms at R = 304 and 137-141 ms at R = 512 against 40 and 44-63 ms for the loop
(16 partials of `[R, O]` written and re-read; the old rule batched up to 16 MB of partials,
i.e. every 128-row tile of a 2048-wide weight), and about the same as the loop at R = 8
(2048-, 5632- and 49152-wide weights), hence the loop above 16 rows. Tiling the output
columns too (256- or 512-column blocks, K loop innermost, so the accumulator stays in L2) was
slower than the whole-row loop (300 x 2048 x 2048: 94-105 ms vs 41-51 ms; 1000 rows: 181-241
vs 137-170 ms): more, smaller dots, each packing its own slices. Memory at M = 4096 (temp +
output of `memory_analysis`): the loop keeps one partial, one x block and one weight block
besides the output (fp32 down_proj 37 MB vs 32 MB stock; the lax.map form held a copied x tile
and a separate accumulator, 52 MB). That needs M to be a multiple of the tile or the last tile
to overlap: with the quantum of 24 (4096 rows: nine 456-row tiles) the padded form copied x and
the output, 153 MB for the fp32 down_proj (`benchmarks/kernels.py` on an AVX2 machine,
2026-12-02: `matmul_peak_mem_vs_stock_1p4b` 4.80; 1.15 with the overlap). Decode (M <= 8) runs
one 8-row dot with AVX-512 (24 rows elsewhere, 3x the compute of a decode matmul); the stock
1-row call is a matrix-vector product that reads the weight once, while every sgemm (ours at 8
rows, as the stock 8-row call) packs it first, so the fp32 lm_head at M = 1 stays ~2-3x of
stock with AVX-512 (13x on the AVX2 machine above): its bits must be those of the 8-row path, so the
matrix-vector kernel cannot be used, and the other forms of the same dot shape measured (loop
instead of batched) were not cheaper. The exit gate `[D, 1]` (and `rowsum`) pays for 16 padded
columns and 16 K blocks against a sub-millisecond matrix-vector product; the benchmark reports
it apart (`gate_*`).

On accelerators (GPU, TPU; issue 16) the same construction, with a row tile fixed for the
backend instead of the CPU's oneDNN-specific argument (3):

* `matmul` (XLA form, `LOOPRL_ACCEL_MATMUL=xla`, the default): rows zero-padded to a multiple
  of ROW_TILE = 64, each 64-row tile one `lax.map` step whose K loop (`fori_loop`, in order, from
  -0.0) adds `[64, 128] x [128, O16]` dots into an fp32 accumulator. Argument: (1) every dot the
  compiler sees has that one shape whatever M, so whatever GEMM algorithm the backend picks for
  it is picked for every call (with autotuning off, `looprl.determinism.ACCELERATOR_FLAGS`, the
  pick is the library heuristic's function of the shape and the device); (2) a 128-long
  contraction leaves split-K nothing worth splitting, and the order over K blocks is our loop;
  (3) a GEMM walks K the same way for every output of a tile, so a row's place in the tile does
  not matter; (4) the tile loop stays a loop (`--xla_gpu_enable_while_loop_unrolling=
  WHILE_LOOP_UNROLLING_NO_UNROLL`): unrolled, its dots share the weight and XLA could merge them
  into one M-dependent dot. 64 rows: a decode step's `[64, I]` bf16 tile does 64 FLOP per
  weight byte, below an H200's bf16 compute/bandwidth ridge (~200), so it costs about a weight
  read; in fp32 at full precision (32 FLOP per byte against a ridge of ~14) it costs about 2x
  a weight read (a roofline estimate, not measured). fp32 dots ask for `Precision.HIGHEST` (no
  TF32), bf16 dots run on the tensor cores with fp32 accumulation.
* `matmul` (Pallas form, `LOOPRL_ACCEL_MATMUL=pallas`): `looprl.kernels.pallas_matmul`, one
  kernel whose programs each own a `[64, 128]` output block and sum its 128-long K blocks in
  order: the order is in the kernel, so no compiler choice can change it. The fallback where
  the XLA form is not exact on a device.
* `attention`: the CPU's key rotation and 128-key blocks, query tiles of ROW_TILE rows in one
  `lax.map`, and the scores too in 128-key blocks (`[64, K] x [K, 128]` per (b, h, block)), so no
  matrix's shape depends on the cache length; K/V stay in the compute dtype. The dots are
  batched over (b, h, block), and the batch count B x H x S'/128 does change with the batch and
  the cache length: argument (1) holds per matrix, and whether a device's batched GEMM keeps a
  matrix's bits whatever the batch count is measured (`reproducibility/gpu_check.py` scans one
  query in calls of other B, S' and C), not argued.
* `rowsum`, `softmax`, `log_softmax`: unchanged (the sum is a `matmul`, in the form above).
Cost: every tile and K block is a step of a sequential loop, so a large-M call (the learner)
runs M/64 x I/128 small dots one after another, and `rowsum` inside attention's softmax nests a
second such loop in the query-tile loop; on a GPU that is far from one big GEMM's throughput (not
measured: `gpu_check.py` runs `benchmarks/kernels.py`). (1), (2) and (4) follow from the program,
and `tests/model/test_accel_kernels.py` checks them on the traced accelerator program from the
CPU; (3) is how GEMM kernels are built and is what
`reproducibility/gpu_check.py` measures on a device. Necessary, not sufficient: until a
committed GPU report shows these kernels exact, the trainer replays off the CPU by re-running
the sampler (`learner.replay_impl=auto` -> `forced`). `kernel_version()` names the form a
rollout was sampled with (the CPU's, or the accelerator's with its matmul implementation).

Elementwise code must also compile the same way in every program: XLA CPU's newer fusion
emitters generated numerically different loops for the same elementwise ops depending on the
surrounding program, so looprl turns them off (`looprl.determinism`).

`stock_*` functions are the same math written the common way (plain `x @ W`, attention over the
live prefix): the negative control of the reproducibility matrix.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from looprl.determinism import cpu_isa, cpu_row_quantum
from looprl.errors import ConfigError
from looprl.kernels.ordered_gemm import (ordered_attention_scores, ordered_attention_values,
                                       ordered_matmul, ordered_matmul_layer,
                                       row_argmax as ordered_row_argmax, row_max, row_sum)
from looprl.kernels.pallas_matmul import pad_to_multiple, pallas_matmul

ROW_TILE = 64  # the fixed row tile off the CPU (accelerators), and the softmax tiles
# CPU: a row tile is a multiple of this, the sgemm register block of the machine's ISA (8 with
# AVX-512, 24 elsewhere: `looprl.determinism.cpu_row_quantum`), recorded as `Schedule.row_tile`
CPU_ISA = cpu_isa()  # read once: the quantum and the kernel version must name the same ISA
ROW_QUANTUM = cpu_row_quantum(CPU_ISA)
ROW_TILE_MAX = 512 // ROW_QUANTUM * ROW_QUANTUM  # CPU: the largest row tile of a dot (512, 504)
N_MIN = 16  # CPU: output columns of a dot are padded to a multiple of this
K_BLOCK = 128  # CPU: longest contraction of one dot (longer ones: blocks summed in order)
BATCHED_MAX_ROWS = 16  # CPU: tiles up to this many rows get their K-block partials in one dot
# The numerics of the invariant kernels: a rollout records it (`Schedule.kernel_version`), and
# `looprl verify --rollout` refuses a rollout sampled under another version (its bits are
# another function's). Bump it whenever a kernel's arithmetic changes.
KERNEL_VERSION = "2026-12-03"  # the CPU's XLA matmul form (LOOPRL_CPU_MATMUL=xla)
KERNEL_VERSION_ORDERED = "2026-12-03-ordered"  # the CPU's default: the ordered FFI matmul
CPU_MATMUL_IMPLS = ("ordered", "xla")  # LOOPRL_CPU_MATMUL: the CPU matmul's form
KERNEL_VERSION_ACCEL = "2026-12-02-accel"  # the accelerator form (module doc), same rule
ACCEL_MATMUL_IMPLS = ("xla", "pallas")  # LOOPRL_ACCEL_MATMUL: the accelerator matmul's form
MASK_VALUE = -1e30  # finite, so fully-masked (padding) query rows never make NaN


def _pad_rows(x, axis: int, tile: int = ROW_TILE):
    """(`x` zero-padded along `axis` to a multiple of `tile`, the length it had)."""
    return pad_to_multiple(x, axis, tile), x.shape[axis]


def on_cpu() -> bool:
    """True when jax compiles for XLA CPU (the kernels' invariant form there; see module doc)."""
    return jax.default_backend() == "cpu"


def on_ordered_cpu() -> bool:
    """True when the ordered FFI kernels run: XLA CPU with `LOOPRL_CPU_MATMUL=ordered` (the
    default; `cpu_matmul_impl`)."""
    return on_cpu() and cpu_matmul_impl() == "ordered"


def _fp32_precision(*xs):
    """Off the CPU, fp32 dots run at `Precision.HIGHEST`: GPUs otherwise use TF32 for fp32
    matmuls (the H200 run in reproducibility/gpu differed from the CPU by ~5e-4 in fp32, beyond
    the matrix's 1e-4 bound for the stock control). None (the default) on the CPU, whose fp32 dots
    are full precision, so CPU programs are unchanged. Not yet run on a GPU."""
    if on_cpu() or not all(x.dtype == jnp.float32 for x in xs):
        return None
    return jax.lax.Precision.HIGHEST


def accel_matmul_impl() -> str:
    """The accelerator matmul's form (module doc): `LOOPRL_ACCEL_MATMUL`, `xla` (default) or
    `pallas`. Read when a program is traced. Raises ConfigError naming the variable and the
    choices for any other value."""
    impl = os.environ.get("LOOPRL_ACCEL_MATMUL", "xla")
    if impl not in ACCEL_MATMUL_IMPLS:
        raise ConfigError(f"LOOPRL_ACCEL_MATMUL={impl!r}: expected one of "
                          f"{', '.join(ACCEL_MATMUL_IMPLS)}")
    return impl


def cpu_matmul_impl() -> str:
    """The CPU matmul's form (module doc): `LOOPRL_CPU_MATMUL`, `ordered` (default: the FFI
    kernel of `looprl.kernels.ordered_gemm`) or `xla` (the XLA-op construction, the numerics of
    kernel version KERNEL_VERSION, kept so that rollouts sampled under it still verify). Read
    when a program is traced. Raises ConfigError naming the variable and the choices for any
    other value."""
    impl = os.environ.get("LOOPRL_CPU_MATMUL", "ordered")
    if impl not in CPU_MATMUL_IMPLS:
        raise ConfigError(f"LOOPRL_CPU_MATMUL={impl!r}: expected one of "
                          f"{', '.join(CPU_MATMUL_IMPLS)}")
    return impl


def cpu_kernel_version() -> str:
    """The CPU numerics: KERNEL_VERSION_ORDERED (`LOOPRL_CPU_MATMUL=ordered`, the default) or
    KERNEL_VERSION (`xla`), followed by `/<isa>` (`/avx2`, `/avx`, `/sse41`, `/other`) except
    where oneDNN runs its AVX-512 sgemm (`looprl.determinism.cpu_isa`). The ordered matmul's
    bits do not depend on the ISA, but the attention's dots and the `xla` matmul are oneDNN's:
    another sgemm kernel gives a row other bits (2026-12-02: the verify --quick rollouts of an
    AVX2 machine had the AVX-512 machine's tokens and exits, and 56 % of their fp32 log-probs
    bit-equal, max 9.5e-7 apart), so a rollout is refused on a machine of another ISA instead
    of failing its cells."""
    base = KERNEL_VERSION_ORDERED if cpu_matmul_impl() == "ordered" else KERNEL_VERSION
    return base if CPU_ISA == "avx512_core" else f"{base}/{CPU_ISA}"


def kernel_version() -> str:
    """The numerics a rollout is sampled with (`Schedule.kernel_version`): `cpu_kernel_version()`
    on the CPU; off it `KERNEL_VERSION_ACCEL/<xla|pallas>` (`accel_matmul_impl`)."""
    if on_cpu():
        return cpu_kernel_version()
    return f"{KERNEL_VERSION_ACCEL}/{accel_matmul_impl()}"


def row_tile() -> int:
    """The row padding quantum in force (recorded in schedules): on the CPU, ROW_QUANTUM (8 or
    24), to which the XLA form (`LOOPRL_CPU_MATMUL=xla`) pads a matmul's rows and attention pads
    the queries of a call of more than one tile (the tile, `_row_tile_for(M)`, is a multiple of
    it; the ordered kernel's bits do not depend on it, and it pads no matmul row and no single
    query tile); ROW_TILE elsewhere."""
    return ROW_QUANTUM if on_cpu() else ROW_TILE


def _row_tile_for(m: int) -> int:
    """The CPU row tile for an m-row call: the fewest tiles of at most ROW_TILE_MAX rows, each
    the equal share of m rounded up to a multiple of ROW_QUANTUM (quantum 8: m = 300: one
    304-row tile; 1000: two of 504; 4096: eight of 512; quantum 24: 312, two of 504, nine of
    456), so at most ROW_QUANTUM - 1 padding rows per tile. Any multiple of the quantum gives
    the same bits (module doc, argument (3)), so this choice is only about cost."""
    n = -(-max(m, 1) // ROW_TILE_MAX)
    share = -(-max(m, 1) // n)
    return -(-share // ROW_QUANTUM) * ROW_QUANTUM


def _tiles_map(fn, x, axis: int):
    """`fn` applied to fixed-size row tiles of `x` along `axis` (padded with zeros to a multiple
    of `_row_tile_for(n)`), results concatenated and cut back to n along the same axis. One
    tile runs without a loop; more run in one `lax.map`, so `fn` is traced once, at one shape."""
    n = x.shape[axis]
    t = _row_tile_for(n)
    x, _ = _pad_rows(x, axis, t)
    tiles = x.shape[axis] // t
    if tiles == 1:
        y = fn(x)
    else:
        xs = jnp.moveaxis(x.reshape(*x.shape[:axis], tiles, t, *x.shape[axis + 1:]), axis, 0)
        ys = jax.lax.map(fn, xs)
        y = jnp.moveaxis(ys, 0, axis)
        y = y.reshape(*y.shape[:axis], tiles * t, *y.shape[axis + 2:])
    return jax.lax.slice_in_dim(y, 0, n, axis=axis)


def _blocked_weight(w_IxO):
    """`[nb, K_BLOCK, O16]` view of a weight: O zero-padded to a multiple of N_MIN, I
    zero-padded to a multiple of K_BLOCK when it is longer than K_BLOCK (else one block of I).
    Zero rows add exact zeros to the fixed-order block sum. An fp32 weight as it is; a 2-byte
    float weight (bf16, f16) as its uint16 bits (zero bits are +0.0), widened to fp32 one block
    at a time where the block is used (`_weight_block`): a whole-weight fp32 copy, loop-invariant,
    would be hoisted out of the decode loop and held through it (0.4 GB for Ouro-1.4B's
    lm_head, issue 19). The widening is exact either way, so every dot sees the same fp32
    block."""
    w = w_IxO
    if w.dtype != jnp.float32 and w.dtype.itemsize == 2:
        w = jax.lax.bitcast_convert_type(w, jnp.uint16)
    elif w.dtype != jnp.float32:
        w = w.astype(jnp.float32)
    return _k_blocks(w)


def _k_blocks(w_IxO):
    """`[nb, kb, O16]`: O zero-padded to a multiple of N_MIN, I cut into kb = min(I, K_BLOCK)
    long blocks (zero-padded), in the weight's own dtype."""
    w, _ = _pad_rows(w_IxO, 1, N_MIN)
    kb = min(w.shape[0], K_BLOCK)
    w, _ = _pad_rows(w, 0, kb)
    return w.reshape(-1, kb, w.shape[1])


def _weight_block(w_ZxIxO, j, dtype):
    """Block j (traced) of a `_blocked_weight` of a `dtype` weight, as fp32 `[kb, O16]`."""
    wj = jax.lax.dynamic_index_in_dim(w_ZxIxO, j, 0, keepdims=False)
    if wj.dtype == jnp.uint16:
        wj = jax.lax.bitcast_convert_type(wj, dtype).astype(jnp.float32)
    return wj


def _kblocked_dot(x_RxI, w_ZxIxO, dtype):
    """`x @ w` for one small fp32 row tile (R <= BATCHED_MAX_ROWS, or a single block) and a
    `_blocked_weight` of a `dtype` weight: every dot is `[R, kb] x [kb, O16]` (kb <= K_BLOCK,
    so nothing below splits the contraction), partial products summed in block order in fp32,
    from the first. An fp32 weight's partials come from one batched dot (the DotThunk runs it
    as nb matmuls of that same shape, reading the weight in place); a 2-byte weight's from a
    `fori_loop` of those nb dots, each block widened as it is used: the same dots and adds."""
    nb, kb, o = w_ZxIxO.shape
    t = x_RxI.shape[0]
    x_RxI, _ = _pad_rows(x_RxI, 1, kb)
    if w_ZxIxO.dtype == jnp.uint16:
        def part(j):
            xb = jax.lax.dynamic_slice_in_dim(x_RxI, j * kb, kb, 1)
            return jnp.dot(xb, _weight_block(w_ZxIxO, j, dtype),
                           preferred_element_type=jnp.float32)
        return jax.lax.fori_loop(1, nb, lambda j, acc: acc + part(j), part(0))
    if nb == 1:
        return jnp.dot(x_RxI, w_ZxIxO[0], preferred_element_type=jnp.float32)
    x_ZxRxI = jnp.swapaxes(x_RxI.reshape(t, nb, kb), 0, 1)
    parts = jnp.einsum("zri,zio->zro", x_ZxRxI, w_ZxIxO, preferred_element_type=jnp.float32)
    acc = parts[0]
    for j in range(1, nb):
        acc = acc + parts[j]
    return acc


def _looped_matmul(rows_MxI, w_ZxIxO, out_dtype, t, dtype):
    """Large tiles (R > BATCHED_MAX_ROWS, more than one K block): one `fori_loop` step per
    (row tile, K block), tile-major, K blocks in order; each step is one `[R, kb] x [kb, O16]`
    dot of a `[R, kb]` slice of x (cast to fp32 there) and the j-th weight block, added into the
    tile's fp32 accumulator, which starts at -0.0 (-0.0 + p == p bitwise for every p, so the sum
    has the bits of `p0 + p1 + ...`, the small-tile sum). fp32 output: the accumulator is the
    output itself, updated in place (`dynamic_update_slice` in the loop carry), so the only
    temporaries are one partial and one x block. Other output dtypes: an inner loop over the K
    blocks on a `[R, O16]` fp32 accumulator, cast into the output per tile. Same dots, same adds
    in the same order as `_kblocked_dot`, so the same bits.

    Rows are not padded when M >= R: the last tile starts at M - R instead of at a multiple of
    R, so it overlaps the tile before it, and recomputes the overlapped rows from a fresh
    accumulator (block 0 is written, not added: -0.0 + p0 == p0). The recomputed rows get the
    bits they already had, since a row's bits do not depend on its place in a tile (module doc,
    argument (3)), so writing them twice changes nothing. Padding M up to a multiple of R
    instead would copy x and the output (at M = 4096 with the 456-row tiles of quantum 24, the
    fp32 down_proj held 153 MB against stock's 32 MB)."""
    nb, kb, o16 = w_ZxIxO.shape
    m = rows_MxI.shape[0]
    x = pad_to_multiple(rows_MxI, 0, t) if m < t else rows_MxI  # one tile of R rows
    x, _ = _pad_rows(x, 1, kb)
    mp = x.shape[0]  # max(M, R) rows, computed in tiles starting at 0, R, ..., and mp - R
    nt = -(-mp // t)

    def tile_start(i):
        return jnp.minimum(i * t, mp - t)

    def partial(r, j):
        xb = jax.lax.dynamic_slice(x, (r, j * kb), (t, kb)).astype(jnp.float32)
        return jnp.dot(xb, _weight_block(w_ZxIxO, j, dtype), preferred_element_type=jnp.float32)

    if out_dtype == jnp.float32:
        def step(s, out):
            r, j = tile_start(s // nb), s % nb
            acc = jax.lax.dynamic_slice(out, (r, 0), (t, o16))
            acc = jnp.where(j == 0, jnp.float32(-0.0), acc)  # a tile's sum starts afresh
            return jax.lax.dynamic_update_slice(out, acc + partial(r, j), (r, 0))

        out = jnp.full((mp, o16), -0.0, jnp.float32)
        return jax.lax.fori_loop(0, nt * nb, step, out)[:m]  # [:M] of M rows: no op (jnp)

    def tile(i, out):
        r = tile_start(i)
        acc = jax.lax.fori_loop(0, nb, lambda j, acc: acc + partial(r, j),
                                jnp.full((t, o16), -0.0, jnp.float32))
        return jax.lax.dynamic_update_slice(out, acc.astype(out_dtype), (r, 0))

    return jax.lax.fori_loop(0, nt, tile, jnp.zeros((mp, o16), out_dtype))[:m]


def _accel_matmul(rows_MxI, w_IxO, out_dtype):
    """The accelerator form (module doc): rows zero-padded to ROW_TILE-row tiles run in one
    `lax.map`; per tile a `fori_loop` over the 128-long K blocks adds each `[ROW_TILE, kb] x
    [kb, O16]` dot (fp32 accumulation, `Precision.HIGHEST` for fp32 operands) into an fp32
    accumulator that starts at -0.0. Operands stay in their dtype (bf16 on the tensor cores)."""
    prec = _fp32_precision(rows_MxI, w_IxO)
    o = w_IxO.shape[1]
    w_ZxIxO = _k_blocks(w_IxO)
    nb, kb, o16 = w_ZxIxO.shape
    x, m = _pad_rows(rows_MxI, 0, ROW_TILE)
    x, _ = _pad_rows(x, 1, kb)
    x_NxZxRxI = jnp.swapaxes(x.reshape(-1, ROW_TILE, nb, kb), 1, 2)

    def tile(x_ZxRxI):
        def step(z, acc):
            return acc + jnp.dot(x_ZxRxI[z], w_ZxIxO[z], preferred_element_type=jnp.float32,
                                 precision=prec)
        return jax.lax.fori_loop(0, nb, step, jnp.full((ROW_TILE, o16), -0.0, jnp.float32))

    y = jax.lax.map(tile, x_NxZxRxI)
    return y.reshape(-1, o16)[:m, :o].astype(out_dtype)


def _tiled_matmul_fwd_impl(rows_MxI, w_IxO, out_dtype):
    if not on_cpu():
        if accel_matmul_impl() == "pallas":
            return pallas_matmul(rows_MxI, w_IxO.astype(rows_MxI.dtype), out_dtype,
                                 block_rows=ROW_TILE)
        return _accel_matmul(rows_MxI, w_IxO, out_dtype)
    if cpu_matmul_impl() == "ordered":
        w = w_IxO if w_IxO.dtype in (jnp.float32, jnp.bfloat16) else w_IxO.astype(jnp.float32)
        return ordered_matmul(rows_MxI.astype(jnp.float32), w).astype(out_dtype)
    o = w_IxO.shape[1]
    wb = _blocked_weight(w_IxO)
    t = _row_tile_for(rows_MxI.shape[0])
    if wb.shape[0] > 1 and t > BATCHED_MAX_ROWS:
        return _looped_matmul(rows_MxI, wb, out_dtype, t, w_IxO.dtype)[:, :o]

    def tile(x_RxI):
        return _kblocked_dot(x_RxI.astype(jnp.float32), wb, w_IxO.dtype).astype(out_dtype)

    return _tiles_map(tile, rows_MxI, 0)[:, :o]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _tiled_matmul(rows_MxI, w_IxO, out_dtype):
    return _tiled_matmul_fwd_impl(rows_MxI, w_IxO, out_dtype)


def _tiled_matmul_fwd(rows_MxI, w_IxO, out_dtype):
    return _tiled_matmul_fwd_impl(rows_MxI, w_IxO, out_dtype), (rows_MxI, w_IxO)


def _tiled_matmul_bwd(out_dtype, res, g_MxO):
    """Plain dots: the backward needs no invariance (DESIGN.md §4); full precision for fp32
    off the CPU, as the stock dots."""
    rows, w = res
    prec = _fp32_precision(g_MxO, w)
    dx = jnp.dot(g_MxO, w.T.astype(g_MxO.dtype), preferred_element_type=jnp.float32,
                 precision=prec)
    dw = jnp.dot(rows.T.astype(g_MxO.dtype), g_MxO, preferred_element_type=jnp.float32,
                 precision=prec)
    return dx.astype(rows.dtype), dw.astype(w.dtype)


_tiled_matmul.defvjp(_tiled_matmul_fwd, _tiled_matmul_bwd)


def matmul(x_MxI: jax.Array, w_IxO: jax.Array, out_dtype=None) -> jax.Array:
    """Row-invariant `x @ w` (module doc): leading dims of x are flattened into rows.

    On the CPU: the ordered FFI kernel (`looprl.kernels.ordered_gemm`; rows and a bf16 weight
    widened to fp32, exact; fp32 result cast to `out_dtype`); with `LOOPRL_CPU_MATMUL=xla` rows
    zero-padded to a multiple of the row tile `_row_tile_for(M)`, every dot `[R, 128] x [128,
    O16]` in fp32 (I in 128-long blocks summed in order, O padded to a multiple of N_MIN),
    small tiles batched, large ones in one `fori_loop`. Backward by plain dots
    (`jax.custom_vjp`). Elsewhere: fixed ROW_TILE-row tiles, every dot
    `[ROW_TILE, 128] x [128, O16]`, K blocks summed in order (`LOOPRL_ACCEL_MATMUL=xla`), or the
    Pallas kernel with fixed blocks (`pallas`); module doc.

    Args:
      x_MxI: `[..., I]` any float dtype. w_IxO: `[I, O]` same dtype as x.
      out_dtype: accumulate/return dtype (`preferred_element_type`); default x.dtype.
    Returns: `[..., O]`.
    Raises: ConfigError for an unknown LOOPRL_CPU_MATMUL / LOOPRL_ACCEL_MATMUL, or when the
      ordered kernel cannot be built (no C++ compiler: `ordered_gemm.build`).
    """
    x = x_MxI
    lead = x.shape[:-1]
    i, o = x.shape[-1], w_IxO.shape[-1]
    rows = x.reshape(-1, i)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    y = _tiled_matmul(rows, w_IxO, out_dtype)
    return y.reshape(*lead, o)


class LayerWeight(NamedTuple):
    """Layer `index` (an int32 scalar, may be traced) of a stacked weight `[L, I, O]`, for
    `layer_matmul` to read in place (the sampler's layer loop, `layers.stack_pass`)."""
    stack: jax.Array
    index: jax.Array


def reads_layers_in_place() -> bool:
    """Whether `layer_matmul` reads a stacked weight's layer in place (XLA CPU's ordered
    kernel), rather than slicing it out first (every other form)."""
    return on_ordered_cpu()


def layer_matmul(x_MxI: jax.Array, w: LayerWeight, out_dtype=None) -> jax.Array:
    """`matmul(x, w.stack[w.index])`, the same bits, with the layer read in place on XLA CPU's
    ordered kernel (`ordered_gemm.ordered_matmul_layer`): a `lax.scan` over the stack slices
    each layer's weight into a copy before the kernel reads it (at Ouro-1.4B width in fp32, 46
    MB for each MLP weight, three a layer pass: a third of the decode's time). Elsewhere the
    layer is sliced and `matmul` runs. Not differentiable on XLA CPU (the sampler's form).

    Args: x `[..., I]` float; w a `LayerWeight` of a `[L, I, O]` stack in x's dtype (float32 or
      bfloat16); out_dtype as `matmul`. Returns `[..., O]`."""
    if not reads_layers_in_place():
        return matmul(x_MxI, jax.lax.dynamic_index_in_dim(w.stack, w.index, 0, False), out_dtype)
    lead, i = x_MxI.shape[:-1], x_MxI.shape[-1]
    out_dtype = jnp.dtype(out_dtype or x_MxI.dtype)
    y = ordered_matmul_layer(x_MxI.reshape(-1, i).astype(jnp.float32), w.stack, w.index)
    return y.astype(out_dtype).reshape(*lead, w.stack.shape[-1])


def _masked_probs(scores_BxHxRxS, mask_BxRxS, scale, dtype, softmax_fn):
    """fp32 scores -> probabilities in the compute dtype: scaled, masked slots set to MASK_VALUE
    (probability exactly 0), fp32 softmax over the key axis, cast to `dtype`."""
    scores = jnp.where(mask_BxRxS[:, None], scores_BxHxRxS * jnp.float32(scale), MASK_VALUE)
    return softmax_fn(scores).astype(dtype)


def _attention_probs_values(q_BxHxRxK, k_BxHxSxK, v_BxHxSxK, mask_BxRxS, scale, dtype, prec,
                            softmax_fn, key_block=None, score_blocks=False):
    """The attention math on one block of queries (the accelerator form and the plain backward;
    the CPU form is `_attention_cpu_impl`): fp32 scores, mask, fp32 softmax, probs cast to the
    compute dtype, value product accumulated in fp32, cast to `dtype`.
    `score_blocks` (the accelerator form): the scores too in `key_block`-key blocks, one
    `[R, K] x [K, key_block]` dot per (b, h, block), so no dot's shape depends on S."""
    if score_blocks:
        B, H, R, K = q_BxHxRxK.shape
        nb = k_BxHxSxK.shape[2] // key_block
        q_BxHxZxRxK = jnp.broadcast_to(q_BxHxRxK[:, :, None], (B, H, nb, R, K))
        k_BxHxZxCxK = k_BxHxSxK.reshape(B, H, nb, key_block, K)
        scores = jnp.einsum("bhjck,bhjsk->bhjcs", q_BxHxZxRxK, k_BxHxZxCxK,
                            preferred_element_type=jnp.float32, precision=prec)
        scores = jnp.moveaxis(scores, 2, 3).reshape(B, H, R, nb * key_block)
    else:
        scores = jnp.einsum("bhck,bhsk->bhcs", q_BxHxRxK, k_BxHxSxK,
                            preferred_element_type=jnp.float32, precision=prec)
    probs = _masked_probs(scores, mask_BxRxS, scale, dtype, softmax_fn).astype(v_BxHxSxK.dtype)
    S = v_BxHxSxK.shape[2]
    if key_block is None or S <= key_block:
        return jnp.einsum("bhcs,bhsk->bhck", probs, v_BxHxSxK, precision=prec,
                          preferred_element_type=jnp.float32).astype(dtype)
    # value product in key_block-long blocks aligned to key positions (S is a multiple of it),
    # one batched dot over (b, h, block), partials summed in block order
    B, H, R, _ = probs.shape
    nb = S // key_block
    p = jnp.moveaxis(probs.reshape(B, H, R, nb, key_block), 3, 2)
    v = v_BxHxSxK.reshape(B, H, nb, key_block, -1)
    parts = jnp.einsum("bhjck,bhjkd->bhjcd", p, v, preferred_element_type=jnp.float32,
                       precision=prec)
    acc = parts[:, :, 0]
    for j in range(1, nb):
        acc = acc + parts[:, :, j]
    return acc.astype(dtype)


def _keys_from_first_live(x, offset_B, axis: int, start=0, length=None, period=None):
    """Slots `start .. start + length` (default: all) of `x`'s key axis rotated left per row by
    its offset modulo `period` (default: the axis length S): rotated slot s holds the key at
    `(s + offset_b) mod period`. Exact (a gather); the rotated-out leading slots are masked
    ones. With `period` > S (x not padded to the blocks the mask is padded to), the slots at S or
    past it are padding slots, masked, and read x's last key instead: any finite value serves
    there (its probability is exactly +0, and `+0 * v` is a zero). `start` may be traced (a
    loop's block index). A bf16 x is gathered as its uint16 bits (the same values)."""
    if x.dtype == jnp.bfloat16:  # gather the bits: XLA CPU widens the whole operand of a bf16
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16)  # gather to fp32 first
        return jax.lax.bitcast_convert_type(
            _keys_from_first_live(bits, offset_B, axis, start, length, period), jnp.bfloat16)
    S = x.shape[axis]
    period = S if period is None else period
    length = period if length is None else length
    idx = (start + jnp.arange(length)[None, :] + offset_B[:, None]) % period  # [B, length]
    if period > S:
        idx = jnp.minimum(idx, S - 1)
    shape = [1] * x.ndim
    shape[0], shape[axis] = idx.shape
    return jnp.take_along_axis(x, idx.reshape(shape), axis=axis)


def _mask_in_blocks(mask_BxCxS):
    """The mask padded to a multiple of K_BLOCK key slots (the new slots masked), and each row's
    first key any of its queries may see (`offset_B`, int `[B]`: the rotation)."""
    mask, _ = _pad_rows(mask_BxCxS, 2, K_BLOCK)
    return mask, jnp.argmax(jnp.any(mask, axis=1), axis=-1)


def _keys_in_blocks_from_first_live(k_BxHxSxK, v_BxHxSxK, mask_BxCxS):
    """K, V and the mask padded to K_BLOCK multiples and rotated per row so that the row's first
    live key sits in slot 0 (exact: pads and gathers)."""
    mask, offset_B = _mask_in_blocks(mask_BxCxS)
    k, _ = _pad_rows(k_BxHxSxK, 2, K_BLOCK)
    v, _ = _pad_rows(v_BxHxSxK, 2, K_BLOCK)
    return tuple(_keys_from_first_live(x, offset_B, 2) for x in (k, v, mask))


def _attention_accel_impl(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale):
    """Accelerator form (module doc): the CPU form's rotated 128-key blocks, K/V in the compute
    dtype, scores in key blocks too, query tiles of a fixed ROW_TILE rows, always in one
    `lax.map` (a decode step's one query is a 64-row tile), fp32 dots at `Precision.HIGHEST`."""
    B, H, C, K = q_BxHxCxK.shape
    dtype = q_BxHxCxK.dtype
    prec = _fp32_precision(q_BxHxCxK, k_BxSxHxK)
    k, v, mask = _keys_in_blocks_from_first_live(jnp.swapaxes(k_BxSxHxK, 1, 2),
                                                 jnp.swapaxes(v_BxSxHxK, 1, 2), mask_BxCxS)

    def tile(qm):
        q_BxHxRxK, mask_BxRxS = qm
        return _attention_probs_values(q_BxHxRxK, k, v, mask_BxRxS, scale, dtype, prec, softmax,
                                       K_BLOCK, score_blocks=True)

    q_pad, _ = _pad_rows(q_BxHxCxK, 2, ROW_TILE)
    m_pad, _ = _pad_rows(mask, 1, ROW_TILE)
    return _map_query_tiles(tile, q_pad, m_pad, ROW_TILE)[:, :, :C]


def _map_query_tiles(tile, q_BxHxCxK, mask_BxCxS, t: int):
    """`tile((q [B, H, t, K], mask [B, t, S]))` over the t-row query tiles of padded queries, in
    one `lax.map` (traced once, at one shape), results joined back to `[B, H, C, K]`."""
    B, H, C, K = q_BxHxCxK.shape
    tiles = C // t
    qs = jnp.moveaxis(q_BxHxCxK.reshape(B, H, tiles, t, K), 2, 0)
    ms = jnp.moveaxis(mask_BxCxS.reshape(B, tiles, t, -1), 1, 0)
    return jnp.moveaxis(jax.lax.map(tile, (qs, ms)), 0, 2).reshape(B, H, tiles * t, K)


def _live_key_blocks(mask_BxRxS):
    """How many K_BLOCK-key blocks, from slot 0, hold every key any query row of the tile may see:
    int32 scalar, 0 when no row sees a key (a tile of padding rows)."""
    S = mask_BxRxS.shape[-1]
    live_S = jnp.any(mask_BxRxS, axis=(0, 1))
    last = jnp.max(jnp.where(live_S, jnp.arange(1, S + 1, dtype=jnp.int32), 0))
    return (last + K_BLOCK - 1) // K_BLOCK


def _attention_cpu_impl(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, scale, cached=None):
    """CPU form (module doc): key axis taken in K_BLOCK-key blocks (the mask padded to a multiple
    of K_BLOCK, the new slots masked), each row's keys rotated to start at its first live key,
    queries in row tiles (`_row_tile_for(C)`, one `lax.map` when there is more than one), and
    per tile both dots in K_BLOCK-key blocks over the live blocks only (`_live_key_blocks`; a
    `fori_loop` per dot): block j's scores are one `[R, K] x [K, 128]` dot per (b, h) written
    into an fp32 `[B, H, R, S]` buffer, the masked fp32 softmax runs over the whole key axis
    (the real query rows only when there is one tile), and block j's value partial, one
    `[R, 128] x [128, K]` dot per (b, h), is added in block order to an accumulator that starts
    at -0.0. Each block of K/V is gathered (rotated) from the cache's `[B, S, H, K]` layout and
    cast to fp32 where it is used, so no whole-cache copy is made and a decode step's attention
    costs what its live keys cost, not the cache length. The mask: bool `[B, C, S]`, or the
    `KeyRange` it comes from (the sampler's; its rotated form then comes from the indices)."""
    B, H, C, K = q_BxHxCxK.shape
    dtype = q_BxHxCxK.dtype
    if isinstance(mask_BxCxS, KeyRange):  # the same rotated mask from its indices
        mask, offset_B = mask_BxCxS.rotated_blocks()
    else:
        mask, offset_B = _mask_in_blocks(mask_BxCxS)
        mask = _keys_from_first_live(mask, offset_B, 2)
    S = mask.shape[2]
    ordered = cpu_matmul_impl() == "ordered"
    if cached is None and ordered:  # the slot as a one-slot cache (its window: its own slot 0)
        cached = CachedKV(k_BxSxHxK[None], v_BxSxHxK[None], 0, jnp.arange(B, dtype=jnp.int32), 0,
                          k_BxSxHxK[:, :1], v_BxSxHxK[:, :1])
    elif cached is not None and not ordered:
        raise ValueError("the in-place KV cache form needs the ordered CPU kernels")
    # K/V are not padded: a padded copy made XLA slow the block loop down 2.5-3x when S is not a
    # multiple of K_BLOCK (2026-12-03: 29 vs 11 ms at 256 rows, S = 50); the gather reads the
    # padding slots from the last key instead (`_keys_from_first_live`, `period`)

    def key_block(x_BxSxHxK, j):
        """Block j of the rotated key axis of x, fp32 `[B, H, K_BLOCK, K]` (an exact gather from
        the cache's own layout: a head-major copy of the whole cache would cost the cache
        length, not the live keys)."""
        x_BxZxHxK = _keys_from_first_live(x_BxSxHxK, offset_B, 1, j * K_BLOCK, K_BLOCK,
                                          period=S)
        return jnp.swapaxes(x_BxZxHxK, 1, 2).astype(jnp.float32)

    def per_head_dot(x_BxHxRxI, w_BxHxIxO, transposed=False):
        """`x @ w` (`x @ w^T` when transposed) per (b, h), fp32, XLA's batched dot (the XLA
        form; the ordered form's products are the attention kernels below)."""
        spec = "bhri,bhoi->bhro" if transposed else "bhri,bhio->bhro"
        return jnp.einsum(spec, x_BxHxRxI, w_BxHxIxO, preferred_element_type=jnp.float32)

    def tile(qm, live_rows=None):
        q_BxHxRxK, mask_BxRxS = qm
        q32 = q_BxHxRxK.astype(jnp.float32)
        R = q32.shape[2]
        n = _live_key_blocks(mask_BxRxS)

        def over_live_blocks(body, init):
            """`body(j, carry)` for j < n; one block is run directly (no loop: a decode step of
            a short cache pays no loop overhead, and a live row has n = 1 there anyway)."""
            if S == K_BLOCK:
                return body(0, init)
            return jax.lax.fori_loop(0, n, body, init)

        def scores_block(j, buf_BxHxRxS):
            s = per_head_dot(q32, key_block(k_BxSxHxK, j), transposed=True)
            return jax.lax.dynamic_update_slice_in_dim(buf_BxHxRxS, s, j * K_BLOCK, axis=3)

        if ordered:  # the same products, the cache read in place (no block or slot copies)
            live = jnp.int32(1) if S == K_BLOCK else n  # over_live_blocks runs block 0 anyway
            place = (cached.rows_M, offset_B, cached.slot, cached.w0, live)
            seen_BxS = jnp.any(mask_BxRxS, axis=1)  # rotated slots a query of the row sees
            span_B = jnp.max(jnp.where(seen_BxS, jnp.arange(1, S + 1, dtype=jnp.int32), 0), 1)
            scores = ordered_attention_scores(q32, cached.k_NxBxSxJxK, cached.k_win_MxCxJxK,
                                              *place[:2], span_B, *place[2:], S)
        else:
            scores = over_live_blocks(scores_block, jnp.zeros((B, H, R, S), jnp.float32))
        if live_rows is not None and live_rows < R:  # the softmax on the real query rows only
            scores, mask_BxRxS = scores[:, :, :live_rows], mask_BxRxS[:, :live_rows]
        probs = _masked_probs(scores, mask_BxRxS, scale, dtype, softmax).astype(jnp.float32)
        if probs.shape[2] < R:
            probs = jnp.pad(probs, [(0, 0), (0, 0), (0, R - probs.shape[2]), (0, 0)])

        def values_block(j, acc_BxHxRxK):
            p = jax.lax.dynamic_slice_in_dim(probs, j * K_BLOCK, K_BLOCK, axis=3)
            return acc_BxHxRxK + per_head_dot(p, key_block(v_BxSxHxK, j))

        if ordered:
            acc = ordered_attention_values(probs, cached.v_NxBxSxJxK, cached.v_win_MxCxJxK,
                                           *place[:2], span_B, *place[2:])
        else:
            acc = over_live_blocks(values_block, jnp.full((B, H, R, K), -0.0, jnp.float32))
        return acc.astype(dtype)

    t = _row_tile_for(C)
    if ordered and C <= t:  # one query tile, unpadded: the ordered dots need no row quantum
        return tile((q_BxHxCxK, mask))
    q_pad, _ = _pad_rows(q_BxHxCxK, 2, t)
    m_pad, _ = _pad_rows(mask, 1, t)
    if q_pad.shape[2] == t:  # one query tile (a decode step)
        out = tile((q_pad, m_pad), live_rows=C)
    else:
        out = _map_query_tiles(tile, q_pad, m_pad, t)
    return out[:, :, :C]


def _attention_tiled_impl(q, k, v, mask, scale):
    impl = _attention_cpu_impl if on_cpu() else _attention_accel_impl
    return impl(q, k, v, mask, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention_tiled(q, k, v, mask, scale):
    return _attention_tiled_impl(q, k, v, mask, scale)


def _attention_plain(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask, scale):
    return _attention_probs_values(q_BxHxCxK, jnp.swapaxes(k_BxSxHxK, 1, 2),
                                   jnp.swapaxes(v_BxSxHxK, 1, 2), mask, scale, q_BxHxCxK.dtype,
                                   _fp32_precision(q_BxHxCxK, k_BxSxHxK),
                                   functools.partial(jax.nn.softmax, axis=-1))


def _attention_tiled_fwd(q, k, v, mask, scale):
    return _attention_tiled_impl(q, k, v, mask, scale), (q, k, v, mask)


def _attention_tiled_bwd(scale, res, g):
    """The same math without tiles or padding (plain dots, `jax.nn.softmax`): the backward
    needs no invariance."""
    q, k, v, mask = res
    _, vjp = jax.vjp(lambda q, k, v: _attention_plain(q, k, v, mask, scale), q, k, v)
    return (*vjp(g), None)


_attention_tiled.defvjp(_attention_tiled_fwd, _attention_tiled_bwd)


def repeat_kv_heads(k_BxSxJxK, v_BxSxJxK, H: int):
    """GQA: each of the J key/value heads repeated H // J times along the head axis (head h
    reads kv head h // (H // J), HF's `repeat_kv`), giving `[B, S, H, K]` each; unchanged when
    J = H. An exact copy, so it moves no bits."""
    J = k_BxSxJxK.shape[2]
    if J == H:
        return k_BxSxJxK, v_BxSxJxK
    return (jnp.repeat(k_BxSxJxK, H // J, axis=2), jnp.repeat(v_BxSxJxK, H // J, axis=2))


def attention(q_BxCxHxK, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, scale: float):
    """Causal softmax attention of C queries over the whole key axis S (fixed length).

    Scores are accumulated in fp32, masked with a finite large negative value, softmax in fp32,
    probabilities cast to the compute dtype for the value product (the HF eager convention).
    On the CPU the key axis is cut into 128-key blocks rotated per row to start at its first
    live key, the queries run in row tiles (multiples of ROW_QUANTUM), both dots per 128-key
    block over the blocks holding a live key only (module doc), backward by plain dots
    (`jax.custom_vjp`); elsewhere the same rotated key blocks, scores in key blocks too, query
    tiles of ROW_TILE rows, fp32 dots at `Precision.HIGHEST` (module doc).

    Args:
      q_BxCxHxK: queries `[B, C, H, K]`; k/v `[B, S, J, K]` with J kv heads, H % J == 0 (GQA,
        `repeat_kv_heads`);
      mask_BxCxS: bool, True where query c may attend to key s.
    Returns: `[B, C, H, K]` in q's dtype.
    """
    B, C, H, K = q_BxCxHxK.shape
    k_BxSxHxK, v_BxSxHxK = repeat_kv_heads(k_BxSxJxK, v_BxSxJxK, H)
    q_BxHxCxK = jnp.swapaxes(q_BxCxHxK, 1, 2)  # K/V stay in the cache's layout [B, S, H, K]
    out = _attention_tiled(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask_BxCxS, float(scale))
    return jnp.swapaxes(out, 1, 2)


class KeyRange(NamedTuple):
    """The causal, left-padded key mask as its two index vectors: query c of row b may see key
    s iff `pad_B[b] <= s <= layout_C[c]` (s < S). `mask()` is that `[B, C, S]` mask
    (`layers.key_mask`); the ordered attention builds its rotated form from the indices instead
    of gathering it (`rotated_blocks`). pad_B: left-padding counts, 0 <= pad_b <= S (the
    sampler's); layout_C: C >= 1 layout indices (`w0 + arange(C)` in the sampler; any order
    works); both int32-range (a review fuzzed both forms equal over these, and found negative
    pads and C = 0 outside them)."""
    pad_B: jax.Array  # int [B]
    layout_C: jax.Array  # int [C]
    S: int

    def mask(self):
        s = jnp.arange(self.S)
        return ((s[None, None, :] >= self.pad_B[:, None, None])
                & (s[None, None, :] <= self.layout_C[None, :, None]))

    def rotated_blocks(self):
        """`(mask, offset_B)` as `_mask_in_blocks` then `_keys_from_first_live(mask, offset_B,
        2)` give them from `mask()`, the same values by construction: the first key any query
        of row b sees is pad_b when `pad_b <= last` (last = min(max_c layout_c, S - 1)), else
        none (offset 0, the row all masked); rotated slot t is key `(t + pad_b) mod Sp`, which a
        query at layout_c sees iff `t <= min(layout_c, S - 1) - pad_b` (for t >= Sp - pad_b the
        key wraps below pad_b: masked; for an all-masked row the bound is negative: all False).
        An iota compare instead of a pad, an argmax and a gather per layer pass. Returns bool
        `[B, C, Sp]` (Sp = S rounded up to K_BLOCK) and int32 `[B]`."""
        Sp = -(-self.S // K_BLOCK) * K_BLOCK
        pad_B = self.pad_B.astype(jnp.int32)
        last_C = jnp.minimum(self.layout_C.astype(jnp.int32), self.S - 1)
        offset_B = jnp.where(pad_B <= jnp.max(last_C), pad_B, 0)
        t = jnp.arange(Sp, dtype=jnp.int32)
        mask = t[None, None, :] <= (last_C[None, :, None] - pad_B[:, None, None])
        return mask, offset_B


class CachedKV(NamedTuple):
    """A layer's keys and values as the sampler's KV cache holds them, to be read in place.

    Row m's keys are slot `slot` of `k_NxBxSxJxK` (N slots, one per (loop, layer): the
    sampler's `[T, L, B, S, J, K]` cache reshaped) at batch row `rows_M[m]`, with the chunk's
    window `k_win_MxCxJxK` written over slots [w0, w0 + C) (w0 clamped to [0, S - C]); values
    alike. `slots()` makes that slot (a copy); `attention_cached` reads it without one."""
    k_NxBxSxJxK: jax.Array
    v_NxBxSxJxK: jax.Array
    slot: jax.Array  # int32 scalar
    rows_M: jax.Array  # int32 [M]
    w0: jax.Array  # int32 scalar
    k_win_MxCxJxK: jax.Array
    v_win_MxCxJxK: jax.Array

    def slots(self):
        """`(k, v)`, each `[M, S, J, K]`: the rows' slot with the window written (a copy; the
        cache's dtype)."""
        def one(cache, win):
            rows = jax.lax.dynamic_index_in_dim(cache, self.slot, 0, keepdims=False)[self.rows_M]
            return jax.lax.dynamic_update_slice_in_dim(rows, win.astype(rows.dtype), self.w0, 1)
        return one(self.k_NxBxSxJxK, self.k_win_MxCxJxK), one(self.v_NxBxSxJxK,
                                                              self.v_win_MxCxJxK)


def cache_window(cache_NxBxSxJxK, slot, rows_M, w0, C: int):
    """Slots [w0, w0 + C) of cache slot `slot` at batch rows `rows_M`: `[M, C, J, K]` (w0
    clamped to [0, S - C], as `dynamic_slice` clamps)."""
    N, B, S, J, K = cache_NxBxSxJxK.shape
    win = jax.lax.dynamic_slice(cache_NxBxSxJxK, (slot, 0, w0, 0, 0), (1, B, C, J, K))[0]
    return win[rows_M]


def attention_cached(q_BxCxHxK, kv: CachedKV, mask_BxCxS, scale: float, stock: bool = False):
    """`attention` (or `stock_attention`) over the keys and values `kv` describes, the same
    bits as `attention(q, *kv.slots(), ...)`. With the CPU's ordered kernels (the default) the
    cache is read in place: no slot, sub-batch or K/V block is copied out of it
    (`ordered_gemm.ordered_attention_scores`), and GQA kv heads are read without repeating
    them; elsewhere the slot is made first (`kv.slots()`). The sampler's form: not
    differentiable (the ordered path has no gradient rule).

    Args: q `[B, C, H, K]` (B = M rows); kv: `CachedKV`; mask `[B, C, S]` bool, or the
      `KeyRange` it comes from (the ordered path then builds the rotated mask from its indices).
    Returns `[B, C, H, K]` in q's dtype."""
    if stock or not on_ordered_cpu():
        if isinstance(mask_BxCxS, KeyRange):
            mask_BxCxS = mask_BxCxS.mask()
        form = stock_attention if stock else attention
        return form(q_BxCxHxK, *kv.slots(), mask_BxCxS, scale)
    out = _attention_cpu_impl(jnp.swapaxes(q_BxCxHxK, 1, 2), None, None, mask_BxCxS,
                              float(scale), cached=kv)
    return jnp.swapaxes(out, 1, 2)


def _ones_column(n: int) -> np.ndarray:
    """The literal `[n, 16]` weight of `rowsum`'s product: ones in column 0, zeros elsewhere."""
    ones = np.zeros((n, N_MIN), np.float32)
    ones[:, 0] = 1.0
    return ones


@jax.custom_vjp
def _ordered_rowsum(rows_MxN, keep):
    """`ordered_matmul(rows, ones)[:, :1]`'s bits from `ordered_gemm.row_sum` (float32 `[M, 1]`);
    `keep`: a tuple of arrays kept alive until the sum (`row_sum`), not differentiated."""
    return row_sum(rows_MxN, keep)[:, None]


def _ordered_rowsum_fwd(rows_MxN, keep):
    return _ordered_rowsum(rows_MxN, keep), (rows_MxN, keep)


def _ordered_rowsum_bwd(res, g_Mx1):
    """The product form's backward, unchanged (`_tiled_matmul_bwd` of the sliced cotangent)."""
    rows_MxN, keep = res
    g_MxO = jnp.pad(g_Mx1, [(0, 0), (0, N_MIN - 1)])
    ones = jnp.asarray(_ones_column(rows_MxN.shape[1]))
    dx = _tiled_matmul_bwd(jnp.float32, (rows_MxN, ones), g_MxO)[0]
    # keep's cotangent a symbolic zero (None): an array of zeros added to x's gradient turns its
    # -0.0 entries +0.0 outside jit (a fresh review found it; tested)
    return dx, tuple(None for _ in keep)


_ordered_rowsum.defvjp(_ordered_rowsum_fwd, _ordered_rowsum_bwd)


def rowsum(x, keepdims: bool = True, keep: tuple = ()):
    """Row-invariant sum over the last axis, fp32 `[..., 1]` (`[...]` without keepdims): the
    product of x with a `[N, 16]` ones-in-column-0 literal (XLA's reduce emitter does not give
    every row one order: RMSNorm rows differed between [B, S, D] and [B, 1, D] inputs; a literal
    so that XLA cannot rewrite the dot into a reduce). On XLA CPU's ordered kernel the product's
    column 0 comes from `ordered_gemm.row_sum`, the same chain without the 15 zero columns (bit
    for bit by construction: `fma(x, 1, acc)` is `x + acc`), and `keep` (arrays) are kept alive
    until the sum is taken (`softmax`). Differentiable (the product's backward)."""
    x = x.astype(jnp.float32)
    if on_ordered_cpu():
        y = _ordered_rowsum(x.reshape(-1, x.shape[-1]), tuple(keep))
        y = y.reshape(*x.shape[:-1], 1)
    else:
        y = matmul(x, jnp.asarray(_ones_column(x.shape[-1])))[..., :1]
    return y if keepdims else y[..., 0]


def _row_max(x_MxN):
    """Each row's max as `[M, 1]`, not differentiated (the softmaxes' shift): `ordered_gemm.
    row_max` on XLA CPU's ordered kernel, XLA's reduce elsewhere. Why the bits cannot depend on
    which: a max is one of the row's values, and equal values have one bit pattern except the
    zeros (+0.0, -0.0 and, read as zero under DAZ, subnormals). Where the max is a zero, `x -
    max` is x for every nonzero x and a zero for every zero-like x, whose sign is the only
    thing the choice moves; softmax takes `exp` of it (1 for either sign), and log_softmax
    returns `shifted - log(sum)`, where the sum counts 1 for each zero-like entry: two or more
    of them (the only case with a choice) make log(sum) >= log 2 > 0, which absorbs the zero's
    sign. NaN rows give NaN (payload bits may differ)."""
    x_MxN = jax.lax.stop_gradient(x_MxN)
    if on_ordered_cpu():
        return row_max(x_MxN)[:, None]
    return jnp.max(x_MxN, axis=-1, keepdims=True)


LAST_AXIS_TILE = 64


def _tiled_rows(fn, x):
    """Apply the row-wise `fn` (last axis = a row) to `x` as a `[M, N]` block with M padded to a
    multiple of ROW_TILE (zero rows; always at least one) and N to a multiple of LAST_AXIS_TILE
    (-inf entries), then cut back.

    XLA CPU compiles `exp(x - max)` differently depending on what it fuses with: a producer
    fused into the exp loop (a temperature multiply) is contracted into an FMA there, but not
    when it ends in a padding op first, and row counts below 64 or rows that are not whole
    vectors compiled differently too (log-softmax over a vocabulary of 58 differed between 32
    and 128 rows in low bits). Padding every call, at fixed tiles, gives every row the same
    code: the producer always ends in the pad, fn always reads a materialised tile."""
    lead, n = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, n)
    m = rows.shape[0]
    m_pad = (m // ROW_TILE + 1) * ROW_TILE
    n_pad = -(-n // LAST_AXIS_TILE) * LAST_AXIS_TILE
    rows = jnp.pad(rows, [(0, m_pad - m), (0, 0)])
    if n_pad != n:
        rows = jnp.pad(rows, [(0, 0), (0, n_pad - n)], constant_values=-jnp.inf)
    return fn(rows)[:m, :n].reshape(*lead, n)


def softmax(x):
    """Row-invariant fp32 softmax over the last axis (max is order-free; the sum is `rowsum`).

    Computed on fixed tiles (`_tiled_rows`)."""
    def fn(x):
        e = jnp.exp(x - _row_max(x))
        return e / rowsum(e, keep=(x,))  # x alive: XLA does not write e over it (`row_sum`)

    return _tiled_rows(fn, x.astype(jnp.float32))


def log_softmax(x):
    """Row-invariant fp32 log-softmax over the last axis (entries of -inf stay -inf), on fixed
    tiles (`_tiled_rows`)."""
    def fn(x):
        shifted = x - _row_max(x)
        return shifted - jnp.log(rowsum(jnp.exp(shifted), keep=(x,)))

    return _tiled_rows(fn, x.astype(jnp.float32))


def row_argmax(x_RxN):
    """`jnp.argmax(x, axis=-1)` (int32 `[R]`, each row's first maximum) of x float32 `[R, N]`,
    with x materialised first on XLA CPU's ordered form (`ordered_gemm.row_argmax`, an FFI
    call): fused into XLA's argmax reduce, x's producer runs in the reduce's scalar loop (the
    sampler's Gumbel noise: two logs per element). The same index either way."""
    if on_ordered_cpu():
        return ordered_row_argmax(x_RxN)
    return jnp.argmax(x_RxN, axis=-1).astype(jnp.int32)


def stock_matmul(x, w, out_dtype=None):
    """`x @ w` the common way (no row padding): the baseline, not batch-invariant."""
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=out_dtype or x.dtype,
                      precision=_fp32_precision(x, w))


def stock_attention(q_BxCxHxK, k_BxSxJxK, v_BxSxJxK, mask_BxCxS, scale: float):
    """Attention the common way: keys trimmed to the live prefix (the last query's position + 1
    over all rows, which the caller guarantees by passing a live-length key axis), no row padding,
    scores in the compute dtype as PyTorch eager does before an fp32 softmax."""
    B, C, H, K = q_BxCxHxK.shape
    k_BxSxHxK, v_BxSxHxK = repeat_kv_heads(k_BxSxJxK, v_BxSxJxK, H)
    scores = jnp.einsum("bchk,bshk->bhcs", q_BxCxHxK * jnp.asarray(scale, q_BxCxHxK.dtype),
                        k_BxSxHxK, precision=_fp32_precision(q_BxCxHxK, k_BxSxHxK)
                        ).astype(jnp.float32)
    scores = jnp.where(mask_BxCxS[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_BxCxHxK.dtype)
    return jnp.einsum("bhcs,bshk->bchk", probs, v_BxSxHxK,
                      precision=_fp32_precision(probs, v_BxSxHxK))


def rms_norm(x, weight, eps: float, stock: bool = False):
    """RMSNorm as the reference code does it: normalise in fp32, cast back to x's dtype, then
    multiply by the weight (cast to x's dtype). `x` `[..., D]`, `weight` `[D]`. The mean of
    squares is a `rowsum` (row-invariant) unless `stock`."""
    xf = x.astype(jnp.float32)
    if stock:
        var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    else:
        var = rowsum(xf * xf) * jnp.float32(1.0 / x.shape[-1])
    out = (xf * jax.lax.rsqrt(var + jnp.float32(eps))).astype(x.dtype) * weight.astype(x.dtype)
    return out


def rope_cos_sin(positions, head_dim: int, theta: float, dtype):
    """RoPE tables for integer `positions` `[...]`: cos, sin `[..., head_dim]` (rotate-half
    layout: frequencies repeated twice), computed in fp32 and cast to `dtype` (HF convention)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x_BxCxHxK, cos_BxCxK, sin_BxCxK):
    """q*cos + rotate_half(q)*sin with rotate_half(x) = cat(-x2, x1)."""
    half = x_BxCxHxK.shape[-1] // 2
    x1, x2 = x_BxCxHxK[..., :half], x_BxCxHxK[..., half:]
    rot = jnp.concatenate([-x2, x1], axis=-1)
    return x_BxCxHxK * cos_BxCxK[:, :, None] + rot * sin_BxCxK[:, :, None]
