"""A run resumes with the settings it started with (issue 14): a checkpoint whose config
predates `rollout.noise_keying` was sampled with the layout keying, and keeps it; one that
predates `learner.seq_bucket` trained on the whole layout, and keeps doing so; one that ran with
the old default `rollout.deferred_max_pending=4` keeps it (resuming it failed on the new
default before the key was inherited)."""
import json

from looprl.config import ExperimentConfig, to_json
from looprl.train.resume import CONFIG_IN_CHECKPOINT, load_resume_point


def test_resume_keeps_the_keys_its_checkpoint_predates(tmp_path):
    cfg = ExperimentConfig()
    d = json.loads(to_json(cfg))
    del d["rollout"]["noise_keying"]  # written before the keys existed
    del d["learner"]["seq_bucket"]
    (tmp_path / CONFIG_IN_CHECKPOINT).write_text(json.dumps(d))
    said = []
    resumed = load_resume_point(tmp_path, cfg, said.append)
    assert (cfg.rollout.noise_keying, cfg.learner.seq_bucket) == ("completion", 64)
    assert (resumed.rollout.noise_keying, resumed.learner.seq_bucket) == ("layout", 0)
    assert said == ["resuming with the run's own rollout.noise_keying='layout'",
                    "resuming with the run's own learner.seq_bucket=0"]
    assert resumed.replace(rollout=resumed.rollout.replace(noise_keying="completion"),
                           learner=resumed.learner.replace(seq_bucket=64)) == cfg


def test_resume_of_a_new_run_changes_nothing(tmp_path):
    cfg = ExperimentConfig()
    (tmp_path / CONFIG_IN_CHECKPOINT).write_text(to_json(cfg))
    assert load_resume_point(tmp_path, cfg) == cfg


def test_resume_keeps_the_deferred_window_it_was_sampled_with(tmp_path):
    cfg = ExperimentConfig()
    assert cfg.rollout.deferred_max_pending is None  # automatic since 2026-12-04
    saved = cfg.replace(rollout=cfg.rollout.replace(kv_policy="deferred",
                                                    deferred_max_pending=4))
    (tmp_path / CONFIG_IN_CHECKPOINT).write_text(to_json(saved))
    now = cfg.replace(rollout=cfg.rollout.replace(kv_policy="deferred"))
    said = []
    resumed = load_resume_point(tmp_path, now, said.append)
    assert resumed.rollout.deferred_max_pending == 4
    assert said == ["resuming with the run's own rollout.deferred_max_pending=4"]
    assert resumed == saved
