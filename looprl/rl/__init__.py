"""Reinforcement learning on looped LMs: the GRPO math (`grpo`), the policy losses (`losses`), the
jitted objective (`objective`), the learner that runs a GRPO step (`learner.GRPOLearner`),
rollout rewards (`rollout`) and greedy evaluation (`evaluation`)."""
from looprl.rl.grpo import (AGG_MODES, LOOP_CREDIT_MODES, GroupAdvantages, aggregate_loss,
                            exit_stage1_loss, gate_stage2_loss, group_advantages, k3_kl,
                            loop_credit_logprobs, loop_credit_weights, loss_normalizer)
from looprl.rl.losses import LOSSES, policy_token_loss, ppo_clip_loss

__all__ = ["AGG_MODES", "LOOP_CREDIT_MODES", "LOSSES", "GroupAdvantages", "aggregate_loss",
           "exit_stage1_loss", "gate_stage2_loss", "group_advantages", "k3_kl",
           "loop_credit_logprobs", "loop_credit_weights", "loss_normalizer", "policy_token_loss",
           "ppo_clip_loss"]
