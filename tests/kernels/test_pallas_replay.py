"""The Pallas kernel set end to end on XLA CPU (interpreted): with `kernels.use_form("pallas-gpu")`
(and `pallas-tpu`, whose decode steps read the KV cache in place) the sampler (prefill, one-query decode steps, deferred chunks, the cache read by slot) and the
learner's teacher-forced replay both run the Pallas kernels, and the replay's log-probs equal
the sampler's bit for bit, for a one-row and a five-row batch, while the stock control
mismatches. The default suite runs one small case (GQA, fp32, the deferred KV policy); the
other KV policies, bf16 and one layer at Ouro-1.4B width run under `-m slow`. This checks the
algorithm; a device decides its own rounding (`looprl verify --device`)."""
import jax
import numpy as np
import pytest

from looprl import kernels as kn
from looprl.logprobs import batch_logprobs
from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.sampling.sampler import SamplingConfig, generate

SMALL = preset("tiny", num_layers=1, num_kv_heads=2)
OURO_LAYER = preset("ouro-1.4b", num_layers=1, vocab_size=49152)


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def _replays(cfg, policy, dtype, rows_list, new_tokens, form="pallas-gpu"):
    params = init_params(cfg, 0)
    params["early_exit_gate"]["bias"] = np.zeros_like(np.asarray(params["early_exit_gate"]["bias"]))
    with kn.use_form(form):
        jax.clear_caches()  # the form is read when a program is traced
        try:
            scfg = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, exit_threshold=0.5,
                                  kv_policy=policy, compute_dtype=dtype, stop_ids=())
            rng = np.random.default_rng(0)
            stock_exact = []
            for rows in rows_list:
                prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size,
                                                         int(rng.integers(3, 9)))]
                           for _ in range(rows)]
                rb = generate(cfg, params, prompts, scfg, seed=rows)
                assert rb.schedule.kernel_version == \
                    f"{kn.KERNEL_VERSION_ACCEL}/{form}-interpret"
                assert rb.schedule.row_tile == kn.ROW_TILE
                emit = np.asarray(rb.exit_loop_BxS) > 0
                assert emit.sum() == rows * new_tokens
                replay, _ = batch_logprobs(cfg, params, rb, "replay")
                wrong = int((_bits(replay) != _bits(rb.logprob_BxS))[emit].sum())
                assert wrong == 0, f"{rows} rows: replay differs at {wrong} of {int(emit.sum())}"
                stock, _ = batch_logprobs(cfg, params, rb, "stock")
                if dtype == "float32":
                    assert np.abs(stock - np.asarray(rb.logprob_BxS))[emit].max() <= 1e-3
                stock_exact.append(_bits(stock)[emit] == _bits(rb.logprob_BxS)[emit])
            assert np.concatenate(stock_exact).mean() < 1.0  # the control can fail
        finally:
            jax.clear_caches()


def test_a_pallas_rollout_replays_bit_for_bit():
    _replays(SMALL, "deferred", "float32", (1, 5), 6)


def test_a_tpu_form_rollout_replays_bit_for_bit():
    """`pallas-tpu`: the sampler's decode steps read the cache in place
    (`pallas_attention_tpu`), the learner attends over whole rows (`flash_attention`)."""
    _replays(SMALL, "copy", "bfloat16", (1, 5), 6, form="pallas-tpu")


@pytest.mark.slow
@pytest.mark.parametrize("policy,dtype", [("dense", "float32"), ("copy", "float32"),
                                          ("deferred", "bfloat16"), ("dense", "bfloat16"),
                                          ("copy", "bfloat16")])
def test_a_pallas_rollout_replays_bit_for_bit_for_every_policy(policy, dtype):
    _replays(SMALL, policy, dtype, (1, 5), 6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pallas_rollout_replays_at_ouro_width(dtype):
    """One layer at Ouro-1.4B width (hidden 2048, V = 49,152), three rows, four tokens."""
    _replays(OURO_LAYER, "deferred", dtype, (3,), 4)


def test_the_sampler_casts_the_layer_stacks_once_with_the_same_bits(monkeypatch):
    """On an accelerator form the sampler casts the fp32 layer stacks to bf16 once per call
    (`looped.stacks_cast_once`), not per layer pass: the same rollout, bit for bit."""
    import looprl.sampling.sampler as sampler
    params = init_params(SMALL, 0)
    scfg = SamplingConfig(max_new_tokens=5, temperature=1.0, exit_threshold=0.5,
                          kv_policy="dense", compute_dtype="bfloat16", stop_ids=())
    prompts = [[5, 9, 11, 4], [7, 3, 3]]
    out = {}
    with kn.use_form("pallas-tpu"):
        assert sampler.stacks_cast_once()
        for once in (True, False):
            monkeypatch.setattr(sampler, "stacks_cast_once", lambda once=once: once)
            jax.clear_caches()  # the choice is read when a program is traced
            try:
                rb = generate(SMALL, params, prompts, scfg, seed=3)
            finally:
                jax.clear_caches()
            out[once] = (np.asarray(rb.tokens_BxS), _bits(rb.logprob_BxS),
                         np.asarray(rb.exit_loop_BxS))
    for a, b in zip(out[True], out[False]):
        assert np.array_equal(a, b)
    assert (out[True][2] > 0).sum() == 10
