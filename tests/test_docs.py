"""The documents cite only commits the history holds, in sentences of median length at most
`MEDIAN_WORDS`.

A commit is cited in one of two forms:
- its 7-character short hash, bare (`at 1a5e12b`, `(f3905f0, a018fdc)`);
- any length of hash after the word "commit" or "commits" (`commit 1a5e12b4`,
  `commits 37895be, f8fee26 and a92bac6`).

A digest is not a commit: it is cited by 8 or more characters and an ellipsis
(`0c8c233c...73cacb6`, `params_sha256 677f617c...`), and the scan passes it by.
"""
import re
import statistics
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
    """One parameter per tracked Markdown file; one skipped parameter, with the reason, where
    the history cannot be checked."""
    reason = _history_reason()
    if reason:
        skip = pytest.mark.skip(reason=f"cited commits are not checked: {reason}")
        return [pytest.param(None, marks=skip, id="history")]
    return [pytest.param(REPO / p, id=p) for p in _git("ls-files", "*.md").stdout.split()]


@pytest.mark.parametrize("path", _docs())
def test_cited_commits_are_in_the_history(path):
    found = [f"{line}: {h}" for line, h in _citations(path.read_text())
             if _git("cat-file", "-e", f"{h}^{{commit}}").returncode != 0]
    assert not found, f"{path.relative_to(REPO)} cites commits not in the history: {found}"


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


# the documents a reader starts from, and the longest median sentence they may have (words)
SHORT_DOCS = ("README.md", "ARCHITECTURE.md", "docs/GUIDE.md", "docs/DESIGN.md",
              "reproducibility/README.md", "experiments/README.md")
MEDIAN_WORDS = 15


def sentence_lengths(text: str) -> list[int]:
    """Words per sentence of a Markdown text's prose: code blocks, tables and headings are
    left out, a list item ends a sentence, a code span counts as one word."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    paragraphs, lines = [], []
    for line in text.splitlines() + [""]:
        s = line.strip()
        item = re.match(r"([-*]|\d+\.)\s+", s)
        if not s or s.startswith(("#", "|", "<!--")) or line.startswith("    ") or item:
            if lines:
                paragraphs.append(" ".join(lines))
            lines = [s[item.end():]] if item else []
        else:
            lines.append(s)
    lengths = []
    for p in paragraphs:
        p = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", re.sub(r"`[^`]*`", "CODE", p))
        lengths += [len(s.split()) for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(`\"'])", p)
                    if s.split()]
    return lengths


@pytest.mark.parametrize("rel", SHORT_DOCS)
def test_sentences_are_short(rel):
    lengths = sentence_lengths((REPO / rel).read_text())
    median = statistics.median(lengths)
    assert median <= MEDIAN_WORDS, (f"{rel}: median sentence {median} words (at most "
                                    f"{MEDIAN_WORDS}); split the longest")


def test_sentence_lengths_count_prose_only():
    text = ("# A heading of many words here\n\nOne two three. Four `a b c` five.\n"
            "| a | table row |\n\n```\ncode block words\n```\n    indented code\n"
            "- an item of five words\n- two [link text](x y)\n")
    assert sentence_lengths(text) == [3, 3, 5, 3]
