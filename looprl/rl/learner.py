"""The GRPO learner: `GRPOLearner.step` runs one GRPO step in five phases.

1. rollout (`rollout`): G completions for each of N train problems, sampled with the learner's
   parameters, the schedule recorded (with `grpo.dynamic_sampling`, `dynamic_rollout`);
2. rewards (`completion_rewards`) and group advantages (`advantages`);
3. replay check at the sampler's parameters (`_at_sampler`): `replay_exact_fraction` (with
   `learner.require_exact`, an inexact step raises TrainingError before any update),
   `stock_max_abs_diff`, the k3 KL to the frozen reference, the learner's mismatch;
4. updates (`_updates`): `ppo_epochs` x `minibatches` optax updates on summed microbatch
   gradients (split-invariant: `looprl.rl.grpo.aggregate_loss`), none when the step has no
   signal (`grpo.skip_zero_advantage_steps`, `looprl.rl.signal`);
5. metrics (`looprl.rl.step_metrics`): one flat row, with `rollout_sha256` of what was sampled.
The learner's log-probs are `hybrid` by default, so the first update's ratio is exactly 1. A
non-finite loss or gradient raises TrainingError naming the step before anything is written.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as PS

from looprl.config import ExperimentConfig
from looprl.distributed import mesh as ml
from looprl.errors import CheckpointError, TrainingError
from looprl.logprobs import batch_logprobs, forced_replay_logprobs, live_seq_len
from looprl.logprobs.mismatch import bits_equal_fraction, mismatch_stats
from looprl.model.config import OuroConfig
from looprl.rl import grpo
from looprl.rl.dynamic_sampling import dynamic_rollout
from looprl.rl.losses import LossSettings
from looprl.rl.objective import (LOOP_KEYS, LossSpec, loss_and_grad, mesh_loss_and_grad,
                                   old_loop_pass)
from looprl.rl.replay_choice import resolve_replay_impl, resolve_require_exact
from looprl.rl.optimizer import accumulate_grads, apply_update, make_optimizer, nonfinite_leaves
from looprl.rl.rollout import (completion_rewards, interrupted_fraction, loss_exit_loops,
                               rollout_sha256, sampling_config)
from looprl.rl.signal import has_signal, step_advantages, truncated_rows
from looprl.rl.step_metrics import step_metrics, token_entropy
from looprl.sampling.sampler import generate
from looprl.sampling.fingerprint import params_fingerprint


@dataclasses.dataclass
class _AtSampler:
    """What a GRPO step measures at the sampler's parameters (`GRPOLearner._at_sampler`)."""
    emit: np.ndarray            # [B, S] bool: positions that emit a completion token
    recorded: np.ndarray        # [B, S] fp32: the sampler's recorded log-probs
    live: int                   # the learner's passes run on positions [0, live)
    replay_lp: np.ndarray       # [B, S] fp32: the replay value (full vocabulary)
    replay_lpp: np.ndarray      # [B, S] fp32: the replay value (processed: top-k/top-p)
    replay_exact: float | None  # raw-bit match fraction; None on an unchecked step
    stock_diff: float           # max |stock - recorded| (nan when not measured)
    ref_lp: np.ndarray          # [B, S] the frozen reference's replay log-probs
    kl_ref: float               # k3 KL to the reference, mean over emitting positions
    own_lp: np.ndarray          # [B, S] the learner method's log-probs (full, processed)
    own_lpp: np.ndarray
    mismatch: dict[str, Any]    # `mismatch_stats` of own_lp vs recorded (None: unmeasured)


