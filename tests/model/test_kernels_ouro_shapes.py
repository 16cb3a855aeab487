"""Row invariance of looprl.kernels at the real Ouro widths (issue 14): every weight shape
of ouro-1.4b / ouro-2.6b (hidden 2048, 16 heads x 128, MLP 5632, vocabulary 49152; both presets
share these widths), fp32 and bf16, raw bits. Each row of an M-row call must equal the same row
of a large call, also when it sits at another position. The thread count is pinned by the test
suite (`--xla_cpu_multi_thread_eigen=false`, tests/conftest.py via looprl.determinism).
The matmul tests run the default CPU form (`ordered`, the FFI kernel); `cpu_form("xla")` runs the
XLA-op form (kernel version KERNEL_VERSION), which its structural, tile and memory tests are
about."""
import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl import kernels as kn
from looprl.kernels import tiling

D, H, K, F, V = 2048, 16, 128, 5632, 49152
WEIGHTS = {"q/k/v/o": (D, D), "gate/up": (D, F), "down": (F, D), "lm_head": (D, V),
           "exit_gate": (D, 1)}
BIG = 600  # default reference call: 600 rows (two 304-row tiles)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


@pytest.fixture
def cpu_form(monkeypatch):
    """`cpu_form("xla")` / `cpu_form("ordered")`: trace the CPU form `cpu-xla` / `cpu-ordered`
    (`kernels.use_form`); the form is read when a program is traced, so cached traces are
    dropped."""
    scope = contextlib.ExitStack()

    def use(impl):
        scope.close()
        scope.enter_context(kn.use_form(f"cpu-{impl}"))
        jax.clear_caches()
    yield use
    scope.close()
    jax.clear_caches()


_CACHE = {}


def _operands(name, dtype, rows):
    key = (name, dtype, rows)
    if key not in _CACHE:
        i, o = WEIGHTS[name]
        rng = np.random.default_rng(hash(name) % 2**32)
        x = jnp.asarray(rng.standard_normal((rows, i)), dtype)
        w = jnp.asarray(rng.standard_normal((i, o)) / np.sqrt(i), dtype)
        _CACHE.clear()
        _CACHE[key] = (x, w)
    return _CACHE[key]


def _check_rows(name, dtype, row_counts, big=BIG, out_dtype=None, cols=None):
    x, w = _operands(name, dtype, big)
    if cols is not None:  # lm_head: a column subsample keeps the fast test fast
        w = w[:, :cols]
    f = jax.jit(lambda a, b: kn.matmul(a, b, out_dtype))
    ref = _bits(f(x, w))
    bad = []
    for m in row_counts:
        if not np.array_equal(_bits(f(x[:m], w)), ref[:m]):
            bad.append(("first", m))
        off = min(37, big - m)  # the same rows at another position (another tile offset)
        if not np.array_equal(_bits(f(x[off:off + m], w)), ref[off:off + m]):
            bad.append(("at", off, m))
    return bad


FAST_ROWS = (1, 2, 3, 5, 7, 8, 17, 64)


