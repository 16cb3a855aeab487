"""Process-level settings that bit-exactness depends on, and the environment record of reports.

XLA CPU (jax 0.10 and 0.11): the newer fusion emitters compile the same elementwise ops into
numerically different loops depending on the surrounding program, so a learner program and a
sampler program disagreed in low bits even with batch-invariant kernels; the legacy emitters do
not (`--xla_cpu_use_fusion_emitters=false`, measured in tests/logprobs). The YNNPACK dot fusions
pick kernels by row count, so they are off too (`--xla_cpu_experimental_ynn_fusion_type=`).
The CPU kernels pad rows to the sgemm register block of the machine's ISA (`cpu_isa`,
`cpu_row_quantum`: 8 with AVX-512, 24 elsewhere). Bits also depend on the
thread count: the test suite and `looprl verify` pin XLA CPU to one intra-op thread
(`--xla_cpu_multi_thread_eigen=false`); the flags in force are recorded in every report.

On a GPU the compiler could still choose per program what the invariant kernels'
argument needs fixed, so where a GPU plugin of jax is installed and a device is present
`configure_xla()` also pins ACCELERATOR_FLAGS: deterministic ops (no atomics in reductions or scatters), GEMM autotuning off
(level 0: the algorithm is the library heuristic's function of the dot's shape and the device,
not a per-program timing), XLA's Triton GEMMs off (cuBLAS takes every dot; the Triton emitter
picks a tiling and split-K per fusion), the kernels' tile loops kept as loops (unrolled, dots
sharing a weight could be merged into one dot whose shape depends on M), and
`NVIDIA_TF32_OVERRIDE=0` (cuBLAS never uses TF32 for fp32). Without a device these flags are
not added (the CPU backend ignores them; they would only change the recorded environment).

`configure_xla()` runs when `looprl` is imported: it appends the flags to XLA_FLAGS unless the
user set them, on every jaxlib line `looprl.compat` supports (the XLA of each knows every flag);
an unsupported jaxlib is `compat.UnsupportedJaxError`. It must run before jax creates its
backends; `environment()` records what the process actually runs with.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import subprocess

from looprl import compat

REQUIRED_CPU_FLAGS = ("--xla_cpu_use_fusion_emitters=false",
                      # YNNPACK dot fusions pick M-dependent kernels (looprl.kernels
                      # then pads rows to whole register blocks, `cpu_row_quantum`)
                      "--xla_cpu_experimental_ynn_fusion_type=")
PINNED_THREAD_FLAG = "--xla_cpu_multi_thread_eigen=false"
ACCELERATOR_FLAGS = ("--xla_gpu_deterministic_ops=true",
                     "--xla_gpu_autotune_level=0",
                     "--xla_gpu_enable_triton_gemm=false",
                     "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_NO_UNROLL")
ACCELERATOR_ENV = {"NVIDIA_TF32_OVERRIDE": "0"}


def gpu_plugin_installed() -> bool:
    """True when a GPU plugin of jax is importable (found without importing it or jax)."""
    return any(importlib.util.find_spec(name) is not None for name in compat.GPU_PLUGINS)


ACCELERATOR_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/accel0", "/dev/vfio/0")
TPU_RUNTIME = "libtpu"


def accelerator_present() -> bool:
    """True when the machine shows an accelerator's device node (NVIDIA, AMD, TPU)."""
    return any(os.path.exists(p) for p in ACCELERATOR_NODES)


def _cpu_only_platform() -> None:
    """Where jax's GPU plugin or libtpu is installed (e.g. for compile-only targets,
    `looprl.aot`) but no accelerator is present and JAX_PLATFORMS is unset, choose the CPU:
    the plugins' failed device searches print warnings and slow every start; the CPU backend
    and its programs are the same either way."""
    if os.environ.get("JAX_PLATFORMS") or accelerator_present():
        return
    if gpu_plugin_installed() or importlib.util.find_spec(TPU_RUNTIME) is not None:
        os.environ["JAX_PLATFORMS"] = "cpu"


def configure_xla(pin_threads: bool = False, accelerator: bool | None = None,
                  jaxlib: str | None = None) -> None:
    """Append looprl's required XLA flags to XLA_FLAGS (idempotent; user settings win).

    `accelerator`: also pin ACCELERATOR_FLAGS and ACCELERATOR_ENV (module doc); default: where a
    GPU plugin of jax is installed and an accelerator is present (`accelerator_present`; a
    compile-only GPU target gets the pins per compile, `looprl.aot.targets`). Where the
    plugins are installed with no accelerator present, JAX_PLATFORMS=cpu unless set.
    `jaxlib`: the version deciding the line (default: the installed one). Raises
    compat.UnsupportedJaxError for a jaxlib outside `compat.SUPPORTED_RANGE`;
    LOOPRL_XLA_FLAGS=0 turns all of this off."""
    if os.environ.get("LOOPRL_XLA_FLAGS", "1") == "0":
        return
    compat.check_jaxlib(jaxlib)
    _cpu_only_platform()
    if accelerator is None:
        accelerator = gpu_plugin_installed() and accelerator_present()
    flags = os.environ.get("XLA_FLAGS", "")
    wanted = list(REQUIRED_CPU_FLAGS) + ([PINNED_THREAD_FLAG] if pin_threads else [])
    if accelerator:
        wanted += list(ACCELERATOR_FLAGS)
        for name, value in ACCELERATOR_ENV.items():
            os.environ.setdefault(name, value)
    for flag in wanted:
        names = {tok.split("=")[0] for tok in flags.split()}  # whole names: a flag whose name
        if flag.split("=")[0] not in names:  # extends another's is another flag
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags


