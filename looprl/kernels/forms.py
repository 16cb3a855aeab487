"""The kernel forms and the one resolver that picks a form from the platform and the
environment.

`LOOPRL_KERNELS=<form>` names the form; unset, the platform decides: `cpu-ordered` on XLA CPU,
`pallas-tpu` on a TPU, `pallas-gpu` elsewhere. The older variables map onto forms where
LOOPRL_KERNELS is unset: `LOOPRL_CPU_MATMUL` (`ordered` -> `cpu-ordered`, `xla` -> `cpu-xla`) on
the CPU and `LOOPRL_ACCEL_MATMUL=pallas` (the platform's Pallas form) elsewhere. The form is
resolved once per (platform, environment) and read when a program is traced; `use_form` selects
one for a scope (tests, `looprl verify --device`).

A Pallas form compiles for the platform its program is LOWERED for, not for the process's
default backend (`pallas.target`): a CPU process under `LOOPRL_KERNELS=pallas-gpu` runs the
kernels interpreted, and compiles them through Triton when it lowers for a compile-only H100
(arguments sharded on that device, `looprl.aot`); `pallas-tpu` alike through Mosaic.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp

from looprl.errors import ConfigError
from looprl.kernels import plain, stock
from looprl.kernels.cpu import ordered as cpu_ordered, xla as cpu_xla
from looprl.kernels.pallas import form as accel
from looprl.kernels.pallas.target import target_name
from looprl.kernels.tiling import CPU_ISA, ROW_QUANTUM, ROW_TILE

# The numerics of the invariant kernels: a rollout records its form's version
# (`Schedule.kernel_version`), and `looprl verify --rollout` refuses a rollout sampled under
# another one. Bump a version whenever a kernel's arithmetic changes (CHANGELOG.md).
KERNEL_VERSION = "2026-12-03"  # cpu-xla
KERNEL_VERSION_ORDERED = "2026-12-03-ordered"  # cpu-ordered
KERNEL_VERSION_ACCEL = "2026-12-05-accel"  # the Pallas forms: `/<form>-<target>`
KERNEL_VERSION_STOCK = "stock"  # not invariant: nothing replays it bit for bit

ENV = "LOOPRL_KERNELS"
CPU_ALIAS = "LOOPRL_CPU_MATMUL"
ACCEL_ALIAS = "LOOPRL_ACCEL_MATMUL"
CPU_ALIASES = {"ordered": "cpu-ordered", "xla": "cpu-xla"}
ACCEL_ALIASES = {"pallas": "pallas"}  # -gpu or -tpu by platform


@dataclasses.dataclass(frozen=True)
class Backward:
    """How a form differentiates: `ops`' custom VJPs and the gradient clip's norm.

    matmul(rows_MxI, w_IxO, g_MxO, precision) -> (dx, dw) in the operands' dtypes.
    attention(q_BxHxCxK, k_BxSxHxK, v_BxSxHxK, mask, scale, softmax, precision) -> `[B, H, C, K]`:
    the function whose vjp is attention's backward (K/V with H heads). global_norm(tree) -> an
    fp32 scalar. scale_last(x, w) -> x * w and add_last(x, b) -> x + b, w and b `[D]` broadcast
    over x's last axis: the form says how their gradients sum over the rows.
    attention_grads(q, k, v, mask, out, g, scale, precision) -> (dq, dk, dv): attention's backward
    where the form has its own (the Pallas forms' flash backward); None: `attention`'s vjp."""
    matmul: Callable
    attention: Callable
    global_norm: Callable
    scale_last: Callable
    add_last: Callable
    attention_grads: Callable | None = None


# plain dots and XLA's sums: the backward needs no invariance
PLAIN = Backward(plain.matmul_grads, plain.attention_for_grads, plain.global_norm,
                 plain.scale_last, plain.add_last)
# ordered kernels: a CPU run's parameters do not depend on the ISA
ORDERED = Backward(cpu_ordered.matmul_grads, cpu_ordered.attention_for_grads,
                   cpu_ordered.global_norm, cpu_ordered.scale_last, cpu_ordered.add_last)


@dataclasses.dataclass(frozen=True)
class Form:
    """One kernel form: what it computes with and what callers ask of it.

    matmul(rows_MxI, w_IxO, out_dtype, precision) -> `[M, O]`; attention(q_BxHxCxK, k_BxSxHxK,
    v_BxSxHxK, mask, scale, softmax, precision) -> `[B, H, C, K]`. The optional kernels
    (rowsum, row_max, row_argmax, layer_matmul, attention_cached) are the ordered form's
    FFI kernels or the Pallas forms' kernels; None means `looprl.kernels` composes the
    operation from matmul and XLA ops. `backend`: the Pallas forms' target (`gpu`, `tpu`);
    `kv_heads_by_index`: attention takes K/V with their own J kv heads (GQA by index);
    `attention_key_range`: attention and its backward take the mask as a `KeyRange` and build
    it in the kernel (no `[B, C, S]` mask made or read);
    `rope(x, cos, sin)`: RoPE where the form computes it its own way (None: the plain
    expression, `plain.rope_rotate_half`); `backward`: how the form differentiates (`Backward`;
    `PLAIN` unless the form has its own)."""
    name: str
    cpu: bool  # runs on XLA CPU only
    version: str  # the kernel version without the ISA suffix
    row_tile: int  # the row padding quantum recorded in schedules (`Schedule.row_tile`)
    fp32_highest: bool  # fp32 dots at Precision.HIGHEST (no TF32); the CPU's are full already
    matmul: Callable
    attention: Callable
    rowsum: Callable | None = None
    row_max: Callable | None = None
    row_argmax: Callable | None = None
    layer_matmul: Callable | None = None
    attention_cached: Callable | None = None
    backend: str | None = None
    kv_heads_by_index: bool = False
    attention_key_range: bool = False
    rope: Callable | None = None
    backward: Backward = PLAIN

    @property
    def reads_layers_in_place(self) -> bool:
        """Whether `kernels.layer_matmul` reads a stacked weight's layer without slicing it."""
        return self.layer_matmul is not None

    def kernel_version(self) -> str:
        """The numerics a rollout is sampled with (`Schedule.kernel_version`). A CPU form's
        version is followed by `/<isa>` (`/avx2`, `/avx`, `/sse41`, `/other`) except where
        oneDNN runs its AVX-512 sgemm (`looprl.determinism.cpu_isa`): XLA's dots and
        elementwise code are the ISA's. A Pallas form's is `<version>/<form>-<target>`
        (`pallas-gpu-sm90`, `pallas-tpu-v5e`; `-interpret` where this process has no device of
        the form's backend: `pallas.target.target_name`)."""
        if self.backend is not None:
            return f"{self.version}/{self.name}-{target_name(self.backend)}"
        if self.cpu and CPU_ISA != "avx512_core":
            return f"{self.version}/{CPU_ISA}"
        return self.version

    def fp32_precision(self, *xs):
        """`Precision.HIGHEST` where the form asks for it and every operand is fp32, else None
        (the default: unchanged CPU programs)."""
        if not self.fp32_highest or not all(x.dtype == jnp.float32 for x in xs):
            return None
        return jax.lax.Precision.HIGHEST


_ORDERED = dict(rowsum=cpu_ordered.rowsum, row_max=cpu_ordered.row_max_column,
                row_argmax=cpu_ordered.row_argmax, layer_matmul=cpu_ordered.layer_matmul,
                attention_cached=cpu_ordered.attention_cached, backward=ORDERED)
def _pallas_fields(backend: str) -> dict:
    """The Pallas form's `Form` fields: its kernels, and `PLAIN` with its flash backward."""
    return dict(accel.form_kernels(backend), backward=dataclasses.replace(
        PLAIN, attention_grads=accel.attention_grads_form(backend)))


FORMS = {f.name: f for f in (
    Form("cpu-ordered", True, KERNEL_VERSION_ORDERED, ROW_QUANTUM, False, cpu_ordered.matmul,
         cpu_ordered.attention, **_ORDERED),
    Form("cpu-xla", True, KERNEL_VERSION, ROW_QUANTUM, False, cpu_xla.matmul, cpu_xla.attention),
    Form("pallas-gpu", False, KERNEL_VERSION_ACCEL, ROW_TILE, True, **_pallas_fields("gpu")),
    Form("pallas-tpu", False, KERNEL_VERSION_ACCEL, ROW_TILE, True, **_pallas_fields("tpu")),
    Form("stock", False, KERNEL_VERSION_STOCK, 1, True, stock.matmul, stock.attention),
)}


def _choice(var: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{var}={value!r}: expected one of {', '.join(choices)}")


def resolve(platform: str, env) -> Form:
    """The form for `platform` (`jax.default_backend()`: cpu, gpu, tpu) under the environment
    mapping `env` (module doc). Raises ConfigError naming the variable, its value and the
    choices for an unknown value, or a CPU form named on another platform."""
    name = env.get(ENV) or ""
    if name:
        _choice(ENV, name, FORMS)
        if FORMS[name].cpu and platform != "cpu":
            raise ConfigError(f"{ENV}={name!r} runs on XLA CPU only; this platform is "
                              f"{platform!r}: choose one of "
                              f"{', '.join(n for n, f in FORMS.items() if not f.cpu)}")
    elif platform == "cpu":
        value = env.get(CPU_ALIAS) or "ordered"
        _choice(CPU_ALIAS, value, CPU_ALIASES)
        name = CPU_ALIASES[value]
    else:
        value = env.get(ACCEL_ALIAS) or "pallas"
        if value == "xla":
            raise ConfigError(f"{ACCEL_ALIAS}='xla': the XLA-loop accelerator form (accel-xla) "
                              "is removed; unset it or use 'pallas' (the Pallas kernels)")
        _choice(ACCEL_ALIAS, value, ACCEL_ALIASES)
        name = "pallas-tpu" if platform == "tpu" else "pallas-gpu"
    form = FORMS[name]
    if name == "stock":  # the stock dots' precision is the platform's (full on the CPU)
        form = dataclasses.replace(form, fp32_highest=platform != "cpu")
    return form


def accelerator_forms(platform: str | None = None) -> tuple[str, ...]:
    """The accelerator forms for `platform` (default: this process's): the platform's Pallas
    form, `("pallas-tpu",)` on a TPU, else `("pallas-gpu",)` (which a CPU process runs with the
    kernels interpreted)."""
    platform = platform or jax.default_backend()
    return ("pallas-tpu" if platform == "tpu" else "pallas-gpu",)


@functools.cache
def _resolved(platform: str, kernels: str | None, cpu: str | None, accel_: str | None) -> Form:
    env = {ENV: kernels, CPU_ALIAS: cpu, ACCEL_ALIAS: accel_}
    return resolve(platform, {k: v for k, v in env.items() if v is not None})


_selected: list[Form] = []  # `use_form`'s stack


def current() -> Form:
    """The form in force: the innermost `use_form`, else the one `resolve` gives this process's
    platform and environment (resolved once per distinct environment)."""
    if _selected:
        return _selected[-1]
    return _resolved(jax.default_backend(), os.environ.get(ENV), os.environ.get(CPU_ALIAS),
                     os.environ.get(ACCEL_ALIAS))


@contextlib.contextmanager
def plain_backward():
    """Programs traced in the scope take the plain backward (`PLAIN`) with the forward of the
    form in force when the scope opens (`benchmarks/learner.py`'s baseline)."""
    _selected.append(dataclasses.replace(current(), backward=PLAIN))
    try:
        yield
    finally:
        _selected.pop()


@contextlib.contextmanager
def use_form(name: str):
    """Run the scope with form `name` (programs traced inside it use it; jit caches do not know
    the form, so clear them or trace fresh functions). An accelerator form on XLA CPU traces
    the accelerator program (Pallas interpreted). Raises ConfigError for an unknown name."""
    _choice("form", name, FORMS)
    form = FORMS[name]
    if name == "stock":
        form = dataclasses.replace(form, fp32_highest=jax.default_backend() != "cpu")
    _selected.append(form)
    try:
        yield form
    finally:
        _selected.pop()
