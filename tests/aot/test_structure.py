"""The invariant kernel forms compiled for an H100 (sm_90), a TPU v5e and a TPU v6e, from this
CPU process (`looprl.aot`): what the compiled programs hold.

One layer at Ouro-1.4B width (Ouro-2.6B has the same width: only its layer count differs), the
LM head at V = 49,152, fp32 and bf16, under the platform's Pallas form (`pallas-gpu`,
`pallas-tpu`): the sampler's prefill, decode steps at 1, 3, 64 and 256 rows, a deferred window,
the learner's forward at two batch shapes. Checked: every forward dot (whose value the sampler
and the learner share) is a looprl Pallas kernel, with one configuration per weight whatever M;
the selected-token log-prob's sum over V is the looprl row sum (no XLA add-reduce over V);
RoPE is the looprl kernel (one materialised value for the cache write and attention);
on the GPU each such kernel's floating-point PTX is the same at every M; no split-K; no TF32;
on the GPU looprl's pins in force. The default suite compiles a few programs per target; the
whole grid is `-m slow`.

What this cannot show: the hardware's own rounding (an fma or an MXU pass is the device's),
anything chosen at run time (cuBLAS-Lt's algorithm where a plain XLA dot is left, launch
configuration heuristics of libraries), and that the program runs at all: nothing executes here.
`looprl verify --device` checks bits on a device.
"""
import collections
import math
import re

import pytest

from looprl.aot import inspect as I
from looprl.aot import programs as PR
from looprl.aot import targets as T
from looprl.aot import traffic as TR
from looprl.kernels import forms
from looprl.model.config import preset

CFG = preset("ouro-1.4b", num_layers=1)
FORM = {"h100": "pallas-gpu", "v5e": "pallas-tpu", "v6e": "pallas-tpu"}
S = 2048  # cache slots of the decode programs
_cache: dict = {}


def _compiled(target, dtype, phase, tmp_path_factory):
    """(program, dump dir, compiled) of `phase` for `target` in `dtype`, compiled once per
    process."""
    key = (target, dtype, phase)
    if key not in _cache:
        reason = T.missing(target)
        if reason:
            pytest.skip(reason)
        dump = tmp_path_factory.mktemp(f"{target}-{dtype}-{phase.label}")
        with forms.use_form(FORM[target]):
            fn, args = PR.build(CFG, dtype, phase)
            c = T.compile_for(target, fn, *args,
                              dump_dir=dump if T.target(target).platform == "cuda" else None)
        _cache[key] = (I.program(c), dump, c)
    return _cache[key]


def _not_interpreted(p):
    names = I.interpreted(p)
    if names:
        pytest.xfail(f"the Pallas form compiled interpreted for a compile-only target "
                     f"({len(names)} launches, e.g. {names[0]}): the form binds the process's "
                     "CPU backend, not the lowering target")


def _projection_dots(p):
    """The XLA dots that are not attention's (its einsums name a head axis `h`)."""
    return [d for d in I.dots(p) if not d["looprl"] and not _attention(d["op_name"])]


def _attention(op_name: str) -> bool:
    m = re.search(r"/([\w.]+),([\w.]+)->([\w.]+)/dot_general$", op_name)
    return bool(m) and "h" in m.group(3)


def _weight_configs(p):
    """{weight operand shape: set of looprl kernel configurations}."""
    out = collections.defaultdict(set)
    for d in I.dots(p):
        # the matmul's weight operand; attention's and the row sum's operands scale with B
        if d["looprl"] and d["config"][0].startswith("looprl_fixed_block_matmul"):
            out[d["config"][1][1]].add(d["config"])
    return out


WEIGHTS = {"2048,2048", "2048,5632", "5632,2048", "2048,49152"}  # q/k/v/o, gate/up, down, head
V = CFG.vocab_size


