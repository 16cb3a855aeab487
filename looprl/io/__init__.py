"""File formats, the bottom floor above the model: the looprl checkpoint (orbax), its flat
train state, HF safetensors <-> params, conversion, and the params `.npz` beside verify rollouts."""

