"""Compile-only accelerator targets and what their compiled programs contain.

`targets` compiles a jitted function for an H100 (sm_90) or a TPU v5e / v6e from a CPU process
(no device present); `inspect` reads the compiled program: its kernels, kernel launches, split-K,
TF32, the PTX of each GPU kernel, memory and cost; `traffic` counts its bytes and FLOPs;
`programs` builds looprl's sampler and learner programs, `fair` the baselines a user would run.
The structural tests (tests/aot) and `benchmarks/accel_cost.py` use them. `targets` and
`inspect` import no other looprl package but `determinism`; `traffic`, `programs` and `fair`
import the kernels and the model.
"""
