"""The Pallas kernel set (`pallas-gpu` / `pallas-tpu`), checked from the CPU.

The kernels run here in Pallas interpret mode, selected with `kernels.use_form`: the same
kernel bodies, tiles and loop orders the devices compile, executed as XLA ops. What these tests
show is the algorithm: every row's bits are the same whatever the row count, its place, its
batch-mates, the cache length or the number of queries in the call. What they cannot show is
the device's own rounding (fma, wgmma, the MXU's passes) and anything a device chooses at run
time: `looprl verify --device` measures those. The export tests check that one program
compiles the Triton kernels for CUDA and the Mosaic ones for a TPU (`pallas_target`).
"""
import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from looprl import determinism
from looprl.errors import ConfigError
from looprl import kernels as kn
from looprl.kernels import forms
from looprl.kernels.pallas.matmul import pallas_matmul
from looprl.kernels.plain import attention_plain

D, F, V = 2048, 5632, 49152  # ouro-1.4b / ouro-2.6b widths (both presets share them)
WEIGHTS = {"q/k/v/o": (D, D), "gate/up": (D, F), "down": (F, D), "lm_head": (D, V),
           "exit_gate": (D, 1)}
ROWS = (1, 3, 7, 64, 300)

_DOT = re.compile(r"stablehlo\.dot_general\s+%\S+,\s+%\S+,(.*?):\s*\((tensor<[^>]*>),\s*"
                  r"(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)")


@pytest.fixture
def accel():
    """Trace the Pallas form `pallas-gpu` on this CPU (interpreted); `accel("pallas-tpu")`
    selects the TPU's."""
    scope = contextlib.ExitStack()

    def use(name="pallas-gpu"):
        scope.close()
        scope.enter_context(kn.use_form(name))
        jax.clear_caches()  # the form is read when a program is traced: no cached traces
    use()
    yield use
    scope.close()
    jax.clear_caches()


def _dims(t):
    return tuple(int(d) for d in re.findall(r"(\d+)x", t))


def _dots(fn, *args):
    """(lhs dims, rhs dims, out dims, attribute text) of every dot_general in the lowered
    (StableHLO, before any backend pass) program of `fn`, lowered for this CPU (the kernels'
    interpreted branch)."""
    text = jax.jit(fn).lower(*args).as_text()
    return [(_dims(lhs), _dims(rhs), _dims(out), attrs)
            for attrs, lhs, rhs, out in _DOT.findall(text.replace("\n", " "))]


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_matmul_dot_of_a_weight_has_one_shape(accel, dtype):
    """Structural, at the Ouro widths: for M in 1, 3, 7, 64, 300 every dot of the Pallas
    matmul is `[64, 128] x [128, 128]`, one shape per weight whatever M; fp32 dots request
    HIGHEST precision, bf16 dots do not (tensor cores / MXU, fp32 accumulation)."""
    for name, (i, o) in WEIGHTS.items():
        w = jax.ShapeDtypeStruct((i, o), jnp.dtype(dtype))
        shapes = set()
        for m in ROWS:
            x = jax.ShapeDtypeStruct((m, i), jnp.dtype(dtype))
            dots = _dots(kn.matmul, x, w)
            assert dots, (name, m)
            for lhs, rhs, out, attrs in dots:
                shapes.add((lhs, rhs))
                assert ("HIGHEST" in attrs) == (dtype == "float32"), (name, m, attrs)
        assert shapes == {((kn.ROW_TILE, 128), (128, 128))}, (name, shapes)


