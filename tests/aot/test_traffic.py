"""`looprl.aot.traffic` on a hand-written optimized HLO module: a while loop of known trip
count 3 whose body slices one layer of a stacked cache inside a fusion, updates the cache in
place, and runs a cuBLAS GEMM (with its workspace). Exact byte and FLOP counts by hand."""
import pytest

from looprl.aot import inspect as I
from looprl.aot import traffic as TR

HLO = """HloModule m

%fused_slice (param_0: f32[3,64,128], param_1: s32[]) -> f32[64,128] {
  %param_0 = f32[3,64,128]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %ds = f32[1,64,128]{2,1,0} dynamic-slice(%param_0, %param_1, %c0, %c0), dynamic_slice_sizes={1,64,128}
  ROOT %bc = f32[64,128]{1,0} bitcast(%ds)
}

%fused_update (param_0.1: f32[3,64,128], param_1.1: f32[1,64,128], param_2: s32[]) -> f32[3,64,128] {
  %param_0.1 = f32[3,64,128]{2,1,0} parameter(0)
  %param_1.1 = f32[1,64,128]{2,1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %c1 = s32[] constant(0)
  ROOT %dus = f32[3,64,128]{2,1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2, %c1, %c1)
}

%fused_dot (param_0.2: f32[64,128], param_1.2: f32[128,32]) -> f32[64,32] {
  %param_0.2 = f32[64,128]{1,0} parameter(0)
  %param_1.2 = f32[128,32]{1,0} parameter(1)
  ROOT %dot = f32[64,32]{1,0} dot(%param_0.2, %param_1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (arg: (s32[], f32[3,64,128], f32[128,32])) -> (s32[], f32[3,64,128], f32[128,32]) {
  %arg = (s32[], f32[3,64,128]{2,1,0}, f32[128,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %cache = f32[3,64,128]{2,1,0} get-tuple-element(%arg), index=1
  %w = f32[128,32]{1,0} get-tuple-element(%arg), index=2
  %layer = f32[64,128]{1,0} fusion(%cache, %i), kind=kLoop, calls=%fused_slice
  %prod = f32[64,32]{1,0} fusion(%layer, %w), kind=kOutput, calls=%fused_dot
  %gemm = (f32[64,32]{1,0}, s8[4194304]{0}) custom-call(%layer, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %row = f32[1,64,128]{2,1,0} bitcast(%layer)
  %new = f32[3,64,128]{2,1,0} fusion(%cache, %row, %i), kind=kLoop, calls=%fused_update
  ROOT %out = (s32[], f32[3,64,128]{2,1,0}, f32[128,32]{1,0}) tuple(%i, %new, %w)
}

%cond (arg.1: (s32[], f32[3,64,128], f32[128,32])) -> pred[] {
  %arg.1 = (s32[], f32[3,64,128]{2,1,0}, f32[128,32]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%arg.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (c: f32[3,64,128], w: f32[128,32]) -> f32[3,64,128] {
  %c = f32[3,64,128]{2,1,0} parameter(0)
  %w.1 = f32[128,32]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %t = (s32[], f32[3,64,128]{2,1,0}, f32[128,32]{1,0}) tuple(%zero, %c, %w.1)
  %loop = (s32[], f32[3,64,128]{2,1,0}, f32[128,32]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %res = f32[3,64,128]{2,1,0} get-tuple-element(%loop), index=1
}
"""

LAYER = 64 * 128 * 4  # one f32 [64, 128] slice
W = 128 * 32 * 4
OUT = 64 * 32 * 4


def test_shapes_count_bytes():
    assert TR.shape_bytes("f32[64,128]{1,0}") == LAYER
    assert TR.shape_bytes("(bf16[2,3]{1,0}, pred[5]{0})") == 12 + 5
    assert TR.shape_bytes("s32[]") == 4


