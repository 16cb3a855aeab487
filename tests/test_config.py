"""Experiment configs: types, overrides, experiment files, JSON round trip (looprl.config)."""
import dataclasses
import json

import pytest

from looprl import config as C
from looprl.errors import ConfigError


def test_defaults_construct_and_are_frozen():
    cfg = C.ExperimentConfig()
    assert cfg.rollout.sequences_per_step == 16 * 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run.seed = 3


def test_overrides_dotted_and_bare_keys_parse_by_type():
    cfg = C.apply_overrides(C.ExperimentConfig(), [
        "grpo.eps_high=0.28", "out_dir=/tmp/run1", "seed=7", "stop_after=2", "resume=/tmp/run1",
        "kv_policy=deferred", "rollout.fixed_depth=3", "tis_cap=2", "train_gate=yes",
        "task.train_datasets=chain_sum, leg_counting", "optim.learning_rate=3e-5",
        "loop_credit=progressive", "group_size=4",
    ])
    assert cfg.grpo.eps_high == 0.28
    assert cfg.run.out_dir == "/tmp/run1"
    assert cfg.run.seed == 7 and isinstance(cfg.run.seed, int)
    assert cfg.run.stop_after == 2
    assert cfg.run.resume == "/tmp/run1"
    assert cfg.rollout.kv_policy == "deferred"
    assert cfg.rollout.fixed_depth == 3
    assert cfg.grpo.tis_cap == 2.0 and isinstance(cfg.grpo.tis_cap, float)
    assert cfg.learner.train_gate is True
    assert cfg.task.train_datasets == ("chain_sum", "leg_counting")
    assert cfg.optim.learning_rate == 3e-5
    assert cfg.grpo.loop_credit == "progressive"
    assert cfg.rollout.group_size == 4
    # later overrides win; none for Optional
    cfg2 = C.apply_overrides(cfg, ["seed=1", "run.seed=2", "fixed_depth=none",
                                   "resume=none"])
    assert cfg2.run.seed == 2 and cfg2.rollout.fixed_depth is None
    assert cfg2.run.resume is None


def test_unknown_key_is_rejected_with_its_name_and_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key 'grpo.eps_hgh'.*grpo.eps_high"):
        C.apply_overrides(C.ExperimentConfig(), ["grpo.eps_hgh=0.3"])
    with pytest.raises(ConfigError, match="unknown config key 'nonsense'"):
        C.apply_overrides(C.ExperimentConfig(), ["nonsense=1"])
    with pytest.raises(ConfigError, match="unknown config key 'grpo'"):
        C.apply_overrides(C.ExperimentConfig(), ["grpo=1"])   # a section, not a leaf


def test_ambiguous_bare_key_is_rejected_listing_the_candidates():
    with pytest.raises(ConfigError, match=r"'learning_rate' is ambiguous.*optim.learning_rate"
                                          r".*warm_start.learning_rate"):
        C.apply_overrides(C.ExperimentConfig(), ["learning_rate=1e-3"])


@pytest.mark.parametrize("item,pattern", [
    ("seed=abc", r"'run.seed': expected int, found 'abc'"),
    ("seed=1.5", r"'run.seed': expected int, found '1.5'"),
    ("rl_terms=2,x", r"'task.rl_terms': expected optional tuple of int .*found '2,x'"),
    ("eps_low=low", r"'grpo.eps_low': expected float, found 'low'"),
    ("kv_policy=sparse", r"'rollout.kv_policy': expected one of 'dense', 'deferred', 'copy', "
                         r"found 'sparse'"),
    ("loss_agg=mean", r"'grpo.loss_agg': expected one of 'token-mean'.*found 'mean'"),
    ("stop_after=two", r"'run.stop_after': expected optional int .*found 'two'"),
])
def test_wrong_types_and_bad_choices_name_key_type_and_value(item, pattern):
    with pytest.raises(ConfigError, match=pattern):
        C.apply_overrides(C.ExperimentConfig(), [item])


