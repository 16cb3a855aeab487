"""HF directory <-> looprl checkpoint (DESIGN.md §2; the `looprl convert` command is
`looprl.cli.convert`), and `load_any_checkpoint`, which reads either kind.

The source dtype (`source_dtype`, and `source_dtypes` per tensor when the source mixed dtypes)
is recorded in the checkpoint's `looprl_meta.json`, so HF -> looprl -> HF is bit-identical.
The settings a model is used with (`hf.USAGE_KEYS`: prompt style, stop ids, task, the
evaluation's exit threshold, KV policy and the rest) travel both ways: in the HF `config.json`
under "looprl", in the checkpoint's meta, so a converted model answers as its source.
A checkpoint without a recorded source dtype (e.g. one a training run wrote) exports as fp32.
"""
from __future__ import annotations

from pathlib import Path

import jax
from tokenizers import Tokenizer

from looprl.errors import CheckpointError
from looprl.io.checkpoint import load_model_checkpoint, save_model_checkpoint
from looprl.io.hf import (check_not_run_directory, hf_usage_settings, read_hf, save_hf,
                          usage_settings)
from looprl.tokenizer import coverage_note


def _read_tokenizer(path: str | Path) -> str:
    """Text of a `tokenizer.json`, checked to load with the `tokenizers` library."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read tokenizer: {e}") from e
    _check_tokenizer(text, str(path))
    return text


def _check_tokenizer(text: str, source: str):
    try:
        Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception subclass
        raise CheckpointError(f"{source}: not a valid HF tokenizers JSON: {e}") from e


def _n_params(params) -> int:
    return sum(int(a.size) for a in jax.tree.leaves(params))


def hf_to_checkpoint(hf_dir: str | Path, out: str | Path, tokenizer: str | Path | None = None
                     ) -> dict:
    """Convert an HF Ouro directory into a looprl checkpoint; returns a summary dict (its
    `tokenizer_note`: `looprl.tokenizer.coverage_note` of the stored tokenizer, or None)."""
    ckpt = read_hf(hf_dir)
    tok = _read_tokenizer(tokenizer) if tokenizer else ckpt.tokenizer_json
    if tok is not None and not tokenizer:
        _check_tokenizer(tok, str(Path(hf_dir) / "tokenizer.json"))
    meta = {"source": str(hf_dir), "source_dtype": ckpt.source_dtype,
            **hf_usage_settings(hf_dir)}
    if len(set(ckpt.source_dtypes.values())) > 1:
        meta["source_dtypes"] = ckpt.source_dtypes
    save_model_checkpoint(out, ckpt.params, ckpt.cfg, tok, extra_meta=meta)
    return {"direction": "hf->looprl", "source": str(hf_dir), "out": str(out),
            "source_dtype": ckpt.source_dtype, "params": _n_params(ckpt.params),
            "tokenizer": tok is not None, "cfg": ckpt.cfg, "settings": usage_settings(meta),
            "tokenizer_note": tok and coverage_note(tok, ckpt.cfg.vocab_size)}


def checkpoint_to_hf(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None,
                     tokenizer: str | Path | None = None) -> dict:
    """Export a looprl checkpoint to an HF directory; `dtype` None = the recorded source dtype
    (per tensor for a mixed source; fp32 when none is recorded). Returns a summary dict (with
    `tokenizer_note`, as `hf_to_checkpoint`'s)."""
    check_not_run_directory(checkpoint)
    params, cfg, tok, meta = load_model_checkpoint(checkpoint)
    if tokenizer:
        tok = _read_tokenizer(tokenizer)
    if dtype is None:
        dtype_arg = meta.get("source_dtypes") or meta.get("source_dtype") or "float32"
    else:
        dtype_arg = dtype
    save_hf(params, cfg, out_dir, dtype_arg, tokenizer_json=tok, usage=usage_settings(meta))
    shown = dtype_arg if isinstance(dtype_arg, str) else "mixed (as the source)"
    return {"direction": "looprl->hf", "source": str(checkpoint), "out": str(out_dir),
            "dtype": shown, "params": _n_params(params), "tokenizer": tok is not None,
            "settings": usage_settings(meta),
            "cfg": cfg, "tokenizer_note": tok and coverage_note(tok, cfg.vocab_size)}


def load_any_checkpoint(path: str, leaf_fn=None):
    """(params fp32 dict, OuroConfig, tokenizer json or None, meta) from a looprl checkpoint or
    an HF directory. `leaf_fn(keys, LeafSlabs) -> array` replaces each leaf as it is read, in
    fp32 slabs (`load_model_checkpoint`, `read_hf`), so the fp32 tree, and a whole fp32 layer
    stack, never exist at once. Raises
    CheckpointError naming the path when it is neither, and naming `RUN/checkpoint` for a run
    directory `RUN`."""
    p = Path(path)
    check_not_run_directory(p)
    if (p / "config.json").exists() and not (p / "looprl_meta.json").exists():
        ckpt = read_hf(p, leaf_fn=leaf_fn)
        return ckpt.params, ckpt.cfg, ckpt.tokenizer_json, {"source": "hf",
                                                            **hf_usage_settings(p)}
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint directory")
    return load_model_checkpoint(p, leaf_fn=leaf_fn)
