"""The matrix's small decode batches (rollouts of 1, 3, 5 rows; cells record `rollout_rows`) and
the kernel version a rollout records (`verify --rollout` refuses another version's rollout, and
accepts the ordered CPU kernel's from a machine of another ISA)."""
import dataclasses
import re
from pathlib import Path

import pytest

from looprl.cli import main
from looprl.errors import ScheduleError
from looprl.io.checkpoint import save_model_checkpoint
from looprl.model import init_params, preset
from looprl.determinism import cpu_isa
from looprl.kernels import KERNEL_VERSION, KERNEL_VERSION_ORDERED, cpu_kernel_version
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.sampling.schedule import RolloutBatch
from looprl.tokenizer import build_char_tokenizer
from looprl.verify import matrix
from looprl.verify.matrix import VerifyOptions, isa_free_match, run_matrix, verify_rollout

ROOT = Path(__file__).resolve().parents[2]
CFG = preset("tiny", vocab_size=64, num_layers=1)
PROMPTS = [[1, 5, 6, 7, 2, 1], [1, 9, 2, 1], [1, 8, 8, 9, 10, 2, 1]]


@pytest.mark.slow  # ~200 s on 2 cores: a whole matrix; `looprl verify --quick` runs these cells too
def test_small_batches_are_cells_of_their_own_and_replay_exactly():
    opts = VerifyOptions(n_prompts=2, group_size=2, max_new_tokens=6, small_batches=(1, 3),
                         small_batch_weights=("random",),
                         min_tokens=12, min_early_exit_fraction=0.0)
    cells = run_matrix(CFG, {"random": init_params(CFG, 0)}, PROMPTS, opts, log=lambda m: None)
    rows = sorted({c["rollout_rows"] for c in cells})
    assert rows == [1, 3, 4]
    by_rows = {r: [c for c in cells if c["rollout_rows"] == r] for r in rows}
    assert all(c["tokens"] >= 12 for c in cells)  # ceil(12 / rows) tokens per row
    assert {c["batching"] for c in by_rows[1]} == {"same"}  # one row: no permutation
    assert all(c["exact_fraction"] == 1.0 for c in cells if c["method"] == "replay")


def test_a_rollout_of_another_kernel_version_is_refused(tmp_path):
    params = init_params(CFG, 0)
    rb = generate(CFG, params, PROMPTS[:1], SamplingConfig(max_new_tokens=4, exit_threshold=0.5))
    here = cpu_kernel_version()
    assert rb.schedule.kernel_version == here
    old = dataclasses.replace(rb, schedule=dataclasses.replace(rb.schedule, kernel_version=""))
    with pytest.raises(ScheduleError, match=f"none recorded.*{re.escape(here)}"):
        verify_rollout(CFG, params, old, VerifyOptions())
    # the ordered kernel sampled on another ISA: its bits do not depend on the ISA, so the
    # version check passes it on (here to the parameter check, as these params are others')
    base = here.split("/")[0]
    other = f"{base}/avx2" if here == base else base
    alien = dataclasses.replace(rb, schedule=dataclasses.replace(rb.schedule,
                                                                 kernel_version=other))
    with pytest.raises(ScheduleError, match="pass the sampler's --checkpoint"):
        verify_rollout(CFG, init_params(CFG, 1), alien, VerifyOptions())
    # a rollout of the CPU matmul's XLA form (kernel version KERNEL_VERSION) names the switch
    xla_form = dataclasses.replace(rb, schedule=dataclasses.replace(
        rb.schedule, kernel_version=here.replace(base, KERNEL_VERSION)))
    with pytest.raises(ScheduleError, match="LOOPRL_CPU_MATMUL=xla"):
        verify_rollout(CFG, params, xla_form, VerifyOptions())
    path = tmp_path / "old.npz"
    old.save(path)
    assert RolloutBatch.load(path).schedule.kernel_version == ""
    ckpt = tmp_path / "ckpt"
    save_model_checkpoint(ckpt, params, CFG, build_char_tokenizer().to_json())
    assert main(["verify", "--rollout", str(path), "--checkpoint", str(ckpt),
                 "--out", str(tmp_path / "rep")]) == 2


def test_only_the_ordered_kernel_is_accepted_across_isas(monkeypatch):
    o = KERNEL_VERSION_ORDERED
    assert isa_free_match(f"{o}/avx2", o) and isa_free_match(o, f"{o}/avx2")
    assert not isa_free_match(f"{KERNEL_VERSION}/avx2", KERNEL_VERSION)  # oneDNN's sgemm
    assert not isa_free_match("2026-12-01/avx2", o) and not isa_free_match("", o)
    # the XLA matmul form on another ISA is still refused
    params = init_params(CFG, 0)
    rb = generate(CFG, params, PROMPTS[:1], SamplingConfig(max_new_tokens=4, exit_threshold=0.5))
    monkeypatch.setattr(matrix, "kernel_version", lambda: KERNEL_VERSION)
    xla_avx2 = dataclasses.replace(rb, schedule=dataclasses.replace(
        rb.schedule, kernel_version=f"{KERNEL_VERSION}/avx2"))
    with pytest.raises(ScheduleError, match="same sgemm kernels"):
        verify_rollout(CFG, params, xla_avx2, VerifyOptions())


@pytest.mark.parametrize("machine", ["cpu", "cpu_avx2"])
def test_committed_rollouts_verify_on_either_isa(machine, tmp_path, capsys):
    """reproducibility/cpu (sampled on AVX-512) and cpu_avx2 (on AVX2): a rollout of each
    verifies here, whichever of the two ISAs this machine has (the ordered kernel's bits do
    not depend on it); the verdict is on stdout."""
    if cpu_isa() not in ("avx512_core", "avx2"):
        pytest.skip(f"the committed rollouts are of AVX-512 and AVX2 machines, not {cpu_isa()}")
    rollout = ROOT / "reproducibility" / machine / "rollouts" / "trained_float32_dense_rows1.npz"
    assert main(["verify", "--rollout", str(rollout), "--quick", "--out",
                 str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("looprl verify: PASS (2/2 replay cells exact")


def test_verify_compares_the_learner_methods_but_hybrid_and_the_schedule_unaware_ones():
    from looprl.logprobs import METHODS as LEARNER
    from looprl.sampling.kv_policies import KV_POLICIES
    from looprl.verify import matrix
    assert matrix.METHODS == ("replay", "dense", "stock")
    assert set(matrix.METHODS) < set(LEARNER) and matrix.POLICIES == KV_POLICIES
