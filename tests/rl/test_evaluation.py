"""Greedy held-out evaluation (`looprl.rl.evaluation`)."""
import numpy as np


def test_evaluate_reports_by_terms_only_for_tasks_with_terms(monkeypatch):
    """`looprl.rl.evaluation.evaluate` (the in-training evaluation), the sampler faked: arithmetic
    problems (metadata num_terms) get a per-terms breakdown, GSM8K problems none."""
    from types import SimpleNamespace

    from looprl.rl import evaluation
    from looprl.tasks.base import Problem

    rewards = {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0}  # by problem id

    def fake_generate(model_cfg, params, prompts, scfg, *, prompt_indices, **kw):
        n = len(prompts)
        exits = np.zeros((n, 3), np.int32)
        exits[:, 1:] = 4  # prompt_len 2: the completion's positions exit at loop 4
        return SimpleNamespace(exit_loop_BxS=exits, schedule=SimpleNamespace(prompt_len=2,
                                                                          seq_len=3),
                               tokens_BxS=np.zeros((n, 3), np.int32),
                               completion_len_B=np.ones((n,), np.int32))

    monkeypatch.setattr(evaluation, "sampling_config",
                        lambda cfg, greedy: SimpleNamespace(compute_dtype="float32"))
    monkeypatch.setattr(evaluation, "generate", fake_generate)
    monkeypatch.setattr(evaluation, "kv_cache_bytes", lambda *a: 0)  # no sampler, no cache
    cfg = SimpleNamespace(eval=SimpleNamespace(eval_batch_size=3), run=SimpleNamespace(seed=0))
    task = SimpleNamespace(format_prompt=lambda p: p.prompt, reward=lambda p, text: rewards[p.id])
    tok = SimpleNamespace(encode=lambda text: [1, 2], decode_completion=lambda ids: "",
                          end_of_turn_id=2)

    arith = [Problem(i, "eval", "1 + 1", "2", {"num_terms": t}) for i, t in enumerate((2, 3, 3, 2))]
    res = evaluation.evaluate(None, None, task, tok, cfg, arith)
    assert res == {"accuracy": 0.75, "mean_exit_loop": 4.0, "problems": 4,
                   "by_terms": {"2": 1.0, "3": 0.5}}
    gsm8k = [Problem(i, "eval", "q", "2", {"file": "test.jsonl", "line": i + 1}) for i in range(4)]
    assert evaluation.evaluate(None, None, task, tok, cfg, gsm8k) == {
        "accuracy": 0.75, "mean_exit_loop": 4.0, "problems": 4}
