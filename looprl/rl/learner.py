"""The GRPO step and loop (issue 5): rollouts, rewards, group advantages, PPO-clip updates.

One GRPO step (`GRPOLearner.step`):
  1. `generate` samples G completions for each of N prompts (seed = run seed, step = GRPO step,
     prompt indices = the problems' global ids), recording the schedule;
  2. rewards from the task's verifier; `group_advantages` per group;
  3. measurements at the sampler's parameters (before any update): `replay_exact_fraction`
     (replay vs recorded log-probs, raw bits, emitting positions; must be 1.0; with
     `learner.require_exact` (auto: on where exactness is claimed) a lower value raises
     TrainingError before any update), and
     `stock_max_abs_diff` (the `stock` method vs recorded); the k3 KL to the reference policy;
     with loop credit, the old per-loop log-probs (`loop_logprobs` at the sampler's parameters);
  4. `ppo_epochs` x `minibatches` optimizer updates; each minibatch's loss normaliser is computed
     once over the whole minibatch, its microbatches' gradients are summed (`aggregate_loss`
     makes this split-invariant), then one optax update (AdamW, global-norm clipping, schedule).
     The exit gate's update is zeroed (`optax.multi_transform`) unless `learner.train_gate`.

Each step's metrics include `rollout_sha256` (`rollout_sha256`: tokens, exit loops and recorded
log-prob bits), so two runs can be checked to have sampled the same completions.

The learner's log-probs are `hybrid` by default, so the first update's ratio is exactly 1.
A non-finite loss or gradient raises `TrainingError` naming the tensor and step before anything
is written.
"""
from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as PS

from looprl.config import ExperimentConfig
from looprl.distributed import mesh as ml
from looprl.errors import CheckpointError, TrainingError
from looprl.logprobs import batch_logprobs, forced_replay_logprobs, live_seq_len
from looprl.logprobs.mismatch import bits_equal_fraction, mismatch_stats
from looprl.model.config import OuroConfig
from looprl.rl import grpo
from looprl.rl.loss import LOOP_KEYS, LossSpec, loss_and_grad, mesh_loss_and_grad, old_loop_pass
from looprl.rl.rollout import (completion_rewards, mean_exit_loop, rollout_sha256,
                               sampling_config)
from looprl.sampling.sampler import generate
from looprl.sampling.schedule import params_fingerprint


def resolve_replay_impl(exp_cfg: ExperimentConfig, backend: str | None = None) -> str:
    """`learner.replay_impl` with "auto" resolved: "invariant" on XLA CPU with invariant sampler
    kernels (where the dense pass reproduces the sampler bit for bit), "forced" otherwise."""
    impl = exp_cfg.learner.replay_impl
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    return "invariant" if backend == "cpu" and exp_cfg.rollout.kernels == "invariant" else "forced"


def resolve_require_exact(exp_cfg: ExperimentConfig, replay_impl: str,
                          backend: str | None = None) -> bool:
    """`learner.require_exact` with none (auto) resolved: true where the README claims exact
    replay (XLA CPU, `rollout.kernels=invariant`, `replay_impl` resolved to "invariant"), false
    elsewhere (forced replay and GPU/TPU, where exactness is measured rather than claimed)."""
    if exp_cfg.learner.require_exact is not None:
        return bool(exp_cfg.learner.require_exact)
    backend = backend or jax.default_backend()
    return (backend == "cpu" and exp_cfg.rollout.kernels == "invariant"
            and replay_impl == "invariant")


