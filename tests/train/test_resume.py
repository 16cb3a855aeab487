"""Training checkpoints, exact resume and whole-run determinism (issue 6).

The determinism claims run `experiments/tiny_arith_smoke.py` (shrunk: 40 warm-start steps, 16
held-out problems; still 6 GRPO steps with non-zero gradients) in separate processes with one
XLA CPU thread (`--xla_cpu_multi_thread_eigen=false`, also pinned by tests/conftest.py) and
compare parameter trees after bitcasting to unsigned integers:
  run B: `stop_after=3` in one process, then `resume=B` in another;
  run A: the whole run, a checkpoint after every step (all kept), in a third process.
A's and B's first three steps ran in two processes from the same config and seed; B's last three
ran after a restore. The SIGTERM test continues a copy of A in this process.
"""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from looprl.config import apply_overrides, load_experiment
from looprl.errors import CheckpointError, ConfigError
from looprl.io.checkpoint import (load_model_checkpoint, load_train_state, read_checkpoint_meta,
                                  save_model_checkpoint)
from looprl.train.resume import (check_resume_config, complete_checkpoints, latest_checkpoint,
                                 resume_command,
                                 restore_training_checkpoint, save_training_checkpoint, step_dir)

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "experiments" / "tiny_arith_smoke.py"
SHRINK = ["warm_start.max_steps=40", "warm_start.eval_every_steps=20", "eval.eval_problems=16",
          "warm_start.eval_problems=16", "progress_bar=false", "tensorboard=false",
          "checkpoint_every_steps=1", "keep_checkpoints=10"]
N_STEPS, STOP = 6, 3
TIMING = {"rollout_s", "learner_s"}


def u_bits(tree):
    """Leaves bitcast to unsigned ints of their width (so -0.0 != +0.0 and NaN payloads count)."""
    def bits(a):
        a = np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(
            getattr(a, "dtype", np.float32), jax.dtypes.prng_key) else a)
        return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")
    return jax.tree.map(bits, tree, is_leaf=lambda x: hasattr(x, "dtype")
                        and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))


def assert_trees_bit_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(u_bits(a))[0],
                            jax.tree.leaves(u_bits(b))):
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert np.array_equal(x, y), f"{jax.tree_util.keystr(path)} differs"