def test_loop_bodies_count_by_trip_count():
    """Per iteration: the slice fusion reads one layer (not the whole stack) and writes it; the
    dot fusion reads the layer and W and writes [64, 32]; the GEMM the same (its s8 workspace
    is no traffic); the in-place update reads the row and writes it (the stack is not read).
    Three iterations; the condition runs 4 times (a compare of two s32 into a pred)."""
    p = I.program(HLO)
    t = TR.traffic(p)
    per_iter = (LAYER + 4 + LAYER) + 2 * (LAYER + W + OUT) + (LAYER + 4 + LAYER)
    cond = 4 * (4 + 4 + 1)
    assert t["bytes"] == 3 * per_iter + cond
    assert t["flops"] == 3 * 2 * (2.0 * 64 * 32 * 128)
    assert t["by_kind"]["gemm"] == {"bytes": 3 * (LAYER + W + OUT), "flops": 3 * 2.0 * 64 * 32 * 128,
                                    "launches": 3}
    assert t["by_kind"]["fusion"]["launches"] == 9


def test_a_loop_without_a_recorded_trip_count():
    """The TPU compiler records no `known_trip_count`: the count comes from the condition
    `i < 3` and the initial value (a copy of constant 0)."""
    hlo = HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', "").replace(
        "  %t = (s32[], f32[3,64,128]{2,1,0}, f32[128,32]{1,0}) tuple(%zero, %c, %w.1)",
        "  %zc = s32[] copy(%zero)\n"
        "  %t = (s32[], f32[3,64,128]{2,1,0}, f32[128,32]{1,0}) tuple(%zc, %c, %w.1)")
    p = I.program(hlo)
    assert I.trip_count(p, p.instr("loop")) == 3
    assert I.launches(p)["unknown_trip_loops"] == []
    assert TR.traffic(p)["bytes"] == TR.traffic(I.program(HLO))["bytes"] + 8  # + the copy
    p = I.program(hlo.replace("constant(3)", "constant(5)"))
    assert I.trip_count(p, p.instr("loop")) == 5


def test_a_tpu_dot_as_a_convolution():
    """A batched matmul the TPU compiler writes as a convolution with the batch and head axes
    as dilated windows: [8, 1024, 16, 128] x [8, 1024, 16, 128] -> [8, 16, 1024, 1024] is
    2 x 8 x 16 x 1024 x 1024 x 128 FLOPs (one tap per output along each window)."""
    hlo = """HloModule c

ENTRY %main (q: bf16[8,1024,16,128], k: bf16[8,1024,16,128]) -> bf16[8,16,1024,1024] {
  %q = bf16[8,1024,16,128]{3,2,1,0} parameter(0)
  %k = bf16[8,1024,16,128]{3,2,1,0} parameter(1)
  ROOT %s = bf16[8,16,1024,1024]{3,2,1,0} convolution(%q, %k), window={size=8x16 stride=7x15 lhs_dilate=8x16}, dim_labels=0b1f_0o1i->01bf
}
"""
    p = I.program(hlo)
    assert TR.traffic(p)["flops"] == 2.0 * 8 * 16 * 1024 * 1024 * 128


def _attention_call(target, name, params, result):
    """An ENTRY with one looprl attention kernel call over `params` [(name, shape)]."""
    sig = ", ".join(f"{n}: {s.split('{')[0]}" for n, s in params)
    lines = [f"  %{n} = {s} parameter({k})" for k, (n, s) in enumerate(params)]
    args = ", ".join(f"%{n}" for n, _ in params)
    lines.append(f'  ROOT %call = {result} custom-call({args}), custom_call_target="{target}", '
                 f'metadata={{op_name="jit(f)/{name}/pallas_call"}}')
    return I.program(f"HloModule a\n\nENTRY %main ({sig}) -> {result.split('{')[0]} {{\n"
                     + "\n".join(lines) + "\n}\n")


# 4 rows, H = 2 heads of K = 128, J = 1 kv head, S = 512 cache slots (S != J * K), 2 slots
# of 4 batch rows; decode: C = 1 query
ROWS, S, KW, HK = 4, 512, 128, 256
KV_READ = ROWS * S * KW * 2  # a row's keys: S x J*K bf16, for each of 4 rows (half the cache)


