"""The README documents only what exists."""
from pathlib import Path

from looprl.cli.main import build_parser


def test_readme_documents_only_flags_that_exist():
    """A removed flag (`verify --overwrite`) stays out of the README; the flags it names exist."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    verify = build_parser()._subparsers._group_actions[0].choices["verify"]
    flags = {s for a in verify._actions for s in a.option_strings}
    assert "--overwrite" not in readme and "--overwrite" not in flags
    assert "-v" in flags and "--list-keys" in readme
