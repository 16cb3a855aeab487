"""A tiny Ouro checkpoint in HF format with a byte-level BPE tokenizer, for the real-model paths.

The real Ouro tokenizer is SmolLM2's byte-level BPE with `<|endoftext|>` = 0, `<|im_start|>` = 1,
`<|im_end|>` = 2. `byte_level_tokenizer_json` builds one of the same kind (ByteLevel pre-tokenizer
and decoder, the 256-symbol byte alphabet, so any text encodes) with a few merges learned from
GSM8K-like text; `write_tiny_hf` writes `config.json` + `model.safetensors` + `tokenizer.json` as
an HF Ouro directory would hold them, with a model vocabulary >= the tokenizer's.
"""
from __future__ import annotations

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAIN_TEXT = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn?",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "The answer is 72. #### 72 She sold 48/2 = 24 clips in May.",
]


def byte_level_tokenizer_json(vocab_size: int = 320) -> str:
    """Text of an HF tokenizer.json: byte-level BPE, specials at ids 0-2, `vocab_size` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT * 4, trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok.to_str()


def tiny_ouro_config(vocab_size: int = 320):
    """A tiny Ouro shape: hidden 64, 1 layer, 2 heads (head_dim 32), T = 4 loops."""
    from looprl.model.config import preset
    return preset("tiny", vocab_size=vocab_size, hidden_size=64, num_layers=1, num_heads=2,
                  num_kv_heads=2, head_dim=32, intermediate_size=128, total_ut_steps=4)


def write_tiny_hf(path, seed: int = 0, dtype: str = "bfloat16", gate_bias: float = 0.4):
    """Write a random-init tiny Ouro HF directory (weights stored in `dtype`, as the released
    checkpoints are bf16) with the byte-level tokenizer at `path`; returns `path`. At init the
    exit gate's weights are small, so lambda is set by its bias: `gate_bias` 0.4 gives lambda ~ 0.6
    per loop (CDF ~ 0.6, 0.84, 0.94, 1), so tokens exit at loop 3 or 4 at q = 0.9 and at loop 1
    at q = 0.5."""
    from looprl.io import hf
    from looprl.model.looped import init_params

    cfg = tiny_ouro_config()
    params = init_params(cfg, seed)
    params["early_exit_gate"]["bias"] = np.full_like(np.asarray(params["early_exit_gate"]["bias"]),
                                                     gate_bias)
    hf.save_hf(params, cfg, path, dtype, tokenizer_json=byte_level_tokenizer_json())
    return path


def tiny_looprl_checkpoint(directory):
    """Write the tiny HF directory under `directory/hf` and convert it (`looprl convert --hf`) into
    the looprl checkpoint `directory/ckpt`; returns (ckpt path, tokenizer.json text)."""
    from pathlib import Path

    from looprl.cli import main

    directory = Path(directory)
    hf_dir = write_tiny_hf(directory / "hf")
    assert main(["convert", "--hf", str(hf_dir), "--out", str(directory / "ckpt")]) == 0
    return directory / "ckpt", (hf_dir / "tokenizer.json").read_text()
