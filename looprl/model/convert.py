"""`looprl convert`: HF directory <-> looprl checkpoint (DESIGN.md §2).

  looprl convert --hf DIR --out CKPT                     HF (config.json + safetensors) -> looprl
  looprl convert --checkpoint CKPT --to-hf DIR [--dtype]  looprl -> HF, in the source dtype
                                                         unless `--dtype` says otherwise

The source dtype (`source_dtype`, and `source_dtypes` per tensor when the source mixed dtypes)
is recorded in the checkpoint's `looprl_meta.json`, so HF -> looprl -> HF is bit-identical.
A checkpoint without a recorded source dtype (e.g. one a training run wrote) exports as fp32.
"""
from __future__ import annotations

from pathlib import Path

from looprl.errors import CheckpointError, ConfigError


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
    from tokenizers import Tokenizer
    try:
        Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception subclass
        raise CheckpointError(f"{source}: not a valid HF tokenizers JSON: {e}") from e


def _n_params(params) -> int:
    import jax
    return sum(int(a.size) for a in jax.tree.leaves(params))


def hf_to_checkpoint(hf_dir: str | Path, out: str | Path, tokenizer: str | Path | None = None
                     ) -> dict:
    """Convert an HF Ouro directory into a looprl checkpoint; returns a summary dict."""
    from looprl.model.hf import read_hf
    from looprl.train.checkpoint import save_model_checkpoint

    ckpt = read_hf(hf_dir)
    tok = _read_tokenizer(tokenizer) if tokenizer else ckpt.tokenizer_json
    if tok is not None and not tokenizer:
        _check_tokenizer(tok, str(Path(hf_dir) / "tokenizer.json"))
    meta = {"source": str(hf_dir), "source_dtype": ckpt.source_dtype}
    if len(set(ckpt.source_dtypes.values())) > 1:
        meta["source_dtypes"] = ckpt.source_dtypes
    save_model_checkpoint(out, ckpt.params, ckpt.cfg, tok, extra_meta=meta)
    return {"direction": "hf->looprl", "source": str(hf_dir), "out": str(out),
            "source_dtype": ckpt.source_dtype, "params": _n_params(ckpt.params),
            "tokenizer": tok is not None, "cfg": ckpt.cfg}


def checkpoint_to_hf(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None,
                     tokenizer: str | Path | None = None) -> dict:
    """Export a looprl checkpoint to an HF directory; `dtype` None = the recorded source dtype
    (per tensor for a mixed source; fp32 when none is recorded). Returns a summary dict."""
    from looprl.model.hf import save_hf
    from looprl.train.checkpoint import load_model_checkpoint

    params, cfg, tok, meta = load_model_checkpoint(checkpoint)
    if tokenizer:
        tok = _read_tokenizer(tokenizer)
    if dtype is None:
        dtype_arg = meta.get("source_dtypes") or meta.get("source_dtype") or "float32"
    else:
        dtype_arg = dtype
    save_hf(params, cfg, out_dir, dtype_arg, tokenizer_json=tok)
    shown = dtype_arg if isinstance(dtype_arg, str) else "mixed (as the source)"
    return {"direction": "looprl->hf", "source": str(checkpoint), "out": str(out_dir),
            "dtype": shown, "params": _n_params(params), "tokenizer": tok is not None,
            "cfg": cfg}


def run_convert(args) -> int:
    """CLI entry (`looprl convert`); prints one summary line. Errors are CheckpointError /
    ConfigError (printed by `looprl.cli.main` as one line, exit status 2)."""
    if args.hf:
        if not args.out or args.to_hf:
            raise ConfigError("convert --hf DIR needs --out CKPT (and no --to-hf)")
        if args.dtype:
            raise ConfigError("convert --hf: --dtype applies to --to-hf exports only (a looprl "
                              "checkpoint always holds fp32 master weights)")
        s = hf_to_checkpoint(args.hf, args.out, args.tokenizer)
        what = f"source dtype {s['source_dtype']}, stored as fp32"
    else:
        if not args.to_hf or args.out:
            raise ConfigError("convert --checkpoint CKPT needs --to-hf DIR (and no --out)")
        s = checkpoint_to_hf(args.checkpoint, args.to_hf, args.dtype, args.tokenizer)
        what = f"written as {s['dtype']}"
    cfg = s["cfg"]
    print(f"looprl convert: {s['source']} -> {s['out']} ({s['direction']}; {s['params']:,} "
          f"params, L={cfg.num_layers} T={cfg.total_ut_steps} D={cfg.hidden_size} "
          f"V={cfg.vocab_size}; {what}; tokenizer {'yes' if s['tokenizer'] else 'none'})")
    return 0