def make_optimizer(exp_cfg: ExperimentConfig, params) -> optax.GradientTransformation:
    """AdamW + global-norm clipping + learning-rate schedule, the exit gate's update zeroed
    unless `learner.train_gate` (DESIGN.md: exit decisions are replayed, never re-decided) or
    the learner is `expected`, whose log-probs train the gate through the exit distribution
    (as HF Ouro's forward with labels does)."""
    o = exp_cfg.optim
    total = max(1, exp_cfg.run.grpo_steps * exp_cfg.learner.ppo_epochs
                * exp_cfg.learner.minibatches)
    if o.lr_schedule == "constant":
        lr = optax.constant_schedule(o.learning_rate)
    elif o.lr_schedule == "cosine":
        lr = optax.cosine_decay_schedule(o.learning_rate, max(1, total - o.warmup_steps))
    else:
        lr = optax.linear_schedule(o.learning_rate, 0.0, max(1, total - o.warmup_steps))
    if o.warmup_steps:
        lr = optax.join_schedules([optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps),
                                   lr], [o.warmup_steps])
    parts = []
    if o.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(o.max_grad_norm))
    parts.append(optax.adamw(lr, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps,
                             weight_decay=o.weight_decay))
    train = optax.chain(*parts)
    gate_trains = exp_cfg.learner.train_gate or exp_cfg.learner.logprob_method == "expected"
    labels = {k: jax.tree.map(lambda _: "frozen" if (k == "early_exit_gate"
                                                      and not gate_trains)
                              else "train", v) for k, v in params.items()}
    return optax.multi_transform({"train": train, "frozen": optax.set_to_zero()}, labels)


@functools.partial(jax.jit, static_argnames=("opt",),
                   donate_argnames=("params", "opt_state"))
def _apply(params, opt_state, grads, *, opt):
    """One optax update, in place: the old parameters and moments are donated, so an
    update needs no second copy of the train state (issue 19's trainer budget)."""
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)


@functools.partial(jax.jit, donate_argnames=("total",))
def _accumulate(total, grads):
    """`total + grads` leaf by leaf, written into `total`'s buffers (donated)."""
    return jax.tree.map(jnp.add, total, grads)


def nonfinite_leaves(tree) -> list[str]:
    """Paths of the leaves of `tree` holding a NaN or inf."""
    bad = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not bool(jnp.all(jnp.isfinite(leaf))):
            bad.append(jax.tree_util.keystr(path))
    return bad


