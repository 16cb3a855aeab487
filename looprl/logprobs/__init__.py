"""Learner log-probs of a recorded rollout: dense, replay, hybrid, stock and the schedule-unaware
baselines (`methods`, docs/DESIGN.md §4), and how far two sets of them are apart (`mismatch`)."""
from looprl.logprobs.methods import (METHODS, SCHEDULE_UNAWARE, batch_logprobs,
                                     forced_replay_logprobs, live_seq_len, loop_logprobs,
                                     sequence_logprobs)

__all__ = ["METHODS", "SCHEDULE_UNAWARE", "batch_logprobs", "forced_replay_logprobs",
           "live_seq_len", "loop_logprobs", "sequence_logprobs"]
