"""The accelerator forms of the kernels, end to end on XLA CPU: with `kernels.use_form`
selecting `accel-xla` or `pallas-gpu` the sampler and the learner both run the accelerator form (fixed 64-row tiles,
128-long K blocks, attention in key blocks; the XLA form and the Pallas kernel, interpreted), and
the learner's replay equals the sampler's log-probs bit for bit for every KV policy, in fp32 and
bf16, for a one-row decode batch and a five-row one, while the stock control mismatches (all
cases under `-m slow`; the default suite checks the accelerator forms kernel by kernel). On
the CPU this shows the form is consistent between the sampler's programs (prefill, one-query
decode steps, deferred chunks) and the learner's teacher-forced pass; on a device the same is
what `reproducibility/gpu_check.py` measures."""
import jax
import numpy as np
import pytest

from looprl.logprobs import batch_logprobs
from looprl import kernels as kn
from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.sampling.sampler import SamplingConfig, generate

CFG = preset("tiny", num_layers=1)


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, 0)
    p["early_exit_gate"]["bias"] = np.zeros_like(np.asarray(p["early_exit_gate"]["bias"]))
    return p


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


CASES = [("deferred", "xla", "float32"), ("dense", "xla", "float32"), ("copy", "xla", "float32"),
         ("deferred", "pallas", "float32"), ("dense", "pallas", "float32"),
         ("copy", "pallas", "float32"), ("dense", "xla", "bfloat16"),
         ("deferred", "xla", "bfloat16"), ("copy", "xla", "bfloat16"),
         ("deferred", "pallas", "bfloat16")]


# every case: 27-53 s on 2 cores; the default suite checks the accelerator forms kernel by kernel
# (tests/model/test_accel_kernels.py)
@pytest.mark.slow
@pytest.mark.parametrize("policy,impl,dtype", CASES)
def test_accelerator_form_replays_bit_for_bit(params, policy, impl, dtype, monkeypatch):
    scope = kn.use_form({"xla": "accel-xla", "pallas": "pallas-gpu"}[impl])
    scope.__enter__()
    jax.clear_caches()  # the form is read when a program is traced
    try:
        scfg = SamplingConfig(max_new_tokens=6, temperature=1.0, exit_threshold=0.5,
                              kv_policy=policy, compute_dtype=dtype, stop_ids=())
        rng = np.random.default_rng(0)
        stock_exact = []
        for rows in (1, 5):
            prompts = [[int(t) for t in rng.integers(3, CFG.vocab_size, int(rng.integers(3, 9)))]
                       for _ in range(rows)]
            rb = generate(CFG, params, prompts, scfg, seed=rows)
            assert rb.schedule.kernel_version == f"{kn.KERNEL_VERSION_ACCEL}/{impl}"
            assert rb.schedule.row_tile == kn.ROW_TILE
            emit = np.asarray(rb.exit_loop_BxS) > 0
            assert emit.sum() == rows * 6
            replay, _ = batch_logprobs(CFG, params, rb, "replay")
            wrong = int((_bits(replay) != _bits(rb.logprob_BxS))[emit].sum())
            assert wrong == 0, f"{rows} rows: replay differs at {wrong} of {int(emit.sum())}"
            stock, _ = batch_logprobs(CFG, params, rb, "stock")
            if dtype == "float32":
                assert np.abs(stock - np.asarray(rb.logprob_BxS))[emit].max() <= 1e-4
            stock_exact.append(_bits(stock)[emit] == _bits(rb.logprob_BxS)[emit])
        assert np.concatenate(stock_exact).mean() < 1.0  # the control can fail
    finally:
        scope.__exit__(None, None, None)
        jax.clear_caches()
