"""Learner log-probs of a recorded rollout: dense, replay, hybrid, stock (DESIGN.md §4)."""