def _sums_over_v(p):
    """(looprl row-sum kernel configurations whose row is V long, XLA add-reduces of a V-long
    axis): the selected-token log-prob's normaliser over the vocabulary."""
    kernels = {d["config"] for d in I.dots(p) if d["looprl"]
               and d["config"][0].startswith("looprl_fixed_order_rowsum")
               and any(re.search(rf"\b{V}\b", s) for s in d["config"][1])}
    xla = []  # a computation (a fusion's body, the entry, ...) adding with a reduce where a
    # V-long array is read (XLA may reduce a V-long axis through a bitcast to [.., 384, 128]);
    # a reduce that reads fewer than V elements (a 1-layer stack's layer axis) is no sum over V
    for comp, instrs in p.computations.items():
        adds = [i for i in instrs if i.opcode == "reduce" and any(
            j.opcode == "add" for c in i.called for j in p.computations.get(c, []))
            and math.prod(TR.dims(TR.operands(p, i)[0].shape)) >= V]
        if adds and any(re.search(rf"[\[,]{V}[\],]", i.shape) for i in instrs):
            xla.append(adds[0].op_name or f"{comp}/{adds[0].name}")
    return kernels, xla


def _check(p, dump, target, dtype):
    _not_interpreted(p)
    stray = _projection_dots(p)
    assert not stray, f"XLA dots outside attention: {[d['op_name'] for d in stray][:5]}"
    shapes = {re.sub(r"^\w+\[|\]$", "", w) for w in _weight_configs(p)}
    assert WEIGHTS <= shapes, f"weights without a looprl kernel: {sorted(WEIGHTS - shapes)}"
    assert I.split_k(p) == [], I.split_k(p)
    assert I.tf32(p) == [], I.tf32(p)
    ropes = {d["config"] for d in I.dots(p) if d["looprl"] and d["config"][0] == "looprl_rope"}
    assert ropes, "RoPE is not a looprl kernel (XLA recomputes it in each consumer's fusion)"
    v_kernels, v_xla = _sums_over_v(p)
    assert len(v_kernels) == 1, f"the sum over V = {V}: {len(v_kernels)} looprl row sums"
    assert v_xla == [], f"XLA add-reduces over V = {V}: {v_xla[:3]}"
    if T.target(target).platform == "cuda":
        opts = I.debug_options(dump)
        for flag in T.compiler_options(target):
            assert opts.get(flag), f"pin {flag} not in force: {opts.get(flag)!r}"
        assert opts["xla_gpu_deterministic_ops"] == "true"
        assert opts["xla_gpu_enable_triton_gemm"] == "false"
        seqs = [s for e, s in I.ptx_kernels(dump) if e.startswith(I.LOOPRL_PREFIX)]
        assert seqs and not any("tf32" in op for s in seqs for op in s)
        if dtype == "float32":  # fp32 in fma chains only, no tensor-core op (exp's range
            # reduction in attention is an fma.rm.f32)
            assert all(op.startswith("fma.r") and op.endswith(".f32") for s in seqs for op in s
                       if op.startswith(("fma", "mma", "wgmma")))


def _across_m(target, dtype, rows, tmp_path_factory):
    progs = [_compiled(target, dtype, PR.decode(b, S), tmp_path_factory) for b in rows]
    for p, dump, _ in progs:
        _check(p, dump, target, dtype)
    configs = [_weight_configs(p) for p, _, _ in progs]
    v_sums = [_sums_over_v(p)[0] for p, _, _ in progs]
    assert all(v == v_sums[0] for v in v_sums), f"the row sum over V across M: {v_sums}"
    for w, c in configs[0].items():
        assert len(c) == 1, f"{w}: {len(c)} kernel configurations in one program: {c}"
        for b, other in zip(rows[1:], configs[1:]):
            assert other[w] == c, f"{w}: configuration at {rows[0]} rows {c} != at {b} {other[w]}"
    if T.target(target).platform == "cuda":
        ptx = [I.looprl_ptx(dump) for _, dump, _ in progs]
        for b, other in zip(rows[1:], ptx[1:]):
            assert set(other) == set(ptx[0]), \
                f"the looprl kernels' fp PTX differs between {rows[0]} and {b} rows"
    return progs


