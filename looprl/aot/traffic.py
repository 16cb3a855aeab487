"""Bytes moved and FLOPs per program run, counted from the optimized HLO with every while body
multiplied by its trip count (XLA's own cost analysis counts a loop body once, and the layer
stack and the learner's microbatches are loops).

Per kernel launch (`inspect.kernels`): bytes = what it reads + what it writes, from the
operands' and the result's shapes. A fusion operand read only through slices (dynamic-slice,
slice, gather) counts the slices' sizes; a fusion whose result is a dynamic-update-slice of one
of its operands (updated in place) writes the update only and does not read that operand.
An array a TPU keeps in VMEM (memory space S(1) in its layout) is no HBM traffic; the async
copy that brings it there or back (`copy-start`) counts its HBM side.
A looprl attention kernel reads its rows' keys and values: q's rows x the key span (the mask's,
or the cache's slot length) x the kv width, whatever the K/V operands' size (the cached kernel
is handed the whole KV cache). FLOPs: 2 x output x contraction for each dot and convolution
(inside fusions or as cuBLAS GEMMs; a convolution's window taps that read an input), a looprl
matmul's 2 M I O, a looprl attention's
4 x (query, key) pairs x head width x heads (its backward's kernels: 8 each, four
products). The pairs are every block the key axis spans, except where the kernel is handed a
`KeyRange` (its mask operand one wide) and its queries span the key axis (the learner's pass,
whose layout is its positions): there, the causal blocks its block table lists, as jax's
causal flash kernels are counted (`causal_pairs`). Elementwise arithmetic is not counted.
What this cannot see: caches (L2 / VMEM reuse), a kernel reading less than its operands (a
fusion reading part of an operand other than by slicing), and anything decided at run time
(left padding's skipped blocks; a bool mask's live blocks).
"""
from __future__ import annotations

import math
import re

from looprl.aot.inspect import (GEMM_TARGETS, Instr, Program, control_flow, gemm_flops,
                                is_looprl_kernel, kernels, looprl_name)
from looprl.kernels.pallas.matmul import BLOCK_COLS
from looprl.kernels.tiling import K_BLOCK, ROW_TILE

ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
              "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\](\{[^}]*\})?")  # type, dims, layout
VMEM = "S(1)"  # a TPU layout's memory space 1: the core's VMEM, not HBM
SLICING = ("dynamic-slice", "slice", "gather")
CAUSAL_BLOCK = 128  # the query and key block of jax's flash kernels (the fair baselines)
TPU_LANES = 128  # the head width of a looprl TPU attention (Mosaic's lane width)
# the looprl attention kernels that read an int32 mask tile per (row, head) program (operand 4,
# after the table and q): the forward (5 operands) and the backward's two kernels
ATTENTION_MASKED = {"looprl_flash_attention": 5, "looprl_flash_attention_dq": 7,
                    "looprl_flash_attention_dkv": 8}


def shape_bytes(shape: str) -> int:
    """HBM bytes of a printed HLO shape (an array or a tuple of arrays; token, opaque and an
    array laid out in a TPU's VMEM, memory space S(1): 0)."""
    return sum(ITEM_BYTES.get(t, 0) * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims, layout in _ARRAY.findall(shape) if VMEM not in layout)


def _elements(shape: str) -> list[str]:
    """The arrays of a printed (tuple) shape, each with its layout."""
    return [m.group(0) for m in _ARRAY.finditer(shape)]


def dims(shape: str) -> list[int]:
    """The dimensions of a printed array shape (`f32[64,2048]{1,0}` -> [64, 2048])."""
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def operands(p: Program, i: Instr) -> list[Instr]:
    """`i`'s operand instructions, in order (from their definitions in `i`'s computation)."""
    by_name = {j.name: j for j in p.computations.get(i.computation, [])}
    depth, end = 0, len(i.rest)
    for k, ch in enumerate(i.rest):  # the operand list ends at the first unmatched ')'
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            end = k
            break
    names = re.findall(r"%([\w.\-]+)", i.rest[:end])
    return [by_name[n] for n in names if n in by_name]


