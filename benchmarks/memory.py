"""Peak host memory of convert, generate, eval and one GRPO step at Ouro-1.4B width.

Writes a random HF checkpoint (bf16 safetensors, `looprl.io.hf.save_hf`) of 4 layers at
Ouro-1.4B width (407 M parameters, 1.6 GB in fp32) with a byte-level BPE tokenizer into a
temporary directory, then runs each step in its own process and reads its peak RSS (`os.wait4`):
  convert        `looprl convert --hf DIR --out CKPT`
  convert_to_hf  `looprl convert --checkpoint CKPT --to-hf DIR2` (bf16, the source's dtype)
  generate       `looprl generate --checkpoint CKPT --prompt ... --max-new-tokens 8` (fp32)
  generate_bf16  the same with `--dtype bfloat16`
  eval           `looprl eval --task gsm8k --limit 2 --max-new-tokens 8` (../shared/data/gsm8k)
  train_step     `looprl train experiments/ouro_1p4b_gsm8k_grpo.py`, one minimal GRPO step
                 (1 prompt x 4 samples, 6 new tokens, bf16, learner.require_exact=false)
`--layers N` measures another depth (24: the whole Ouro-1.4B), `--skip-train` leaves the train
step out. Each figure is peak bytes / fp32 parameter bytes; the sampling steps also check their
budget, 1.3 x the parameter bytes in their compute dtype plus the KV cache they report
(`<step>_within_budget`). Last line: JSON ({"benchmark": "memory", "<step>_peak_rss",
"<step>_rss_per_param_byte", "<step>_wall_s", "<step>_rc", the budget keys, ...}).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = Path("/work/shared/data/gsm8k")
if not DATA.is_dir():
    DATA = ROOT.parent / "shared" / "data" / "gsm8k"


def tokenizer_json() -> str:
    """A byte-level BPE tokenizer.json (specials at ids 0-2), vocabulary 320."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["Natalia sold clips to 48 of her friends in April. How many?",
                             "The answer is 72. #### 72"] * 8, trainer)
    return tok.to_str()


def write_checkpoint(out: Path, layers: int) -> None:
    """Run in a child process (`--write DIR LAYERS`): the random HF checkpoint."""
    import numpy as np

    from looprl.io import hf
    from looprl.model.config import preset
    from looprl.model.looped import expected_param_shapes
    cfg = preset("ouro-1.4b", num_layers=layers)
    rng = np.random.default_rng(0)
    import jax
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32) * 0.02,
                          expected_param_shapes(cfg))
    for k in ("norm",):
        params[k][:] = 1.0
    for k in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
              "post_attention_layernorm_2"):
        params["layers"][k][:] = 1.0
    hf.save_hf(params, cfg, out, "bfloat16", tokenizer_json=tokenizer_json())


def compute_param_bytes(cfg, dtype: str) -> int:
    """Bytes of the parameters held in `dtype` for sampling (`ComputeWeights`: the exit gate
    stays fp32)."""
    import jax
    import numpy as np

    from looprl.model.looped import expected_param_shapes
    size = {"float32": 4, "bfloat16": 2}[dtype]
    return sum(int(np.prod(s.shape)) * (4 if kp[0].key == "early_exit_gate" else size)
               for kp, s in jax.tree_util.tree_flatten_with_path(expected_param_shapes(cfg))[0])


def measure(name: str, argv: list[str], env) -> dict:
    """Run `argv` in its own process; (wall s, peak RSS bytes, exit status)."""
    t0 = time.time()
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    rec = {"wall_s": round(time.time() - t0, 1), "peak_rss": usage.ru_maxrss * 1024, "rc": rc}
    print(f"{name}: {rec}", flush=True)
    if rc != 0:
        print(out.decode(errors="replace")[-3000:], flush=True)
    rec["stdout"] = out.decode(errors="replace")
    return rec


