"""Experiment configs: typed, frozen, nested dataclasses; `key=value` overrides; JSON round trip.

An experiment is a Python file under `experiments/` that defines `CONFIG` (an
`ExperimentConfig`) or a function `config()` returning one; `load_experiment(path)` imports it.
`apply_overrides(cfg, ["grpo.eps_high=0.28", "seed=1"])` parses each value by the field's
declared type (int, float, bool, str, Optional[...], Literal[...] choices, tuple[str, ...] as a
comma list) and accepts a dotted path (`section.field`) or a bare field name that is unique
across sections (`out_dir=`, `seed=`, `stop_after=`, `resume=`, `group_size=` ...).
`to_json`/`from_json` write and read the resolved config saved in the run directory.

Every section checks its field types and value ranges when constructed (in the experiment
file, by an override, or from JSON), so a bad config fails before any work starts.

Raises `ConfigError` naming the key, the expected type or choices, and the value found.
"""
from looprl.config.files import (from_json, load_experiment, load_experiment_module, load_json,
                                 save_json, to_dict, to_json)
from looprl.config.overrides import apply_overrides, config_key_lines, parse_value, resolve_key
from looprl.config.sections import (ComputeDtype, EvalConfig, ExperimentConfig, GRPOConfig, Kernels,
                                    KVPolicy, LearnerConfig, LogprobMethod, LoopCredit, LossAgg,
                                    LrSchedule, MeshConfig, ModelConfig, OptimConfig, PromptStyle,
                                    ReplayImpl, RolloutConfig, RunConfig, TaskConfig, TaskSource,
                                    WarmStartConfig)

__all__ = ["ComputeDtype", "Kernels", "KVPolicy", "LogprobMethod", "LoopCredit", "LossAgg",
           "LrSchedule", "PromptStyle", "ReplayImpl", "TaskSource", "EvalConfig",
           "ExperimentConfig", "GRPOConfig", "LearnerConfig", "MeshConfig", "ModelConfig",
           "OptimConfig", "RolloutConfig", "RunConfig", "TaskConfig", "WarmStartConfig",
           "apply_overrides", "config_key_lines", "from_json", "load_experiment",
           "load_experiment_module", "load_json", "parse_value", "resolve_key", "save_json",
           "to_dict", "to_json"]