def test_the_gpu_cached_attention_reads_its_rows_span():
    """The GPU's in-place attention (`looprl_flash_attention` with the cache whole and the
    windows last: meta, q, k cache, v cache, key range, k window, v window): K and V are
    rows x S x J*K, the span the cache's S (not the window's width); FLOPs 4 x rows x C x S x
    H*K."""
    p = _attention_call("__gpu$xla.gpu.triton", "looprl_flash_attention", [
        ("meta", "s32[4,1,5]{2,1,0}"), ("q", "bf16[4,1,256]{2,1,0}"),
        ("kc", "bf16[8,512,128]{2,1,0}"), ("vc", "bf16[8,512,128]{2,1,0}"),
        ("last", "s32[64,1]{1,0}"), ("kw", "bf16[4,1,128]{2,1,0}"),
        ("vw", "bf16[4,1,128]{2,1,0}")], "bf16[4,1,256]{2,1,0}")
    t = TR.traffic(p)
    small = 4 * 5 * 4 + 64 * 4 + 2 * (4 * 128 * 2) + 2 * (4 * HK * 2)  # + q and out
    assert t["bytes"] == 2 * KV_READ + small
    assert t["flops"] == 4.0 * ROWS * 1 * S * HK


def test_the_tpu_cached_attention_reads_its_rows_span():
    """The TPU's decode kernel (`looprl_flash_attention_cached`: rows, n, q padded to a row
    tile, last, k cache, v cache `[N, B', S, J, K]`, k window, v window)."""
    p = _attention_call("tpu_custom_call", "looprl_flash_attention_cached", [
        ("rows", "s32[20]{0}"), ("n", "s32[4]{0}"), ("q", "bf16[4,64,256]{2,1,0}"),
        ("last", "s32[64,1]{1,0}"), ("kc", "bf16[2,4,512,1,128]{4,3,2,1,0}"),
        ("vc", "bf16[2,4,512,1,128]{4,3,2,1,0}"), ("kw", "bf16[4,1,128]{2,1,0}"),
        ("vw", "bf16[4,1,128]{2,1,0}")], "bf16[4,64,256]{2,1,0}")
    t = TR.traffic(p)
    small = 20 * 4 + 4 * 4 + 64 * 4 + 2 * (4 * 128 * 2) + 2 * (4 * 64 * HK * 2)
    assert t["bytes"] == 2 * KV_READ + small
    assert t["flops"] == 4.0 * ROWS * 64 * S * HK


def test_tpu_vmem_arrays_are_no_hbm_traffic():
    """A TPU program prefetches `a` into VMEM (S(1)) with an async copy and two ops read it
    there: the copy reads `a` from HBM once; negate and multiply read nothing from HBM for it
    and write their HBM results (multiply also reads negate's)."""
    t = "{1,0:T(8,128)(2,1)}"
    v = "{1,0:T(8,128)(2,1)S(1)}"
    hlo = f"""HloModule v

ENTRY %main (a: bf16[64,128]) -> bf16[64,128] {{
  %a = bf16[64,128]{t} parameter(0)
  %cs = (bf16[64,128]{t}, bf16[64,128]{v}, u32[]{{:S(2)}}) copy-start(%a)
  %cd = bf16[64,128]{v} copy-done(%cs)
  %n = bf16[64,128]{t} negate(%cd)
  ROOT %m = bf16[64,128]{t} multiply(%cd, %n)
}}
"""
    x = 64 * 128 * 2
    out = TR.traffic(I.program(hlo))
    assert out["by_kind"]["copy-start"] == {"bytes": x, "flops": 0.0, "launches": 0}
    assert out["bytes"] == x + x + 2 * x
    assert TR.shape_bytes(f"(bf16[64,128]{t}, bf16[64,128]{v})") == x


