"""The package's floors (ARCHITECTURE.md): imports run one way, from the command line down to
the file formats and the model, and looprl imports sit at module top.

Walks every module of `looprl/` with `ast`; fails on an import of a package on a higher floor
(or the same floor's other package: `rl` and `verify` are independent), and on any
function-level `looprl` import outside the documented exceptions (the CLI dispatch, the lazy
`looprl.load_hf`, the task registry).
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "looprl"

# floor of each top-level part of the package; a module may import its own package, any leaf,
# and any package on a lower floor
LEAVES = {"errors", "determinism", "programs", "timing", "config", "tokenizer", "tasks",
          "distributed"}
FLOORS = {"kernels": 1, "model": 2, "io": 3, "reference": 3, "sampling": 4, "logprobs": 5,
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


MAX_LINES = 450
ONE_CONCEPT_NOTE = "one concept"  # a longer file says so in its first docstring


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_file_size(path):
    text = path.read_text()
    n = text.count("\n")
    if n > MAX_LINES:
        doc = ast.get_docstring(ast.parse(text)) or ""
        assert ONE_CONCEPT_NOTE in doc.lower(), (f"{path.name}: {n} lines > {MAX_LINES} and its "
                                                 f"docstring does not say it holds one concept")
