"""What a compiled program holds, read from its optimized HLO text and, on a GPU, its PTX.

`program(compiled)` parses `compiled.as_text()` into computations. From it: `kernels` (each
device kernel: fusions, custom calls, Triton and Pallas kernels, with the computation it sits
in), `launches` (kernel launches per run, a while loop's body counted by its known trip count),
`dots` (every instruction that computes a `dot_general` of the traced program, and whether a
looprl Pallas kernel computes it: their names start with `looprl_`), `split_k` (GEMMs whose
contraction XLA splits), `tf32` (fp32 dots that may run in TF32). `ptx_kernels` reads the PTX
XLA dumps (`targets.compile_for(dump_dir=)`): per kernel entry, its floating-point instruction
sequence. `memory` and `cost` give memory_analysis and cost_analysis as dicts; where the target
has no cost analysis (the compile-only GPU), XLA's HLO cost analysis of the optimized module;
a looprl matmul kernel's FLOPs are added from its operand shapes (a custom call counts none).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

LOOPRL_PREFIX = "looprl_"  # every looprl Pallas kernel's name
FREE_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
            "conditional", "call", "after-all", "add-dependency", "opt-barrier", "partition-id",
            "replica-id", "copy-start", "copy-done", "domain", "slice-done"}
# custom calls that move no data: the TPU compiler's buffer allocation and bitcast of a concat
FREE_CUSTOM_CALLS = ('custom_call_target="AllocateBuffer"', 'custom_call_target="ConcatBitcast"')
PALLAS_TARGETS = ("__gpu$xla.gpu.triton", "tpu_custom_call")
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$")
_COMP = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"^(\w+)\[([\d,]*)\]")
FP_OPCODE = re.compile(r"^\s*(@%p\d+\s+)?((?:w?gmma|mma|fma|add|sub|mul|div|rcp|sqrt|rsqrt|ex2|lg2|"
                       r"max|min|neg|abs|cvt|tanh)[\w.]*\.(?:f32|f16|bf16|f64|tf32|e4m3|e5m2)\w*"
                       r"(?:\.[\w]+)*)")


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    shape: str  # the result type as printed, e.g. `f32[64,2048]{1,0}`
    opcode: str
    rest: str  # the operands and attributes as printed
    computation: str
    root: bool = False  # the computation's ROOT

    def attr(self, key: str) -> str | None:
        """The value of attribute `key=` (up to the next top-level comma), or None."""
        m = re.search(rf"\b{key}=", self.rest)
        if not m:
            return None
        j = m.end()
        if self.rest[j:j + 1] == "{":  # balanced braces
            depth = 0
            for k in range(j, len(self.rest)):
                depth += {"{": 1, "}": -1}.get(self.rest[k], 0)
                if depth == 0:
                    return self.rest[j:k + 1]
        v = re.match(r'"[^"]*"|[^,\s]+', self.rest[j:])
        return v.group(0) if v else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.rest)
        return m.group(1) if m else ""

    @property
    def called(self) -> list[str]:
        """The computations this instruction calls (fusion bodies, loop bodies, branches)."""
        names = []
        for key in ("calls", "body", "condition", "to_apply"):
            v = self.attr(key)
            if v:
                names += [n.strip().lstrip("%") for n in v.strip("{}").split(",")]
        v = self.attr("branch_computations")
        if v:
            names += [n.strip().lstrip("%") for n in v.strip("{}").split(",")]
        return names


@dataclasses.dataclass
class Program:
    computations: dict[str, list[Instr]]
    entry: str
    text: str

    def instr(self, name: str) -> Instr | None:
        for instrs in self.computations.values():
            for i in instrs:
                if i.name == name:
                    return i
        return None

    def operand_types(self, i: Instr) -> list[str]:
        """The element types of `i`'s operands (`f32`, `bf16`, ...), from their definitions."""
        by_name = {j.name: j for j in self.computations.get(i.computation, [])}
        args = i.rest.split(")", 1)[0]
        return [by_name[n].shape.lstrip("(").split("[")[0]
                for n in re.findall(r"%([\w.\-]+)", args) if n in by_name]