def test_a_dot_in_a_nested_fusion_counts():
    """The TPU compiler nests fusions (a score dot inside the softmax's fusion): the inner
    fusion's dot counts, 2 x 64 x 32 x 128 FLOPs."""
    hlo = """HloModule n

%inner (p0: f32[64,128], p1: f32[128,32]) -> f32[64,32] {
  %p0 = f32[64,128]{1,0} parameter(0)
  %p1 = f32[128,32]{1,0} parameter(1)
  ROOT %d = f32[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%outer (q0: f32[64,128], q1: f32[128,32]) -> f32[64,32] {
  %q0 = f32[64,128]{1,0} parameter(0)
  %q1 = f32[128,32]{1,0} parameter(1)
  %f = f32[64,32]{1,0} fusion(%q0, %q1), kind=kOutput, calls=%inner
  ROOT %e = f32[64,32]{1,0} exponential(%f)
}

ENTRY %main (a: f32[64,128], b: f32[128,32]) -> f32[64,32] {
  %a = f32[64,128]{1,0} parameter(0)
  %b = f32[128,32]{1,0} parameter(1)
  ROOT %o = f32[64,32]{1,0} fusion(%a, %b), kind=kLoop, calls=%outer
}
"""
    t = TR.traffic(I.program(hlo))
    assert t["flops"] == 2.0 * 64 * 32 * 128
    assert t["bytes"] == LAYER + W + OUT


def _call(target, op_name, params, result):
    """An ENTRY with one custom call of `target` over `params` [(name, shape)], its op_name
    metadata `op_name`."""
    sig = ", ".join(f"{n}: {s.split('{')[0]}" for n, s in params)
    lines = [f"  %{n} = {s} parameter({k})" for k, (n, s) in enumerate(params)]
    args = ", ".join(f"%{n}" for n, _ in params)
    lines.append(f'  ROOT %call = {result} custom-call({args}), custom_call_target="{target}", '
                 f'metadata={{op_name="{op_name}"}}')
    return I.program(f"HloModule a\n\nENTRY %main ({sig}) -> {result.split('{')[0]} {{\n"
                     + "\n".join(lines) + "\n}\n")


def test_an_update_through_a_bitcast_is_in_place():
    """A fusion whose root updates a bitcast (reshape) of its operand writes the update only."""
    hlo = """HloModule u

%fu (p0: f32[4,64], p1: f32[1,1,64], p2: s32[]) -> f32[2,2,64] {
  %p0 = f32[4,64]{1,0} parameter(0)
  %b = f32[2,2,64]{2,1,0} bitcast(%p0)
  %p1 = f32[1,1,64]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = f32[2,2,64]{2,1,0} dynamic-update-slice(%b, %p1, %p2, %z, %z)
}

ENTRY %main (a: f32[4,64], u: f32[1,1,64], i: s32[]) -> f32[2,2,64] {
  %a = f32[4,64]{1,0} parameter(0)
  %u = f32[1,1,64]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = f32[2,2,64]{2,1,0} fusion(%a, %u, %i), kind=kLoop, calls=%fu
}
"""
    assert TR.traffic(I.program(hlo))["bytes"] == 256 + 4 + 256  # update read, index, written


def test_a_paged_attention_reads_its_page_table():
    """jax's paged attention over pages `[J=2, 64 pages, 16, 128]` bf16 with a table of 4 rows
    x 8 pages: K and V are 32 pages x (2 x 16 x 128 x 2 B) each, not the 64 pages handed in;
    FLOPs 4 x 32 x 16 keys x 256."""
    p = _call("__gpu$xla.gpu.triton", "jit(f)/jit(paged_attention)/pallas_call", [
        ("q", "bf16[4,2,16,128]{3,2,1,0}"), ("k", "bf16[2,64,16,128]{3,2,1,0}"),
        ("v", "bf16[2,64,16,128]{3,2,1,0}"), ("table", "s32[4,8,1]{2,1,0}"),
        ("n", "s32[4,1]{1,0}")], "bf16[4,2,16,128]{3,2,1,0}")
    page = 2 * 16 * 128 * 2
    t = TR.traffic(p)
    assert t["by_kind"]["jax_paged"]["bytes"] == 2 * 32 * page + 2 * 32768 + 128 + 16  # + q, out, table, n
    assert t["flops"] == 4.0 * 32 * 16 * 256