@pytest.mark.parametrize("target,dtype,rows", [
    ("h100", "bfloat16", (1, 64)), ("h100", "float32", (1,)),
    ("v5e", "bfloat16", (1, 3)), ("v6e", "float32", (1, 3))],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_decode_projections_are_looprl_kernels_at_every_m(target, dtype, rows, tmp_path_factory):
    _across_m(target, dtype, rows, tmp_path_factory)


@pytest.mark.parametrize("target", ["h100", "v5e"])
def test_every_forward_dot_is_a_looprl_kernel(target, tmp_path_factory):
    dtype = "bfloat16"
    p, _, _ = _compiled(target, dtype, PR.decode(1, S), tmp_path_factory)
    _not_interpreted(p)
    xla = [d["op_name"] for d in I.dots(p) if not d["looprl"]]
    assert xla == [], f"{len(xla)} XLA dots, e.g. {xla[:2]}"


def test_stock_form_fails_the_check(tmp_path_factory):
    """The negative control: the stock form's plain dots are found as XLA dots."""
    if T.missing("h100"):
        pytest.skip(T.missing("h100"))
    with forms.use_form("stock"):
        fn, args = PR.build(CFG, "bfloat16", PR.decode(3, 256), stock=True)
        p = I.program(T.compile_for("h100", fn, *args))
    assert len(_projection_dots(p)) >= 7
    assert not any(d["looprl"] for d in I.dots(p))
    v_kernels, v_xla = _sums_over_v(p)
    assert not v_kernels and v_xla, "the stock log-prob's sum over V is an XLA reduce"


def test_widths_of_the_two_presets_are_one_program():
    """Ouro-2.6B differs from Ouro-1.4B only in its layer count: one layer is the same."""
    assert preset("ouro-2.6b", num_layers=1) == CFG


PHASES = [PR.prefill(2, 512), *(PR.decode(b, S) for b in (1, 3, 64, 256)), PR.window(8, 4, S),
          PR.learner_forward(2, 512), PR.learner_forward(8, 512)]


@pytest.mark.slow
@pytest.mark.parametrize("target,dtype", [
    (t, d) for t in ("h100", "v5e", "v6e") for d in ("float32", "bfloat16")])
def test_grid(target, dtype, tmp_path_factory):
    """Every phase: projections as looprl kernels with one configuration per weight across
    all phases, and (GPU) one fp PTX set."""
    progs = [_compiled(target, dtype, ph, tmp_path_factory) for ph in PHASES]
    configs = collections.defaultdict(set)
    for p, dump, _ in progs:
        _check(p, dump, target, dtype)
        for w, c in _weight_configs(p).items():
            configs[w] |= c
    assert all(len(c) == 1 for c in configs.values()), dict(configs)
    if T.target(target).platform == "cuda":
        ptx = [set(I.looprl_ptx(dump)) for _, dump, _ in progs]
        assert all(x == ptx[0] for x in ptx), "fp PTX differs between phases"


GEMM_HLO = """HloModule m

ENTRY %main (a: bf16[8,2048], b: bf16[2048,6144]) -> bf16[8,6144] {
  %a = bf16[8,2048]{1,0} parameter(0)
  %b = bf16[2048,6144]{1,0} parameter(1)
  %custom-call.5 = (bf16[8,6144]{1,0}, s8[33554432]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %gte = bf16[8,6144]{1,0} get-tuple-element(%custom-call.5), index=0
}
"""


def test_a_cublas_gemm_counts_its_flops():
    """A cuBLAS GEMM custom call counts no FLOPs in XLA's HLO cost analysis; `inspect` adds
    2 x output elements x contraction length (benchmarks/accel_cost.py's stock figures)."""
    p = I.program(GEMM_HLO)
    assert I.gemm_flops(p, p.instr("custom-call.5")) == 2.0 * 8 * 6144 * 2048
    assert I.gemm_flops(p, p.instr("gte")) == 0.0