def program(compiled_or_text) -> Program:
    """The optimized HLO of a `jax.stages.Compiled` (or its `.as_text()`) as computations."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        mi = _INSTR.match(line)
        if mi:
            comps[current].append(Instr(mi.group(2), mi.group(3), mi.group(4), mi.group(5),
                                        current, bool(mi.group(1))))
    if not entry:
        raise ValueError("no ENTRY computation in the compiled text")
    return Program(comps, entry, text)


def _constant(p: Program, comp: str, name: str) -> int | None:
    """The integer value of scalar `name` in `comp` where it is a constant (through copies)."""
    i = next((j for j in p.computations.get(comp, []) if j.name == name), None)
    while i is not None and i.opcode in ("copy", "bitcast"):
        src = re.match(r"\s*%([\w.\-]+)\)", i.rest)
        i = next((j for j in p.computations.get(comp, []) if src and j.name == src.group(1)),
                 None)
    m = re.match(r"\s*(-?\d+)\)", i.rest) if i is not None and i.opcode == "constant" else None
    return int(m.group(1)) if m else None


def trip_count(p: Program, loop: Instr) -> int | None:
    """A while loop's trip count: XLA's `known_trip_count` where the GPU compiler records it,
    else read from the loop (the TPU's): the condition `i < N` on tuple element k with N a
    constant and element k of the initial tuple a constant c (counting up by one: N - c).
    None when neither is found."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.rest)
    if m:
        return int(m.group(1))
    cond = loop.attr("condition").lstrip("%")
    body = p.computations.get(cond, [])
    root = next((j for j in body if j.root), None)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.rest:
        return None
    lhs, rhs = re.findall(r"%([\w.\-]+)", root.rest.split(")", 1)[0])[:2]
    gte = next((j for j in body if j.name == lhs and j.opcode == "get-tuple-element"), None)
    limit = _constant(p, cond, rhs)
    init = re.match(r"\s*%([\w.\-]+)\)", loop.rest)
    tup = p.instr(init.group(1)) if init else None
    if gte is None or limit is None or tup is None or tup.opcode != "tuple":
        return None
    k = int(re.search(r"index=(\d+)", gte.rest).group(1))
    elems = re.findall(r"%([\w.\-]+)", tup.rest.split(")", 1)[0])
    start = _constant(p, tup.computation, elems[k]) if k < len(elems) else None
    return None if start is None else max(0, limit - start)


def control_flow(p: Program):
    """(computation, multiplier) for the entry and every computation run as control flow
    (while bodies and conditions, conditional branches, calls), with launch multipliers."""
    out, unknown = [], []

    def walk(comp: str, mult: int):
        out.append((comp, mult))
        for i in p.computations.get(comp, []):
            if i.opcode == "while":
                n = trip_count(p, i)
                if n is None:
                    unknown.append(i.name)
                    n = 1
                walk(i.attr("body").lstrip("%"), mult * n)
                walk(i.attr("condition").lstrip("%"), mult * (n + 1))
            elif i.opcode in ("conditional", "call"):
                for c in i.called:
                    walk(c, mult)
    walk(p.entry, 1)
    return out, unknown


def kernels(p: Program) -> list[tuple[Instr, int]]:
    """Every kernel launch site: (instruction, launches per program run) for fusions, custom
    calls and the other non-free ops of the entry and its control-flow computations."""
    sites, _ = control_flow(p)
    return [(i, mult) for comp, mult in sites for i in p.computations.get(comp, [])
            if i.opcode not in FREE_OPS
            and not (i.opcode == "custom-call" and any(t in i.rest for t in FREE_CUSTOM_CALLS))]


def launches(p: Program) -> dict:
    """Kernel launches per run: `total`, by kind (`fusion`, `custom-call`, other opcodes), and
    `unknown_trip_loops` (while loops without a known trip count, counted once)."""
    _, unknown = control_flow(p)
    by: dict[str, int] = {}
    for i, mult in kernels(p):
        by[i.opcode] = by.get(i.opcode, 0) + mult
    return {"total": sum(by.values()), "by_opcode": by, "unknown_trip_loops": unknown}


def is_looprl_kernel(i: Instr) -> bool:
    """True for a custom call of a looprl Pallas kernel (Triton or Mosaic)."""
    return (i.opcode == "custom-call" and any(t in i.rest for t in PALLAS_TARGETS)
            and (f"/{LOOPRL_PREFIX}" in i.op_name or f'name = "{LOOPRL_PREFIX}' in i.rest))


def looprl_name(i: Instr) -> str:
    """The looprl kernel's name (`looprl_flash_attention`, ...) of a looprl kernel's launch."""
    return re.search(rf"{LOOPRL_PREFIX}\w+", i.op_name + i.rest).group(0)


def interpreted(p: Program) -> list[str]:
    """Launches that run a looprl kernel's body as XLA ops (Pallas interpret mode compiled for
    the target: the kernel form was not bound to the target's platform)."""
    return [i.name for i, _ in kernels(p) if f"/{LOOPRL_PREFIX}" in i.op_name
            and not is_looprl_kernel(i)]


def dots(p: Program) -> list[dict]:
    """Every launch that computes a traced `dot_general`: a looprl kernel (`looprl: True`,
    `config`: its name, operand shapes but the rows', and Triton's warps and stages) or an XLA
    dot (a GEMM custom call, a fusion holding a dot, convolution or a dot rewritten as a
    reduce), with its op_name and launches per run."""
    out = []
    for i, mult in kernels(p):
        if is_looprl_kernel(i):
            shapes = re.findall(r"(\w+\[[\d,]*\])\{", i.attr("operand_layout_constraints") or "")
            name = looprl_name(i)
            tune = tuple(re.findall(r"(num_warps|num_stages) = (\d+)", i.rest))
            config = (name, tuple(s.split("[")[0] + "[M," + s.split(",", 1)[1]
                                  if "," in s else s for s in shapes[:1]) + tuple(shapes[1:]),
                      tune)
            out.append({"looprl": True, "name": i.name, "op_name": i.op_name, "config": config,
                        "launches": mult, "shape": i.shape})
            continue
        body = [j for c in i.called for j in p.computations.get(c, [])]
        names = [i.op_name] + [j.op_name for j in body]
        gemm = i.opcode == "custom-call" and any(t in i.rest for t in GEMM_TARGETS)
        holds = any(j.opcode in ("dot", "convolution") for j in body)
        if gemm or holds or any(n.endswith("dot_general") for n in names):
            out.append({"looprl": False, "name": i.name, "op_name": next(
                (n for n in names if "dot_general" in n), i.op_name), "launches": mult,
                "shape": i.shape, "opcode": i.opcode})
    return out


def split_k(p: Program) -> list[str]:
    """Instructions where XLA splits a GEMM's contraction: a Triton GEMM config with
    split_k > 1, or a GEMM fusion whose dot contracts a split K (a batch axis then reduced)."""
    found = []
    for i, _ in kernels(p):
        m = re.search(r'"split_k":"?(\d+)', i.rest)
        if m and int(m.group(1)) > 1:
            found.append(i.name)
        elif "gemm" in i.rest and "__triton" in i.rest:
            body = [j for c in i.called for j in p.computations.get(c, [])]
            if any(j.opcode == "dot" and "lhs_batch_dims" in j.rest
                   and "split" in (j.op_name + j.rest) for j in body):
                found.append(i.name)
    return found


def tf32(p: Program) -> list[str]:
    """fp32 GEMMs that may run in TF32: cuBLAS calls of fp32 operands without HIGHEST
    precision or an fp32 algorithm, and XLA fp32 dots at DEFAULT precision."""
    found = []
    for i, _ in kernels(p):
        if i.opcode == "custom-call" and any(t in i.rest for t in GEMM_TARGETS):
            if "f32" in p.operand_types(i) and '"HIGHEST","HIGHEST"' not in i.rest \
                    and "ALG_DOT_F32_F32_F32" not in i.rest:
                found.append(i.name)
        for j in (j for c in i.called for j in p.computations.get(c, [])):
            if j.opcode == "dot" and "f32" in p.operand_types(j) and "HIGHEST" not in j.rest \
                    and "F32_F32_F32" not in j.rest:
                found.append(f"{i.name}/{j.name}")
    return found


def ptx_kernels(dump_dir) -> list[tuple[str, tuple[str, ...]]]:
    """(entry name, floating-point instruction sequence) for every `.entry` of the PTX files in
    `dump_dir` (opcodes with their types and rounding, in program order; `mma`/`wgmma` and
    `tf32` included). Raises FileNotFoundError when the directory holds no PTX."""
    files = sorted(Path(dump_dir).glob("*.ptx"))
    if not files:
        raise FileNotFoundError(f"{dump_dir}: no .ptx files (compile with dump_dir= on a GPU)")
    out: list[tuple[str, tuple[str, ...]]] = []
    for f in files:
        entry, seq = None, []
        for line in f.read_text().splitlines():
            m = re.match(r"^\.(?:visible|weak)?\s*\.entry (\w+)", line)
            if m:
                if entry:
                    out.append((entry, tuple(seq)))
                entry, seq = m.group(1), []
                continue
            mo = FP_OPCODE.match(line)
            if entry and mo:
                seq.append(mo.group(2))
        if entry:
            out.append((entry, tuple(seq)))
    return out


def looprl_ptx(dump_dir) -> dict[str, int]:
    """The looprl kernels' PTX: {fingerprint of the fp instruction sequence: entries}."""
    out: dict[str, int] = {}
    for entry, seq in ptx_kernels(dump_dir):
        if entry.startswith(LOOPRL_PREFIX):
            out[fingerprint(seq)] = out.get(fingerprint(seq), 0) + 1
    return out


def debug_options(dump_dir) -> dict[str, str]:
    """The XLA debug options a compile ran with, from its dump's `.debug_options` file."""
    out = {}
    for f in Path(dump_dir).glob("*.debug_options"):
        for line in f.read_text().splitlines():
            if ":" in line:
                k, v = line.split(":", 1)
                out[k.strip()] = v.strip().strip('"')
    return out


def fingerprint(seq) -> str:
    """A short sha256 of a sequence of strings (for messages and JSON)."""
    return hashlib.sha256("\n".join(seq).encode()).hexdigest()[:16]


def memory(compiled) -> dict:
    """`compiled.memory_analysis()` as a dict of bytes, with `peak_bytes` = arguments +
    outputs + temporaries - aliased."""
    m = compiled.memory_analysis()
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")
    d = {k: int(getattr(m, k)) for k in keys}
    d["peak_bytes"] = (d["argument_size_in_bytes"] + d["output_size_in_bytes"]
                       + d["temp_size_in_bytes"] - d["alias_size_in_bytes"])
    return d


def _shape_elems(s: str) -> tuple[str, list[int]]:
    m = _SHAPE.match(s)
    return m.group(1), [int(x) for x in m.group(2).split(",") if x]


def gemm_flops(p: Program, i: Instr) -> float:
    """2 x output elements x contraction length of a cuBLAS GEMM custom call (0 for another
    custom call)."""
    if not any(t in i.rest for t in GEMM_TARGETS[:2]):
        return 0.0
    _, out = _shape_elems(i.shape.lstrip("("))
    lhs_name = re.match(r"\s*%([\w.\-]+)", i.rest)
    by_name = {j.name: j for j in p.computations.get(i.computation, [])}
    lhs = by_name.get(lhs_name.group(1)) if lhs_name else None
    dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', i.rest)
    if lhs is None or dims is None:
        return 0.0
    _, lhs_dims = _shape_elems(lhs.shape.lstrip("("))
    k = 1
    for d in re.findall(r"\d+", dims.group(1)):
        k *= lhs_dims[int(d)]
    n = 1
    for x in out:
        n *= x
    return 2.0 * n * k


def cost(compiled) -> dict:
    """FLOPs, transcendentals and bytes accessed per run: `compiled.cost_analysis()` where the
    target has one (TPU), else XLA's HLO cost analysis of the optimized module (GPU; a while
    body counted once). A looprl matmul kernel's FLOPs (2 M I O, padded shapes) are added
    where the analysis counts a custom call as none (`source` says which), and so are a cuBLAS
    GEMM's (2 x output elements x contraction length)."""
    try:
        c = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - the compile-only GPU raises UNIMPLEMENTED
        c = None
    source = "cost_analysis"
    if not c:
        import jax
        from jax._src.lib import xla_client
        module = compiled.runtime_executable().hlo_modules()[0]
        c = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
        source = "hlo_cost_analysis"
    c = c[0] if isinstance(c, list) else c
    out = {"flops": float(c.get("flops", 0.0)),
           "transcendentals": float(c.get("transcendentals", 0.0)),
           "bytes_accessed": float(c.get("bytes accessed", 0.0)), "source": source}
    p = program(compiled)  # a Pallas custom call counts no FLOPs in either analysis
    extra = 0.0
    for d in dots(p):
        if d["looprl"] and "matmul" in d["config"][0]:
            i = p.instr(d["name"])
            shapes = re.findall(r"(\w+\[[\d,]*\])\{", i.attr("operand_layout_constraints"))
            (_, (m, k)), (_, (_, o)) = _shape_elems(shapes[0]), _shape_elems(shapes[1])
            extra += 2.0 * m * k * o * d["launches"]
        elif not d["looprl"] and d.get("opcode") == "custom-call":
            extra += gemm_flops(p, p.instr(d["name"])) * d["launches"]
    out["flops"] += extra
    out["custom_call_flops_added"] = extra
    return out


def summary(compiled) -> dict:
    """launches, dots (looprl / XLA counts), split_k, tf32, memory and cost, JSON-ready."""
    p = program(compiled)
    ds = dots(p)
    return json.loads(json.dumps({
        "launches": launches(p)["total"], "looprl_dots": sum(d["looprl"] for d in ds),
        "xla_dots": sum(not d["looprl"] for d in ds), "split_k": split_k(p), "tf32": tf32(p),
        "memory": memory(compiled), "cost": cost(compiled)}))
