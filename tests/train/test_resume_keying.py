"""A run resumes with the noise keying it started with (issue 14): a checkpoint whose config
predates `rollout.noise_keying` was sampled with the layout keying, and keeps it."""
import json

from looprl.config import ExperimentConfig, to_json
from looprl.train.resume import CONFIG_IN_CHECKPOINT, load_resume_point


def test_resume_keeps_the_checkpoints_noise_keying(tmp_path):
    cfg = ExperimentConfig()
    d = json.loads(to_json(cfg))
    del d["rollout"]["noise_keying"]  # written before the key existed
    (tmp_path / CONFIG_IN_CHECKPOINT).write_text(json.dumps(d))
    said = []
    resumed = load_resume_point(tmp_path, cfg, said.append)
    assert cfg.rollout.noise_keying == "completion"
    assert resumed.rollout.noise_keying == "layout"
    assert said == ["resuming with the run's own rollout.noise_keying='layout'"]
    assert resumed.replace(rollout=resumed.rollout.replace(noise_keying="completion")) == cfg


def test_resume_of_a_new_run_changes_nothing(tmp_path):
    cfg = ExperimentConfig()
    (tmp_path / CONFIG_IN_CHECKPOINT).write_text(to_json(cfg))
    assert load_resume_point(tmp_path, cfg) == cfg
