"""The accelerator forms of the invariant kernels, checked from the CPU.

The accelerator forms are traced here on the CPU, selected with `kernels.use_form`. What these
tests can show is necessary, not sufficient, for bits on a GPU or TPU: that every dot of a weight
has one shape whatever the row count M, that the contraction is cut into 128-long blocks summed in a
loop (no split-K left to the compiler), and that fp32 dots ask for full precision (no TF32).
Whether the device's GEMM then gives every row the same bits is what
`reproducibility/gpu_check.py` measures. Because the shapes are fixed, the accelerator form is
also row-invariant on XLA CPU, which the raw-bit tests below check (the Pallas kernel in
interpret mode)."""
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
from looprl.kernels.pallas_matmul import pallas_matmul

D, F, V = 2048, 5632, 49152  # ouro-1.4b / ouro-2.6b widths (both presets share them)
WEIGHTS = {"q/k/v/o": (D, D), "gate/up": (D, F), "down": (F, D), "lm_head": (D, V),
           "exit_gate": (D, 1)}
ROWS = (1, 3, 7, 64, 300)

_DOT = re.compile(r"stablehlo\.dot_general\s+%\S+,\s+%\S+,(.*?):\s*\((tensor<[^>]*>),\s*"
                  r"(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)")


@pytest.fixture
def accel():
    """Trace the accelerator form `accel-xla` on this CPU; `accel("pallas")` selects the Pallas
    form (`pallas-gpu`, interpreted here)."""
    scope = contextlib.ExitStack()

    def use(impl="xla"):
        scope.close()
        scope.enter_context(kn.use_form({"xla": "accel-xla", "pallas": "pallas-gpu"}[impl]))
        jax.clear_caches()  # the form is read when a program is traced: no cached traces
    use("xla")
    yield use
    scope.close()
    jax.clear_caches()


def _dims(t):
    return tuple(int(d) for d in re.findall(r"(\d+)x", t))