def backend_initialized() -> bool:
    """True if jax already created its backends (then XLA_FLAGS changes have no effect)."""
    return compat.backends_started()


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else `platform.processor()` or the machine."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


AVX512_CORE = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # oneDNN's `avx512_core`
CPU_ROW_QUANTUM_AVX512 = 8  # oneDNN's AVX-512 sgemm row register block (our rows: its N side)
CPU_ROW_QUANTUM_OTHER = 24  # elsewhere: lcm of the 4-, 6- (AVX2) and 8-row blocks


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# oneDNN's x86 ISA levels, lowest first (`ONEDNN_MAX_CPU_ISA` names, by prefix: AVX2_VNNI is an
# AVX2 level, AVX512_CORE_BF16 and AVX10_1_512_AMX are AVX-512 core levels)
ISA_LEVELS = ("sse41", "avx", "avx2", "avx512_core")
_CAP_PREFIXES = (("AVX10", 3), ("AVX512_CORE", 3), ("AVX512_MIC", 2), ("AVX2", 2), ("AVX", 1),
                 ("SSE41", 0))


def _hardware_isa_level(flags) -> int | None:
    if all(f in flags for f in AVX512_CORE):
        return 3
    if "avx2" in flags and "fma" in flags:
        return 2
    if "avx" in flags:
        return 1
    if "sse4_1" in flags:
        return 0
    return None


def cpu_isa() -> str:
    """The ISA level of oneDNN's sgemm kernels on this CPU (what XLA CPU's dots run): the
    highest of ISA_LEVELS the CPU's flags allow (`avx512_core` needs all four of AVX512_CORE),
    capped by ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA when set (oneDNN honours it inside XLA,
    and a capped ISA runs other sgemm kernels, with other bits); `other` where the flags
    cannot be read (no /proc/cpuinfo, not x86) or the cap is a name oneDNN's x86 list does
    not have."""
    level = _hardware_isa_level(cpu_flags())
    if level is None:
        return "other"
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL")
    cap = cap.strip().upper()
    if cap != "ALL":
        cap_level = next((lv for prefix, lv in _CAP_PREFIXES if cap.startswith(prefix)), None)
        if cap_level is None:
            return "other"
        level = min(level, cap_level)
    return ISA_LEVELS[level]


def cpu_row_quantum(isa: str | None = None) -> int:
    """The CPU kernels' row quantum (`looprl.kernels`, argument (3)): every row tile of a
    dot is a multiple of it, so that every row of every sgemm call sits in a whole register block
    of the micro-kernel. 8 with `avx512_core` (its block is 8 rows). 24 elsewhere, the least
    common multiple of the 4-, 6- and 8-row blocks of oneDNN's x86 kernels (AVX2's block is 6
    rows; its leftover rows take another code path with other bits). Off x86 (no oneDNN) 24
    is not argued: the tests decide (docs/NUMERICS.md, "The XLA CPU form")."""
    isa = cpu_isa() if isa is None else isa
    return CPU_ROW_QUANTUM_AVX512 if isa == "avx512_core" else CPU_ROW_QUANTUM_OTHER


def git_commit() -> dict:
    """{git_commit: HEAD of the checkout looprl runs from (None outside one), git_dirty: whether
    tracked files differ from it (None when unknown)}."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode != 0:
            return {"git_commit": None, "git_dirty": None}
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout
        return {"git_commit": out.stdout.strip() or None, "git_dirty": bool(dirty.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}


def environment() -> dict:
    """What bit claims hold for (docs/DESIGN.md section 5), the one record every report
    carries (`looprl verify`'s report.json, `looprl eval`'s summary, benchmarks):
    jax/jaxlib/python versions, backend, device kind and count, CPU model, the CPU's sgemm ISA
    and the kernels' row quantum (`cpu_isa`, `cpu_row_quantum`), CPU count and affinity,
    XLA_FLAGS,
    `threads_pinned` (one intra-op thread) and `intra_op_threads`, the accelerator pins
    (`accelerator_pins`: each of ACCELERATOR_FLAGS and ACCELERATOR_ENV, in force or not;
    `accel_matmul`: LOOPRL_ACCEL_MATMUL), platform, git commit and whether the checkout is
    dirty.

    jax is imported here, not at module top: this module sets XLA_FLAGS before jax loads."""
    import jax
    import jaxlib
    dev = jax.devices()[0]
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        affinity = None
    flags = os.environ.get("XLA_FLAGS", "")
    pinned = PINNED_THREAD_FLAG in flags
    isa = cpu_isa()
    return {
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version(),
        "backend": jax.default_backend(), "device_kind": getattr(dev, "device_kind", str(dev)),
        "device_count": jax.device_count(), "cpu_model": cpu_model(), "cpu_isa": isa,
        "cpu_row_quantum": cpu_row_quantum(isa),
        "cpu_count": os.cpu_count(), "cpu_affinity": affinity, "xla_flags": flags,
        "threads_pinned": pinned, "intra_op_threads": 1 if pinned else affinity,
        "accelerator_pins": {**{f: f in flags.split() for f in ACCELERATOR_FLAGS},
                             **{k: os.environ.get(k) == v for k, v in ACCELERATOR_ENV.items()}},
        "accel_matmul": os.environ.get("LOOPRL_ACCEL_MATMUL", "xla"),
        "platform": platform.platform(), **git_commit(),
    }
