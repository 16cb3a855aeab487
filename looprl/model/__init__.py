"""The looped model: config, kernels, layers, the loop and exit gate, HF checkpoints."""
from looprl.model.config import PRESETS, OuroConfig, preset
from looprl.model.looped import (LoopedLM, ModelOutput, all_loop_outputs, cast_weights,
                                 exit_distribution, init_params, q_exit_loops)

__all__ = ["PRESETS", "OuroConfig", "preset", "LoopedLM", "ModelOutput", "all_loop_outputs",
           "cast_weights", "exit_distribution", "init_params", "q_exit_loops"]
