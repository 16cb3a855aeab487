"""Training runs (the floor below the CLI): the `looprl train` loop (`run`), task setup,
the supervised warm start, training checkpoints and resume, variants, plots."""

