"""The matrix's small decode batches (rollouts of 1, 3, 5 rows; cells record `rollout_rows`) and
the kernel version a rollout records (`verify --rollout` refuses another version's rollout)."""
import dataclasses
import re

import pytest

from looprl.cli import main
from looprl.errors import ScheduleError
from looprl.io.checkpoint import save_model_checkpoint
from looprl.model import init_params, preset
from looprl.kernels import KERNEL_VERSION, cpu_kernel_version
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.sampling.schedule import RolloutBatch
from looprl.tokenizer import build_char_tokenizer
from looprl.verify.matrix import VerifyOptions, run_matrix, verify_rollout

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
    # a rollout of a machine with another sgemm ISA (its bits are other kernels')
    base = here.split("/")[0]
    other = f"{base}/avx2" if here == base else base
    alien = dataclasses.replace(rb, schedule=dataclasses.replace(rb.schedule,
                                                                 kernel_version=other))
    with pytest.raises(ScheduleError, match=f"{re.escape(other)}, this looprl has "
                                            f"{re.escape(here)}.*same sgemm kernels"):
        verify_rollout(CFG, params, alien, VerifyOptions())
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


def test_verify_compares_the_learner_methods_but_hybrid_and_the_schedule_unaware_ones():
    from looprl.logprobs import METHODS as LEARNER
    from looprl.sampling.kv_policies import KV_POLICIES
    from looprl.verify import matrix
    assert matrix.METHODS == ("replay", "dense", "stock")
    assert set(matrix.METHODS) < set(LEARNER) and matrix.POLICIES == KV_POLICIES
