"""What `looprl train` prints (`looprl.train.console`): progress as plain lines when stderr is
not a terminal, and the warning of a run that learned nothing."""
import json

from looprl.train.console import (LineProgress, no_learning_line, progress_bar,
                                  steps_with_zero_grad)


def test_progress_on_a_redirected_stderr_is_plain_lines(capsys):
    """A log file gets a few whole lines, not tqdm's carriage-return redraws."""
    bar = progress_bar(True, 100, "warm start", "step")  # capsys: stderr is not a terminal
    assert isinstance(bar, LineProgress)
    for _ in range(100):
        bar.update(1)
        bar.set_postfix(loss="0.123")
    bar.write("a line above the bar")
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 11 and lines[-2] == "warm start: 100/100 step (loss=0.123)"
    assert lines[0] == "warm start: 10/100 step (loss=0.123)"
    assert progress_bar(False, 100, "x", "step") is None


def test_zero_gradient_steps_are_counted_and_a_run_that_learned_nothing_says_so(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": i, "grad_norm": g}) + "\n"
                         for i, g in enumerate([0.0, 0.0, 0.5, 0.0])) + '{"step": 4, "gr')
    assert steps_with_zero_grad(m, 4) == 3 and steps_with_zero_grad(m, 2) == 2
    assert steps_with_zero_grad(tmp_path / "none.jsonl", 3) == 0
    assert no_learning_line(True, 1, 4) is None
    assert no_learning_line(False, 0, 0) is None  # no GRPO step: nothing was to be learned
    line = no_learning_line(False, 2, 2)
    assert "every one of the 2 GRPO steps had gradient norm 0" in line
    assert "did not change" in line
    assert "1 of 3 GRPO steps had gradient norm 0" in no_learning_line(False, 1, 3)
