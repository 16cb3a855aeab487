"""Checkpoints, metrics and plots of training runs (leaf package: model <- train)."""