@pytest.mark.parametrize("form", ["ordered", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["gate/up", "down", "exit_gate"])
def test_matmul_rows_do_not_depend_on_the_row_count_at_ouro_widths(name, dtype, form, cpu_form):
    """Regression (issue 14): rows of a 2..7-row `[M, 2048] x [2048, 5632]` call differed from
    the same rows of a 512-row call (fp32 and bf16) with unpadded rows and 128-long K slices
    summed by XLA; M = 49 differed in row 48 alone with plain dots. Both CPU forms; the ordered
    kernel's row counts cross its paths (up to 6 rows, up to 48, more)."""
    cpu_form(form)
    rows = FAST_ROWS + ((6, 48, 49) if form == "ordered" else ())
    assert _check_rows(name, dtype, rows, big=300) == []


@pytest.mark.parametrize("dtype, out_dtype", [("float32", None), ("bfloat16", "float32")])
def test_lm_head_rows_do_not_depend_on_the_row_count(dtype, out_dtype):
    """The lm_head with fp32 output (lm_logits), on a 4096-column slice of the vocabulary
    (the full 49152 columns run in the slow test)."""
    assert _check_rows("lm_head", dtype, (1, 3, 8, 17), big=80, out_dtype=out_dtype,
                       cols=4096) == []


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_matmul_rows_all_counts_at_ouro_widths(name, dtype):
    rows = tuple(range(1, 65)) + (100, 300, 1000, 4096)
    out_dtype = "float32" if name == "lm_head" else None
    big = 4096 + 64
    if name == "lm_head":
        rows, big = tuple(range(1, 17)) + (64, 300, 1000), 1100
    assert _check_rows(name, dtype, rows, big=big, out_dtype=out_dtype) == []


def _attention_case(dtype, C, S, pad, seed=0):
    rng = np.random.default_rng(seed)
    B = 1
    q = jnp.asarray(rng.standard_normal((B, C, H, K)), dtype)
    k = jnp.asarray(rng.standard_normal((B, S, H, K)), dtype)
    v = jnp.asarray(rng.standard_normal((B, S, H, K)), dtype)
    return q, k, v


def _attention_invariant(dtype, S, pad, counts, C_big):
    """Queries at layout positions pad..pad+C_big-1 (left padding `pad`) over a fixed S-key
    cache; chunks of `c` queries starting at several offsets must reproduce the big call."""
    q, k, v = _attention_case(dtype, C_big, S, pad)
    s = jnp.arange(S)

    def mask_for(start, c):
        qpos = pad + start + jnp.arange(c)
        return ((s[None, :] >= pad) & (s[None, :] <= qpos[:, None]))[None]

    f = jax.jit(lambda q, k, v, m: kn.attention(q, k, v, m, K ** -0.5))
    ref = _bits(f(q, k, v, mask_for(0, C_big)))
    bad = []
    for c in counts:
        for start in {0, C_big - c, (C_big - c) // 2}:
            out = _bits(f(q[:, start:start + c], k, v, mask_for(start, c)))
            if not np.array_equal(out, ref[:, start:start + c]):
                bad.append((c, start))
    return bad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pad", [0, 120])  # 120: the live keys straddle the first key block
def test_attention_query_rows_do_not_depend_on_the_chunk_at_ouro_widths(dtype, pad):
    assert _attention_invariant(dtype, S=512, pad=pad, counts=(1, 3, 8, 17), C_big=64) == []


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("S, pad", [(4096, 0), (4096, 1000), (1024, 3), (1024, 128)])
def test_attention_query_rows_all_counts(dtype, S, pad):
    assert _attention_invariant(dtype, S=S, pad=pad, counts=tuple(range(1, 65)),
                                C_big=512) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("C", [1, 17])  # a decode step; a deferred window
def test_attention_does_not_depend_on_the_cache_length_at_ouro_widths(dtype, C):
    """Rows with left pads 0, 37, 200 and 5 whose C queries sit at their last live positions
    (33, 300, 130 and 260 live keys): the same queries over the same keys in a cache of 384,
    768 and 1536 slots, the slots past the live keys filled with other values (masked), give the
    same bits. What the live-prefix learner and a decode step's skipped key blocks rely on:
    every dot is one `[R, K] x [K, 128]` or `[R, 128] x [128, K]` per (b, h, block), whatever
    the cache length (module doc)."""
    rng = np.random.default_rng(7)
    pads, live = np.array([0, 37, 200, 5]), np.array([33, 300, 130, 260])
    B, S_max = len(pads), 1536
    q = jnp.asarray(rng.standard_normal((B, C, H, K)), dtype)
    kv = rng.standard_normal((2, B, S_max, H, K)).astype(np.float32)
    f = jax.jit(lambda q, k, v, m: kn.attention(q, k, v, m, K ** -0.5))
    outs = []
    for S in (384, 768, 1536):
        k, v = kv[0, :, :S].copy(), kv[1, :, :S].copy()
        k[:, 340:] = -k[:, 340:]  # other values past every row's live keys (pad + live <= 337)
        s = np.arange(S)
        qpos = (pads + live)[:, None] - C + np.arange(C)[None, :]  # [B, C]
        mask = (s[None, None, :] >= pads[:, None, None]) & (s[None, None, :] <= qpos[:, :, None])
        outs.append(_bits(f(q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(mask))))
    assert [np.array_equal(o, outs[0]) for o in outs[1:]] == [True, True]


def test_every_attention_dot_has_one_shape_whatever_the_cache_length(cpu_form):
    """Structural (the XLA form): in the optimized program of a 1-query (decode) and a 17-query
    call at Ouro widths, the attention dots (batched over b, h) are `[R, K] x [K, 128]` and `[R,
    128] x [128, K]` per (b, h), R = `_row_tile_for(C)`, and the program's dots are the same for
    a cache of 256, 1000 and 2048 slots (the softmax's `rowsum` dots are `matmul`'s, whose rows
    are the row side, in this form)."""
    cpu_form("xla")
    for C in (1, 17):
        progs = []
        for S in (256, 1000, 2048):
            q = jax.ShapeDtypeStruct((2, C, H, K), jnp.bfloat16)
            kv = jax.ShapeDtypeStruct((2, S, H, K), jnp.bfloat16)
            m = jax.ShapeDtypeStruct((2, C, S), jnp.bool_)
            text = jax.jit(lambda q, k, v, m: kn.attention(q, k, v, m, K ** -0.5)).lower(
                q, kv, kv, m).compile().as_text()
            progs.append(sorted({(tuple(lhs), tuple(rhs), tuple(out))
                                 for lhs, rhs, out, _ in _dots(text)}))
        assert progs[1] == progs[0] and progs[2] == progs[0], (C, progs)
        R = tiling.row_tile_for(C)
        batched = {d for d in progs[0] if len(d[0]) == 4}
        assert batched == {((2, H, R, K), (2, H, kn.K_BLOCK, K), (2, H, R, K))}, (C, progs[0])


ORDERED_TARGET = "looprl_ordered_matmul"


def test_attention_is_two_ordered_calls_on_the_cache_itself(cpu_form):
    """Structural (the default CPU form): the attention program of a 1-query (decode) and a
    17-query call at Ouro widths holds no dot and no K/V gather: one ordered scores call and
    one ordered value call per query tile (`cpu.ffi.ordered_attention_scores` / `_values`,
    whose numerics per (b, h) the kernel fixes), the queries unpadded (C rows), each reading
    the K/V arrays themselves (`[1, B, S, H, K]`: the slot as a one-slot cache, not a copied
    block), for a cache of 256, 1000 and 2048 slots; the softmax's max and sum are the
    `row_max` / `row_sum` reductions."""
    cpu_form("ordered")
    B = 2
    for C in (1, 17):
        for S in (256, 1000, 2048):
            q = jax.ShapeDtypeStruct((B, C, H, K), jnp.bfloat16)
            kv = jax.ShapeDtypeStruct((B, S, H, K), jnp.bfloat16)
            m = jax.ShapeDtypeStruct((B, C, S), jnp.bool_)
            text = jax.jit(lambda q, k, v, m: kn.attention(q, k, v, m, K ** -0.5)).lower(
                q, kv, kv, m).compile().as_text()
            assert _dots(text) == [], (C, S)
            assert _dots(text, "looprl_ordered_batched_matmul") == [], (C, S)
            Sp = -(-S // kn.K_BLOCK) * kn.K_BLOCK
            calls = {t: [(tuple(a), tuple(b), tuple(o)) for a, b, o, _ in _dots(text, t)]
                     for t in ("looprl_ordered_attention_scores",
                               "looprl_ordered_attention_values")}
            assert calls == {
                "looprl_ordered_attention_scores": [((B, H, C, K), (1, B, S, H, K),
                                                     (B, H, C, Sp))],
                "looprl_ordered_attention_values": [((B, H, C, Sp), (1, B, S, H, K),
                                                     (B, H, C, K))]}, (C, S, calls)


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*\w+\[([\d,]*)\]\S*\s+([\w\-]+)\((.*?)\)(.*)$")


def _dots(text, target=None):
    """(lhs dims, rhs dims, out dims, attributes) of every dot in an optimized HLO text, or with
    `target` of every custom call to it; fails on convolutions and on other custom calls (a dot
    in another disguise)."""
    dims, found = {}, []
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, operands, attrs = m.groups()
        dims[name] = [int(d) for d in shape.split(",") if d]
        assert op != "convolution", line
        if op == "custom-call":  # the ordered products, or the softmax's row max and sum
            target_re = r'custom_call_target="looprl_(ordered_|row_max"|row_sum")'
            assert re.search(target_re, attrs), line
        if (op == "dot" and not target
                or op == "custom-call" and f'custom_call_target="{target}"' in attrs):
            lhs, rhs = [o.strip().split(" ")[-1] for o in operands.split(",")[:2]]
            found.append((lhs, rhs, dims[name], attrs))
    return [(dims[lhs], dims[rhs], out, attrs) for lhs, rhs, out, attrs in found]


@pytest.mark.parametrize("name", ["gate/up", "down", "exit_gate"])
def test_every_dot_of_a_weight_has_one_shape(name, cpu_form):
    """Structural: in the optimized program of an M-row matmul (M in 1, 3, 7, 64, 300) every dot
    is `[T, kb] x [kb, O16]` per batch element (T a multiple of ROW_QUANTUM up to
    ROW_TILE_MAX, kb <= K_BLOCK, O16 = O padded to N_MIN), and one program holds one such shape
    whatever M. (The XLA form.)"""
    cpu_form("xla")
    i, o = WEIGHTS[name]
    w = jax.ShapeDtypeStruct((i, o), jnp.float32)
    o16 = -(-o // kn.N_MIN) * kn.N_MIN
    for m in (1, 3, 7, 64, 300):
        x = jax.ShapeDtypeStruct((m, i), jnp.float32)
        dots = _dots(jax.jit(kn.matmul).lower(x, w).compile().as_text())
        assert dots, m
        shapes = set()
        for lhs, rhs, out, attrs in dots:
            lc = int(re.search(r"lhs_contracting_dims=\{(\d+)\}", attrs).group(1))
            batch = len(re.search(r"lhs_batch_dims=\{([\d,]*)\}", attrs).group(1).split(",")) \
                if "lhs_batch_dims" in attrs else 0
            kb = lhs[lc]
            rows = [d for j, d in enumerate(lhs) if j != lc and j >= batch]
            shapes.add((tuple(rows), kb, out[-1]))
        assert len(shapes) == 1, (m, shapes)
        (rows, kb, cols), = shapes
        assert len(rows) == 1 and rows[0] % kn.ROW_QUANTUM == 0 and rows[0] <= kn.ROW_TILE_MAX and kb <= kn.K_BLOCK and cols == o16, \
            (m, shapes)


def _at_quantum(tiles):
    """The distinct tile sizes `tiles` rounded up to this machine's row quantum (8 with AVX-512,
    24 elsewhere): a tile that is not a multiple of it leaves rows outside a register block."""
    q = kn.ROW_QUANTUM
    return sorted({-(-t // q) * q for t in tiles})


def _check_tiles(name, dtype, tiles, rows=512, monkeypatch=None):
    """Every row of a `rows`-row call with the row tile forced to each of `tiles` (multiples of
    ROW_QUANTUM, most not powers of two) must equal the same row with the default tile."""
    x, w = _operands(name, dtype, rows)
    ref = _bits(jax.jit(kn.matmul)(x, w))
    bad = []
    for t in tiles:
        monkeypatch.setattr(tiling, "row_tile_for", lambda m, t=t: t)
        if not np.array_equal(_bits(jax.jit(kn.matmul)(x, w)), ref):
            bad.append(t)
    monkeypatch.undo()
    return bad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_do_not_depend_on_the_tile_size(dtype, monkeypatch, cpu_form):
    """Argument (3) of the module doc: any multiple of the quantum (8 with AVX-512, 24
    elsewhere) gives a row the same bits, so the tile is `ceil(M / tiles)` rounded up to it, not
    a power of two; forced tiles of 8..512 rows rounded up to the quantum (the
    512 rows then sit at other offsets in other tiles, the last tile overlapping the one before
    it, `_looped_matmul`) all agree."""
    cpu_form("xla")
    tiles = _at_quantum((8, 24, 104, 304, 504))
    assert _check_tiles("gate/up", dtype, tiles, monkeypatch=monkeypatch) == []


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["q/k/v/o", "down", "exit_gate"])
def test_rows_do_not_depend_on_the_tile_size_all_weights(name, dtype, monkeypatch, cpu_form):
    cpu_form("xla")
    tiles = _at_quantum((8, 16, 24, 40, 56, 72, 104, 136, 200, 264, 304, 344, 400, 456, 504, 512))
    assert _check_tiles(name, dtype, tiles, monkeypatch=monkeypatch) == []


@pytest.mark.parametrize("name, m", [("down", 1000), ("q/k/v/o", 4096)])
def test_a_long_call_copies_neither_x_nor_the_output(name, m, cpu_form):
    """fp32, `memory_analysis`: the output is stock's size and the temporaries are one `[R, O]`
    partial, one `[R, 128]` x block and one `[128, O]` weight block (within 10 %), at row counts
    that are not a multiple of the tile (1000: two 504-row tiles with either quantum; 4096: nine
    456-row tiles with the quantum of 24), where at 4096 rows that puts the peak within issue
    14's 1.25x of stock's.
    The last tile overlaps the one before instead of padding: padded, x and the output were
    copied (the fp32 down_proj at 4096 rows held 153 MB against stock's 32 MB on an AVX2
    machine). (The XLA form.)"""
    cpu_form("xla")
    i, o = WEIGHTS[name]
    x, w = jax.ShapeDtypeStruct((m, i), jnp.float32), jax.ShapeDtypeStruct((i, o), jnp.float32)
    ours = jax.jit(kn.matmul).lower(x, w).compile().memory_analysis()
    stock = jax.jit(kn.stock_matmul).lower(x, w).compile().memory_analysis()
    t = tiling.row_tile_for(m)
    assert ours.output_size_in_bytes == stock.output_size_in_bytes == m * o * 4
    assert ours.temp_size_in_bytes <= 1.1 * 4 * (t * o + t * kn.K_BLOCK + kn.K_BLOCK * o)
    if m == 4096:
        assert (ours.temp_size_in_bytes + ours.output_size_in_bytes
                <= 1.25 * (stock.temp_size_in_bytes + stock.output_size_in_bytes))


@pytest.mark.parametrize("name", ["gate/up", "down", "lm_head", "exit_gate"])
def test_the_ordered_form_is_one_kernel_call_whatever_m(name, cpu_form):
    """Structural (the default CPU form): in the optimized program of an M-row matmul (M in 1, 3,
    7, 64, 300) the weight meets no dot, only one call of the ordered kernel on `[M, I]` rows
    and the unpadded `[I, O]` weight, so nothing XLA chooses per shape touches the numerics
    (docs/NUMERICS.md, "The ordered CPU form")."""
    cpu_form("ordered")
    i, o = WEIGHTS[name]
    for dtype in ("float32", "bfloat16"):
        w = jax.ShapeDtypeStruct((i, o), dtype)
        for m in (1, 3, 7, 64, 300):
            x = jax.ShapeDtypeStruct((m, i), dtype)
            text = jax.jit(lambda a, b: kn.matmul(a, b, "float32")).lower(x, w).compile().as_text()
            assert _dots(text) == [], (m, dtype)
            calls = _dots(text, ORDERED_TARGET)
            assert [(lhs, rhs, out) for lhs, rhs, out, _ in calls] == [([m, i], [i, o], [m, o])], \
                (m, dtype, calls)


@pytest.mark.parametrize("name, m", [("down", 1000), ("q/k/v/o", 4096), ("lm_head", 4096)])
def test_the_ordered_form_holds_no_more_than_stock(name, m, cpu_form):
    """fp32, `memory_analysis` (issue 14's memory target, <= 1.25x stock at 4096 rows): the
    ordered kernel writes the output in place and needs no XLA temporaries (its packing buffers,
    <= 1.2 MB per task, live inside the call)."""
    cpu_form("ordered")
    i, o = WEIGHTS[name]
    x, w = jax.ShapeDtypeStruct((m, i), jnp.float32), jax.ShapeDtypeStruct((i, o), jnp.float32)
    ours = jax.jit(kn.matmul).lower(x, w).compile().memory_analysis()
    stock = jax.jit(kn.stock_matmul).lower(x, w).compile().memory_analysis()
    assert ours.output_size_in_bytes == stock.output_size_in_bytes == m * o * 4
    assert ours.temp_size_in_bytes <= stock.temp_size_in_bytes
