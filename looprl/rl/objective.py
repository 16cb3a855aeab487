"""The GRPO objective: one microbatch's loss and gradient, jitted, on one device or per device on a
mesh (`shard_map`). The policy loss (`grpo.loss`, from the registry `looprl.rl.losses`) runs on
the learner's log-probs (`looprl.logprobs.methods`), with the optional KL, TIS, loop credit and
gate terms (`looprl.rl.grpo`). With `mask_truncated`, rows where `mb["keep"]` is 0 leave the loss.

`LossSpec` holds every static setting, so one compiled program serves every microbatch of a
run. The hybrid log-prob (docs/DESIGN.md §4) takes its value from replay and its gradient from the
dense pass; with `forced_replay` the value comes from the sampler re-run in forced mode
(`mb["replay_lp"]`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as PS

from looprl.distributed.mesh import ROW_AXES, gather_fsdp, sum_grads
from looprl.logprobs import loop_logprobs, sequence_logprobs
from looprl.model.config import OuroConfig
from looprl.model.looped import exit_distribution
from looprl.rl import grpo
from looprl.rl.losses import LossSettings, policy_token_loss


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Static (hashable) arguments of the jitted loss/grad function."""
    cfg: OuroConfig
    kv_policy: str
    compute_dtype: str
    temperature: float
    top_k: int
    top_p: float
    method: str
    loss_agg: str
    max_new_tokens: int
    kl_beta: float
    tis_cap: float | None
    loop_credit: str
    loop_credit_alpha: float
    train_gate: bool
    gate_loss_coef: float
    forced_replay: bool = False  # hybrid's value from mb["replay_lp"/"replay_lpp"] (forced re-run)
    loss: str = "ppo-clip"       # a key of `looprl.rl.losses.LOSSES`
    settings: LossSettings = LossSettings()  # the policy loss's own settings
    mask_truncated: bool = False  # rows with mb["keep"] == 0 leave the loss

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def policy_loss(params, mb, normalizer, gate_normalizer, spec: LossSpec):
    """Scalar loss of one microbatch (its share of the minibatch loss) and fp32 stats."""
    tokens, pad, exit_loop, kv_depth = mb["tokens"], mb["pad"], mb["exit_loop"], mb["kv_depth"]
    mask = exit_loop > 0
    if spec.mask_truncated:
        mask = mask & (mb["keep"] > 0)[:, None]
    hybrid_forced = spec.forced_replay and spec.method == "hybrid"
    lp, lpp = sequence_logprobs(spec.cfg, params, tokens, pad, exit_loop, kv_depth,
                                kv_policy=spec.kv_policy, compute_dtype=spec.compute_dtype,
                                temperature=spec.temperature,
                                method="dense" if hybrid_forced else spec.method,
                                top_k=spec.top_k, top_p=spec.top_p)
    if hybrid_forced:  # value: the forced re-run's bits; gradient: dense's (docs/DESIGN.md §4)
        sg = jax.lax.stop_gradient
        lp = sg(mb["replay_lp"]) + (lp - sg(lp))
        lpp = sg(mb["replay_lpp"]) + (lpp - sg(lpp))
    cur = lpp if spec.truncated else lp
    old = mb["old_lp"]
    need_loops = spec.loop_credit != "none" or spec.train_gate
    if need_loops:
        lp_T, gate_z = loop_logprobs(spec.cfg, params, tokens, pad, exit_loop, kv_depth,
                                     kv_policy=spec.kv_policy, compute_dtype=spec.compute_dtype,
                                     temperature=spec.temperature)
    if spec.loop_credit != "none":
        probs = exit_distribution(jax.nn.sigmoid(mb["old_gate_z"]))
        w = grpo.loop_credit_weights(exit_loop, spec.cfg.total_ut_steps, spec.loop_credit,
                                     alpha=spec.loop_credit_alpha, exit_probs_TxBxS=probs)
        cur = grpo.loop_credit_logprobs(lp_T, w)
        old = grpo.loop_credit_logprobs(mb["old_lp_T"], w)
    tis = {}
    if spec.tis_cap is not None:
        tis = dict(sampler_logprobs_BxS=mb["sampler_lp"], tis_cap=spec.tis_cap)
    loss_bs, stats = policy_token_loss(spec.loss, cur, old, mb["adv"], mask,
                                       **dataclasses.asdict(spec.settings), **tis)
    if spec.kl_beta > 0:
        loss_bs = loss_bs + spec.kl_beta * grpo.k3_kl(lp, mb["ref_lp"], mask)
    loss = grpo.aggregate_loss(loss_bs, mask, spec.loss_agg, normalizer)
    if spec.train_gate:
        gate_loss = grpo.gate_stage2_loss(-lp_T, mask, gate_logits_TxBxS=gate_z,
                                          normalizer=gate_normalizer)
        loss = loss + spec.gate_loss_coef * gate_loss
        stats["gate_loss"] = jax.lax.stop_gradient(gate_loss)
    return loss, stats


