"""The CPU wing: the two CPU kernel forms and what they share.

`ordered` is the ordered form (`cpu-ordered`, the CPU's default). `xla` is the XLA-op form
(`cpu-xla`). `attention` is the attention both use. `ffi` binds, builds and loads the C++
kernels whose sources sit in `csrc/`.
"""