def kv_cache_bytes(name: str, rec: dict, eval_dir: Path) -> int:
    """The KV cache bytes a sampling step reported: `generate --json`'s timings, `eval`'s
    results.json (its largest batch); 0 when the step failed."""
    try:
        if name == "eval":
            return int(json.loads((eval_dir / "results.json").read_text())
                       ["thresholds"][0]["kv_cache_bytes"])
        return int(json.loads(rec["stdout"].strip().splitlines()[-1])["timings"]
                   ["kv_cache_bytes"])
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--write":
        write_checkpoint(Path(sys.argv[2]), int(sys.argv[3]))
        return
    args = sys.argv[1:]
    skip_train = "--skip-train" in args
    args = [a for a in args if a != "--skip-train"]
    layers = 4
    if len(args) == 2 and args[0] == "--layers" and args[1].isdigit():
        layers = int(args[1])
    elif args:
        sys.exit("usage: python benchmarks/memory.py [--layers N] [--skip-train]  (default: 4 "
                 "layers, every step)")
    from looprl.config import LearnerConfig
    from looprl.model.config import preset
    cfg = preset("ouro-1.4b", num_layers=layers)
    param_bytes = 4 * cfg.num_params
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this tree's looprl in every child
    py = [sys.executable]
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="looprl-memory-") as tmp:
        tmp = Path(tmp)
        hf_dir, ckpt = tmp / "hf", tmp / "ckpt"
        measure("write", py + [__file__, "--write", str(hf_dir), str(layers)], env)
        cli = py + ["-m", "looprl.cli"]
        res = {}
        res["convert"] = measure("convert", cli + ["convert", "--hf", str(hf_dir), "--out",
                                                   str(ckpt)], env)
        res["convert_to_hf"] = measure("convert_to_hf", cli + [
            "convert", "--checkpoint", str(ckpt), "--to-hf", str(tmp / "hf_back")], env)
        for dtype, key in (("float32", "generate"), ("bfloat16", "generate_bf16")):
            res[key] = measure(key, cli + [
                "generate", "--checkpoint", str(ckpt), "--prompt", "How many clips?",
                "--max-new-tokens", "8", "--dtype", dtype, "--json"], env)
        res["eval"] = measure("eval", cli + [
            "eval", "--checkpoint", str(ckpt), "--task", "gsm8k", "--limit", "2",
            "--max-new-tokens", "8", "--data-dir", str(DATA), "--out", str(tmp / "eval")], env)
        for key, dtype in (("generate", "float32"), ("generate_bf16", "bfloat16"),
                           ("eval", "float32")):
            kv = kv_cache_bytes(key, res[key], tmp / "eval")
            budget = 1.3 * compute_param_bytes(cfg, dtype) + kv
            res[key].update(kv_cache_bytes=kv, budget=budget)
        if skip_train:
            return _report(res, cfg, layers, param_bytes, t_start)
        extra = (["learner.require_exact=false"] if "require_exact" in
                 {f.name for f in dataclasses.fields(LearnerConfig)} else [])
        res["train_step"] = measure("train_step", cli + [
            "train", "experiments/ouro_1p4b_gsm8k_grpo.py", f"model.checkpoint={ckpt}",
            f"out_dir={tmp / 'run'}", f"task.data_dir={DATA}", "grpo_steps=1",
            "prompts_per_step=1", "group_size=4", "max_new_tokens=6", "minibatches=1",
            "learner.measure_stock=false", "grpo.kl_beta=0",  # one learner pass fewer each
            "microbatch_size=4", "eval.eval_problems=2", "eval_batch_size=2",
            "tensorboard=false", "progress_bar=false", *extra], env)
    _report(res, cfg, layers, param_bytes, t_start)


def _report(res: dict, cfg, layers: int, param_bytes: int, t_start: float) -> None:
    figures = {"benchmark": "memory", "layers": layers, "num_params": cfg.num_params,
               "fp32_param_bytes": param_bytes}
    for k, r in res.items():
        figures[f"{k}_rss_per_param_byte"] = round(r["peak_rss"] / param_bytes, 3)
        figures[f"{k}_peak_rss"] = r["peak_rss"]
        figures[f"{k}_wall_s"] = r["wall_s"]
        figures[f"{k}_rc"] = r["rc"]
        if "budget" in r:
            figures[f"{k}_kv_cache_bytes"] = r["kv_cache_bytes"]
            figures[f"{k}_budget_per_param_byte"] = round(r["budget"] / param_bytes, 3)
            figures[f"{k}_within_budget"] = bool(r["rc"] == 0 and r["peak_rss"] <= r["budget"])
    figures["wall_s"] = round(time.time() - t_start, 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