def _dots(fn, *args):
    """(lhs dims, rhs dims, out dims, attribute text) of every dot_general in the lowered
    (StableHLO, before any backend pass) program of `fn`."""
    text = jax.jit(fn).lower(*args).as_text()
    return [(_dims(lhs), _dims(rhs), _dims(out), attrs)
            for attrs, lhs, rhs, out in _DOT.findall(text.replace("\n", " "))]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_accelerator_dot_of_a_weight_has_one_shape(accel, impl, dtype):
    """Structural, at the Ouro widths: for M in 1, 3, 7, 64, 300 every dot of the accelerator
    matmul is `[64, 128] x [128, O']` (O' = O padded to 16 for the XLA form, a 128-column
    block for the Pallas one), one shape per weight whatever M; fp32 dots request HIGHEST
    precision, bf16 dots do not (they run on the tensor cores)."""
    accel(impl)
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
        assert len(shapes) == 1, (name, shapes)
        (lhs, rhs), = shapes
        cols = 128 if impl == "pallas" else -(-o // kn.N_MIN) * kn.N_MIN
        assert lhs == (kn.ROW_TILE, 128) and rhs == (128, cols), (name, lhs, rhs)


def test_accelerator_attention_dots_do_not_depend_on_the_chunk_or_the_cache(accel):
    """Structural: a decode step (C = 1), a chunk of 5 and a 300-query prefill, over caches of
    200 and 700 keys: every matrix of every attention dot is a `[64, 128] x [128, 128]` tile
    (scores per 128-key block, value product per block) or a rowsum block, fp32 at HIGHEST.
    The dots' batch count (B x H x key blocks) does change with the cache length (asserted
    below): per matrix only, which is why gpu_check.py also scans attention on the device."""
    shapes, batches = set(), set()
    for C, S in ((1, 200), (5, 700), (300, 700)):
        q = jax.ShapeDtypeStruct((2, C, 4, 128), jnp.float32)
        kv = jax.ShapeDtypeStruct((2, S, 4, 128), jnp.float32)
        mask = jax.ShapeDtypeStruct((2, C, S), jnp.bool_)
        for lhs, rhs, out, attrs in _dots(lambda q, k, v, m: kn.attention(q, k, v, m, 0.1),
                                          q, kv, kv, mask):
            assert "HIGHEST" in attrs
            shapes.add((lhs[-2:], rhs[-2:]))
            if len(lhs) == 5:
                batches.add(lhs[:3])
    # scores [64, 128] x [128 keys, 128]^T, values [64, 128 keys] x [128, 128], rowsum blocks
    assert shapes <= {((64, 128), (128, 128)), ((64, 128), (128, 16))}, shapes
    assert {(2, 4, 2), (2, 4, 6)} <= batches, batches  # 200 keys: 2 blocks; 700: 6


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_accelerator_matmul_rows_do_not_depend_on_the_row_count(accel, impl, dtype):
    """Raw bits, run on XLA CPU: rows of an M-row call (M in 1, 2, 3, 7, 8, 64, 65) equal the
    same rows of a 200-row call, at offsets 0 and 100; values agree with a plain dot."""
    accel(impl)
    rng = np.random.default_rng(0)
    i, o = 640, 272  # five K blocks, 17 output groups of 16 (three 128-column Pallas blocks)
    x = jnp.asarray(rng.standard_normal((200, i)), dtype)
    w = jnp.asarray(rng.standard_normal((i, o)) / np.sqrt(i), dtype)
    f = jax.jit(kn.matmul)
    big = f(x, w)
    np.testing.assert_allclose(np.asarray(big, np.float32),
                               np.asarray(x, np.float32) @ np.asarray(w, np.float32),
                               rtol=2e-2 if dtype == "bfloat16" else 1e-5, atol=2e-2
                               if dtype == "bfloat16" else 1e-5)
    for m in (1, 2, 3, 7, 8, 64, 65):
        for off in (0, 100):
            assert np.array_equal(_bits(f(x[off:off + m], w)), _bits(big[off:off + m])), (m, off)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_accelerator_matmul_gradients_are_plain_dots(accel, impl):
    """Both accelerator forms differentiate through the invariant matmul's custom_vjp (plain
    HIGHEST dots): equal to jax's gradient of a plain HIGHEST dot, to rounding; the Pallas
    kernel alone is forward-only."""
    accel(impl)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((9, 200)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((200, 130)) / 14, jnp.float32)
    np.testing.assert_allclose(np.asarray(pallas_matmul(x, w)), np.asarray(x) @ np.asarray(w),
                               rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda x, w: jnp.sum(jnp.sin(kn.matmul(x, w))), argnums=(0, 1))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(jnp.sin(
        jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))), argnums=(0, 1))(x, w)
    for a, b in zip(g, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_accelerator_attention_does_not_depend_on_the_left_padding_or_the_chunk(accel, dtype):
    """Raw bits, run on XLA CPU: 100 live keys in prompt buckets of 128 and 192 (the live keys
    straddling slot 128 in the second), queried by the last 8 positions at once and by the last
    one alone (a decode step): the same bits."""
    rng = np.random.default_rng(0)
    H, K, live, C = 2, 128, 100, 8
    q = rng.standard_normal((1, C, H, K)).astype(np.float32)
    kv = rng.standard_normal((2, 1, live, H, K)).astype(np.float32)
    f = jax.jit(lambda q, k, v, m: kn.attention(q, k, v, m, K ** -0.5))
    outs, last = [], []
    for P in (128, 192):
        S, pad = P + 16, P - live
        k = np.zeros((1, S, H, K), np.float32)
        v = np.zeros((1, S, H, K), np.float32)
        k[:, pad:pad + live], v[:, pad:pad + live] = kv[0], kv[1]
        qpos = pad + live - C + np.arange(C)
        mask = (np.arange(S)[None, :] >= pad) & (np.arange(S)[None, :] <= qpos[:, None])
        args = [jnp.asarray(a, dtype) for a in (q, k, v)]
        outs.append(_bits(f(*args, jnp.asarray(mask[None])).astype(jnp.float32)))
        last.append(_bits(f(args[0][:, -1:], args[1], args[2],
                            jnp.asarray(mask[None, -1:])).astype(jnp.float32)))
    assert np.array_equal(outs[0], outs[1])
    assert np.array_equal(last[0], outs[0][:, -1:]) and np.array_equal(last[1], last[0])


def test_the_accelerator_form_is_named_in_the_kernel_version(accel):
    """A rollout records which numerics sampled it: the accelerator form with its matmul
    implementation; off the CPU LOOPRL_ACCEL_MATMUL picks it, and a bad value is a ConfigError
    naming the variable; on the CPU that variable is not read."""
    assert kn.kernel_version() == f"{kn.KERNEL_VERSION_ACCEL}/xla"
    accel("pallas")
    assert kn.kernel_version() == f"{kn.KERNEL_VERSION_ACCEL}/pallas"
    assert forms.resolve("gpu", {}).name == "accel-xla"
    assert forms.resolve("gpu", {"LOOPRL_ACCEL_MATMUL": "pallas"}).name == "pallas-gpu"
    assert forms.resolve("tpu", {"LOOPRL_ACCEL_MATMUL": "pallas"}).name == "pallas-tpu"
    with pytest.raises(ConfigError, match="LOOPRL_ACCEL_MATMUL='triton'.*xla, pallas"):
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
@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_accelerator_matmul_rows_at_ouro_widths(accel, impl, dtype):
    """Raw bits at the real widths, run on XLA CPU (the Pallas kernel interpreted): for every
    Ouro weight shape, rows of an M-row call (M in 1, 3, 7, 64, 300) equal the same rows of a
    512-row call, at offsets 0 and 100. Minutes each; the interpreted Pallas kernel in bf16 ran
    over 25 minutes on 2 shared cores (2026-12-02) and was stopped, the other three passed."""
    accel(impl)
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


@pytest.mark.parametrize("platform,backend,check", [("cuda", "gpu", _TRITON),
                                                    ("tpu", "tpu", _MOSAIC_TPU)])
@pytest.mark.parametrize("dtype,i,o", [("float32", 2048, 2048), ("bfloat16", 5632, 2048)])
def test_pallas_kernel_lowers_for_gpu_and_tpu(platform, backend, check, dtype, i, o):
    """Lowering only (no device here): the Pallas form exports for CUDA (through Triton: jax
    0.10's default Mosaic GPU lowering stages the whole contraction in shared memory and fails
    at these widths) and for TPU, at Ouro widths, for a decode row and a 300-row call."""
    for m in (1, 300):
        x = jax.ShapeDtypeStruct((m, i), jnp.dtype(dtype))
        w = jax.ShapeDtypeStruct((i, o), jnp.dtype(dtype))
        exp = export.export(jax.jit(lambda x, w: pallas_matmul(x, w, interpret=False,
                                                               backend=backend)),
                            platforms=(platform,), disabled_checks=[check])(x, w)
        assert exp.out_avals[0].shape == (m, o)


def test_pallas_matmul_of_no_rows_is_empty():
    out = pallas_matmul(jnp.zeros((0, 256), jnp.float32), jnp.ones((256, 130), jnp.float32))
    assert out.shape == (0, 130) and out.dtype == jnp.float32


def test_accelerator_backward_dots_ask_for_full_precision(accel):
    """The gradient programs of the accelerator matmul and attention (plain dots, no
    invariance needed) run every fp32 dot at HIGHEST, as the stock dots: no TF32 in the
    gradients either."""
    x = jax.ShapeDtypeStruct((5, 256), jnp.float32)
    w = jax.ShapeDtypeStruct((256, 40), jnp.float32)
    dots = _dots(jax.grad(lambda x, w: jnp.sum(kn.matmul(x, w)), argnums=(0, 1)), x, w)
    q = jax.ShapeDtypeStruct((1, 3, 2, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 20, 2, 16), jnp.float32)
    m = jax.ShapeDtypeStruct((1, 3, 20), jnp.bool_)
    dots += _dots(jax.grad(lambda q, k, v, m: jnp.sum(kn.attention(q, k, v, m, 0.25)),
                           argnums=(0, 1, 2)), q, kv, kv, m)
    assert len(dots) >= 4 and all("HIGHEST" in attrs for *_, attrs in dots), dots