# interpreted, both forms run the same CPU branch: the default suite checks one
@pytest.mark.parametrize("name", ["pallas-gpu", pytest.param("pallas-tpu", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_rows_do_not_depend_on_the_row_count(accel, name, dtype):
    """Raw bits (needle): rows of an M-row call (M in 1, 2, 3, 7, 8, 64, 65) equal the same
    rows of a 200-row call, at offsets 0 and 100; values agree with a plain dot."""
    accel(name)
    rng = np.random.default_rng(0)
    i, o = 640, 272  # five K blocks, three 128-column blocks
    x = jnp.asarray(rng.standard_normal((200, i)), dtype)
    w = jnp.asarray(rng.standard_normal((i, o)) / np.sqrt(i), dtype)
    f = jax.jit(kn.matmul)
    big = f(x, w)
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(np.asarray(big, np.float32),
                               np.asarray(x, np.float32) @ np.asarray(w, np.float32),
                               rtol=tol, atol=tol)
    for m in (1, 2, 3, 7, 8, 64, 65):
        for off in (0, 100):
            assert np.array_equal(_bits(f(x[off:off + m], w)), _bits(big[off:off + m])), (m, off)


def test_row_reductions_do_not_depend_on_the_row_count(accel):
    """Raw bits: `rowsum` (the Pallas kernel), `softmax`, `log_softmax` and `rms_norm` of a row
    alone equal that row inside 3-, 64- and 130-row calls, at several places; the Pallas row
    sum's value is the row's sum, and a sum that the order changes (1e8, 1, -1e8) comes out
    as the kernel's order gives it (lanes first, then across lanes)."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((130, 300)) * 4, jnp.float32)
    w = jnp.asarray(rng.standard_normal(300), jnp.float32)
    fns = {"rowsum": jax.jit(kn.rowsum), "softmax": jax.jit(kn.softmax),
           "log_softmax": jax.jit(kn.log_softmax),
           "rms_norm": jax.jit(lambda a: kn.rms_norm(a, w, 1e-6))}
    for name, f in fns.items():
        big = _bits(f(x))
        for m, off in ((1, 0), (1, 77), (3, 5), (64, 66), (130, 0)):
            assert np.array_equal(_bits(f(x[off:off + m])), big[off:off + m]), (name, m, off)
    np.testing.assert_allclose(np.asarray(fns["rowsum"](x))[:, 0], np.asarray(x).sum(1),
                               rtol=1e-5, atol=1e-4)
    row = np.zeros((1, 300), np.float32)
    row[0, 0], row[0, 1], row[0, 128] = 1e8, 1.0, -1e8  # lane 0: 1e8 + -1e8; lane 1: 1
    assert float(fns["rowsum"](jnp.asarray(row))[0, 0]) == 1.0


def _causal(S, pad_B, qpos_C):
    s = np.arange(S)
    return ((s[None, None, :] >= np.asarray(pad_B)[:, None, None])
            & (s[None, None, :] <= np.asarray(qpos_C)[None, :, None]))


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_attention_of_a_query_does_not_depend_on_what_shares_the_call(accel, dtype):
    """Raw bits (needle): a query row of row b, asked alone (a decode step), with its 63 / 70
    neighbours (a chunk, a two-tile prefill), with other batch rows beside it, and over a
    cache of 300 or 520 slots (the live keys at other offsets, straddling blocks): the same
    bits; GQA by index (1 kv head for 2 query heads) equals repeated heads; values agree
    with the plain attention."""
    rng = np.random.default_rng(0)
    H, J, K, live, C = 2, 1, 16, 230, 66
    q = rng.standard_normal((1, C, H, K)).astype(np.float32)
    kv = rng.standard_normal((2, 1, live, J, K)).astype(np.float32)
    f = jax.jit(lambda q, k, v, m: kn.attention(q, k, v, m, K ** -0.5))
    needle, outs = [], []
    for S, pad in ((300, 40), (520, 250)):
        k = rng.standard_normal((3, S, J, K)).astype(np.float32)  # rows 0, 2: batch-mates
        v = rng.standard_normal((3, S, J, K)).astype(np.float32)
        k[1, pad:pad + live], v[1, pad:pad + live] = kv[0, 0], kv[1, 0]
        qpos = pad + live - C + np.arange(C)
        mask = _causal(S, [pad - 30, pad, 0], qpos)
        qs = np.concatenate([rng.standard_normal((1, C, H, K)), q,
                             rng.standard_normal((1, C, H, K))]).astype(np.float32)
        args = [jnp.asarray(a, dtype) for a in (qs, k, v)]
        out = _bits(f(*args, jnp.asarray(mask)).astype(jnp.float32))[1]
        outs.append(out)
        for c0, c1 in ((65, 66), (0, 63)):
            needle.append((c0, _bits(f(args[0][1:2, c0:c1], args[1][1:2], args[2][1:2],
                                       jnp.asarray(mask[1:2, c0:c1])).astype(jnp.float32))[0]))
        ref = attention_plain(jnp.swapaxes(args[0], 1, 2).astype(jnp.float32),
                                 *kn.repeat_kv_heads(*(a.astype(jnp.float32) for a in args[1:]),
                                                     H), jnp.asarray(mask), K ** -0.5, None)
        tol = 3e-2 if dtype == "bfloat16" else 1e-5
        np.testing.assert_allclose(np.asarray(f(*args, jnp.asarray(mask)), np.float32),
                                   np.asarray(jnp.swapaxes(ref, 1, 2)), rtol=tol, atol=tol)
    assert np.array_equal(outs[0], outs[1])
    for c0, got in needle:
        assert np.array_equal(got, outs[0][c0:c0 + got.shape[0]]), c0
    with kn.use_form("pallas-gpu"):  # GQA by index == repeated heads, bit for bit
        rep = f(args[0], *kn.repeat_kv_heads(args[1], args[2], H), jnp.asarray(mask))
        assert np.array_equal(_bits(rep.astype(jnp.float32))[1], outs[1])


def test_attention_cached_reads_the_slot_and_window(accel):
    """`attention_cached` on the Pallas form equals `attention` over the slots it describes, bit
    for bit, whichever rows of the cache are asked for."""
    rng = np.random.default_rng(5)
    N, B, S, J, K, H, C = 2, 3, 140, 1, 16, 2, 4
    cache = [jnp.asarray(rng.standard_normal((N, B, S, J, K)), jnp.float32) for _ in range(2)]
    win = [jnp.asarray(rng.standard_normal((2, C, J, K)), jnp.float32) for _ in range(2)]
    kv = kn.CachedKV(cache[0], cache[1], jnp.int32(1), jnp.asarray([2, 0], jnp.int32),
                     jnp.int32(100), win[0], win[1])
    q = jnp.asarray(rng.standard_normal((2, C, H, K)), jnp.float32)
    rng_mask = kn.KeyRange(jnp.asarray([5, 0], jnp.int32), jnp.arange(100, 100 + C), S)
    got = kn.attention_cached(q, kv, rng_mask, 0.25)
    want = kn.attention(q, *kv.slots(), rng_mask.mask(), 0.25)
    assert np.array_equal(_bits(got), _bits(want))
    one = kn.attention_cached(q[1:], kv._replace(rows_M=kv.rows_M[1:], k_win_MxCxJxK=win[0][1:],
                                                 v_win_MxCxJxK=win[1][1:]),
                              kn.KeyRange(rng_mask.pad_B[1:], rng_mask.layout_C, S), 0.25)
    assert np.array_equal(_bits(one), _bits(got)[1:])


def test_gradients_are_plain_dots(accel):
    """The matmul, attention (GQA) and rowsum differentiate through custom_vjps of plain HIGHEST
    dots: equal to jax's gradients of the plain math, to rounding."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((9, 200)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((200, 130)) / 14, jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    g = jax.grad(lambda x, w: jnp.sum(jnp.sin(kn.matmul(x, w))), argnums=(0, 1))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(jnp.sin(jnp.dot(x, w, precision=hi))),
                   argnums=(0, 1))(x, w)
    for a, b in zip(g, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    gr = jax.grad(lambda x: jnp.sum(jnp.sin(kn.rowsum(x))))(x)
    np.testing.assert_allclose(np.asarray(gr), np.broadcast_to(
        np.cos(np.asarray(x).sum(1, keepdims=True)), x.shape), rtol=1e-4, atol=1e-4)
    q = jnp.asarray(rng.standard_normal((1, 3, 2, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 20, 1, 16)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(_causal(20, [2], [17, 18, 19]))
    ga = jax.grad(lambda q, k, v: jnp.sum(kn.attention(q, k, v, mask, 0.25) ** 2),
                  argnums=(0, 1, 2))(q, k, v)
    gp = jax.grad(lambda q, k, v: jnp.sum(jnp.swapaxes(attention_plain(
        jnp.swapaxes(q, 1, 2), *kn.repeat_kv_heads(k, v, 2), mask, 0.25, hi), 1, 2) ** 2),
        argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ga, gp):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_the_form_and_its_target_are_named_in_the_kernel_version(accel):
    """A rollout records which numerics sampled it: the Pallas form and its target (here
    `interpret`: no device of the form's backend); off the CPU the platform's Pallas form is
    the default; LOOPRL_ACCEL_MATMUL=pallas still selects it, =xla is a ConfigError naming the
    removed form; on the CPU that variable is not read."""
    assert kn.kernel_version() == f"{kn.KERNEL_VERSION_ACCEL}/pallas-gpu-interpret"
    accel("pallas-tpu")
    assert kn.kernel_version() == f"{kn.KERNEL_VERSION_ACCEL}/pallas-tpu-interpret"
    assert forms.resolve("gpu", {}).name == "pallas-gpu"
    assert forms.resolve("tpu", {}).name == "pallas-tpu"
    assert forms.resolve("gpu", {"LOOPRL_ACCEL_MATMUL": "pallas"}).name == "pallas-gpu"
    assert forms.resolve("tpu", {"LOOPRL_ACCEL_MATMUL": "pallas"}).name == "pallas-tpu"
    with pytest.raises(ConfigError, match="LOOPRL_ACCEL_MATMUL='xla'.*accel-xla.*removed"):
        forms.resolve("gpu", {"LOOPRL_ACCEL_MATMUL": "xla"})
    with pytest.raises(ConfigError, match="LOOPRL_ACCEL_MATMUL='triton'.*pallas"):
        forms.resolve("gpu", {"LOOPRL_ACCEL_MATMUL": "triton"})
    assert forms.resolve("cpu", {"LOOPRL_ACCEL_MATMUL": "triton"}).name == "cpu-ordered"


def test_gpu_installs_pin_the_accelerator_flags(monkeypatch):
    """configure_xla(accelerator=True) adds every ACCELERATOR_FLAGS entry and
    NVIDIA_TF32_OVERRIDE=0, keeps a user's own setting of a flag (matched by whole flag name:
    `--xla_gpu_enable_triton_gemm_int4` is not `--xla_gpu_enable_triton_gemm`), and the
    environment record says which pins are in force."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4 "
                       "--xla_gpu_enable_triton_gemm_int4=true")
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "")  # recorded, so the teardown restores it
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE")
    monkeypatch.delenv("LOOPRL_XLA_FLAGS", raising=False)
    determinism.configure_xla(accelerator=True)
    flags = determinism.os.environ["XLA_FLAGS"]
    assert "--xla_gpu_autotune_level=4" in flags and "--xla_gpu_autotune_level=0" not in flags
    for f in determinism.ACCELERATOR_FLAGS[:1] + determinism.ACCELERATOR_FLAGS[2:]:
        assert f in flags.split(), f  # a flag whose name extends another's is another flag
    assert determinism.os.environ["NVIDIA_TF32_OVERRIDE"] == "0"
    pins = determinism.environment()["accelerator_pins"]
    assert pins["NVIDIA_TF32_OVERRIDE"] and pins["--xla_gpu_deterministic_ops=true"]
    assert not pins["--xla_gpu_autotune_level=0"]
    monkeypatch.setenv("XLA_FLAGS", "")
    determinism.configure_xla(accelerator=False)
    assert "xla_gpu" not in determinism.os.environ["XLA_FLAGS"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_rows_at_ouro_widths(accel, dtype):
    """Raw bits at the real widths (interpreted): for every Ouro weight shape, rows of an M-row
    call (M in 1, 3, 7, 64, 300) equal the same rows of a 512-row call, at offsets 0 and 100.
    Minutes each."""
    rng = np.random.default_rng(2)
    f = jax.jit(kn.matmul)
    for name, (i, o) in WEIGHTS.items():
        x = jnp.asarray(rng.standard_normal((512, i)), dtype)
        w = jnp.asarray(rng.standard_normal((i, o)) / np.sqrt(i), dtype)
        big = _bits(f(x, w))
        for m in ROWS:
            for off in (0, 100 if m < 400 else 0):
                assert np.array_equal(_bits(f(x[off:off + m], w)), big[off:off + m]), \
                    (name, m, off)


_TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
_MOSAIC_TPU = export.DisabledSafetyCheck.custom_call("tpu_custom_call")


@pytest.mark.parametrize("form,platform,check", [("pallas-gpu", "cuda", _TRITON),
                                                 ("pallas-tpu", "tpu", _MOSAIC_TPU)])
def test_one_program_exports_the_compiled_kernels_for_its_platform(accel, form, platform, check):
    """Lowering only (no device here): the invariant API under `pallas-gpu` exports for CUDA
    with Triton calls and under `pallas-tpu` for a TPU with Mosaic calls, with no interpreted
    kernel left (no `while` from an interpreted grid); lowered for this CPU the same function
    has no such call. Ouro widths for the matmul (a decode row, a 300-row call)."""
    accel(form)
    cases = []
    for m in (1, 300):
        cases.append((kn.matmul, (jax.ShapeDtypeStruct((m, 2048), jnp.bfloat16),
                                  jax.ShapeDtypeStruct((2048, 5632), jnp.bfloat16))))
    cases.append((lambda x: kn.rms_norm(x, jnp.ones(256, jnp.float32), 1e-6),
                  (jax.ShapeDtypeStruct((3, 256), jnp.float32),)))
    q = jax.ShapeDtypeStruct((2, 5, 4, 128), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 300, 2, 128), jnp.float32)
    cases.append((lambda q, k, v, m: kn.attention(q, k, v, m, 0.1),
                  (q, kv, kv, jax.ShapeDtypeStruct((2, 5, 300), jnp.bool_))))
    target = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    for fn, args in cases:
        exp = export.export(jax.jit(fn), platforms=(platform,), disabled_checks=[check])(*args)
        text = exp.mlir_module()
        assert target in text and "stablehlo.while" not in text, (form, fn)
        assert target not in jax.jit(fn).lower(*args).as_text()


def test_pallas_matmul_of_no_rows_is_empty():
    out = pallas_matmul(jnp.zeros((0, 256), jnp.float32), jnp.ones((256, 130), jnp.float32))
    assert out.shape == (0, 130) and out.dtype == jnp.float32


def test_backward_dots_ask_for_full_precision(accel):
    """The gradient programs of the matmul and attention (plain dots, no invariance needed) run
    every fp32 dot at HIGHEST, as the stock dots: no TF32 in the gradients either."""
    x = jax.ShapeDtypeStruct((5, 256), jnp.float32)
    w = jax.ShapeDtypeStruct((256, 40), jnp.float32)
    dots = _dots(jax.grad(lambda x, w: jnp.sum(kn.matmul(x, w)), argnums=(0, 1)), x, w)
    q = jax.ShapeDtypeStruct((1, 3, 2, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 20, 2, 16), jnp.float32)
    m = jax.ShapeDtypeStruct((1, 3, 20), jnp.bool_)
    dots += _dots(jax.grad(lambda q, k, v, m: jnp.sum(kn.attention(q, k, v, m, 0.25)),
                           argnums=(0, 1, 2)), q, kv, kv, m)
    assert len(dots) >= 4 and all("HIGHEST" in attrs for *_, attrs in dots), dots
