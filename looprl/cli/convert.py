"""`looprl convert`: HF directory <-> looprl checkpoint (`looprl.io.convert`).

  looprl convert --hf DIR --out CKPT                     HF (config.json + safetensors) -> looprl
  looprl convert --checkpoint CKPT --to-hf DIR [--dtype]  looprl -> HF, in the source dtype
                                                         unless `--dtype` says otherwise
"""
from __future__ import annotations

import sys

from looprl.errors import ConfigError
from looprl.io.convert import checkpoint_to_hf, hf_to_checkpoint


def run(args) -> int:
    """CLI entry (`looprl convert`); prints one summary line, and a warning on stderr when the
    tokenizer's id count differs from the model's vocabulary. Errors are CheckpointError /
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
    if s.get("tokenizer_note"):
        print(f"looprl convert: warning: {s['tokenizer_note']}", file=sys.stderr, flush=True)
    print(f"looprl convert: {s['source']} -> {s['out']} ({s['direction']}; {s['params']:,} "
          f"params, L={cfg.num_layers} T={cfg.total_ut_steps} D={cfg.hidden_size} "
          f"V={cfg.vocab_size}; {what}; tokenizer {'yes' if s['tokenizer'] else 'none'}; "
          f"settings {', '.join(s['settings']) or 'none recorded'})")
    return 0