@pytest.mark.parametrize("item,key", [
    ("temperature=0", "rollout.temperature"),
    ("exit_threshold=1.5", "rollout.exit_threshold"),
    ("group_size=0", "rollout.group_size"),
    ("logprob_method=replay", "learner.logprob_method"),
    ("learner.minibatches=3", "learner.minibatches"),       # 128 sequences not divisible by 3
    ("tis_cap=-1", "grpo.tis_cap"),
])
def test_out_of_range_values_are_rejected_naming_the_key(item, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        C.apply_overrides(C.ExperimentConfig(), [item])


def test_override_without_equals_sign_is_rejected():
    with pytest.raises(ConfigError, match="expected key=value"):
        C.apply_overrides(C.ExperimentConfig(), ["seed"])


def test_overrides_are_validated_together_not_one_at_a_time():
    # 3 minibatches alone is invalid for 16 x 8 sequences, valid with 12 x 8 = 96.
    cfg = C.apply_overrides(C.ExperimentConfig(), ["minibatches=3", "prompts_per_step=12"])
    assert cfg.learner.minibatches == 3


def test_constructor_type_checks_and_coerces_int_to_float():
    with pytest.raises(ConfigError, match=r"rollout.group_size': expected int, found '8'"):
        C.RolloutConfig(group_size="8")
    with pytest.raises(ConfigError, match=r"run.resume': expected str, found 1"):
        C.RunConfig(resume=1)
    g = C.GRPOConfig(eps_low=0, tis_cap=3)
    assert isinstance(g.eps_low, float) and isinstance(g.tis_cap, float)


def test_json_round_trip_of_a_non_default_config(tmp_path):
    cfg = C.apply_overrides(C.ExperimentConfig(name="x"), [
        "seed=5", "tis_cap=1.5", "fixed_depth=2", "train_datasets=a,b,c", "kv_policy=copy",
        "kl_beta=0.001", "compute_dtype=bfloat16"])
    text = C.to_json(cfg)
    assert json.loads(text)["task"]["train_datasets"] == ["a", "b", "c"]
    back = C.from_json(text)
    assert back == cfg
    assert back.task.train_datasets == ("a", "b", "c")
    C.save_json(cfg, tmp_path / "config.json")
    assert C.load_json(tmp_path / "config.json") == cfg


def test_from_json_rejects_unknown_keys_and_wrong_types_and_fills_defaults():
    d = C.to_dict(C.ExperimentConfig())
    d["grpo"]["eps_hgh"] = 0.3
    with pytest.raises(ConfigError, match=r"run.json: unknown config keys \['grpo.eps_hgh'\]"):
        C.from_json(json.dumps(d), source="run.json")
    d = C.to_dict(C.ExperimentConfig())
    d["run"]["seed"] = "7"
    with pytest.raises(ConfigError, match=r"'run.seed': expected int, found '7'"):
        C.from_json(json.dumps(d))
    assert C.from_json(json.dumps({"run": {"seed": 3}})).run.seed == 3
    with pytest.raises(ConfigError, match="not valid JSON"):
        C.from_json("{")


def _write(tmp_path, name, body):
    p = tmp_path / name
    p.write_text(body)
    return p


def test_load_experiment_with_CONFIG_and_with_config_function(tmp_path):
    p = _write(tmp_path, "exp_a.py", (
        "from looprl.config import ExperimentConfig, RolloutConfig\n"
        "CONFIG = ExperimentConfig(name='a', rollout=RolloutConfig(group_size=4))\n"))
    cfg = C.load_experiment(p)
    assert cfg.name == "a" and cfg.rollout.group_size == 4
    p = _write(tmp_path, "exp_b.py", (
        "from looprl.config import ExperimentConfig\n"
        "def config():\n    return ExperimentConfig(name='b')\n"))
    assert C.load_experiment(p).name == "b"
    # an experiment may import a sibling experiment file
    p = _write(tmp_path, "exp_c.py", (
        "from exp_a import CONFIG as BASE\n"
        "CONFIG = BASE.replace(name='c')\n"))
    cfg = C.load_experiment(p)
    assert cfg.name == "c" and cfg.rollout.group_size == 4


def test_load_experiment_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        C.load_experiment(tmp_path / "missing.py")
    p = _write(tmp_path, "none.py", "X = 1\n")
    with pytest.raises(ConfigError, match=r"none.py' defines neither CONFIG nor config\(\)"):
        C.load_experiment(p)
    p = _write(tmp_path, "wrong.py", "CONFIG = {'seed': 1}\n")
    with pytest.raises(ConfigError, match="CONFIG must be an ExperimentConfig, found dict"):
        C.load_experiment(p)
    p = _write(tmp_path, "badtype.py", (
        "from looprl.config import ExperimentConfig, RunConfig\n"
        "CONFIG = ExperimentConfig(run=RunConfig(seed='0'))\n"))
    with pytest.raises(ConfigError, match=r"badtype.py'.*run.seed"):
        C.load_experiment(p)


def test_load_experiment_of_a_non_python_file_is_a_config_error(tmp_path):
    p = _write(tmp_path, "README.md", "# not a config\n")
    with pytest.raises(ConfigError, match=r"README.md' is not an experiment file: expected a "
                                          r"\.py file defining CONFIG.*config\.json"):
        C.load_experiment_module(p)


def test_train_cli_on_a_markdown_file_exits_2_naming_it(tmp_path, capsys):
    from looprl.cli import main
    p = _write(tmp_path, "README.md", "# not a config\n")
    assert main(["train", str(p)]) == 2
    err = capsys.readouterr().err
    assert "README.md" in err and ".py file defining CONFIG" in err


def test_cross_section_checks_name_their_keys():
    with pytest.raises(ConfigError, match=r"'learner.microbatch_size': expected a divisor of the "
                                          r"minibatch size 128, found 5"):
        C.apply_overrides(C.ExperimentConfig(), ["microbatch_size=5"])
    with pytest.raises(ConfigError, match=r"'rollout.fixed_depth': expected an int in \[1, 2\]"):
        C.apply_overrides(C.ExperimentConfig(), ["total_ut_steps=2", "fixed_depth=3"])


def test_shape_note_names_both_shapes_when_a_checkpoint_differs_from_its_preset():
    """The ouro-1.4b preset never silently takes a checkpoint of another shape (6 layers)."""
    from looprl.config import ModelConfig
    from looprl.model.config import preset, shape_note
    section = ModelConfig(preset="ouro-1.4b")
    assert shape_note(section, preset("ouro-1.4b")) is None
    assert shape_note(section, preset("ouro-1.4b", vocab_size=100)) is None  # vocab: checkpoint's
    six = preset("ouro-1.4b", num_layers=6)
    note = shape_note(section, six)
    assert "num_layers 24->6" in note and "'ouro-1.4b'" in note
    assert f"{six.num_params:,} params" in note and "\n" not in note
    assert shape_note(ModelConfig(preset="ouro-1.4b", num_layers=6), six) is None


def test_old_key_fixed_exit_loop_is_read_as_fixed_depth_with_a_warning(tmp_path):
    from looprl.config.fields import ConfigRenameWarning
    for key in ("fixed_exit_loop=2", "rollout.fixed_exit_loop=2"):
        with pytest.warns(ConfigRenameWarning, match=r"'rollout.fixed_exit_loop' is the old "
                                                     r"name of 'rollout.fixed_depth'"):
            cfg = C.apply_overrides(C.ExperimentConfig(), [key])
        assert cfg.rollout.fixed_depth == 2
    # a config.json written before the rename
    d = C.to_dict(C.ExperimentConfig())
    del d["rollout"]["fixed_depth"]
    d["rollout"]["fixed_exit_loop"] = 3
    with pytest.warns(ConfigRenameWarning):
        assert C.from_json(json.dumps(d)).rollout.fixed_depth == 3
    d["rollout"]["fixed_depth"] = 3
    with pytest.warns(ConfigRenameWarning), pytest.raises(ConfigError, match="both"):
        C.from_json(json.dumps(d))


def test_one_type_dispatch_checks_values_and_parses_text_alike():
    from typing import Literal, Optional

    from looprl.config.fields import convert_value
    cases = [(int, 3, "3"), (float, 2.5, "2.5"), (bool, False, "off"), (str, "x", "x"),
             (Optional[int], None, "none"), (tuple[int, ...], (1, 2), "1, 2"),
             (Literal["a", "b"], "b", "b")]
    for tp, value, text in cases:
        assert convert_value(tp, value, "k") == value
        assert convert_value(tp, text, "k", text=True) == value
    assert convert_value(float, 2, "k") == 2.0 and isinstance(convert_value(float, 2, "k"), float)
    with pytest.raises(ConfigError, match=r"'k': expected int, found True"):
        convert_value(int, True, "k")


def test_the_sampler_takes_exactly_the_configs_kernel_choices():
    """`rollout.kernels`' choices are the one list the sampler and `looprl generate` check."""
    from looprl.cli.main import build_parser
    from looprl.errors import SamplingError
    from looprl.sampling.sampler import SamplingConfig

    assert C.sections.KERNELS == ("invariant", "stock")
    for kernels in C.sections.KERNELS:
        SamplingConfig(kernels=kernels).validate(4)
    with pytest.raises(SamplingError, match="kernels"):
        SamplingConfig(kernels="fast").validate(4)
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    choices = {a.dest: a.choices for a in generate._actions}
    assert tuple(choices["kernels"]) == C.sections.KERNELS
