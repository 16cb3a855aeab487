"""GRPO on GSM8K for the released Ouro-2.6B: the Ouro-1.4B config (`ouro_1p4b_gsm8k_grpo.py`, whose
docstring gives every setting and its source) with the 48-layer model. Nothing here has been run
at this scale yet: no figures are claimed.

    looprl convert --hf /path/to/Ouro-2.6B --out ckpts/ouro-2.6b
    XLA_FLAGS=--xla_gpu_deterministic_ops=true \\
        looprl train experiments/ouro_2p6b_gsm8k_grpo.py model.checkpoint=ckpts/ouro-2.6b

Differences: twice the layers (48 shared layers, T = 4 loops: 192 layer applications per token),
so microbatches of 4 sequences instead of 8 (the same minibatches and optimizer updates: the
loss normaliser is computed per minibatch, so the split does not change the update).
"""
from ouro_1p4b_gsm8k_grpo import CONFIG as _BASE  # sibling file (looprl train puts it on the path)

CONFIG = _BASE.replace(
    name="ouro_2p6b_gsm8k_grpo",
    model=_BASE.model.replace(preset="ouro-2.6b"),
    learner=_BASE.learner.replace(microbatch_size=4),
    run=_BASE.run.replace(out_dir="runs/ouro_2p6b_gsm8k_grpo"),
)