def test_jax_flash_kernels_count_the_causal_blocks():
    """jax's GPU flash forward over q `[B=2, S=384, H=4, K=64]`: 3 blocks of 128, 6 on or
    below the diagonal; 2 dots of 2 x B x H x K FLOPs per (query, key) pair; the backward 7."""
    ops = [(n, "bf16[2,384,4,64]{3,2,1,0}") for n in ("q", "k", "v")]
    fwd = _call("__gpu$xla.gpu.triton", "jit(f)/jit(mha)/mha_forward/pallas_call", ops,
                "bf16[2,384,4,64]{3,2,1,0}")
    pairs = 6 * 128 * 128
    assert TR.causal_pairs(384) == pairs
    assert TR.traffic(fwd)["flops"] == 2 * 2.0 * 512 * pairs
    assert TR.traffic(fwd)["bytes"] == 4 * 2 * 384 * 4 * 64 * 2  # no re-reads on a GPU
    bwd = _call("__gpu$xla.gpu.triton", "jit(f)/mha_backward/pallas_call", ops,
                "bf16[2,384,4,64]{3,2,1,0}")
    assert TR.traffic(bwd)["flops"] == 7 * 2.0 * 512 * pairs


def test_tpu_kernels_count_their_block_rereads():
    """On a TPU: jax's flash forward (q `[B, H, S=384, K]`, k, v, q and kv segment ids) reads
    k, v and the kv segment ids again for each further query block: (3 - 1) / 2 = 1 more time
    each; a looprl matmul of 384 columns reads its rows once per 128-column block (3 times); a
    looprl attention reads its int32 mask once per head (q `[B, C, 2 x 128]`: 2 heads)."""
    x = 2 * 4 * 384 * 64 * 2
    seg = 2 * 384 * 4
    fwd = _call("tpu_custom_call", "jit(f)/jit(flash_attention)/pallas_call",
                [("q", "bf16[2,4,384,64]{3,2,1,0}"), ("k", "bf16[2,4,384,64]{3,2,1,0}"),
                 ("v", "bf16[2,4,384,64]{3,2,1,0}"), ("sq", "s32[2,384]{1,0}"),
                 ("sk", "s32[2,384]{1,0}")], "bf16[2,4,384,64]{3,2,1,0}")
    assert TR.traffic(fwd)["bytes"] == (4 * x + 2 * seg) + (2 * x + seg)
    mm = _call("tpu_custom_call", "jit(f)/looprl_fixed_block_matmul/pallas_call",
               [("x", "bf16[256,128]{1,0}"), ("w", "bf16[128,384]{1,0}")], "bf16[256,384]{1,0}")
    w = 128 * 384 * 2
    assert TR.traffic(mm)["bytes"] == 3 * 256 * 128 * 2 + w + 256 * 384 * 2
    att = _call("tpu_custom_call", "jit(f)/looprl_flash_attention/pallas_call", [
        ("meta", "s32[2,1,2]{2,1,0}"), ("q", "bf16[2,64,256]{2,1,0}"),
        ("k", "bf16[2,128,256]{2,1,0}"), ("v", "bf16[2,128,256]{2,1,0}"),
        ("mask", "s32[2,64,256]{2,1,0}")], "bf16[2,64,256]{2,1,0}")
    mask = 2 * 64 * 256 * 4
    kv = 2 * 128 * 256 * 2  # each row's 128-key span, the whole operand
    assert TR.traffic(att)["bytes"] == 16 + 2 * 65536 + 2 * kv + 2 * mask


def test_kernels_one_after_another():
    """`serial_s` sums each launch's max(FLOPs / peak, bytes / bandwidth): at 1e12 FLOP/s and
    1e9 B/s every launch of the loop is memory-bound; at 1e6 FLOP/s and 1e12 B/s the GEMM and
    the dot fusion (3 launches each) are compute-bound, the rest memory-bound."""
    p = I.program(HLO)
    t = TR.traffic(p, 1e12, 1e9)
    assert t["serial_s"] == pytest.approx(t["bytes"] / 1e9, rel=1e-12)
    t = TR.traffic(p, 1e6, 1e12)
    dot = 2.0 * 64 * 32 * 128
    rest = t["bytes"] - 3 * 2 * (LAYER + W + OUT)
    assert t["serial_s"] == pytest.approx(3 * 2 * dot / 1e6 + rest / 1e12, rel=1e-12)