class GRPOLearner:
    """Holds the policy parameters, the optimizer state and the frozen reference; `step(i)` runs
    one GRPO step and returns its metrics (a flat dict of floats).

    RNG state: `rng_key` is the run's typed PRNG key, `jax.random.key(exp_cfg.run.seed)`; every
    sampled token's key is `fold_in`-derived from its data (= `jax.random.PRNGKey(seed)`), the
    GRPO step, the prompt's global id, the sample and the position
    (`looprl.sampling.processing.row_keys`), so (rng_key, step) is the whole RNG state and the
    data stream's state is `data_position`. `train_state(next_step)` / `restore_train_state`
    are what a training checkpoint stores and restores (exact resume)."""

    def __init__(self, exp_cfg: ExperimentConfig, model_cfg: OuroConfig, params, task, tokenizer,
                 ref_params=None, mesh=None):
        """`mesh`: a `jax.sharding.Mesh`; default `exp_cfg.mesh` over every visible device when
        there are several (one device: no mesh, the unsharded programs)."""
        self.exp_cfg, self.model_cfg = exp_cfg, model_cfg
        self.task, self.tokenizer = task, tokenizer
        if mesh is None and jax.device_count() > 1:
            mesh = ml.make_mesh(exp_cfg.mesh)
        self.mesh = mesh if ml.is_sharded(mesh) else None
        # the learner's own buffers (updates donate them): a caller's jax arrays are copied
        self.params = jax.tree.map(lambda a: np.asarray(a, np.float32)
                                   if not isinstance(a, jax.Array)
                                   else jnp.array(a, jnp.float32, copy=True), params)
        self.params = ml.place_params(self.params, self.mesh) if self.mesh is not None else \
            jax.tree.map(jnp.asarray, self.params)
        # The frozen reference (default: the starting policy) has buffers of its own, since
        # `_apply` donates the policy's. `_params_at_ref`: no update applied yet, so the
        # reference pass would repeat the replay pass and is skipped.
        self._params_at_ref = ref_params is None
        self.ref_params = jax.tree.map(jnp.copy, self.params) if ref_params is None else \
            ml.place_params(ref_params, self.mesh)
        self.opt = make_optimizer(exp_cfg, self.params)
        self.opt_state = self.opt.init(self.params)
        self.data_position = 0
        self.last_token_abs_delta = None  # per-token |learner - sampler| of the last step
        self.rng_key = jax.random.key(exp_cfg.run.seed)
        self.scfg = sampling_config(exp_cfg)
        r, g, lc = exp_cfg.rollout, exp_cfg.grpo, exp_cfg.learner
        self.replay_impl = resolve_replay_impl(exp_cfg)
        self.require_exact = resolve_require_exact(exp_cfg, self.replay_impl)
        self.spec = LossSpec(
            cfg=model_cfg, kv_policy=r.kv_policy, compute_dtype=exp_cfg.model.compute_dtype,
            temperature=float(r.temperature), top_k=int(r.top_k), top_p=float(r.top_p),
            method=lc.logprob_method, eps_low=g.eps_low, eps_high=g.eps_high,
            loss_agg=g.loss_agg, max_new_tokens=r.max_new_tokens, kl_beta=g.kl_beta,
            tis_cap=g.tis_cap, loop_credit=g.loop_credit, loop_credit_alpha=g.loop_credit_alpha,
            train_gate=lc.train_gate, gate_loss_coef=lc.gate_loss_coef,
            forced_replay=self.replay_impl == "forced")

    # --- checkpointed state ---------------------------------------------------------------------
    def train_state(self, next_step: int) -> dict[str, Any]:
        """The state a training checkpoint stores besides the parameters: {"opt_state" (the
        optax state pytree), "rng_key" (typed key), "step" (int64, the next GRPO step to run),
        "data_position" (int64, problems consumed from the training stream)}."""
        return {"opt_state": self.opt_state, "rng_key": self.rng_key,
                "step": np.asarray(next_step, np.int64),
                "data_position": np.asarray(self.data_position, np.int64)}

    def restore_train_state(self, params, state) -> int:
        """Continue from a checkpoint: `params` (fp32 tree) and `state` (a `train_state`
        pytree already checked against `self.train_state(0)` as template). The frozen
        reference is left as constructed. Returns the next GRPO step.
        Raises: CheckpointError if the stored run key is not this run's (another seed)."""
        stored = np.asarray(jax.random.key_data(state["rng_key"]))
        mine = np.asarray(jax.random.key_data(self.rng_key))
        if not np.array_equal(stored, mine):
            raise CheckpointError(f"checkpoint run key {stored.tolist()} is not this run's "
                                  f"{mine.tolist()} (run.seed {self.exp_cfg.run.seed}): another "
                                  f"seed")
        self.params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
        self.opt_state = jax.tree.map(jnp.asarray, state["opt_state"])
        if self.mesh is not None:  # back onto this run's mesh (any device count wrote them)
            self.params = ml.place_params(self.params, self.mesh)
            self.opt_state = ml.place_params(self.opt_state, self.mesh)
        self.data_position = int(state["data_position"])
        self._params_at_ref = False
        return int(state["step"])

    # --- the mesh -----------------------------------------------------------------------------
    def _check_handoff(self, batch, step: int) -> None:
        """The weights the sampler used are the learner's (digest), and the rollout's mesh lets
        the learner claim exact replay; raises TrainingError otherwise."""
        fp = params_fingerprint(self.params)
        if fp != batch.schedule.params_fingerprint:
            raise TrainingError(f"GRPO step {step}: the rollout was sampled with parameters "
                                f"{batch.schedule.params_fingerprint}, the learner holds {fp}")
        ok, why = ml.replay_compatible(batch.schedule.mesh,
                                       ml.mesh_record(self.mesh, self.params))
        if not ok:
            raise TrainingError(f"GRPO step {step}: {why}")

    def _loss_and_grad(self, mb, norm, gate_norm):
        """One microbatch's (loss, stats, grads), on the mesh when there is one (rows padded
        with zero rows, which carry no tokens, to a multiple of the row shards)."""
        if self.mesh is None:
            return loss_and_grad(self.params, {k: jnp.asarray(v) for k, v in mb.items()},
                                  norm, gate_norm, spec=self.spec)
        n = ml.padded_rows(len(mb["tokens"]), self.mesh)
        placed = {}
        for k, v in mb.items():
            ax = 1 if k in LOOP_KEYS else 0
            placed[k] = ml.put_global(ml.pad_rows(v, n, ax), ml.row_sharding(self.mesh,
                                                                             v.ndim, ax))
        specs = ml.param_specs(self.params, self.mesh)
        flat = jax.tree_util.tree_flatten(specs, is_leaf=lambda x: isinstance(x, PS))
        fn = mesh_loss_and_grad(self.spec, self.mesh, (flat[1], tuple(flat[0])),
                                 tuple(sorted(mb)))
        rep = ml.replicated(self.mesh)
        return fn(self.params, placed, ml.put_global(np.float32(norm), rep),
                  ml.put_global(np.float32(gate_norm), rep))

    # --- the learner's own log-probs -------------------------------------------------------------
    def _learner_logprobs(self, batch, replay_lp, replay_lpp, stock=None, seq_len=None):
        """(full, processed) log-probs `[B, S]` of the learner's method at the current
        parameters (before any update of this step): replay's for `hybrid` (its value), the
        `stock` pass already run for `stock_max_abs_diff` when there is one (`stock`), the
        method's own pass otherwise (on the first `seq_len` positions, `batch_logprobs`)."""
        method = self.exp_cfg.learner.logprob_method
        if method == "stock" and stock is not None:
            return stock
        if method == "hybrid":
            if replay_lpp is None:
                _, replay_lpp = batch_logprobs(self.model_cfg, self.params, batch, "replay",
                                               mesh=self.mesh, seq_len=seq_len)
            return replay_lp, replay_lpp
        return batch_logprobs(self.model_cfg, self.params, batch, method, mesh=self.mesh,
                              seq_len=seq_len)

    def _old_logprobs(self, batch, own_lp, own_lpp):
        """The PPO ratio's old log-probs `[B, S]` fp32 (`learner.old_logprobs`): the rollout's
        recorded ones, or the learner's own at the rollout's parameters (`recompute`); the
        processed ones when top-k/top-p truncation is on."""
        if self.exp_cfg.learner.old_logprobs == "recompute":
            return np.asarray(own_lpp if self.spec.truncated else own_lp, np.float32)
        return np.asarray(batch.logprob_processed_BxS if self.spec.truncated
                          else batch.logprob_BxS, np.float32)

    # --- one step ---------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        exp_cfg, spec = self.exp_cfg, self.spec
        N, G = exp_cfg.rollout.prompts_per_step, exp_cfg.rollout.group_size
        t0 = time.perf_counter()
        problems = self.task.train_problems(N, self.data_position)
        self.data_position += N
        prompts = [self.tokenizer.encode(self.task.format_prompt(p)) for p in problems]
        batch = generate(self.model_cfg, self.params, prompts, self.scfg, group_size=G,
                         seed=exp_cfg.run.seed, step=step, prompt_indices=[p.id for p in problems],
                         mesh=self.mesh)
        self._check_handoff(batch, step)
        rewards, _ = completion_rewards(self.task, self.tokenizer, problems, batch, G)
        rollout_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        adv = grpo.group_advantages(jnp.asarray(rewards.reshape(N, G)),
                                    scale_by_std=exp_cfg.grpo.scale_adv_by_std,
                                    std_floor=exp_cfg.grpo.adv_std_floor)
        adv_B = np.asarray(adv.advantages_NxG).reshape(-1)
        emit = np.asarray(batch.exit_loop_BxS) > 0
        recorded = np.asarray(batch.logprob_BxS)
        # every pass below runs on the batch's live prefix (same bits: learner.logprobs doc)
        live = live_seq_len(batch, exp_cfg.learner.seq_bucket)
        # measurements at the sampler's parameters (the first update of this rollout batch)
        forced = self.replay_impl == "forced"
        every = exp_cfg.learner.replay_check_every
        checked = every > 0 and step % every == 0
        replay_exact = None  # measured only on check steps, never recorded vs recorded
        if not checked:  # at the sampler's own parameters the replay value is the recorded one
            replay_lp = recorded.astype(np.float32)
            replay_lpp = np.asarray(batch.logprob_processed_BxS, np.float32)
        elif forced:
            replay_lp, replay_lpp = forced_replay_logprobs(self.model_cfg, self.params, batch,
                                                           mesh=self.mesh)
        else:
            replay_lp, replay_lpp = batch_logprobs(self.model_cfg, self.params, batch,
                                                   "replay", mesh=self.mesh, seq_len=live)
        if checked:
            replay_exact = bits_equal_fraction(replay_lp, recorded, emit)
        if self.require_exact and replay_exact is not None and replay_exact < 1.0:
            raise TrainingError(f"GRPO step {step}: replay_exact_fraction {replay_exact:.4f} < 1"
                                f" (replay_impl {self.replay_impl}, rollout.kernels "
                                f"{exp_cfg.rollout.kernels}): the learner does not reproduce the "
                                f"sampler's log-probs; stopping before any update (check the "
                                f"backend with `looprl verify`, or set "
                                f"learner.require_exact=false to train anyway)")
        stock_diff, stock = float("nan"), None
        if exp_cfg.learner.measure_stock:
            stock = batch_logprobs(self.model_cfg, self.params, batch, "stock", mesh=self.mesh,
                                   seq_len=live)
            stock_diff = float(np.max(np.abs(stock[0] - recorded)[emit], initial=0.0))
        ref_lp = replay_lp
        if not self._params_at_ref:
            ref_lp, _ = batch_logprobs(self.model_cfg, self.ref_params, batch, "replay",
                                       mesh=self.mesh, seq_len=live)
        x = (ref_lp - recorded)[emit]
        kl_ref = float(np.mean(np.expm1(x) - x)) if x.size else 0.0
        # the learner's own log-probs at the sampler's parameters: its mismatch with the
        # sampler, and with learner.old_logprobs=recompute the PPO ratio's old log-probs
        own_lp, own_lpp = self._learner_logprobs(batch, replay_lp, replay_lpp, stock, live)
        mismatch = mismatch_stats(own_lp, recorded, emit, exp_cfg.grpo.eps_low,
                                  exp_cfg.grpo.eps_high)
        if not checked and exp_cfg.learner.logprob_method == "hybrid":  # own = recorded: unmeasured
            mismatch = {k: None for k in mismatch}
        self.last_token_abs_delta = np.abs(np.asarray(own_lp, np.float32)[emit]
                                           - recorded.astype(np.float32)[emit])

        arrays = {"tokens": np.asarray(batch.tokens_BxS, np.int32),
                  "pad": np.asarray(batch.pad_B, np.int32),
                  "exit_loop": np.asarray(batch.exit_loop_BxS, np.int32),
                  "kv_depth": batch.kv_depth_BxS(), "adv": adv_B.astype(np.float32),
                  "old_lp": self._old_logprobs(batch, own_lp, own_lpp),
                  "sampler_lp": recorded.astype(np.float32), "ref_lp": ref_lp.astype(np.float32)}
        hybrid_forced = forced and spec.method == "hybrid"
        if hybrid_forced:
            arrays["replay_lp"], arrays["replay_lpp"] = replay_lp, replay_lpp
        # the loss and the old loop pass on the live prefix too (rows x positions)
        arrays = {k: v if v.ndim == 1 else v[..., :live] for k, v in arrays.items()}
        if spec.loop_credit != "none":
            loop_in = tuple(arrays[k] for k in ("tokens", "pad", "exit_loop", "kv_depth"))
            if self.mesh is not None:
                old_T, old_z = ml.row_sharded_call(old_loop_pass, self.mesh, (self.params,),
                                                loop_in, static={"spec": spec},
                                                row_axes_out=(1, 1))
            else:
                old_T, old_z = old_loop_pass(self.params, *map(jnp.asarray, loop_in),
                                              spec=spec)
            arrays["old_lp_T"] = np.asarray(old_T)
            arrays["old_gate_z"] = np.asarray(old_z)
        # per-row arrays: move the T axis of loop arrays behind the row axis for slicing
        B = arrays["tokens"].shape[0]
        stats_acc: dict[str, list[float]] = {}
        grad_norms, losses = [], []
        mb_rows = B // exp_cfg.learner.minibatches
        micro = exp_cfg.learner.microbatch_size or mb_rows
        for epoch in range(exp_cfg.learner.ppo_epochs):
            for m in range(exp_cfg.learner.minibatches):
                if hybrid_forced and (epoch or m):  # the sampler re-run at the updated params
                    lp_f, lpp_f = forced_replay_logprobs(self.model_cfg, self.params, batch,
                                                         mesh=self.mesh)
                    arrays["replay_lp"], arrays["replay_lpp"] = lp_f[:, :live], lpp_f[:, :live]
                rows = np.arange(m * mb_rows, (m + 1) * mb_rows)
                mask = arrays["exit_loop"][rows] > 0
                norm = grpo.loss_normalizer(jnp.asarray(mask), exp_cfg.grpo.loss_agg,
                                            exp_cfg.rollout.max_new_tokens)
                gate_norm = jnp.float32(max(1, int(mask.sum()) * (self.model_cfg.T - 1)))
                grads_sum, loss_sum = None, 0.0
                for u in range(0, mb_rows, micro):
                    r = rows[u:u + micro]
                    mb = {k: v[:, r] if k in LOOP_KEYS else v[r] for k, v in arrays.items()}
                    loss, stats, grads = self._loss_and_grad(mb, norm, gate_norm)
                    loss_sum += float(loss)
                    grads_sum = grads if grads_sum is None else _accumulate(grads_sum, grads)
                    n_tok = float(stats["tokens"])
                    for k, v in stats.items():
                        if k not in ("tokens", "ratio_min", "ratio_max"):
                            stats_acc.setdefault(k, []).append((float(v), n_tok))
                    for k in ("ratio_min", "ratio_max"):
                        stats_acc.setdefault(k, []).append((float(stats[k]), 1.0))
                if not np.isfinite(loss_sum):
                    raise TrainingError(f"GRPO step {step}: non-finite loss {loss_sum} (epoch "
                                        f"{epoch}, minibatch {m}); stopping, nothing written")
                bad = nonfinite_leaves(grads_sum)
                if bad:
                    raise TrainingError(f"GRPO step {step}: non-finite gradient in {bad[:5]} "
                                        f"(epoch {epoch}, minibatch {m}); stopping, nothing "
                                        f"written")
                self.params, self.opt_state, gnorm = _apply(self.params, self.opt_state,
                                                            grads_sum, opt=self.opt)
                self._params_at_ref = False
                grad_norms.append(float(gnorm))
                losses.append(loss_sum)
        jax.block_until_ready(self.params)
        learner_s = time.perf_counter() - t1

        def wmean(k):
            vals = stats_acc.get(k, [])
            tot = sum(w for _, w in vals)
            return float(sum(v * w for v, w in vals) / tot) if tot > 0 else 0.0

        comp = np.asarray(batch.completion_len_B)
        out = {"step": step, "reward_mean": float(rewards.mean()),
               "reward_std": float(rewards.std()), "accuracy": float(np.mean(rewards == 1.0)),
               "response_length": float(comp.mean()), "mean_exit_loop": mean_exit_loop(batch),
               "kl": kl_ref, "clip_frac": wmean("clip_frac"),
               "entropy": float(-recorded[emit].mean()) if emit.any() else 0.0,
               "grad_norm": float(np.mean(grad_norms)), "loss": float(np.mean(losses)),
               "replay_exact_fraction": replay_exact, "replay_impl": self.replay_impl,
               "stock_max_abs_diff": stock_diff,
               "ratio_mean": wmean("ratio_mean"),
               "ratio_min": min(v for v, _ in stats_acc["ratio_min"]),
               "ratio_max": max(v for v, _ in stats_acc["ratio_max"]),
               "approx_kl_old": wmean("approx_kl"),
               "degenerate_groups": int(adv.num_degenerate),
               **mismatch,
               "tokens": int(emit.sum()), "learner_seq_len": live,
               "rollout_s": rollout_s, "learner_s": learner_s,
               "rollout_sha256": rollout_sha256(batch)}
        if "gate_loss" in stats_acc:
            out["gate_loss"] = wmean("gate_loss")
        if "tis_weight_mean" in stats_acc:
            out["tis_weight_mean"] = wmean("tis_weight_mean")
        return out
