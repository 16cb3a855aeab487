"""The documents cite only commits the history holds.

A commit is cited in one of two forms:
- its 7-character short hash, bare (`at 1a5e12b`, `(f3905f0, a018fdc)`);
- any length of hash after the word "commit" or "commits" (`commit 1a5e12b4`,
  `commits 37895be, f8fee26 and a92bac6`).

A digest is not a commit: it is cited by 8 or more characters and an ellipsis
(`0c8c233c...73cacb6`, `params_sha256 677f617c...`), and the scan passes it by.
"""
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# 7-40 lower-case hex digits holding a digit and a letter, a word of its own
_HEX = r"(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_])"
# a bare 7-character hash; not the tail of a digest (`...73cacb6`), nor followed by an ellipsis
SHORT = re.compile(r"(?<![0-9A-Za-z_.…])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7}"
                   r"(?![0-9A-Za-z_])(?!\.\.\.|…)")
# "commit H" or "commits H, H and H"
CITED = re.compile(rf"\bcommits?\s+({_HEX}(?:(?:,\s*|,?\s+and\s+){_HEX})*)", re.IGNORECASE)


def _citations(text: str):
    """(line, hash) of each commit the text cites, in either form."""
    found = {}
    for m in SHORT.finditer(text):
        found[m.start()] = m.group()
    for m in CITED.finditer(text):
        for h in re.finditer(_HEX, m.group(1)):
            found[m.start(1) + h.start()] = h.group()
    return [(text.count("\n", 0, at) + 1, h) for at, h in sorted(found.items())]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def _history_reason() -> str | None:
    """Why the history cannot be checked here, or None."""
    try:
        shallow = _git("rev-parse", "--is-shallow-repository")
    except FileNotFoundError:
        return "git is not installed"
    if shallow.returncode != 0:
        return "not a git checkout"
    if shallow.stdout.strip() != "false":
        return "a shallow clone: the history is cut"
    return None


def _docs():
    listed = _git("ls-files", "*.md").stdout.split() if _history_reason() is None else []
    return [REPO / p for p in listed]


@pytest.mark.parametrize("path", _docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_cited_commits_are_in_the_history(path):
    found = [f"{line}: {h}" for line, h in _citations(path.read_text())
             if _git("cat-file", "-e", f"{h}^{{commit}}").returncode != 0]
    assert not found, f"{path.relative_to(REPO)} cites commits not in the history: {found}"


def test_the_history_is_checked():
    reason = _history_reason()
    if reason:
        pytest.skip(f"cited commits are not checked: {reason}")
    assert _docs(), "git lists no Markdown files"


def test_citation_forms_catch_and_spare():
    """The scanner itself: both citation forms are caught; digests, hex words and numbers
    are not."""
    text = ("at 1a5e12b (f3905f0, a018fdc; night)\n"
            "commit 1a5e12b4c and commits 37895be, f8fee26 and a92bac6\n"
            "`0c8c233c...73cacb6`, params_sha256 677f617c... and 677f617…, 0x9e37790, "
            "deadbeef, 2654435, fp32abc\n")
    assert _citations(text) == [(1, "1a5e12b"), (1, "f3905f0"), (1, "a018fdc"),
                                (2, "1a5e12b4c"), (2, "37895be"), (2, "f8fee26"),
                                (2, "a92bac6")]
