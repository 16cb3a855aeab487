"""`looprl generate`: sample from a checkpoint and print each completion token with its exit loop.

`--checkpoint` takes any looprl checkpoint (a converted HF model, a run's `warm_start/` or
`checkpoint/`) or an HF directory (config.json + safetensors). The prompt is framed with the
checkpoint's prompt style (ChatML by default; `--prompt-style raw` sends the text as is).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from looprl.errors import CheckpointError, SamplingError
from looprl.io.convert import load_any_checkpoint
from looprl.model.looped import device_params
from looprl.sampling.sampler import SamplingConfig, generate
from looprl.tokenizer import chat_prompt, tokenizer_from_json


def check_args(args) -> None:
    """Checks that need no model, done before loading one. Raises SamplingError when both
    `--exit-threshold` and `--fixed-depth` are given (the fixed depth would silently override
    the threshold) or when the directory of `--save-rollout FILE` does not exist."""
    if args.fixed_depth is not None and args.exit_threshold is not None:
        raise SamplingError(f"--fixed-depth {args.fixed_depth} and --exit-threshold "
                            f"{args.exit_threshold} both given: a fixed depth replaces the "
                            f"Q-exit rule, pass only one")
    if args.save_rollout:
        parent = Path(args.save_rollout).expanduser().parent
        if not parent.is_dir():
            raise SamplingError(f"--save-rollout {args.save_rollout}: directory {str(parent)!r} "
                                f"does not exist")


def generation_timings(timings: dict, n_tokens: int) -> dict:
    """{prefill_s, decode_s (wall seconds, compilation included), decode_tokens_per_s}: the
    tokens after the first (prefill emits the first) over the decode seconds; 0.0 when no
    decode step ran."""
    decode_s = float(timings.get("decode_s", 0.0))
    rate = (n_tokens - 1) / decode_s if decode_s > 0 and n_tokens > 1 else 0.0
    return {"prefill_s": float(timings["prefill_s"]), "decode_s": decode_s,
            "decode_tokens_per_s": rate}


def run(args) -> int:
    """Sample one completion and print it (text with one line per token, or `--json`); with
    `--save-rollout FILE` also write the RolloutBatch (in both modes). Raises SamplingError for
    bad arguments (checked before sampling, see `check_args`) and CheckpointError for a missing
    or tokenizer-less checkpoint."""
    from tqdm import tqdm


    check_args(args)
    q = 1.0 if args.exit_threshold is None else args.exit_threshold
    params, cfg, tok_json, meta = load_any_checkpoint(args.checkpoint)
    params = device_params(params)
    if tok_json is None:
        raise CheckpointError(f"{args.checkpoint}: no tokenizer.json (convert with --tokenizer)")
    tok = tokenizer_from_json(tok_json)
    style = args.prompt_style or (meta or {}).get("prompt_style", "chatml")
    text = args.prompt if style == "raw" else chat_prompt(args.prompt, style)
    if not args.prompt:
        raise SamplingError("--prompt is empty")
    ids = tok.encode(text)
    scfg = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, exit_threshold=q,
                          fixed_depth=args.fixed_depth, kv_policy=args.kv_policy,
                          compute_dtype=args.dtype, stop_ids=(tok.end_of_turn_id,),
                          kernels=args.kernels)
    bar = tqdm(total=args.max_new_tokens, desc="decode", unit="tok", disable=not sys.stderr.isatty()
               or args.max_new_tokens < 64, leave=False)

    def progress(done, total):
        bar.update(done - bar.n)

    timings: dict = {}
    batch = generate(cfg, params, [ids], scfg, seed=args.seed, decode_steps_per_call=32,
                     progress=progress, timings=timings)
    bar.close()
    P = batch.schedule.prompt_len
    n = int(batch.completion_len_B[0])
    toks = batch.tokens_BxS[0, P:P + n].tolist()
    exits = batch.exit_loop_BxS[0, P - 1:P - 1 + n].tolist()
    lps = batch.logprob_BxS[0, P - 1:P - 1 + n].tolist()
    if args.save_rollout:
        batch.save(Path(args.save_rollout).expanduser())
    timing = generation_timings(timings, n)
    print(f"# prefill {timing['prefill_s']:.3f} s ({len(ids)} prompt tokens), decode "
          f"{timing['decode_s']:.3f} s, {timing['decode_tokens_per_s']:.2f} tokens/s",
          file=sys.stderr, flush=True)
    depth = f"fixed_depth={args.fixed_depth}" if args.fixed_depth is not None else f"q={q}"
    if args.json:
        print(json.dumps({"completion": tok.decode_completion(toks), "tokens": toks,
                          "exit_loops": exits, "logprobs": lps,
                          "mean_exit_loop": sum(exits) / max(len(exits), 1),
                          "rollout_file": args.save_rollout or None, "timings": timing}))
        return 0
    print(tok.decode_completion(toks))
    print(f"# {n} tokens, mean exit loop {sum(exits) / max(n, 1):.2f} of {cfg.total_ut_steps} "
          f"(kv_policy={args.kv_policy}, {depth})")
    for t, k, lp in zip(toks, exits, lps):
        print(f"{tok.decode([t])!r:>12}  exit_loop={k}  logprob={lp:.4f}")
    if args.save_rollout:
        print(f"# rollout saved to {args.save_rollout}")
    return 0


