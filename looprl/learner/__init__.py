"""Learner log-probs (dense, replay, hybrid, stock) and the reproducibility matrix."""
