"""The package's layout rules (ARCHITECTURE.md, docs/DESIGN.md).

- Floors: imports run one way, from the command line down to the file formats and the model
  (`rl` and `verify` share a floor and do not import each other); looprl imports sit at module
  top, outside the documented lazy exceptions (the CLI dispatch, `looprl.load_hf`, the task
  registry).
- Size: no source file of `looprl/` (`.py`, `.cc`, `.h`) over `MAX_LINES` lines, unless
  `LONG_FILES` names it with a reason.
- Present tense: the prose of `looprl/`, `benchmarks/` and `experiments/` (comments, docstrings
  and other string literals) and of `docs/` (its Markdown outside code) holds no dates, no
  "issue N" and no commit hashes; history lives in docs/LOG.md. String constants named in
  `VERSION_CONSTANTS` and Markdown code spans are data and exempt.
"""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "looprl"

# floor of each top-level part of the package; a module may import its own package, any leaf,
# and any package on a lower floor
LEAVES = {"errors", "determinism", "programs", "timing", "config", "tokenizer", "tasks",
          "distributed", "compat", "legacy", "device_reports"}
FLOORS = {"kernels": 1, "model": 2, "io": 3, "reference": 3, "aot": 3, "sampling": 4, "logprobs": 5,
          "rl": 6, "verify": 6, "train": 7, "cli": 8}
# function-level looprl imports that are allowed, by module
LAZY_ALLOWED = {
    "looprl/cli/main.py": "the CLI dispatch: a command's module is imported when it runs",
    "looprl/__init__.py": "the lazy load_hf: `import looprl` sets XLA flags before jax starts",
    "looprl/tasks/__init__.py": "the task registry",
    "looprl/tasks/base.py": "the task registry",
}


def _part(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "looprl" or len(parts) == 1:
        return None
    return parts[1]


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node, a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node, node.module
            if node.module == "looprl":  # `from looprl import determinism`
                for a in node.names:
                    yield node, f"looprl.{a.name}"


def _modules():
    return sorted(p for p in ROOT.rglob("*.py"))


def _floor(part: str | None):
    if part is None or part in LEAVES:
        return 0
    return FLOORS[part]


def _own_part(path: Path) -> str | None:
    rel = path.relative_to(ROOT).parts
    return rel[0].removesuffix(".py") if len(rel) > 1 or rel[0] != "__init__.py" else None


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_imports_run_down_and_sit_at_top(path):
    tree = ast.parse(path.read_text())
    own = _own_part(path)
    rel = str(path.relative_to(ROOT.parent))
    for node, module in _imports(tree):
        part = _part(module)
        if part is None:
            continue
        if node.col_offset > 0 and rel not in LAZY_ALLOWED:
            pytest.fail(f"{rel}:{node.lineno}: function-level import of {module} (imports sit at "
                        f"module top; exceptions: {sorted(LAZY_ALLOWED)})")
        if own is None or own in LEAVES:
            if own in LEAVES and part not in LEAVES and part != own:
                pytest.fail(f"{rel}:{node.lineno}: leaf {own!r} imports {module} (a leaf imports "
                            f"only leaves)")
            continue
        if part == own or part in LEAVES:
            continue
        if _floor(part) >= _floor(own):
            pytest.fail(f"{rel}:{node.lineno}: {own!r} (floor {_floor(own)}) imports {module} "
                        f"(floor {_floor(part)}): imports run from higher floors to lower ones")


def test_every_part_has_a_floor():
    parts = {_own_part(p) for p in _modules()} - {None}
    assert parts <= LEAVES | set(FLOORS), sorted(parts - LEAVES - set(FLOORS))


def test_upward_import_is_caught(tmp_path):
    """The walker itself: an upward import in a model module is reported."""
    tree = ast.parse("from looprl.train.run import train\n")
    (node, module), = list(_imports(tree))
    assert _floor(_part(module)) > _floor("model")


KERNELS = ROOT / "kernels"
# a kernel backend's folder; the rest of kernels/ is the core
KERNEL_WINGS = {"cpu", "pallas"}
# the core module that builds a `Form` from each wing: the one core import of a wing
KERNEL_REGISTRY = "looprl/kernels/forms.py"


def _wing(module: str, names=()) -> set[str]:
    parts = module.split(".")
    if parts[:2] != ["looprl", "kernels"]:
        return set()
    if len(parts) > 2:
        return {parts[2]} & KERNEL_WINGS
    return set(names) & KERNEL_WINGS  # `from looprl.kernels import cpu`


def test_kernel_wings_are_folders():
    assert {p.name for p in KERNELS.iterdir() if (p / "__init__.py").is_file()} == KERNEL_WINGS


def _kernel_id(path: Path) -> str:
    return path.relative_to(ROOT.parent).as_posix()


@pytest.mark.parametrize("path", sorted(KERNELS.rglob("*.py")), ids=_kernel_id)
def test_kernel_wings_import_only_the_core(path):
    """A wing imports the core, never another wing; the core imports a wing only in its
    registry of forms: a kernel backend is one folder and its `Form`."""
    rel = _kernel_id(path)
    inner = path.relative_to(KERNELS).parts
    own = inner[0] if len(inner) > 1 else None
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            wings = set().union(*(_wing(a.name) for a in node.names))
        elif node.module and node.level == 0:
            wings = _wing(node.module, [a.name for a in node.names])
        else:
            continue
        for wing in wings - {own}:
            if own is None and rel == KERNEL_REGISTRY:
                continue
            pytest.fail(f"{rel}:{node.lineno}: imports the kernel wing {wing!r} (a wing imports "
                        f"the core only; the core imports wings only in {KERNEL_REGISTRY})")


MAX_LINES = 450
# files allowed over MAX_LINES: {path relative to the repository: the reason}
LONG_FILES: dict[str, str] = {}


def _sources():
    return sorted(p for p in ROOT.rglob("*") if p.suffix in {".py", ".cc", ".h"})


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


@pytest.mark.parametrize("path", _sources(), ids=_rel)
def test_file_size(path):
    n = path.read_text().count("\n")
    if _rel(path) not in LONG_FILES:
        assert n <= MAX_LINES, (f"{_rel(path)}: {n} lines > {MAX_LINES}; split it along its "
                                f"concepts, or name it in LONG_FILES with a reason")


def test_long_files_list_is_current():
    """Each LONG_FILES entry names a file that exists and needs the exception (one test over
    the list: parametrized over an empty list, pytest would report a skip with no reason)."""
    for rel in sorted(LONG_FILES):
        path = REPO / rel
        assert path.is_file(), f"LONG_FILES names {rel}, which does not exist"
        assert path.read_text().count("\n") > MAX_LINES, f"{rel} fits in {MAX_LINES} lines now"


# String constants that are data, not prose (a version names the day its bits were fixed):
# {name the literal is assigned to: why}
VERSION_CONSTANTS = {
    "KERNEL_VERSION": "the CPU XLA kernels' version, recorded in every schedule",
    "KERNEL_VERSION_ORDERED": "the ordered CPU kernels' version, recorded in every schedule",
    "KERNEL_VERSION_ACCEL": "the accelerator kernels' version, recorded in every schedule",
}

DATE = re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")
ISSUE = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
# 7-40 lower-case hex digits with at least one digit and one letter, not a 0x literal
COMMIT = re.compile(r"(?<![0-9A-Za-z_])(?!0x)(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}"
                    r"(?![0-9A-Za-z_])")
HISTORY = {"a date": DATE, "an issue number": ISSUE, "a commit hash": COMMIT}


def _python_prose(text: str):
    """(line, text) of each comment and string literal of a Python source, except the string
    constants of VERSION_CONSTANTS."""
    exempt = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in VERSION_CONSTANTS for t in targets):
                exempt.add(node.value.lineno)
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    for tok in tokens:
        kind = tok.type
        if kind == tokenize.COMMENT or (kind == tokenize.STRING and tok.start[0] not in exempt):
            yield tok.start[0], tok.string
        elif kind == getattr(tokenize, "FSTRING_MIDDLE", None):
            yield tok.start[0], tok.string