@functools.partial(jax.jit, static_argnames=("spec",))
def loss_and_grad(params, mb, normalizer, gate_normalizer, *, spec: LossSpec):
    (loss, stats), grads = jax.value_and_grad(policy_loss, has_aux=True)(
        params, mb, normalizer, gate_normalizer, spec)
    return loss, stats, grads


_STAT_SUM = ("tokens", "gate_loss")


_STAT_MIN, _STAT_MAX = ("ratio_min",), ("ratio_max",)


def reduce_stats(stats):
    """Inside `shard_map`: the microbatch's stats from every device's: token counts and loss
    shares summed, min/max reduced, the rest (token means) re-weighted by token counts."""
    n = stats["tokens"]
    n_all = jax.lax.psum(n, ROW_AXES)
    out = {}
    for k, v in stats.items():
        if k in _STAT_SUM:
            out[k] = jax.lax.psum(v, ROW_AXES)
        elif k in _STAT_MIN:
            out[k] = jax.lax.pmin(v, ROW_AXES)
        elif k in _STAT_MAX:
            out[k] = jax.lax.pmax(v, ROW_AXES)
        else:
            out[k] = jax.lax.psum(v * n, ROW_AXES) / jnp.maximum(n_all, 1.0)
    return out


@functools.lru_cache(maxsize=16)
def mesh_loss_and_grad(spec: LossSpec, mesh, param_specs_flat, mb_keys: tuple):
    """`loss_and_grad` on a mesh: each device runs `policy_loss` on its rows with the
    parameters all-gathered (`gather_fsdp`); the loss shares and gradients are summed over the
    row axes (gradients come back with the parameters' shardings)."""
    treedef, leaves = param_specs_flat
    pspecs = jax.tree_util.tree_unflatten(treedef, leaves)

    def body(params, mb, normalizer, gate_normalizer):
        def local(p):
            return policy_loss(gather_fsdp(p, pspecs), mb, normalizer, gate_normalizer, spec)
        (loss, stats), grads = jax.value_and_grad(local, has_aux=True)(params)
        return (jax.lax.psum(loss, ROW_AXES), reduce_stats(stats), sum_grads(grads, pspecs))

    mb_specs = {k: PS(None, ROW_AXES) if k in LOOP_KEYS else PS(ROW_AXES) for k in mb_keys}
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(pspecs, mb_specs, PS(), PS()),
                                 out_specs=(PS(), PS(), pspecs), check_vma=False))


LOOP_KEYS = ("old_lp_T", "old_gate_z")  # [T, B, S]: rows on axis 1


@functools.partial(jax.jit, static_argnames=("spec",))
def old_loop_pass(params, tokens, pad, exit_loop, kv_depth, *, spec: LossSpec):
    return loop_logprobs(spec.cfg, params, tokens, pad, exit_loop, kv_depth,
                         kv_policy=spec.kv_policy, compute_dtype=spec.compute_dtype,
                         temperature=spec.temperature, remat=False)