def read_jsonl(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def no_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def looprl_train(*overrides):
    """`looprl train SMOKE ...` in a fresh process running this tree, one XLA CPU thread."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ["XLA_FLAGS"]}
    assert "--xla_cpu_multi_thread_eigen=false" in env["XLA_FLAGS"]
    return subprocess.Popen([sys.executable, "-m", "looprl.cli", "train", str(SMOKE), *SHRINK,
                             *overrides], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc):
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("determinism")
    a, b = root / "A", root / "B"
    # Process B first: it compiles every program into the run's persistent compilation cache
    # (tests/conftest.py), so A and the resume, started together after it, load them instead of
    # both compiling them at once (compiling is about two thirds of a cold run: 137 s cold,
    # 46 s warm on a 2-core AMD EPYC, 2026-12-02). The cache key holds the program, so a
    # hit is the executable XLA would have built again. With the cache on, A runs B's compiled
    # programs, so this checks execution across processes; with LOOPRL_TEST_JAX_CACHE=0 every
    # process compiles its own, which also checks that compiling is deterministic.
    log = finish(looprl_train(f"out_dir={b}", f"stop_after={STOP}"))  # process 1
    stopped = {"log": log, "metrics": read_jsonl(b / "metrics.jsonl"),
               "summary": json.loads((b / "summary.json").read_text()),
               "checkpoints": [s for s, _ in complete_checkpoints(b)]}
    pa = looprl_train(f"out_dir={a}")                          # process 2, in parallel with 3
    pc = looprl_train(f"resume={b}", "tensorboard=true")       # process 3: out_dir from resume
    finish(pa)
    finish(pc)
    return {"A": a, "B": b, "stopped": stopped}


def test_smoke_run_has_at_least_4_steps_with_nonzero_gradients(runs):
    rows = read_jsonl(runs["A"] / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(N_STEPS))
    assert sum(r["grad_norm"] > 0 for r in rows) >= 4
    assert all(r["replay_exact_fraction"] == 1.0 for r in rows)


def test_same_config_and_seed_in_two_processes_give_identical_bits(runs):
    a, stopped = runs["A"], runs["stopped"]
    assert stopped["checkpoints"] == [1, 2, 3] and stopped["summary"]["grpo_steps"] == STOP
    assert stopped["summary"]["resumed_from_step"] is None
    for name in ("warm_start", f"checkpoints/step_{STOP:08d}"):
        pa, _, _, _ = load_model_checkpoint(a / name)
        pb, _, _, _ = load_model_checkpoint(runs["B"] / name)
        assert_trees_bit_equal(pa, pb)
    # same batches and samples, step by step (rollout_sha256: tokens, exits, log-prob bits)
    assert no_timing(stopped["metrics"]) == no_timing(read_jsonl(a / "metrics.jsonl"))[:STOP]


def test_a_stopped_run_prints_the_command_that_continues_it(runs):
    b = runs["B"]
    assert runs["stopped"]["summary"]["complete"] is False
    assert (f"stopped after GRPO step {STOP} of {N_STEPS} (stop_after); continue with: "
            f"{resume_command(b)}") in runs["stopped"]["log"]


def test_stop_and_resume_gives_the_uninterrupted_run_bit_for_bit(runs):
    a, b = runs["A"], runs["B"]
    sa = json.loads((a / "summary.json").read_text())
    sb = json.loads((b / "summary.json").read_text())
    assert sa["resumed_from_step"] is None and sb["resumed_from_step"] == STOP
    assert sa["grpo_steps"] == sb["grpo_steps"] == N_STEPS
    assert sa["params_sha256"] == sb["params_sha256"]
    assert sa["eval_after"] == sb["eval_after"] and sa["eval_before"] == sb["eval_before"]
    ca, cb = step_dir(a, N_STEPS), step_dir(b, N_STEPS)
    assert_trees_bit_equal(load_model_checkpoint(ca)[0], load_model_checkpoint(cb)[0])
    assert_trees_bit_equal(load_train_state(ca), load_train_state(cb))  # optimizer state too
    assert_trees_bit_equal(load_model_checkpoint(a / "checkpoint")[0],
                           load_model_checkpoint(b / "checkpoint")[0])
    # metrics.jsonl: one row per step, the resumed run's rows equal the uninterrupted run's
    assert no_timing(read_jsonl(b / "metrics.jsonl")) == no_timing(read_jsonl(a / "metrics.jsonl"))
    # index.jsonl: params_sha256 of every checkpoint; retention kept B's own 10 newest
    ia = {r["step"]: r["params_sha256"] for r in read_jsonl(a / "checkpoints" / "index.jsonl")}
    ib = read_jsonl(b / "checkpoints" / "index.jsonl")
    assert [r["step"] for r in ib] == list(range(1, N_STEPS + 1))
    assert all(ia[r["step"]] == r["params_sha256"] for r in ib)
    assert read_checkpoint_meta(cb)["params_sha256"] == sb["params_sha256"]
    assert (b / "tb").is_dir()


def test_sigterm_saves_after_the_step_and_the_run_resumes_exactly(runs, tmp_path, capsys):
    """A copy of run A cut back to step 2 is resumed in this process; SIGTERM arrives during
    step 3 (0-based), so the run checkpoints at 4 and stops (exit 143); resuming again (from
    the run directory's config.json) finishes with A's bits."""
    from looprl.cli import main
    from looprl.rl.learner import GRPOLearner

    c = tmp_path / "C"
    shutil.copytree(runs["A"], c)
    for s in (3, 4, 5, 6):
        shutil.rmtree(step_dir(c, s))
    real_step = GRPOLearner.step

    def step_then_sigterm(self, i):
        if i == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # handled (a flag) while the step runs
        return real_step(self, i)

    before = signal.getsignal(signal.SIGTERM)
    mp = pytest.MonkeyPatch()
    mp.setattr(GRPOLearner, "step", step_then_sigterm)
    try:
        assert main(["train", str(SMOKE), *SHRINK, f"resume={c}"]) == 128 + signal.SIGTERM
    finally:
        mp.undo()
    assert signal.getsignal(signal.SIGTERM) is before
    pre = json.loads((c / "preempted.json").read_text())
    assert pre["preempted_at_step"] == 4 and latest_checkpoint(c)[0] == 4
    printed = re.search(r"continue with: (.+)$", capsys.readouterr().out, re.M).group(1)
    assert printed == pre["resume"]  # printed and recorded alike
    assert [r["step"] for r in read_jsonl(c / "metrics.jsonl")] == [0, 1, 2, 3]
    # the command as printed (the run's config.json: the overrides need not be given again)
    argv = shlex.split(printed)
    assert argv[0] == "looprl" and main(argv[1:]) == 0
    assert not (c / "preempted.json").exists()
    sc = json.loads((c / "summary.json").read_text())
    sa = json.loads((runs["A"] / "summary.json").read_text())
    assert sc["resumed_from_step"] == 4 and sc["params_sha256"] == sa["params_sha256"]
    assert no_timing(read_jsonl(c / "metrics.jsonl")) == no_timing(
        read_jsonl(runs["A"] / "metrics.jsonl"))
    assert_trees_bit_equal(load_train_state(step_dir(c, N_STEPS)),
                           load_train_state(step_dir(runs["A"], N_STEPS)))


def test_resume_of_a_finished_run_changes_nothing(runs, tmp_path, capsys):
    """`resume=` of a run that reached its grpo_steps says so and exits 0 without running the
    final evaluation again or rewriting summary.json; a fresh run into it names the finished
    run."""
    from looprl.cli import main
    f = tmp_path / "F"
    shutil.copytree(runs["A"], f)
    before = {p.relative_to(f): p.read_bytes() for p in f.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", str(f / "config.json"), f"resume={f}"]) == 0
    err = capsys.readouterr().err
    assert f"{f} finished at GRPO step {N_STEPS} (summary.json); nothing to run" in err
    after = {p.relative_to(f): p.read_bytes() for p in f.rglob("*") if p.is_file()}
    assert after == before
    assert main(["train", str(f / "config.json"), f"out_dir={f}"]) == 2
    assert "holds a finished run (summary.json)" in capsys.readouterr().err


def test_summary_records_learning_and_the_environment(runs):
    """summary.json says whether the parameters moved and how many steps had zero gradient,
    and records the environment (`determinism.environment()`) with the kernel version."""
    from looprl.kernels import kernel_version
    s = json.loads((runs["A"] / "summary.json").read_text())
    rows = read_jsonl(runs["A"] / "metrics.jsonl")
    assert s["params_changed"] is True
    assert s["steps_with_zero_grad"] == sum(r["grad_norm"] == 0 for r in rows)
    env = s["environment"]
    assert env["kernel_version"] == kernel_version()
    assert {"jax", "cpu_isa", "git_commit"} <= set(env)


# --- no training below ---------------------------------------------------------------------

def _learner(*overrides):
    from looprl.model.looped import init_params
    from looprl.rl.learner import GRPOLearner
    from looprl.train.setup import build_tasks
    from looprl.model.config import from_model_section

    cfg = apply_overrides(load_experiment(SMOKE), list(overrides))
    mcfg = from_model_section(cfg.model)
    _, rl_task = build_tasks(cfg)
    return cfg, mcfg, GRPOLearner(cfg, mcfg, init_params(mcfg, 0), rl_task, rl_task.tokenizer())


def _copy_as_step(src, run, step, *, meta_step=True):
    dst = step_dir(run, step)
    shutil.copytree(src, dst)
    if meta_step:
        meta = json.loads((dst / "looprl_meta.json").read_text())
        (dst / "looprl_meta.json").write_text(json.dumps({**meta, "step": step}))
    return dst


def test_latest_skips_interrupted_or_damaged_checkpoints_and_retention_keeps_the_newest(tmp_path):
    cfg, mcfg, learner = _learner("keep_checkpoints=2")
    run = tmp_path / "run"
    for s in (1, 2, 3):
        save_training_checkpoint(run, s, learner, mcfg, None, cfg)
    assert [s for s, _ in complete_checkpoints(run)] == [2, 3]      # retention: newest 2
    good = step_dir(run, 3)
    (_copy_as_step(good, run, 4) / "looprl_meta.json").unlink()     # meta never written
    f = max((p for p in _copy_as_step(good, run, 5).rglob("*") if p.is_file()
             and p.name != "looprl_meta.json"), key=lambda p: p.stat().st_size)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])           # a file cut short
    shutil.rmtree(_copy_as_step(good, run, 6) / "train_state")       # a part missing
    _copy_as_step(good, run, 7, meta_step=False)                    # meta says step 3
    shutil.copytree(good, run / "checkpoints" / ".step_00000008.tmp-x")  # unrenamed temp dir
    assert latest_checkpoint(run) == (3, step_dir(run, 3).absolute())
    with pytest.raises(CheckpointError, match="incomplete"):
        read_checkpoint_meta(step_dir(run, 5))
    # the next save replaces the broken step 4, removes the temp dir, keeps the newest two
    save_training_checkpoint(run, 4, learner, mcfg, None, cfg)
    assert [s for s, _ in complete_checkpoints(run)] == [3, 4]
    assert not (run / "checkpoints" / ".step_00000008.tmp-x").exists()
    assert [r["step"] for r in read_jsonl(run / "checkpoints" / "index.jsonl")] == [1, 2, 3, 4]


def test_restore_into_a_learner_of_another_shape_names_the_array(tmp_path):
    cfg, mcfg, learner = _learner()
    assert mcfg.num_layers == 1
    save_training_checkpoint(tmp_path, 2, learner, mcfg, None, cfg)
    _, _, bigger = _learner("model.num_layers=2")
    with pytest.raises(CheckpointError, match=r"params: array 'layers/\w+' is dtype float32 "
                                              r"shape \[1, .*expected dtype float32 shape \[2, "):
        restore_training_checkpoint(step_dir(tmp_path, 2), bigger)
    _, _, same = _learner()
    assert restore_training_checkpoint(step_dir(tmp_path, 2), same) == 2
    model_only = tmp_path / "model_only"
    save_model_checkpoint(model_only, jax.tree.map(np.asarray, learner.params), mcfg, None)
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        restore_training_checkpoint(model_only, same)


def test_resume_refuses_a_config_that_changes_more_than_run_control_keys():
    cfg = load_experiment(SMOKE)
    ok = apply_overrides(cfg, ["stop_after=2", "resume=x", "out_dir=x", "grpo_steps=9",
                               "keep_checkpoints=5", "progress_bar=false"])
    check_resume_config(cfg, ok, "ck")
    bad = apply_overrides(cfg, ["grpo.eps_high=0.3", "seed=1"])
    with pytest.raises(ConfigError, match=r"\['grpo.eps_high', 'run.seed'\] differ from the run "
                                          r"being resumed \(ck\): grpo.eps_high \(0.28 -> 0.3\)"):
        check_resume_config(cfg, bad, "ck")
    cosine = apply_overrides(cfg, ["optim.lr_schedule=cosine"])
    with pytest.raises(ConfigError, match=r"\['run.grpo_steps'\]"):
        check_resume_config(cosine, apply_overrides(cosine, ["grpo_steps=9"]), "ck")


def test_resume_needs_the_same_out_dir_and_a_checkpoint(tmp_path):
    from looprl.train.run import train
    cfg = load_experiment(SMOKE)
    with pytest.raises(ConfigError, match="out_dir must be the resumed directory"):
        train(apply_overrides(cfg, [f"resume={tmp_path}", f"out_dir={tmp_path / 'other'}"]))
    with pytest.raises(ConfigError, match="is not a run directory"):
        train(apply_overrides(cfg, [f"resume={tmp_path}", f"out_dir={tmp_path}"]))
    (tmp_path / "config.json").write_text("{}")   # restarting the start: config checked first
    with pytest.raises(ConfigError, match="differ from the run being resumed"):
        train(apply_overrides(cfg, [f"resume={tmp_path}", f"out_dir={tmp_path}"]))
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="finished .* without a GRPO training checkpoint"):
        train(apply_overrides(cfg, [f"resume={tmp_path}", f"out_dir={tmp_path}"]))
    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no usable training checkpoint: step_00000002: "
                                              ".*looprl_meta.json missing"):
        train(apply_overrides(cfg, [f"resume={tmp_path}", f"out_dir={tmp_path}"]))


def test_damaged_bytes_of_the_right_size_are_refused_and_learner_left_untouched(tmp_path):
    cfg, mcfg, learner = _learner()
    save_training_checkpoint(tmp_path, 2, learner, mcfg, None, cfg)
    data = max((p for p in (step_dir(tmp_path, 2) / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 64] = bytes(b ^ 0x5A for b in raw[mid:mid + 64])
    data.write_bytes(bytes(raw))                      # same size: the file manifest passes
    read_checkpoint_meta(step_dir(tmp_path, 2))
    _, _, other = _learner()
    before = jax.tree.map(np.asarray, other.params)
    with pytest.raises(CheckpointError,
                       match="damaged checkpoint file|damaged parameters|cannot restore"):
        restore_training_checkpoint(step_dir(tmp_path, 2), other)
    assert_trees_bit_equal(jax.tree.map(np.asarray, other.params), before)


def test_metrics_row_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
    from looprl.train.run import _truncate_jsonl
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0, "x": 1}\n{"step": 1, "x": 2}\n{"step": 2, "x"')
    _truncate_jsonl(p, 2, inclusive=False)
    assert read_jsonl(p) == [{"step": 0, "x": 1}, {"step": 1, "x": 2}]


# --- Ctrl-C (issue 15) ---------------------------------------------------------------------

def _wait_for(cond, proc, timeout=300):
    import time
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.05)


@pytest.mark.slow  # 33 s; the SIGTERM test runs the same finish-step, checkpoint, resume path
def test_ctrl_c_during_grpo_finishes_the_step_checkpoints_and_resumes_exactly(runs, tmp_path):
    """A first SIGINT during GRPO does what SIGTERM does: the step finishes, a checkpoint is
    written, the resume line is printed, exit status 130, no traceback; the resumed run ends
    with the uninterrupted run's bits."""
    from looprl.cli import main
    d = tmp_path / "D"
    proc = looprl_train(f"out_dir={d}", "checkpoint_every_steps=100")
    metrics = d / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    pre = json.loads((d / "preempted.json").read_text())
    k = pre["preempted_at_step"]
    assert pre["signal"] == "SIGINT" and 1 <= k < N_STEPS
    assert [s for s, _ in complete_checkpoints(d)] == [k]          # written because of Ctrl-C
    assert [r["step"] for r in read_jsonl(metrics)] == list(range(k))
    assert f"continue with: looprl train {d}/config.json resume={d}" in out
    assert main(["train", str(d / "config.json"), f"resume={d}"]) == 0
    sa = json.loads((runs["A"] / "summary.json").read_text())
    assert json.loads((d / "summary.json").read_text())["params_sha256"] == sa["params_sha256"]


def test_ctrl_c_during_the_warm_start_leaves_a_run_that_resume_restarts(runs, tmp_path):
    """Ctrl-C before the first training checkpoint: one line, exit 130; `resume=` (which used
    to refuse such a directory, as did a rerun) runs the start again and gives the same bits
    as the uninterrupted run (its index.jsonl digest after 2 GRPO steps)."""
    from looprl.cli import main
    e = tmp_path / "E"
    proc = looprl_train(f"out_dir={e}")
    _wait_for(lambda: (e / "config.json").exists(), proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out
    assert f"continue with: looprl train {e}/config.json resume={e}" in out
    assert not complete_checkpoints(e)
    assert main(["train", str(SMOKE), *SHRINK, f"resume={e}", "stop_after=2"]) == 0
    ia = {r["step"]: r["params_sha256"] for r in read_jsonl(runs["A"] / "checkpoints"
                                                             / "index.jsonl")}
    assert json.loads((e / "summary.json").read_text())["params_sha256"] == ia[2]
    # the run's config.json keeps no run-control key, so it serves as CONFIG again
    saved = json.loads((e / "config.json").read_text())["run"]
    assert saved["resume"] is None and saved["stop_after"] is None