_CC_PROSE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', re.DOTALL)


def _cc_prose(text: str):
    """(line, text) of each comment and string literal of a C++ source."""
    for m in _CC_PROSE.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group()


_MD_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def _md_prose(text: str):
    """(1, text) of a Markdown file with its code blocks and code spans blanked (line
    breaks kept)."""
    yield 1, _MD_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)


def _history(path: Path):
    """'line: what' for each date, issue number or commit hash in the prose of `path`."""
    text = path.read_text()
    prose = {".py": _python_prose, ".md": _md_prose}.get(path.suffix, _cc_prose)(text)
    for line, chunk in prose:
        for what, pattern in HISTORY.items():
            for m in pattern.finditer(chunk):
                yield f"{line + chunk.count(chr(10), 0, m.start())}: {what} ({m.group()!r})"


def _prose_files():
    files = (_sources() + sorted((REPO / "benchmarks").rglob("*.py"))
             + sorted((REPO / "experiments").glob("*.py")))
    docs = [p for p in sorted((REPO / "docs").glob("*.md")) if p.name != "LOG.md"]
    return [p for p in files if p.suffix in {".py", ".cc", ".h"}] + docs


@pytest.mark.parametrize("path", _prose_files(), ids=_rel)
def test_prose_is_in_the_present_tense(path):
    found = list(_history(path))
    assert not found, (f"{_rel(path)}: history in the prose (move it to docs/LOG.md): "
                       + "; ".join(found))


def test_history_patterns_catch_and_spare(tmp_path):
    """The scanner itself: dates, issue numbers and hashes in comments, docstrings and
    messages are caught; version constants, 0x literals, numbers and words are not."""
    src = tmp_path / "m.py"
    src.write_text('"""Sampled since 2026-12-01 (issue 18)."""\n'
                   'KERNEL_VERSION = "2026-12-03-ordered"\n'
                   'OTHER = "2026-12-03"\n'
                   'x = 0x9E3779B9  # see e5197e1, issue #7\n'
                   'y = f"{x} before 2026-12-04"  # decade, 2654435761, sha 1e3, 0x5bd1e995\n')
    found = [f.split(": ", 1)[1] for f in _history(src)]
    assert found == ["a date ('2026-12-01')", "an issue number ('issue 18')",
                     "a date ('2026-12-03')", "an issue number ('issue #7')",
                     "a commit hash ('e5197e1')", "a date ('2026-12-04')"]
    cc = tmp_path / "k.cc"
    cc.write_text('// blocked (2026-12-04)\nint a = 0x1f2e3d4c; /* c0ffee1 */\n')
    assert [f.split(": ", 1)[1] for f in _history(cc)] == [
        "a date ('2026-12-04')", "a commit hash ('c0ffee1')"]
    md = tmp_path / "d.md"
    md.write_text('Fixed at c0ffee1\n(issue 9), version `2026-12-03-ordered`\n'
                  '```\n2026-12-05 d00dfee\n```\non 2026-12-06.\n')
    assert list(_history(md)) == ["6: a date ('2026-12-06')", "2: an issue number ('issue 9')",
                                  "1: a commit hash ('c0ffee1')"]
