"""`looprl` command line: train | generate | verify | eval | convert | plot.

Every subcommand's parser is built here; its work is done by `run(args)` in `looprl.cli.<command>`,
imported only when that command runs (the one place where looprl modules are imported inside a
function), so `looprl --help` stays fast. `looprl verify` pins XLA CPU to one intra-op thread
before anything imports jax. Errors of the looprl families are printed as one clear line with
exit status 2, never a bare traceback. A Ctrl-C ends any command with one line and exit status
130, also one that Python dropped inside a gc callback (`looprl.train.interrupts.CtrlC`, handed
to the command as `args.ctrl_c`: checked after every `looprl eval` batch, in `looprl train` as
its docstring says, and when the command returns).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import typing

import looprl
from looprl import determinism
from looprl.config import KVPolicy
from looprl.config.sections import KERNELS
from looprl.errors import LooprlError
from looprl.tasks import task_names
from looprl.train.interrupts import CtrlC

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
                   help="the small matrix (6-17 min on 2 CPU cores: 6 on an AVX-512 "
                        "host, 10-17 on slower AVX2 ones)")
    p.add_argument("--replay-impl", default="invariant", choices=["invariant", "auto"],
                   help="auto: where the invariant replay is not exact, replay by re-running the "
                        "sampler in forced mode (recorded per cell as replay_impl)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="directory for report.json/.md (required, except with --compare NEW OLD or "
                        "--device OUT)")
    p.add_argument("--compare", metavar="DIR", nargs="+", default=None,
                   help="NEW OLD: whether two report directories hold the same cells and bits "
                        "(or the first difference); OLD with --out NEW: verify, then compare")
    dev = p.add_argument_group("the device check (reproducibility/README.md)")
    dev.add_argument("--device", metavar="OUT", nargs="?", const="", default=None,
                     help="the device check on this GPU/TPU: OUT/report.json, report.md, a "
                          "verdict line; exit 0 on PASS (budgets add up to 6 minutes)")
    dev.add_argument("--dry-run", action="store_true",
                     help="with --device: tiny widths, interpreted kernels on the CPU; budgets "
                          "and speed ratios recorded, not judged")
    dev.add_argument("--carry", metavar="DIR", default=None,
                     help="with --device: build what travels to a device whose image has its "
                          "own jax (looprl's wheel and the wheels it lacks) into DIR, and print "
                          "the one line to run there")
    dev.add_argument("--python-version", default="3.12",
                     help="with --carry: the device's Python (default 3.12)")
    dev.add_argument("--groups", default="",
                     help="with --device: comma-separated item groups (replay, needle, "
                          "replay_more, scan, speed; run-to-run always runs)")
    dev.add_argument("--budget-scale", type=float, default=1.0,
                     help="with --device: multiply every item's time budget")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print every cell's line (default: one line per weights, dtype and KV "
                        "policy, and the verdict table)")


def _add_train(sub):
    p = sub.add_parser("train", help="warm start, GRPO and evaluation of an experiment config")
    p.add_argument("config", metavar="CONFIG", nargs="?", default=None,
                   help="experiments/*.py file defining CONFIG, or a run directory's config.json")
    p.add_argument("--list-keys", action="store_true",
                   help="print every config key of CONFIG with its value and type, then exit")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, e.g. out_dir=runs/x seed=1 stop_after=4")
    d = p.add_argument_group("multi-host (jax.distributed; see docs/GUIDE.md 'Multi-device and "
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
    return p


def _add_plot(sub):
    p = sub.add_parser("plot", help="PNG plots of a run directory's metrics")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directories (several: curves side by side)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="where to write the PNGs (default: the first RUN_DIR/plots)")
    p.add_argument("--compare", action="store_true",
                   help="each RUN_DIR is one seed's out_dir of an experiment with VARIANTS: "
                        "mean and min-max curves per variant across seeds, step-0 |delta "
                        "logprob| histograms and comparison.md")


def _add_generate(sub):
    p = sub.add_parser("generate", help="sample a completion; print tokens with their exit loops")
    p.add_argument("--checkpoint", required=True, metavar="CKPT")
    p.add_argument("--prompt", required=True)
    p.add_argument("--prompt-style", default=None,
                   choices=["chatml", "thinking", "compact", "raw"])
    p.add_argument("--exit-threshold", type=float, default=None, metavar="Q",
                   help="q of the Q-exit rule, in (0, 1] (default: the run's, else 1.0: "
                        "always loop T)")
    p.add_argument("--fixed-depth", type=int, default=None, metavar="D",
                   help="exit every token at loop D (1..T); not with --exit-threshold")
    # defaults None: a run's checkpoint records its evaluation settings (cli/generate.py)
    p.add_argument("--kv-policy", default=None, choices=typing.get_args(KVPolicy),
                   help="default: the run's, else dense")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-samples", type=int, default=1, metavar="N",
                   help="sample N completions of the prompt in one batch (default 1)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="decode all --max-new-tokens (no stop ids), e.g. for a rollout that "
                        "`looprl verify --rollout` accepts (>= 512 sampled tokens)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: the run's, else float32")
    p.add_argument("--kernels", default=None, choices=KERNELS,
                   help="invariant (default, or the run's): replayable by the learner's dense "
                        "pass; stock: plain matmuls, faster at small batch, replayed by forced "
                        "re-run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save-rollout", metavar="FILE.npz", help="save the RolloutBatch")


def _add_eval(sub):
    p = sub.add_parser("eval", help="pass@1 on a task's held-out set at one or more exit "
                                    "thresholds")
    p.add_argument("--checkpoint", required=True, metavar="CKPT",
                   help="looprl checkpoint (or HF directory) with a tokenizer.json")
    p.add_argument("--task", default=None,
                   help=f"one of {', '.join(task_names())} (default: the task a run's "
                        f"checkpoint records, with its config)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory for results.json, problems.jsonl (and the plot)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="evaluate the first N held-out problems (default: all)")
    p.add_argument("--exit-threshold", default=None, metavar="Q[,Q...]",
                   help="q of the Q-exit rule, several separated by commas (default: the run's, "
                        "else 1.0)")
    # defaults None: a run's checkpoint records its evaluation settings (cli/eval.py)
    p.add_argument("--kv-policy", default=None, choices=typing.get_args(KVPolicy))
    p.add_argument("--compute-dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's, else 512")
    p.add_argument("--batch-size", type=int, default=None,
                   help="problems per sampler call (default: the run's, else 32)")
    p.add_argument("--data-dir", default=None,
                   help="GSM8K and math: directory of train.jsonl/test.jsonl (relative: to the "
                        "working directory, else to the repository root; GSM8K's default "
                        "../shared/data/gsm8k)")
    p.add_argument("--source", default=None, choices=["jsonl", "hub"],
                   help="GSM8K: read the JSONL files (default), or openai/gsm8k through "
                        "`datasets`")
    p.add_argument("--prompt-style", default=None, choices=["chatml", "thinking", "compact"],
                   help="thinking: the prompt ends with <think>\\n (Ouro Thinking models); "
                        "compact: the tiny arithmetic models' framing (default: the run's, "
                        "else the task's)")
    p.add_argument("--prompt-len-multiple", type=int, default=None, metavar="N",
                   help="left-pad prompts to a multiple of N tokens (fewer compilations; "
                        "default: the run's, else 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling noise (with --temperature > 0; default: the run's, else 0)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N",
                   help="completions per problem (N > 1 needs --temperature > 0): mean@N and "
                        "pass@k for k = 1, 2, 4, ..., N (unbiased estimator)")
    p.add_argument("--json", action="store_true", help="print results.json's object, no table")


def _command_module(command: str):
    """The module that runs `command` (lazy: the CLI dispatch)."""
    if command == "train":
        from looprl.cli import train as module
    elif command == "generate":
        from looprl.cli import generate as module
    elif command == "convert":
        from looprl.cli import convert as module
    elif command == "verify":
        determinism.configure_xla(pin_threads=True)  # before jax starts (docs/DESIGN.md §5)
        from looprl.cli import verify as module
    elif command == "eval":
        from looprl.cli import eval as module
    else:
        from looprl.cli import plot as module
    return module


class _Version(argparse.Action):
    """`looprl --version`: `looprl.version_lines()` (imports jax only when asked), exit 0."""

    def __call__(self, parser, namespace, values, option_string=None):
        print("\n".join(looprl.version_lines()))
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="looprl", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print looprl's version, git commit, jax version and kernel "
                             "version, then exit")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.train_parser = _add_train(sub)
    _add_generate(sub)
    _add_convert(sub)
    _add_verify(sub)
    _add_eval(sub)
    _add_plot(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train" and args.config is None:  # usage, exit status 2
        parser.train_parser.error("CONFIG is required: an experiments/*.py file or a run "
                                  "directory's config.json, e.g. looprl train "
                                  "experiments/tiny_arith.py out_dir=runs/tiny_arith")
    args.t_start = COMMAND_START
    try:
        with CtrlC() as ctrl_c:  # a Ctrl-C Python dropped (in a gc callback) still ends in 130
            args.ctrl_c = ctrl_c
            rc = _command_module(args.command).run(args)
            ctrl_c.check()
    except LooprlError as e:
        print(f"looprl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback
        print(f"\nlooprl {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    return int(rc or 0)


def entry() -> None:
    """The `looprl` executable (and `python -m looprl.cli`): `main()`, then exit with its status.

    After a Ctrl-C (status 130) the process ends with `os._exit`, skipping the interpreter's
    finalization: the KeyboardInterrupt may have landed inside XLA's C++ (a compile, a
    dispatch), and finalizing that runtime can then crash the process with another status.
    Nothing is lost: every file looprl writes is complete when written (atomic renames), the
    TensorBoard writer is closed in `train`'s `finally`, and stdout/stderr are flushed here."""
    status = main()
    if status == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
