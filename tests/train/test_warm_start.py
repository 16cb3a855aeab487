"""Warm start: stage I lowers the Ouro loss; stage II moves only the exit gate."""
import jax
import numpy as np
import pytest

from looprl.model.config import preset
from looprl.model.looped import init_params
from looprl.tasks import get_task
from looprl.train.warm_start import plateaued, supervised_batch, warm_start

CFG = preset("tiny", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
             intermediate_size=64)


def _task():
    return get_task("arithmetic", seed=0, dataset="chain_sum", train_terms=(2, 2),
                    train_digits=(1, 1), eval_terms=(3, 3), eval_digits=(1, 1), eval_size=50)


def test_supervised_mask_covers_solution_and_end_of_turn():
    task = _task()
    tok = task.tokenizer()
    p = task.train_problem(0)
    tokens, mask = supervised_batch(task, tok, [p])
    n_prompt = len(tok.encode(task.format_prompt(p)))
    n_sol = len(tok.encode(task.solution_text(p))) + 1   # + end of turn
    assert mask.sum() == n_sol
    assert mask[0, n_prompt - 1] == 1 and mask[0, n_prompt - 2] == 0
    assert tokens[0, n_prompt + n_sol - 1] == 2          # the last target is <|im_end|>


def test_stage1_lowers_loss_and_stage2_moves_only_the_gate():
    task = _task()
    params = init_params(CFG, 0)
    p1, rep = warm_start(CFG, params, task, task.tokenizer(), steps=60, batch_size=16,
                         learning_rate=3e-3, seed=0, gate_steps=0)
    assert rep["stage1_steps"] == 60 and rep["stage2_steps"] == 0
    assert rep["curve"][-1]["loss"] < rep["curve"][0]["loss"]
    p2, rep2 = warm_start(CFG, p1, task, task.tokenizer(), steps=0, batch_size=16,
                          learning_rate=3e-3, seed=0, gate_steps=5, gate_learning_rate=1e-2)
    assert rep2["stage2_steps"] == 5 and np.isfinite(rep2["stage2_final_loss"])
    for k in p1:
        same = jax.tree.leaves(jax.tree.map(
            lambda a, b: bool(np.array_equal(np.asarray(a).view(np.uint32),
                                             np.asarray(b).view(np.uint32))), p1[k], p2[k]))
        assert all(same) == (k != "early_exit_gate"), k


def test_plateau_rule():
    flat = [{"step": s, "accuracy": a} for s, a in
            zip(range(100, 1100, 100), [.1, .3, .5, .6, .65, .66, .66, .67, .67, .67])]
    rising = [{"step": s, "accuracy": 0.1 * i} for i, s in enumerate(range(100, 1100, 100))]
    assert plateaued(flat) and not plateaued(rising) and not plateaued(flat[:3])


@pytest.mark.parametrize("gate_steps", [25, 0])
def test_progress_bar_total_shrinks_to_the_steps_run_when_stage1_plateaus(gate_steps,
                                                                             capsys):
    """A stage I that stops at its plateau cuts the bar's total to the steps that run (the
    `stage1_done` callback, `looprl.train.console.warm_start_bar_cut`), with or without a stage
    II, so the bar ends full, not at 10 of 1025; the evaluation lines go above the bar."""
    import io

    from tqdm import tqdm

    from looprl.train.console import warm_start_bar_cut, warm_start_logger
    task = _task()
    out = io.StringIO()
    bar = tqdm(total=1000 + gate_steps, file=out)
    said = []
    _, rep = warm_start(CFG, init_params(CFG, 0), task, task.tokenizer(), steps=1000,
                        batch_size=4, learning_rate=3e-3, seed=0, gate_steps=gate_steps,
                        eval_fn=lambda p: 0.5, eval_every=2, plateau_min_evals=5,
                        log=warm_start_logger(bar, said.append), progress=bar.update,
                        stage1_done=warm_start_bar_cut(bar, gate_steps))
    assert rep["plateaued"] and rep["stage1_steps"] == 10 and rep["stage2_steps"] == gate_steps
    assert bar.n == bar.total == 10 + gate_steps
    assert said == [] and "warm start step 10: loss" in capsys.readouterr().err
