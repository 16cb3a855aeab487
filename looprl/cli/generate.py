"""`looprl generate`: sample from a checkpoint and print each completion token with its exit loop.

`--checkpoint` takes any looprl checkpoint (a converted HF model, a run's `warm_start/` or
`checkpoint/`) or an HF directory (config.json + safetensors). The prompt is framed with the
prompt style the checkpoint records (a run's checkpoints record its task's, e.g. `compact` for
the arithmetic task; ChatML for a converted model or an HF directory; `--prompt-style raw` sends
the text as is), and a completion stops at the checkpoint's recorded stop ids (default: the
tokenizer's end of turn). A run's checkpoint from before these were recorded falls back to
ChatML with a one-line warning. The exit threshold (or fixed depth), KV policy, dtype and
kernels not given as flags are the run's evaluation settings its checkpoint records, as
`looprl eval` takes them (`recorded_settings`). A prompt plus `--max-new-tokens` beyond the
model's positions is an error; an id the tokenizer cannot decode is shown as `<id N: ...>`.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from looprl.errors import CheckpointError, SamplingError
from looprl.io.checkpoint import META_FILE, read_checkpoint_meta
from looprl.io.hf import hf_usage_settings
from looprl.sampling.resident import load_for_sampling
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.tokenizer import chat_prompt, tokenizer_from_json


def check_args(args) -> None:
    """Checks that need no model, done before loading one. Raises SamplingError when both
    `--exit-threshold` and `--fixed-depth` are given (the fixed depth would silently override
    the threshold), when `--save-rollout FILE` is a directory or its directory does not
    exist."""
    if args.fixed_depth is not None and args.exit_threshold is not None:
        raise SamplingError(f"--fixed-depth {args.fixed_depth} and --exit-threshold "
                            f"{args.exit_threshold} both given: a fixed depth replaces the "
                            f"Q-exit rule, pass only one")
    if args.num_samples < 1:
        raise SamplingError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.save_rollout:
        target = Path(args.save_rollout).expanduser()
        parent = target.parent
        if target.is_dir():
            raise SamplingError(f"--save-rollout {args.save_rollout}: is a directory; name the "
                                f"rollout file to write, e.g. {str(target / 'rollout.npz')!r}")
        if not parent.is_dir():
            raise SamplingError(f"--save-rollout {args.save_rollout}: directory {str(parent)!r} "
                                f"does not exist")


FLAGS = {"exit_threshold q": "--exit-threshold", "fixed_depth": "--fixed-depth",
         "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
         "max_new_tokens": "--max-new-tokens", "kv_policy": "--kv-policy",
         "compute_dtype": "--dtype", "kernels": "--kernels"}


def check_sampling(scfg: SamplingConfig, T: int) -> None:
    """`scfg.validate(T)`, its SamplingError naming the command-line flag instead of the
    field (`--exit-threshold must lie in (0, 1], got 1.5`)."""
    try:
        scfg.validate(T)
    except SamplingError as e:
        msg = str(e)
        for field, flag in FLAGS.items():
            if msg.startswith(field + " "):
                raise SamplingError(flag + msg[len(field):]) from None
        raise


def recorded_prompt_style(meta: dict, checkpoint) -> str:
    """The prompt style a checkpoint records; ChatML when none is (a converted model, an HF
    directory), with a one-line warning on stderr for a run's checkpoint written before the
    style was recorded (its task may have used another framing, and the completion be empty)."""
    if meta.get("prompt_style"):
        return meta["prompt_style"]
    if meta.get("stage"):
        print(f"looprl generate: warning: {checkpoint} records no prompt style (an older "
              f"checkpoint); framing the prompt as ChatML, pass --prompt-style (compact for "
              f"the arithmetic task)", file=sys.stderr, flush=True)
    return "chatml"


def recorded_settings(checkpoint, args) -> dict:
    """The sampling settings: each flag given wins, else the value a run's checkpoint records
    for its held-out evaluation (`meta["eval"]`, as `looprl eval` takes it), else q 1.0, dense,
    float32, invariant kernels. A fixed depth and a threshold exclude each other: a flag for
    either drops the recorded other. Reads only `looprl_meta.json` (no weights)."""
    path = Path(checkpoint).expanduser()
    rec = dict(hf_usage_settings(path).get("eval") or {})  # an HF directory's, if it keeps them
    if (path / META_FILE).is_file():
        rec = dict(read_checkpoint_meta(path).get("eval") or {})
    flag_depth = args.fixed_depth is not None or args.exit_threshold is not None
    return {"exit_threshold": args.exit_threshold if args.exit_threshold is not None
            else 1.0 if args.fixed_depth is not None else rec.get("exit_threshold", 1.0),
            "fixed_depth": args.fixed_depth if flag_depth else rec.get("fixed_depth"),
            "kv_policy": args.kv_policy or rec.get("kv_policy", "dense"),
            "dtype": args.dtype or rec.get("compute_dtype", "float32"),
            "kernels": args.kernels or rec.get("kernels", "invariant")}


def check_length(n_prompt: int, max_new_tokens: int, cfg, checkpoint) -> None:
    """Raise SamplingError when the prompt's tokens plus `max_new_tokens` exceed the model's
    positions (`max_position_embeddings`), naming the three numbers."""
    if n_prompt + max_new_tokens > cfg.max_position_embeddings:
        raise SamplingError(f"the prompt has {n_prompt} tokens and --max-new-tokens is "
                            f"{max_new_tokens}: {n_prompt + max_new_tokens} positions, more than "
                            f"the {cfg.max_position_embeddings} of {checkpoint}'s model "
                            f"(max_position_embeddings); shorten the prompt or lower "
                            f"--max-new-tokens")


def shown_token(tok, t: int) -> str:
    """A token id as the per-token lines show it: its text, or `<id N: not in the tokenizer>`
    for an id the tokenizer cannot decode (a model vocabulary larger than the tokenizer's)."""
    text = tok.decode([t])
    if text == "" and t >= tok.vocab_size:
        return f"<id {t}: not in the tokenizer>"
    return repr(text)


def check_finite_logprobs(lps, toks, checkpoint) -> None:
    """Raise SamplingError naming the first completion token whose recorded log-prob is NaN or
    infinite (damaged or diverged weights: the output would be meaningless)."""
    for i, (lp, t) in enumerate(zip(lps, toks)):
        if not math.isfinite(lp):
            raise SamplingError(f"{checkpoint}: completion token {i} (id {t}) has log-prob {lp}: "
                                f"the model computes non-finite numbers (damaged or diverged "
                                f"weights)")


def generation_timings(timings: dict, n_tokens: int) -> dict:
    """{prefill_s, decode_s (wall seconds, compilation included), decode_tokens_per_s,
    kv_cache_bytes}: the tokens after the first (prefill emits the first) over the decode
    seconds, 0.0 when no decode step ran; the KV cache's bytes (`state.kv_cache_bytes`)."""
    decode_s = float(timings.get("decode_s", 0.0))
    rate = (n_tokens - 1) / decode_s if decode_s > 0 and n_tokens > 1 else 0.0
    return {"prefill_s": float(timings["prefill_s"]), "decode_s": decode_s,
            "decode_tokens_per_s": rate, "kv_cache_bytes": int(timings.get("kv_cache_bytes", 0))}


def run(args) -> int:
    """Sample `--num-samples` completions of the prompt in one batch and print them (text with
    one line per token, or `--json` with the `settings` used); with `--save-rollout FILE` also
    write the RolloutBatch (in both modes). Prefill seconds and decode tokens/s go to stderr
    (and `--json`'s "timings"). Raises SamplingError for bad arguments (checked before
    sampling, see `check_args`), a prompt too long for the model (`check_length`) or a
    non-finite log-prob, CheckpointError for a missing, damaged or tokenizer-less checkpoint."""
    from tqdm import tqdm

    check_args(args)
    st = recorded_settings(args.checkpoint, args)
    q, fixed_depth = st["exit_threshold"], st["fixed_depth"]
    # on the device in the compute dtype (bf16: 2 B per parameter, the fp32 master's fingerprint)
    params, cfg, tok_json, meta, fingerprint = load_for_sampling(args.checkpoint, st["dtype"])
    if tok_json is None:
        raise CheckpointError(f"{args.checkpoint}: no tokenizer.json (convert with --tokenizer)")
    tok = tokenizer_from_json(tok_json)
    style = args.prompt_style or recorded_prompt_style(meta, args.checkpoint)
    text = args.prompt if style == "raw" else chat_prompt(args.prompt, style)
    if not args.prompt:
        raise SamplingError("--prompt is empty")
    ids = tok.encode(text)
    check_length(len(ids), args.max_new_tokens, cfg, args.checkpoint)
    stop_ids = () if args.ignore_eos else tuple(meta.get("stop_ids") or (tok.end_of_turn_id,))
    scfg = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, exit_threshold=q,
                          fixed_depth=fixed_depth, kv_policy=st["kv_policy"],
                          compute_dtype=st["dtype"], stop_ids=stop_ids, kernels=st["kernels"])
    check_sampling(scfg, cfg.total_ut_steps)
    bar = tqdm(total=args.max_new_tokens, desc="decode", unit="tok", disable=not sys.stderr.isatty()
               or args.max_new_tokens < 64, leave=False)

    def progress(done, total):
        bar.update(done - bar.n)

    timings: dict = {}
    batch = generate(cfg, params, [ids], scfg, group_size=args.num_samples, seed=args.seed,
                     decode_steps_per_call=32, progress=progress, timings=timings,
                     master_fingerprint=fingerprint)
    bar.close()
    P = batch.schedule.prompt_len
    samples = []
    for b in range(args.num_samples):
        n = int(batch.completion_len_B[b])
        toks = batch.tokens_BxS[b, P:P + n].tolist()
        exits = batch.exit_loop_BxS[b, P - 1:P - 1 + n].tolist()
        lps = batch.logprob_BxS[b, P - 1:P - 1 + n].tolist()
        check_finite_logprobs(lps, toks, args.checkpoint)
        samples.append({"completion": tok.decode_completion(toks), "tokens": toks,
                        "exit_loops": exits, "logprobs": lps,
                        "mean_exit_loop": sum(exits) / max(len(exits), 1)})
    if args.save_rollout:
        batch.save(Path(args.save_rollout).expanduser())
    timing = generation_timings(timings, max(len(s["tokens"]) for s in samples))
    print(f"# prefill {timing['prefill_s']:.3f} s ({len(ids)} prompt tokens, "
          f"{args.num_samples} rows), decode {timing['decode_s']:.3f} s, "
          f"{timing['decode_tokens_per_s']:.2f} tokens/s per row; KV cache "
          f"{timing['kv_cache_bytes'] / 1e6:.1f} MB", file=sys.stderr, flush=True)
    depth = f"fixed_depth={fixed_depth}" if fixed_depth is not None else f"q={q}"
    if args.json:  # the first sample's fields at the top level (one sample: as before)
        print(json.dumps({**samples[0], "samples": samples,
                          "rollout_file": args.save_rollout or None, "timings": timing,
                          "settings": st}, allow_nan=False))
        return 0
    for i, s in enumerate(samples):
        if args.num_samples > 1:
            print(f"# sample {i}")
        print(s["completion"])
        print(f"# {len(s['tokens'])} tokens, mean exit loop {s['mean_exit_loop']:.2f} of "
              f"{cfg.total_ut_steps} (kv_policy={st['kv_policy']}, {depth}, "
              f"dtype={st['dtype']}, kernels={st['kernels']})")
        for t, k, lp in zip(s["tokens"], s["exit_loops"], s["logprobs"]):
            print(f"{shown_token(tok, t):>12}  exit_loop={k}  logprob={lp:.4f}")
    if args.save_rollout:
        print(f"# rollout saved to {args.save_rollout}")
    return 0
