"""The device check, `looprl verify --device OUT`: on one GPU (H100/H200) or TPU, within six
minutes, what the kernels' accelerator form must show before the trainer trusts it
(`reproducibility/README.md`, "GPU and TPU: the device check", says what each item shows).

`plan` (the items, their order and time budgets), `checks` (row scans, replay cells, the
needle), `speed` (named candidate / baseline pairs), `summary` (exactness, the verdict,
`report.md`), `run` (the processes, the compilation cache, `report.json`), `carry` (what
travels to a device whose image has its own jax).
"""
