"""The Pallas wing: the accelerator forms `pallas-gpu` and `pallas-tpu`.

`form` gives each form's kernels (the `Form` fields). `matmul`, `attention`, `attention_tpu`,
`rows` and `rope` are the kernels. `target` says where a kernel compiles.
"""