def test_the_attention_backward_kernels():
    """The backward's `dq` (table, q, k, v, mask, do, di) and `dkv` kernels: their operands
    and results as given, FLOPs 2 x 4 products x B x Cp x Sp x H*K each."""
    ops = [("n", "s32[2,2]{1,0}"), ("q", "bf16[2,128,256]{2,1,0}"),
           ("k", "bf16[2,256,256]{2,1,0}"), ("v", "bf16[2,256,256]{2,1,0}"),
           ("mask", "s32[2,128,256]{2,1,0}"), ("do", "bf16[2,128,256]{2,1,0}"),
           ("di", "f32[2,2,128,1]{3,2,1,0}")]
    p = _call("__gpu$xla.gpu.triton", "jit(f)/looprl_flash_attention_dq/pallas_call", ops,
              "(bf16[2,128,256]{2,1,0}, f32[2,2,128,1]{3,2,1,0})")
    t = TR.traffic(p)
    q, kv, mask, vec = 2 * 128 * 256 * 2, 2 * 256 * 256 * 2, 2 * 128 * 256 * 4, 2 * 2 * 128 * 4
    assert t["bytes"] == 16 + 2 * q + 2 * kv + mask + vec + (q + vec)
    assert t["flops"] == 2.0 * 4 * 2 * 128 * 256 * 256


def test_a_key_range_attention_counts_the_causal_blocks_it_runs():
    """Handed a `KeyRange` (the mask operand one wide) with its queries spanning the key axis
    (the learner's pass), the forward and the backward count the blocks up to each 64-query
    tile's last query: tiles 0 and 1 of 128 queries run one 128-key block each (2 x 64 x 128
    pairs, not 128 x 256); a chunk of 64 queries over 384 keys counts every block."""
    assert TR.looprl_pairs(128, 256, True) == 2 * 64 * 128
    assert TR.looprl_pairs(128, 256, False) == 128 * 256
    assert TR.looprl_pairs(64, 384, True) == 64 * 384
    assert TR.looprl_pairs(1024, 1152, True) == 64 * 128 * 2 * sum(range(1, 9))
    fwd = _call("tpu_custom_call", "jit(f)/looprl_flash_attention/pallas_call", [
        ("meta", "s32[2,2,3]{2,1,0}"), ("q", "bf16[2,128,256]{2,1,0}"),
        ("k", "bf16[2,256,256]{2,1,0}"), ("v", "bf16[2,256,256]{2,1,0}"),
        ("last", "s32[128,1]{1,0}")], "bf16[2,128,256]{2,1,0}")
    t = TR.traffic(fwd)
    assert t["flops"] == 4.0 * 2 * (2 * 64 * 128) * 256
    q, kv = 2 * 128 * 256 * 2, 2 * 256 * 256 * 2
    assert t["bytes"] == 2 * 2 * 3 * 4 + 2 * q + 2 * kv + 128 * 4 * 2  # the last keys per head
    dq = _call("__gpu$xla.gpu.triton", "jit(f)/looprl_flash_attention_dq/pallas_call", [
        ("n", "s32[2,2]{1,0}"), ("q", "bf16[2,128,256]{2,1,0}"),
        ("k", "bf16[2,256,256]{2,1,0}"), ("v", "bf16[2,256,256]{2,1,0}"),
        ("lim", "s32[2,128,1]{2,1,0}"), ("do", "bf16[2,128,256]{2,1,0}"),
        ("di", "f32[2,2,128,1]{3,2,1,0}")], "(bf16[2,128,256]{2,1,0}, f32[2,2,128,1]{3,2,1,0})")
    assert TR.traffic(dq)["flops"] == 2.0 * 4 * 2 * (2 * 64 * 128) * 256
