"""Ctrl-C and SIGTERM handling of `looprl train` (`looprl.train.interrupts`); the whole-run
cases (Ctrl-C in the warm start and in GRPO, then `resume=`) are in test_resume.py."""
import importlib
import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from looprl.config import apply_overrides, load_experiment
from looprl.train.interrupts import CtrlC
from looprl.train.run import _grpo_loop

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python process running this tree (its own signal handlers)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_ctrl_c_dropped_inside_a_gc_callback_is_raised_at_the_next_check():
    """Python drops a KeyboardInterrupt raised inside a gc callback ("Exception ignored in"),
    and jax runs one at every collection: CI saw a Ctrl-C in the warm start lost that way (the
    run went on and exited 0). `CtrlC` remembers it; its `check()` raises it again."""
    code = ("import gc, os, signal\n"
            "from looprl.train.interrupts import CtrlC\n"
            "def cb(phase, info):\n"
            "    if phase == 'start':\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "        for _ in range(1000): pass\n"
            "with CtrlC() as c:\n"
            "    gc.callbacks.append(cb)\n"
            "    gc.collect()\n"  # the interrupt is raised inside cb and dropped there
            "    gc.callbacks.remove(cb)\n"
            "    print('collected', c.pending)\n"
            "    try:\n"
            "        c.check()\n"
            "    except KeyboardInterrupt:\n"
            "        print('raised at check')\n")
    p = _python(code)
    assert p.returncode == 0, p.stderr
    # gc.collect() returned although the SIGINT handler ran (pending): the interrupt was dropped
    assert p.stdout.split("\n")[:2] == [f"collected {int(signal.SIGINT)}", "raised at check"]
    assert p.stderr == ""  # and Python's "Exception ignored in ..." traceback is not printed


def test_a_second_ctrl_c_aborts_at_once_without_a_traceback():
    code = ("import os, signal, time\n"
            "from looprl.train.interrupts import DeferredSignals\n"
            "with DeferredSignals() as f:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    assert f.received == signal.SIGINT\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(30)\n")
    p = _python(code)
    assert p.returncode == 130
    assert "Traceback" not in p.stderr
    assert "finishing this GRPO step" in p.stderr and "second Ctrl-C: aborting now" in p.stderr


def test_an_ignored_sigint_stays_ignored_and_handlers_come_back():
    """A SIGINT the process inherited as ignored (a background job of a script) is left
    ignored by both managers; otherwise each restores the handler and unraisable hook it found."""
    code = ("import signal, sys\n"
            "from looprl.train.interrupts import CtrlC, DeferredSignals\n"
            "hook = sys.unraisablehook\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "with CtrlC(), DeferredSignals():\n"
            "    print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "with CtrlC() as c:\n"
            "    print(signal.getsignal(signal.SIGINT) == c._raise, sys.unraisablehook != hook)\n"
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,\n"
            "      sys.unraisablehook is hook)\n")
    p = _python(code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "True", "True", "True", "True"]


class _NoStepLearner:
    def step(self, step):
        raise AssertionError("a GRPO step ran although a Ctrl-C was pending")


def test_a_ctrl_c_pending_when_grpo_starts_stops_the_run_before_its_first_step(tmp_path):
    """A Ctrl-C dropped in the gap between the last check of the start and the GRPO loop's own
    handler used to go unseen by the loop (which ran every step). `_grpo_loop` checks once its
    handler is in, before any step."""
    cfg = apply_overrides(load_experiment(ROOT / "experiments" / "tiny_arith_smoke.py"),
                          ["tensorboard=false", "progress_bar=false"])
    with CtrlC() as ctrl_c:
        ctrl_c.pending = signal.SIGINT  # as `_raise` leaves it when Python dropped the raise
        with pytest.raises(KeyboardInterrupt):
            _grpo_loop(cfg, tmp_path, _NoStepLearner(), None, "", 0, 3, False, True, True, {},
                       ctrl_c)
        before = signal.getsignal(signal.SIGINT)
    assert before == ctrl_c._raise  # the loop's own handler was taken off again
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # no step row written


def test_a_dropped_ctrl_c_ends_any_command_with_130(monkeypatch, capsys):
    """`looprl <command>`: a Ctrl-C dropped while the command ran (pending, never raised) is
    raised when it returns: one line, exit status 130, not the command's 0."""
    cli = importlib.import_module("looprl.cli.main")  # the module (looprl.cli.main is also
    # the name of its function, re-exported by looprl.cli)

    def run(args):
        args.ctrl_c.pending = signal.SIGINT  # as `CtrlC._raise` leaves it when Python drops it
        return 0

    monkeypatch.setattr(cli, "_command_module", lambda command: types.SimpleNamespace(run=run))
    assert cli.main(["plot", "some_run_dir"]) == 130
    assert capsys.readouterr().err.strip() == "looprl plot: interrupted (Ctrl-C)"


class _SigintAtStepLearner:
    """A learner whose step `at` receives a SIGINT (a Ctrl-C) while it runs."""
    last_token_abs_delta = None

    def __init__(self, at):
        self.at = at

    def step(self, step):
        if step == self.at:
            os.kill(os.getpid(), signal.SIGINT)
        return {"step": step, "replay_exact_fraction": 1.0, "reward_mean": 0.5,
                "mean_exit_loop": 2.0}


def test_a_ctrl_c_in_the_last_grpo_step_stops_the_run_after_it(tmp_path, monkeypatch, capsys):
    """The Ctrl-C is acknowledged ("finishing this GRPO step"), so it is acted on: the loop
    returns the preemption record with the checkpoint of the last step and the command that
    continues the run (which then runs the final evaluation), instead of going on as if none
    had come."""
    from looprl.train import run as run_module
    saved = []
    monkeypatch.setattr(run_module, "save_training_checkpoint",
                        lambda out, done, *a, **k: (saved.append(done) or (out / f"s{done}",
                                                                           "sha")))
    cfg = apply_overrides(load_experiment(ROOT / "experiments" / "tiny_arith_smoke.py"),
                          ["tensorboard=false", "progress_bar=false",
                           "checkpoint_every_steps=100"])
    with CtrlC() as ctrl_c:
        pre = _grpo_loop(cfg, tmp_path, _SigintAtStepLearner(2), None, "", 0, 3, False, True,
                         True, {}, ctrl_c)
    assert "finishing this GRPO step" in capsys.readouterr().err
    assert pre is not None and pre["preempted_at_step"] == 3 and pre["signal"] == "SIGINT"
    assert pre["exit_status"] == 130 and saved == [3]
    assert pre["resume"] == f"looprl train {tmp_path}/config.json resume={tmp_path}"
    assert json.loads((tmp_path / "preempted.json").read_text()) == pre


def test_a_ctrl_c_python_wraps_in_another_error_is_still_a_ctrl_c():
    """A SIGINT during an import whose dataclass runs `__set_name__` reaches the caller as
    RuntimeError("Error calling __set_name__ ...") caused by the KeyboardInterrupt; `CtrlC`
    turns it back into a KeyboardInterrupt (exit 130 with the resume line, not a traceback).
    An error with no Ctrl-C behind it passes through unchanged."""
    class Interrupting:
        def __set_name__(self, owner, name):
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt) as info:
        with CtrlC():
            type("Config", (), {"field": Interrupting()})
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "__set_name__" in str(info.value.__cause__)
    with pytest.raises(RuntimeError, match="not an interrupt"):
        with CtrlC():
            raise RuntimeError("not an interrupt")
