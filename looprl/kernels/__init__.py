"""Batch-invariant kernels: the numerics that make sampler and learner agree bit for bit.

The sampler and the learner call a product with different row counts. Each row gets the same
bits whatever the number of rows and wherever the row sits. Why each kernel keeps that promise
on each backend is docs/NUMERICS.md.

One form computes them, resolved once from the platform and `LOOPRL_KERNELS` (`forms`). Each
backend is a wing: `cpu/` holds `cpu-ordered` (the CPU's default) and `cpu-xla`; `pallas/`
holds `pallas-gpu` and `pallas-tpu` (the default off the CPU). `stock` is the common way, not
invariant: the reproducibility matrix's negative control. `ops` holds the API every caller
uses; this module re-exports it. `kernel_version()` names the form's numerics, which a
rollout records.
"""
from looprl.kernels.forms import (FORMS, KERNEL_VERSION, KERNEL_VERSION_ACCEL,
                                  KERNEL_VERSION_ORDERED, KERNEL_VERSION_STOCK, Form,
                                  accelerator_forms, use_form)
from looprl.kernels.operands import (CachedKV, KeyRange, LayerWeight, cache_window,
                                     repeat_kv_heads)
from looprl.kernels.ops import (add_last, apply_rope, attention, attention_cached,
                                attention_takes_key_range, cpu_kernel_version, current_form,
                                global_norm, kernel_version, layer_matmul, log_softmax, matmul,
                                reads_layers_in_place, rms_norm, rope_cos_sin, row_argmax,
                                row_tile, rowsum, scale_last, softmax, stock_attention,
                                stock_matmul)
from looprl.kernels.tiling import (K_BLOCK, MASK_VALUE, N_MIN, ROW_QUANTUM, ROW_TILE,
                                   ROW_TILE_MAX)

__all__ = ["CachedKV", "FORMS", "Form", "KERNEL_VERSION", "KERNEL_VERSION_ACCEL",
           "KERNEL_VERSION_ORDERED", "KERNEL_VERSION_STOCK", "K_BLOCK", "KeyRange", "LayerWeight",
           "MASK_VALUE", "N_MIN", "ROW_QUANTUM", "ROW_TILE", "ROW_TILE_MAX", "accelerator_forms",
           "add_last", "apply_rope", "attention", "attention_cached", "attention_takes_key_range",
           "cache_window", "cpu_kernel_version", "current_form", "global_norm",
           "kernel_version", "layer_matmul", "log_softmax", "matmul", "reads_layers_in_place",
           "repeat_kv_heads", "rms_norm", "rope_cos_sin", "row_argmax", "row_tile", "rowsum",
           "scale_last", "softmax", "stock_attention", "stock_matmul", "use_form"]
