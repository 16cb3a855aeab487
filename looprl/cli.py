"""`looprl` command line: train | generate | verify | eval | convert | plot.

Each subcommand's parser is built here and its work is done by a `run_*` function in the module
that owns the concept (imported lazily, so `looprl --help` is fast). Errors of the looprl
families are printed as one clear line with exit status 2, never a bare traceback.
"""
from __future__ import annotations

import argparse
import sys
import time

from looprl.errors import LooprlError

COMMAND_START = time.time()  # `wall_s` of `looprl train` counts from here (imports included)


def _add_convert(sub):
    p = sub.add_parser("convert", help="HF directory <-> looprl checkpoint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", metavar="DIR", help="HF directory (config.json + safetensors)")
    src.add_argument("--checkpoint", metavar="CKPT", help="looprl checkpoint to export")
    p.add_argument("--out", metavar="CKPT", help="looprl checkpoint to write (with --hf)")
    p.add_argument("--to-hf", metavar="DIR", help="HF directory to write (with --checkpoint)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="dtype of the written HF tensors (default: the source dtype)")
    p.add_argument("--tokenizer", metavar="FILE", default=None,
                   help="tokenizer.json to store (default: DIR/tokenizer.json)")
    p.set_defaults(func=lambda a: _lazy("looprl.model.convert", "run_convert")(a))


def _add_verify(sub):
    p = sub.add_parser("verify", help="reproducibility matrix: replay vs sampler bits (report)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="CKPT", default=None,
                     help="looprl checkpoint: its weights are the 'trained' cells (with "
                          "--rollout: the sampler's weights)")
    src.add_argument("--config", metavar="CFG", default=None,
                     help="experiment config: model shape for a warm-started tiny model")
    p.add_argument("--rollout", metavar="FILE", default=None,
                   help="re-verify a saved rollout (.npz written by RolloutBatch.save, e.g. "
                        "`looprl generate --save-rollout`); needs --checkpoint CKPT, the "
                        "parameters it was sampled with, unless `looprl verify` wrote it (its "
                        "<weights>_params.npz lies next to it)")
    p.add_argument("--quick", action="store_true",
                   help="the small matrix (<= 15 min on 2 CPU cores)")
    p.add_argument("--replay-impl", default="invariant", choices=["invariant", "auto"],
                   help="auto: where the invariant replay is not exact, replay by re-running the "
                        "sampler in forced mode (recorded per cell as replay_impl)")
    p.add_argument("--out", metavar="DIR", required=True, help="directory for report.json/.md")
    p.set_defaults(func=lambda a: _lazy("looprl.learner.verify", "run_verify")(a))


def _add_train(sub):
    p = sub.add_parser("train", help="warm start, GRPO and evaluation of an experiment config")
    p.add_argument("config", metavar="CONFIG", help="experiments/*.py file defining CONFIG, "
                                                    "or a run directory's config.json")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, e.g. out_dir=runs/x seed=1 stop_after=4")
    d = p.add_argument_group("multi-host (jax.distributed; see README 'Multi-device and "
                             "multi-host')")
    d.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                   help="process 0's address (default: $LOOPRL_COORDINATOR)")
    d.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="processes in the run (default: $LOOPRL_NUM_PROCESSES)")
    d.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="this process's index 0..N-1 (default: $LOOPRL_PROCESS_ID)")
    d.add_argument("--distributed", action="store_true",
                   help="join a multi-process run, auto-detecting coordinator, count and id "
                        "(TPU pod slices, SLURM srun, Open MPI)")
    p.set_defaults(func=lambda a: _lazy("looprl.train.run", "run_train")(a))


def _add_plot(sub):
    p = sub.add_parser("plot", help="PNG plots of a run directory's metrics")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directories (several: curves side by side)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="where to write the PNGs (default: the first RUN_DIR/plots)")
    p.set_defaults(func=lambda a: _lazy("looprl.train.plots", "run_plot")(a))


def _add_generate(sub):
    from looprl.sampling.generate import add_parser
    add_parser(sub)


def _add_eval(sub):
    from looprl.evaluate import add_parser
    add_parser(sub)


def _lazy(module: str, name: str):
    import importlib
    return getattr(importlib.import_module(module), name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="looprl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_generate(sub)
    _add_convert(sub)
    _add_verify(sub)
    _add_eval(sub)
    _add_plot(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.t_start = COMMAND_START
    try:
        rc = args.func(args)
    except LooprlError as e:
        print(f"looprl {args.command}: error: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