@dataclasses.dataclass
class _Updates:
    """What a GRPO step's optimizer updates report (`GRPOLearner._updates`)."""
    stats: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)

    def weighted_mean(self, key: str) -> float:
        """The weighted mean of stat `key` over every microbatch (0.0 when none has weight)."""
        vals = self.stats.get(key, [])
        tot = sum(w for _, w in vals)
        return float(sum(v * w for v, w in vals) / tot) if tot > 0 else 0.0


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
        # `apply_update` donates the policy's. `_params_at_ref`: no update applied yet, so the
        # reference pass would repeat the replay pass and is skipped.
        self._params_at_ref = ref_params is None
        self.ref_params = jax.tree.map(jnp.copy, self.params) if ref_params is None else \
            ml.place_params(ref_params, self.mesh)
        self.opt = make_optimizer(exp_cfg, self.params)
        self.opt_state = self.opt.init(self.params)
        self.data_position = 0
        self.last_token_abs_delta = None  # per-token |learner - sampler| of the last step
        self.rng_key = jax.random.key(exp_cfg.run.seed)
        self.scfg = sampling_config(exp_cfg, tokenizer=tokenizer)
        r, g, lc = exp_cfg.rollout, exp_cfg.grpo, exp_cfg.learner
        self.replay_impl = resolve_replay_impl(exp_cfg)
        self.require_exact = resolve_require_exact(exp_cfg, self.replay_impl)
        self.spec = LossSpec(
            cfg=model_cfg, kv_policy=r.kv_policy, compute_dtype=exp_cfg.model.compute_dtype,
            temperature=float(r.temperature), top_k=int(r.top_k), top_p=float(r.top_p),
            method=lc.logprob_method, loss_agg=g.loss_agg, max_new_tokens=r.max_new_tokens,
            kl_beta=g.kl_beta, tis_cap=g.tis_cap, loop_credit=g.loop_credit,
            loop_credit_alpha=g.loop_credit_alpha, train_gate=lc.train_gate,
            gate_loss_coef=lc.gate_loss_coef,
            forced_replay=self.replay_impl == "forced", loss=g.loss,
            settings=LossSettings.from_section(g), mask_truncated=g.mask_truncated)
        # hybrid's value is the sampler re-run in forced mode (at every update's parameters)
        self.hybrid_forced = self.replay_impl == "forced" and self.spec.method == "hybrid"

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
    def step(self, step: int) -> dict[str, Any]:
        """Run GRPO step `step` in its five phases (module doc); returns the metrics row."""
        t0 = time.perf_counter()
        ds = {}
        if self.exp_cfg.grpo.dynamic_sampling:
            problems, batch, ds = dynamic_rollout(self, step)
        else:
            problems, batch = self.rollout(step)
        rewards, _ = completion_rewards(self.task, self.tokenizer, problems, batch,
                                        self.exp_cfg.rollout.group_size)
        rollout_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        adv = self.advantages(rewards)
        at = self._at_sampler(batch, step)
        arrays = self._loss_arrays(batch, adv, at)
        g = self.exp_cfg.grpo
        truncated = truncated_rows(batch)
        keep = ~truncated if g.mask_truncated else np.ones_like(truncated)
        if g.mask_truncated:
            arrays["keep"] = keep.astype(np.int32)
        extra = {**ds, "truncated_fraction": float(truncated.mean()),
                 "interrupted_fraction": interrupted_fraction(batch),
                 "token_entropy": token_entropy(self.params, arrays, self.spec, self.mesh,
                                                self.exp_cfg.learner.microbatch_size)
                 if g.token_entropy else None}
        # no signal: the policy term's gradient is exactly 0 and no other term is on
        skip = (g.skip_zero_advantage_steps and g.kl_beta == 0 and not self.spec.train_gate
                and not has_signal(arrays["adv"], keep))
        upd = _Updates() if skip else self._updates(batch, arrays, at.live, step)
        extra["update_skipped"] = skip
        jax.block_until_ready(self.params)
        learner_s = time.perf_counter() - t1
        return step_metrics(self, step, batch, rewards, adv, at, upd, extra, rollout_s,
                            learner_s)

    # --- the sampler interface (`looprl.rl.dynamic_sampling.StepSampler`) ----------------------
    def rollout(self, step: int):
        """(problems, RolloutBatch): the next `prompts_per_step` train problems, G samples each
        (`sample`); advances `data_position` past them."""
        N = self.exp_cfg.rollout.prompts_per_step
        problems = self.task.train_problems(N, self.data_position)
        self.data_position += N
        return problems, self.sample(problems, step)

    def sample(self, problems, step: int):
        """The RolloutBatch of `problems`, G samples each, at GRPO step `step`: noise keyed by
        run seed, step and the problems' global ids, sampled with the learner's parameters.
        Raises TrainingError when the rollout's parameters or mesh are not the learner's."""
        prompts = [self.tokenizer.encode(self.task.format_prompt(p)) for p in problems]
        batch = generate(self.model_cfg, self.params, prompts, self.scfg,
                         group_size=self.exp_cfg.rollout.group_size, seed=self.exp_cfg.run.seed,
                         step=step, prompt_indices=[p.id for p in problems], mesh=self.mesh)
        self._check_handoff(batch, step)
        return batch

    def advantages(self, rewards_B) -> grpo.GroupAdvantages:
        """`step_advantages` of the rewards `[B]`, one group of G rows per prompt."""
        g = self.exp_cfg.grpo
        N, G = self.exp_cfg.rollout.prompts_per_step, self.exp_cfg.rollout.group_size
        return step_advantages(jnp.asarray(rewards_B.reshape(N, G)),
                               g.scale_rewards if g.scale_adv_by_std else "none", g.adv_std_floor)

    def _replay(self, batch, step: int, recorded, emit, live: int):
        """(replay_lp, replay_lpp, replay_exact): the replay value `[B, S]` fp32 at the sampler's
        parameters and, on check steps (`learner.replay_check_every`), its raw-bit match with
        the recorded log-probs on emitting positions (None elsewhere).

        Raises:
          TrainingError: `require_exact` and a checked step that is not exact.
        """
        every = self.exp_cfg.learner.replay_check_every
        checked = every > 0 and step % every == 0
        replay_exact = None  # measured only on check steps, never recorded vs recorded
        if not checked:  # at the sampler's own parameters the replay value is the recorded one
            replay_lp = recorded.astype(np.float32)
            replay_lpp = np.asarray(batch.logprob_processed_BxS, np.float32)
        elif self.replay_impl == "forced":
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
                                f"{self.exp_cfg.rollout.kernels}): the learner does not "
                                f"reproduce the sampler's log-probs; stopping before any update "
                                f"(check the backend with `looprl verify`, or set "
                                f"learner.require_exact=false to train anyway)")
        return replay_lp, replay_lpp, replay_exact

    def _at_sampler(self, batch, step: int) -> _AtSampler:
        """Everything measured at the sampler's parameters, before any update of this step:
        the replay check, `stock_max_abs_diff`, the k3 KL to the reference, and the learner's
        own log-probs with their mismatch to the sampler."""
        exp_cfg = self.exp_cfg
        emit = batch.sampled_mask_BxS  # forced tokens (thinking budget) claim nothing
        recorded = np.asarray(batch.logprob_BxS)
        # every pass below runs on the batch's live prefix (same bits: `live_seq_len`)
        live = live_seq_len(batch, exp_cfg.learner.seq_bucket)
        replay_lp, replay_lpp, replay_exact = self._replay(batch, step, recorded, emit, live)
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
        if replay_exact is None and exp_cfg.learner.logprob_method == "hybrid":
            mismatch = {k: None for k in mismatch}  # own = recorded on an unchecked step
        self.last_token_abs_delta = np.abs(np.asarray(own_lp, np.float32)[emit]
                                           - recorded.astype(np.float32)[emit])
        return _AtSampler(emit, recorded, live, replay_lp, replay_lpp, replay_exact, stock_diff,
                          ref_lp, kl_ref, own_lp, own_lpp, mismatch)

    def _loss_arrays(self, batch, adv, at: _AtSampler) -> dict[str, np.ndarray]:
        """The loss's per-row inputs on the live prefix: tokens, schedule, advantages, the old,
        sampler and reference log-probs, the forced replay value (hybrid with forced replay)
        and, with loop credit, the old per-loop log-probs and gate logits `[T, B, S]`."""
        spec = self.spec
        adv_B = np.asarray(adv.advantages_NxG).reshape(-1)
        arrays = {"tokens": np.asarray(batch.tokens_BxS, np.int32),
                  "pad": np.asarray(batch.pad_B, np.int32),
                  "exit_loop": loss_exit_loops(batch),
                  "kv_depth": batch.kv_depth_BxS(), "adv": adv_B.astype(np.float32),
                  "old_lp": self._old_logprobs(batch, at.own_lp, at.own_lpp),
                  "sampler_lp": at.recorded.astype(np.float32),
                  "ref_lp": at.ref_lp.astype(np.float32)}
        if self.hybrid_forced:
            arrays["replay_lp"], arrays["replay_lpp"] = at.replay_lp, at.replay_lpp
        arrays = {k: v if v.ndim == 1 else v[..., :at.live] for k, v in arrays.items()}
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
        return arrays

    def _updates(self, batch, arrays, live: int, step: int) -> _Updates:
        """`ppo_epochs` x `minibatches` optimizer updates, each on one minibatch's summed
        microbatch gradients (with forced hybrid, the sampler re-run at the updated
        parameters before every update but the first)."""
        lc = self.exp_cfg.learner
        out = _Updates()
        mb_rows = arrays["tokens"].shape[0] // lc.minibatches
        micro = lc.microbatch_size or mb_rows
        for epoch in range(lc.ppo_epochs):
            for m in range(lc.minibatches):
                if self.hybrid_forced and (epoch or m):
                    lp_f, lpp_f = forced_replay_logprobs(self.model_cfg, self.params, batch,
                                                         mesh=self.mesh)
                    arrays["replay_lp"], arrays["replay_lpp"] = lp_f[:, :live], lpp_f[:, :live]
                rows = np.arange(m * mb_rows, (m + 1) * mb_rows)
                grads_sum, loss_sum = self._minibatch_grads(arrays, rows, micro, out.stats)
                where = f"epoch {epoch}, minibatch {m}"
                if not np.isfinite(loss_sum):
                    raise TrainingError(f"GRPO step {step}: non-finite loss {loss_sum} ({where});"
                                        f" stopping, nothing written")
                bad = nonfinite_leaves(grads_sum)
                if bad:
                    raise TrainingError(f"GRPO step {step}: non-finite gradient in {bad[:5]} "
                                        f"({where}); stopping, nothing written")
                self.params, self.opt_state, gnorm = apply_update(self.params, self.opt_state,
                                                            grads_sum, opt=self.opt)
                self._params_at_ref = False
                out.grad_norms.append(float(gnorm))
                out.losses.append(loss_sum)
        return out

    def _minibatch_grads(self, arrays, rows, micro: int, stats_acc):
        """(summed gradients, summed loss) of the minibatch `rows`, `micro` rows at a time;
        the loss normalisers are the whole minibatch's. Appends each microbatch's stats to
        `stats_acc` as (value, weight) pairs."""
        mask = arrays["exit_loop"][rows] > 0
        if "keep" in arrays:  # grpo.mask_truncated: truncated rows leave the normalisers too
            mask = mask & (arrays["keep"][rows] > 0)[:, None]
        norm = grpo.loss_normalizer(jnp.asarray(mask), self.exp_cfg.grpo.loss_agg,
                                    self.exp_cfg.rollout.max_new_tokens)
        gate_norm = jnp.float32(max(1, int(mask.sum()) * (self.model_cfg.T - 1)))
        grads_sum, loss_sum = None, 0.0
        for u in range(0, len(rows), micro):
            r = rows[u:u + micro]
            mb = {k: v[:, r] if k in LOOP_KEYS else v[r] for k, v in arrays.items()}
            loss, stats, grads = self._loss_and_grad(mb, norm, gate_norm)
            loss_sum += float(loss)
            grads_sum = grads if grads_sum is None else accumulate_grads(grads_sum, grads)
            n_tok = float(stats["tokens"])
            for k, v in stats.items():  # token means weighted by tokens, min/max unweighted
                if k not in ("tokens", "ratio_min", "ratio_max"):
                    stats_acc.setdefault(k, []).append((float(v), n_tok))
            for k in ("ratio_min", "ratio_max"):
                stats_acc.setdefault(k, []).append((float(stats[k]), 1.0))
        return grads_sum, loss_sum
