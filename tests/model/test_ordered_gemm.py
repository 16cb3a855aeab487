"""The ordered CPU matmul (looprl/kernels/cpu/csrc/ordered_matmul.cc): its bits are exactly the chain its
docstring defines (`reference_matmul`, a correctly rounded numpy emulation), on every code path
(1-2 rows; 3-16 with the weight read in place or, past 8192 columns or in bf16, packed 1024
columns at a time; more, in row blocks and tasks of 256-2048 columns; partial column panels
and tasks; a last short k chunk), for fp32 and bf16
weights; and its errors name the problem."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from looprl.errors import ConfigError
from looprl import kernels as kn
from looprl.kernels.cpu import ffi as og


def _u32(x):
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("m, k, n", [(1, 300, 1), (2, 300, 40), (1, 263, 33), (2, 261, 20),
                                     (5, 2048, 300), (6, 257, 17),
                                     (7, 513, 64), (3, 300, 8200), (11, 130, 8300),
                                     (9, 300, 8250), (2, 260, 17000),
                                     (13, 700, 37), (16, 300, 1040), (49, 512, 40),
                                     (100, 256, 16), (1601, 260, 24),
                                     (1601, 130, 1100)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bits_are_the_documented_chain(m, k, n, dtype):
    # (1601, 130, 1100): 3 row blocks x 3 tasks of 512 columns on a 2-thread pool (2 tasks of
    # 1024 on one thread; 256 from 3 threads on), the last task 76 columns wide
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32), dtype)
    y = jax.jit(og.ordered_matmul)(jnp.asarray(x), w)
    ref = og.reference_matmul(x, np.asarray(w.astype(jnp.float32)))
    assert np.array_equal(_u32(y), _u32(ref))


def test_the_reference_fma_is_correctly_rounded():
    """`_fma32` against exact rational arithmetic on values whose fp64 sum would round twice."""
    from fractions import Fraction
    rng = np.random.default_rng(0)
    a = rng.standard_normal(2000).astype(np.float32)
    b = rng.standard_normal(2000).astype(np.float32)
    c = (rng.standard_normal(2000) * np.exp2(rng.integers(-30, 30, 2000))).astype(np.float32)
    got = og._fma32(a, b, c)
    for i in range(0, 2000, 7):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        lo = np.float32(float(exact))  # nearest double, then float32: may round twice
        cands = [np.nextafter(lo, np.float32(-np.inf)), lo, np.nextafter(lo, np.float32(np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact),
                                         int(np.asarray(v).view(np.uint32)) & 1))
        assert got[i] == best, i


def test_zero_rows_and_a_one_column_weight():
    w = jnp.ones((64, 1), jnp.float32)
    assert og.ordered_matmul(jnp.zeros((0, 64), jnp.float32), w).shape == (0, 1)
    y = og.ordered_matmul(jnp.full((2, 64), 0.5, jnp.float32), w)
    assert np.array_equal(np.asarray(y), np.full((2, 1), 32.0, np.float32))


def test_bad_operands_are_named():
    with pytest.raises(ValueError, match=r"\(3, 4\) and w \(5, 2\)"):
        og.ordered_matmul(jnp.zeros((3, 4)), jnp.zeros((5, 2)))
    with pytest.raises(ValueError, match="x must be float32"):
        og.ordered_matmul(jnp.zeros((3, 4), jnp.bfloat16), jnp.zeros((4, 2)))


def test_a_failed_build_names_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("LOOPRL_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="building looprl's CPU matmul kernel failed: false "):
        og.build()
    assert list((tmp_path / "cache").iterdir()) == []  # no half-written library left behind


def test_a_missing_compiler_is_named_with_the_xla_form_as_the_way_out(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("LOOPRL_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"cannot run the compiler .*no-such-g\+\+.* "
                                          r"LOOPRL_KERNELS=cpu-xla"):
        og.build()
    assert not (tmp_path / "cache").exists()  # nothing written


def test_the_cpu_form_is_chosen_by_env_and_named_in_the_kernel_version(monkeypatch):
    monkeypatch.delenv("LOOPRL_KERNELS", raising=False)
    monkeypatch.delenv("LOOPRL_CPU_MATMUL", raising=False)
    assert kn.current_form().name == "cpu-ordered"
    assert kn.cpu_kernel_version().startswith(kn.KERNEL_VERSION_ORDERED)
    monkeypatch.setenv("LOOPRL_CPU_MATMUL", "xla")  # the older name of LOOPRL_KERNELS=cpu-xla
    assert kn.current_form().name == "cpu-xla"
    assert kn.cpu_kernel_version().split("/")[0] == kn.KERNEL_VERSION
    monkeypatch.setenv("LOOPRL_KERNELS", "cpu-ordered")  # LOOPRL_KERNELS wins over the alias
    assert kn.current_form().name == "cpu-ordered"
    monkeypatch.delenv("LOOPRL_KERNELS")
    monkeypatch.setenv("LOOPRL_CPU_MATMUL", "onednn")
    with pytest.raises(ConfigError,
                       match="LOOPRL_CPU_MATMUL='onednn': expected one of ordered, xla"):
        kn.kernel_version()


def test_matmul_on_the_cpu_is_the_ordered_kernel():
    """`kernels.matmul` (the model's every projection) gives the reference's bits, bf16 rows and
    weight widened exactly, output cast last; its gradient is the plain one."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((7, 300)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((300, 24)), jnp.bfloat16)
    y = jax.jit(lambda a, b: kn.matmul(a, b, jnp.float32))(x, w)
    ref = og.reference_matmul(np.asarray(x.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    assert np.array_equal(_u32(y), _u32(ref))
    xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
    g = jax.grad(lambda b: kn.matmul(xf, b).sum())(wf)
    assert np.array_equal(_u32(g), _u32(jnp.dot(xf.T, jnp.ones((7, 24), jnp.float32))))


@pytest.mark.parametrize("z, m, k, n", [(3, 1, 128, 128), (5, 24, 32, 128), (4, 100, 128, 33),
                                        (1, 97, 130, 6200)])
def test_batched_products_are_single_products(z, m, k, n):
    """Each (b, h) product of the attention's batched form, plain and transposed, has the bits of
    one `ordered_matmul` call of its shape, which are the reference's. A batched product runs
    its tasks on one thread, so (1, 97, 130, 6200) takes 2048-column tasks on any host (the
    last 56 columns wide)."""
    rng = np.random.default_rng(z * m + k + n)
    x = rng.standard_normal((z, m, k), dtype=np.float32)
    w = rng.standard_normal((z, k, n), dtype=np.float32)
    plain = og.ordered_batched_matmul(jnp.asarray(x), jnp.asarray(w))
    wt = jnp.asarray(np.ascontiguousarray(np.swapaxes(w, 1, 2)))
    trans = og.ordered_batched_matmul(jnp.asarray(x), wt, transposed=True)
    for i in (0, z - 1):
        one = _u32(og.reference_matmul(x[i], w[i]))
        assert np.array_equal(_u32(plain[i]), one) and np.array_equal(_u32(trans[i]), one)
    with pytest.raises(ValueError, match=r"\[Z, N, K\]"):
        og.ordered_batched_matmul(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4, 5)), transposed=True)


def test_subnormals_flush_to_zero_and_infinities_pass_through():
    """FTZ/DAZ is the kernel's own state (module doc), whatever the calling thread's, and the
    reference flushes alike; an infinite input gives inf in both (the reference's TwoSum error
    is NaN there)."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 40)) * 1e-20).astype(np.float32)
    w = (rng.standard_normal((40, 5)) * 1e-20).astype(np.float32)
    for a, b in [(x, w), (np.array([[1e-39]], np.float32), np.array([[2.0]], np.float32)),
                 (np.array([[np.inf, 1.0]], np.float32), np.ones((2, 1), np.float32))]:
        y = og.ordered_matmul(jnp.asarray(a), jnp.asarray(b))
        assert np.array_equal(_u32(y), _u32(og.reference_matmul(a, b)))
    assert np.all(np.asarray(og.ordered_matmul(jnp.asarray(x), jnp.asarray(w))) == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_stacked_weight_read_in_place_gives_the_slices_bits(dtype):
    """`kernels.layer_matmul` (the sampler's layer loop: `ordered_matmul_layer` reads layer l of
    the `[L, K, N]` stack in place) equals `matmul` on the sliced layer bit for bit, at every
    layer of a scan over the stack (a traced index) and past 300 rows (packed path, several
    column tasks); a layer outside the stack fails the call."""
    rng = np.random.default_rng(3)
    stack = jnp.asarray(rng.standard_normal((3, 130, 600)).astype(np.float32), dtype)
    x = jnp.asarray(rng.standard_normal((2, 170, 130)).astype(np.float32), dtype)

    def scan(use_layer):
        def body(c, l):
            w = kn.LayerWeight(stack, l)
            y = (kn.layer_matmul(x, w) if use_layer
                 else kn.matmul(x, jax.lax.dynamic_index_in_dim(stack, l, 0, False)))
            return c, y
        return jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1])()

    got, want = scan(True), scan(False)
    assert got.shape == (3, 2, 170, 600) and got.dtype == dtype
    assert np.array_equal(np.asarray(got, np.float32).view(np.uint32),
                          np.asarray(want, np.float32).view(np.uint32))
    assert kn.reads_layers_in_place()  # the test ran the in-place kernel (XLA CPU, ordered)
    with pytest.raises(Exception, match="layer index outside the stack"):
        og.ordered_matmul_layer(x[0].astype(jnp.float32), stack, 3).block_until_ready()
    with pytest.raises(ValueError, match=r"\[L, K, N\]"):
        og.ordered_matmul_layer(x[0].astype(jnp.float32), stack[0], 0)


def _ones_product(x):
    """`ordered_matmul(x, ones-in-column-0)[..., 0]`: the product `kernels.rowsum` was before
    `row_sum`, whose bits `row_sum` must have."""
    ones = np.zeros((x.shape[-1], 16), np.float32)
    ones[:, 0] = 1.0
    rows = jnp.asarray(x).reshape(int(np.prod(x.shape[:-1])), x.shape[-1])
    return np.asarray(og.ordered_matmul(rows, jnp.asarray(ones))[:, 0]).reshape(x.shape[:-1])


# (320, 128): a decode step's softmax tile (64 rows x 4 heads, padded); (5, 2048) RMSNorm at
# Ouro width; (17, 49152) the Ouro vocabulary (on the pool: 8-row blocks, one a task); (300,
# 2048) above the inline size, several blocks a task; 257 and 300 columns: a second k chunk
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (9, 257), (320, 128), (5, 2048),
                                   (17, 49152), (300, 2048), (2, 3, 300), (4, 0)])
def test_row_sum_is_the_product_with_a_ones_column_bit_for_bit(shape):
    """`row_sum` gives `ordered_matmul(x, ones)`'s column bit for bit (its docstring's
    argument: the same chain per row, k chunks of K_CHUNK added in order, FTZ/DAZ), on the
    inline and the pool paths, a partial last 8-row block and a second k chunk, with values
    spread over 60 binades, -0.0 entries, subnormals and a row of -0.0 only."""
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    x *= rng.choice(np.float32([1e-30, 1e-3, 1.0, 1e20]), size=shape)
    if x.size:
        flat = x.reshape(-1)
        flat[rng.integers(0, flat.size, 7)] = -0.0
        flat[rng.integers(0, flat.size, 7)] = 3e-39  # subnormal: read as zero (DAZ)
        x.reshape(-1, shape[-1])[0] = -0.0
    got = np.asarray(jax.jit(og.row_sum)(jnp.asarray(x)))
    want = _ones_product(x)
    assert got.shape == shape[:-1]
    assert np.array_equal(_u32(got), _u32(want))
    if shape[-1] and shape[0] == 320:  # and the documented chain itself (numpy)
        ref = og.reference_matmul(x, np.ones((shape[-1], 1), np.float32))[:, 0]
        assert np.array_equal(_u32(got), _u32(ref))


def test_row_sum_passes_infinities_and_nans_through_as_the_product_does():
    x = np.array([[1.0, np.inf, 2.0], [np.inf, -np.inf, 0.0], [np.nan, 1.0, 1.0]], np.float32)
    got = np.asarray(og.row_sum(jnp.asarray(x)))
    assert got[0] == np.inf and np.isnan(got[1]) and np.isnan(got[2])
    assert np.array_equal(np.isnan(got), np.isnan(_ones_product(x)))


def test_row_max_is_each_rows_max_and_nan_where_the_row_has_one():
    """Every row's max (the values of numpy's), across the vector body and the scalar tail;
    NaN anywhere in a row (body or tail) gives NaN; -inf rows stay -inf; on the pool path too
    (Ouro's vocabulary)."""
    rng = np.random.default_rng(5)
    for shape in [(1, 1), (7, 13), (320, 128), (17, 49152)]:
        x = rng.standard_normal(shape).astype(np.float32)
        got = np.asarray(jax.jit(og.row_max)(jnp.asarray(x)))
        assert np.array_equal(got, x.max(-1))
    x = np.zeros((4, 19), np.float32)
    x[0, 3] = np.nan      # in the vector body
    x[1, 18] = np.nan     # in the tail
    x[2] = -np.inf
    x[3, 17] = 5.0
    got = np.asarray(og.row_max(jnp.asarray(x)))
    assert np.isnan(got[0]) and np.isnan(got[1]) and got[2] == -np.inf and got[3] == 5.0


def test_row_reductions_name_bad_operands():
    with pytest.raises(ValueError, match=r"row_sum: x \(3,\) int32 is not a float32"):
        og.row_sum(jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="row_max: x"):
        og.row_max(jnp.float32(1.0))
