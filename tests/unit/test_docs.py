"""The docs are references, not a journal, and their links resolve.

Every page under docs/ (decision records included) and README.md:
- names no issue number ("issue 18"), no pass of work ("tenth pass") and no stop ("stop 31"): a page
  says what the thing does and what was measured with which command; git log keeps the history;
- every relative link points at a file or directory that exists in the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
            "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
            "eighteenth", "nineteenth", "twentieth")
JOURNAL = (
    ("an issue number", re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE)),
    ("a pass", re.compile(r"\b(?:" + "|".join(ORDINALS) + r"|\d+(?:st|nd|rd|th))\s+pass\b", re.IGNORECASE)),
    ("a stop", re.compile(r"\bstop\s+\d+\b", re.IGNORECASE)),
)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)  # http:, https:, mailto:, //host


def _pages() -> list[Path]:
    return sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


def journal_mentions(text: str) -> list[str]:
    """Each issue number, pass or stop the text names, as `line N: what: 'match'`."""
    found: list[str] = []
    for n, line in enumerate(text.splitlines(), start=1):
        for what, pattern in JOURNAL:
            found.extend(f"line {n}: {what}: {m.group(0)!r}" for m in pattern.finditer(line))
    return found


def relative_links(text: str) -> list[str]:
    """The targets of the text's relative links (markdown inline and reference links, outside code),
    without their #fragment; links to a fragment of the page itself are left out."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    targets = [m.group(1) for m in INLINE_LINK.finditer(prose)]
    targets += [m.group(1) for m in REFERENCE_LINK.finditer(prose)]
    out: list[str] = []
    for t in targets:
        path = t.split("#", 1)[0].split("?", 1)[0]
        if path and not EXTERNAL.match(path):
            out.append(path)
    return out


def test_the_checks_find_what_they_are_for() -> None:
    # the checks themselves: a journal heading, links inside and outside code
    text = ("## Issue 18, eleventh pass: a rule (2026-11-27, stop 31)\n"
            "See [the records](decisions/README.md#index), [a site](https://example.com/x.md),\n"
            "[this page](#reading-the-output) and a reference link:\n"
            "[ref]: ../README.md\n"
            "```\n[not a link](missing.md)\n```\n"
            "`[nor this](missing.md)`; the 3rd pass, issues #12; a pass over the data; stop the replica.\n")
    assert journal_mentions(text) == [
        "line 1: an issue number: 'Issue 18'", "line 1: a pass: 'eleventh pass'", "line 1: a stop: 'stop 31'",
        "line 8: an issue number: 'issues #12'", "line 8: a pass: '3rd pass'",
    ]
    assert relative_links(text) == ["decisions/README.md", "../README.md"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_names_no_issue_pass_or_stop(page: Path) -> None:
    found = journal_mentions(page.read_text(encoding="utf-8"))
    assert not found, (f"{page.relative_to(ROOT)} reads like a journal (say what the thing does and the "
                       "command that measures it; git log keeps the history): " + "; ".join(found))


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(page: Path) -> None:
    broken = [t for t in relative_links(page.read_text(encoding="utf-8")) if not (page.parent / t).exists()]
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {', '.join(broken)}"