def _users(p: Program, body: list[Instr], prm: Instr) -> list[Instr]:
    return [j for j in body if any(o.name == prm.name for o in operands(p, j))]


def _fusion_bytes(p: Program, i: Instr) -> int:
    body = [j for c in i.called for j in p.computations.get(c, [])]
    params = {int(re.match(r"(\d+)", j.rest).group(1)): j for j in body
              if j.opcode == "parameter"}
    roots = _roots(p, body)
    in_place = {_through_bitcasts(p, operands(p, r)[0]).name for r in roots
                if r.opcode == "dynamic-update-slice"}
    total = 0
    for k, op in enumerate(operands(p, i)):
        prm = params.get(k)
        if prm is None:
            total += shape_bytes(op.shape)
            continue
        if prm.name in in_place:
            continue
        users = _users(p, body, prm)
        if users and all(u.opcode in SLICING and operands(p, u)[:1] == [prm] for u in users):
            total += min(shape_bytes(op.shape), sum(shape_bytes(u.shape) for u in users))
        else:
            total += shape_bytes(op.shape)
    for r in roots:
        if r.opcode == "dynamic-update-slice":
            total += shape_bytes(operands(p, r)[1].shape)
        else:
            total += shape_bytes(r.shape)
    return total


def _through_bitcasts(p: Program, i: Instr) -> Instr:
    """`i`, or what a chain of bitcasts (a reshape of the same bytes) starts from."""
    while i.opcode == "bitcast" and operands(p, i):
        i = operands(p, i)[0]
    return i


def _roots(p: Program, body: list[Instr]) -> list[Instr]:
    """A fused computation's root instruction, or the elements of its root tuple."""
    out = []
    for r in (j for j in body if j.root):
        out += operands(p, r) if r.opcode == "tuple" else [r]
    return out


def _attention_operands(p: Program, i: Instr):
    """(q, [k, v], the key span each row reads, the other operands) of a looprl attention
    kernel: `looprl_flash_attention` (meta, q, k, v, mask: the span is the mask's key axis;
    the GPU's cached form adds the k and v windows: its k, v are the caches `[N*B', S, J*K]`,
    the span S) or `looprl_flash_attention_cached` (the TPU's: rows, n, q, last, k cache, v
    cache `[N, B', S, J, K]`, k window, v window: the span S)."""
    ops = operands(p, i)
    if looprl_name(i) == "looprl_flash_attention_cached":
        return ops[2], ops[4:6], dims(ops[4].shape)[-3], ops[:2] + [ops[3]] + ops[6:]
    if len(ops) == 7:  # the GPU's cached form: the windows follow the mask
        return ops[1], ops[2:4], dims(ops[2].shape)[-2], [ops[0]] + ops[4:]
    return ops[1], ops[2:4], dims(ops[2].shape)[-2], [ops[0], ops[4]]


def looprl_pairs(cp: int, span: int, key_range: bool) -> int:
    """(query, key) pairs a looprl attention kernel computes for cp padded queries over a key
    axis of `span`: every block (cp x span), or, for a `KeyRange` whose queries span the key
    axis (cp + K_BLOCK >= span; layout c = position c), the blocks up to each ROW_TILE query
    tile's last query."""
    if not key_range or cp + K_BLOCK < span:
        return cp * span
    return sum(ROW_TILE * K_BLOCK * min(-(-ROW_TILE * (t + 1) // K_BLOCK), span // K_BLOCK)
               for t in range(cp // ROW_TILE))


def _key_range(p: Program, i: Instr) -> bool:
    """Whether a looprl attention kernel (forward or backward) is handed a `KeyRange`: its
    mask operand (operand 4) is one wide."""
    ops = operands(p, i)
    return len(ops) > 4 and dims(ops[4].shape)[-1] == 1


def _attention_bytes(p: Program, i: Instr) -> int:
    """q, the small operands and the output as they are; K and V: q's rows x the key span x
    the kv width (whatever the operands' size: the cached kernel is handed the whole cache)."""
    q, kv, span, rest = _attention_operands(p, i)
    total = shape_bytes(i.shape) + shape_bytes(q.shape) + sum(shape_bytes(o.shape) for o in rest)
    rows = dims(q.shape)[0]
    for x in kv:
        d = dims(x.shape)
        key = shape_bytes(x.shape) // math.prod(d) * (d[-1] * d[-2] if len(d) > 3 else d[-1])
        total += min(shape_bytes(x.shape), rows * span * key)  # a key: every kv head
    return total


def _window(rest: str, n: int) -> list[dict]:
    """A convolution's window attributes per spatial dimension (HLO defaults where absent)."""
    m = re.search(r"window=\{([^}]*)\}", rest)
    out = [dict(size=1, stride=1, lo=0, lhs_dilate=1, rhs_dilate=1) for _ in range(n)]
    for key, val in re.findall(r"(\w+)=([\d_x]+)", m.group(1) if m else ""):
        for d, v in enumerate(val.split("x")[:n]):
            if key == "pad":
                out[d]["lo"] = int(v.split("_")[0])
            elif key in out[d]:
                out[d][key] = int(v)
    return out


def _taps(w: dict, n_in: int, n_out: int) -> int:
    """(output position, window tap) pairs that read an input element along one dimension."""
    span = (n_in - 1) * w["lhs_dilate"]
    count = 0
    for o in range(n_out):
        for k in range(w["size"]):
            x = o * w["stride"] + k * w["rhs_dilate"] - w["lo"]
            count += 0 <= x <= span and x % w["lhs_dilate"] == 0
    return count


def _dot_flops(p: Program, j: Instr) -> float:
    """2 x output x contraction of a dot; for a convolution (the TPU's form of its dots),
    2 x batch x output features x input features x the window taps that read an input."""
    ops = operands(p, j)
    if len(ops) < 2:
        return 0.0
    lhs, rhs, out = dims(ops[0].shape), dims(ops[1].shape), dims(j.shape)
    if j.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", j.rest)
        k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m else 1
        return 2.0 * math.prod(out) * k
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", j.rest)
    if not labels:
        return 0.0
    ll, rl, ol = labels.groups()
    spatial = sorted(c for c in ol if c.isdigit())
    window = _window(j.rest, len(spatial))
    taps = math.prod(_taps(window[d], lhs[ll.index(c)], out[ol.index(c)])
                     for d, c in enumerate(spatial))
    return 2.0 * out[ol.index("b")] * out[ol.index("f")] * rhs[rl.index("i")] * taps


def _flops(p: Program, i: Instr) -> float:
    kind = jax_kernel(i)
    if kind in FLASH_DOTS:
        S, bhk = _flash_dims(i, operands(p, i)[0])
        return 2.0 * FLASH_DOTS[kind] * bhk * causal_pairs(S)
    if kind == "paged":
        ops = operands(p, i)
        x = max(ops, key=lambda o: shape_bytes(o.shape))
        table = max((o for o in ops if o.shape.startswith("s32")),
                    key=lambda o: math.prod(dims(o.shape)))
        d = dims(x.shape)
        return 4.0 * math.prod(dims(table.shape)) * math.prod(d) // d[1]
    if is_looprl_kernel(i):
        name = looprl_name(i)
        ops = operands(p, i)
        if "matmul" in name and len(ops) >= 2:
            (m, k), o = dims(ops[0].shape)[-2:], dims(ops[1].shape)[-1]
            return 2.0 * m * k * o
        if name in BACKWARD:  # (table, q, k, v, ...): q `[B, Cp, H*K]`, k `[B, Sp, J*K]`
            b, cp, hk = dims(ops[1].shape)
            pairs = looprl_pairs(cp, dims(ops[2].shape)[1], _key_range(p, i))
            return 2.0 * BACKWARD[name] * b * pairs * hk
        if "attention" in name:
            q, _, span, _ = _attention_operands(p, i)
            b, cp, hk = dims(q.shape)
            cached = name == "looprl_flash_attention_cached" or len(ops) == 7
            return 4.0 * b * looprl_pairs(cp, span, not cached and _key_range(p, i)) * hk
        return 0.0
    if i.opcode == "custom-call":
        if any(t in i.rest for t in GEMM_TARGETS[:2]):
            return gemm_flops(p, i)
        return 0.0
    if i.opcode in ("dot", "convolution"):
        return _dot_flops(p, i)
    return sum(_dot_flops(p, j) for j in _fused(p, i) if j.opcode in ("dot", "convolution"))


def _fused(p: Program, i: Instr) -> list[Instr]:
    """The instructions of the computations `i` calls, a nested fusion's (the TPU's) included."""
    out, todo = [], list(i.called)
    while todo:
        for j in p.computations.get(todo.pop(), []):
            out.append(j)
            todo += j.called if j.opcode == "fusion" else []
    return out


BACKWARD = {"looprl_flash_attention_dq": 4, "looprl_flash_attention_dkv": 4}  # dots per block


def _bytes(p: Program, i: Instr) -> int:
    if (is_looprl_kernel(i) and looprl_name(i).startswith("looprl_flash_attention")
            and looprl_name(i) not in BACKWARD):
        return _attention_bytes(p, i) + _tpu_rereads(p, i)
    if jax_kernel(i) == "paged":
        return _paged_bytes(p, i)
    if i.opcode == "fusion":
        return _fusion_bytes(p, i)
    ops = operands(p, i)
    if i.opcode == "dynamic-update-slice":
        return 2 * shape_bytes(ops[1].shape)
    if i.opcode in SLICING:
        return 2 * shape_bytes(i.shape)
    if i.opcode == "slice-start":  # the TPU's async slice: ((operand), slice, context)
        arrays = _elements(i.shape)
        if len(arrays) < 2:
            return 0
        read = shape_bytes(arrays[1].split("{")[0]) if VMEM not in arrays[0] else 0
        return read + shape_bytes(arrays[1])
    result = i.shape
    if i.opcode == "custom-call" and i.shape.startswith("("):  # a library's scratch: no traffic
        result = ", ".join(a for a in _elements(i.shape) if not a.startswith("s8["))
    return shape_bytes(result) + sum(shape_bytes(o.shape) for o in ops) + _tpu_rereads(p, i)


def jax_kernel(i: Instr) -> str | None:
    """Which of jax's own Pallas attention kernels `i` launches (the fair baselines'):
    `flash_forward`, `flash_backward` (the GPU's one backward kernel), `flash_dkv`, `flash_dq`
    (the TPU's two), `paged`; None for any other instruction."""
    if i.opcode != "custom-call" or is_looprl_kernel(i) or "pallas_call" not in i.op_name:
        return None
    n = i.op_name
    for key, kind in (("paged_attention", "paged"), ("mha_preprocess_backward", None),
                      ("mha_backward", "flash_backward"), ("flash_mha_bwd_dkv", "flash_dkv"),
                      ("flash_mha_bwd_dq", "flash_dq"), ("mha_forward", "flash_forward"),
                      ("flash_attention", "flash_forward")):
        if key in n:
            return kind
    return None


FLASH_DOTS = {"flash_forward": 2, "flash_backward": 7, "flash_dkv": 4, "flash_dq": 3}
# the operands a TPU flash kernel reads again for every block of its inner loop (with segment
# ids, as the fair programs pass them): the keys' side forward and for dq, the queries' for dkv
FLASH_SWEPT = {"flash_forward": (1, 2, 4), "flash_dq": (1, 2, 4), "flash_dkv": (0, 3, 5, 6, 7, 8)}


def _flash_dims(i: Instr, q: Instr) -> tuple[int, int]:
    """(S, B x H x K) of a jax flash kernel's q: `[B, S, H, K]` on a GPU, `[B, H, S, K]` on a
    TPU."""
    d = dims(q.shape)
    S = d[2] if "tpu_custom_call" in i.rest else d[1]
    return S, math.prod(d) // S


def causal_pairs(S: int, block: int = CAUSAL_BLOCK) -> int:
    """(query, key) pairs a causal flash kernel computes over S positions: the whole
    `block x block` tiles on and below the diagonal."""
    n = -(-S // block)
    return block * block * n * (n + 1) // 2


def _paged_bytes(p: Program, i: Instr) -> int:
    """A paged attention: the pages (the two largest operands, `[J, pages, page, K]`) as the
    page table's entries (the largest int32 operand) x a page across the kv heads; the rest as
    given."""
    ops = operands(p, i)
    pages = sorted(ops, key=lambda o: shape_bytes(o.shape))[-2:]
    table = max((o for o in ops if o.shape.startswith("s32")), key=lambda o: math.prod(dims(o.shape)))
    entries = math.prod(dims(table.shape))
    total = shape_bytes(i.shape) + sum(shape_bytes(o.shape) for o in ops if o not in pages)
    for x in pages:
        total += min(shape_bytes(x.shape), entries * shape_bytes(x.shape) // dims(x.shape)[1])
    return total


def _tpu_rereads(p: Program, i: Instr) -> int:
    """HBM bytes a TPU Pallas kernel reads again, block by block (a TPU has no cache: a block
    whose index changes is copied in again): a looprl matmul's rows once per 128-column block, a
    looprl attention's int32 mask once per head (forward and backward; heads of 128 lanes), a
    jax flash kernel's swept operands once per block of its inner loop (causal: (n + 1) / 2
    times on average)."""
    if i.opcode != "custom-call" or "tpu_custom_call" not in i.rest:
        return 0
    ops = operands(p, i)
    kind = jax_kernel(i)
    if kind in FLASH_SWEPT:
        S, _ = _flash_dims(i, ops[0])
        n = -(-S // CAUSAL_BLOCK)
        return sum(shape_bytes(ops[k].shape) for k in FLASH_SWEPT[kind] if k < len(ops)) * (n - 1) // 2
    if not is_looprl_kernel(i):
        return 0
    name = looprl_name(i)
    if name == "looprl_fixed_block_matmul":  # column blocks outer
        return shape_bytes(ops[0].shape) * (dims(ops[1].shape)[-1] // BLOCK_COLS - 1)
    if name in ATTENTION_MASKED and len(ops) == ATTENTION_MASKED[name]:
        heads = dims(ops[1].shape)[-1] // TPU_LANES
        return shape_bytes(ops[4].shape) * (heads - 1)
    return 0


def _add(out: dict, kind: str, b: float, f: float, launches: int):
    k = out["by_kind"].setdefault(kind, {"bytes": 0.0, "flops": 0.0, "launches": 0})
    k["bytes"] += b
    k["flops"] += f
    k["launches"] += launches
    out["bytes"] += b
    out["flops"] += f


def traffic(p: Program, flops_per_s: float | None = None,
            bytes_per_s: float | None = None) -> dict:
    """Per program run: `bytes` and `flops` (module doc), and `by_kind` ({looprl kernel name,
    jax kernel (`jax_kernel`), `gemm` or the opcode: {bytes, flops, launches}}). A TPU's async
    copies between HBM and VMEM (`copy-start`, no launch) count their HBM side. Given a
    device's peaks (FLOP/s, HBM bytes/s), also `serial_s`: the kernels one after another,
    each launch max(its FLOPs / flops_per_s, its bytes / bytes_per_s), and the async copies'
    bytes / bytes_per_s (no launch cost: the caller adds it)."""
    out = {"bytes": 0.0, "flops": 0.0, "by_kind": {}}
    serial = 0.0
    for i, mult in kernels(p):
        if is_looprl_kernel(i):
            kind = looprl_name(i)
        elif jax_kernel(i):
            kind = f"jax_{jax_kernel(i)}"
        elif i.opcode == "custom-call" and any(t in i.rest for t in GEMM_TARGETS):
            kind = "gemm"
        else:
            kind = i.opcode
        b, f = _bytes(p, i), _flops(p, i)
        _add(out, kind, b * mult, f * mult, mult)
        if flops_per_s and bytes_per_s:
            serial += mult * max(f / flops_per_s, b / bytes_per_s)
    for comp, mult in control_flow(p)[0]:
        for i in p.computations.get(comp, []):
            if i.opcode == "copy-start":  # ((from), to, context)
                b = sum(map(shape_bytes, _elements(i.shape)[:2])) * mult
                _add(out, i.opcode, b, 0.0, 0)
                serial += b / bytes_per_s if flops_per_s and bytes_per_s else 0.0
    if flops_per_s and bytes_per_s:
        out["serial_s"] = serial
    return out
