"""The docs and the code's comments describe the product, not the work that made it: no file
narrates who ran what when (work sessions, numbered device calls, lettered machines, numbered
rounds, "I"); history lives in git and benchmarks/LOG.md. "session" may appear only where it means
an HTTP or chat session. And docs/backends.md lists exactly the KIPP_* variables the code reads."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = (
    "fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|"
    "sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
HISTORY = re.compile(
    r"(?i:session|\bcalls? [0-9]|\brounds? (?:of work|[0-9])|\bhelper-[0-9]"
    rf"|\b(?:{ROUNDS})\b|\bwe (?:tried|ran|found|measured|predicted)\b)"
    r"|\bmachines? [A-D]\b"
    # "I" the pronoun, not I the dimension ("2 I rows", "[T, I]", "I = 37")
    r"|(?<![0-9*+/=,(\[] )\bI(?: [a-z]|'[a-z])"
)
SESSION_MEANINGS = re.compile(r"(?i)client ?session|chat ?session|http session|aiohttp")
PROSE = [
    "README.md",
    "BENCHMARKS.md",
    "CHANGELOG.md",
    "CONTRIBUTING.md",
    "docs/**/*.md",
    "benchmarks/*.md",
    "benchmarks/*/README.md",
    "tools/**/*.md",
]
CODE = ["kipp_core", "kipp_cuda", "kipp_mlx", "oracle", "tools", "tests"]
# Files in folders edited by other changes, whose words are reworded when those changes merge.
# (tests/conftest.py, tests/core/conftest.py, tests/server/test_load.py: pytest's session scope.)
KNOWN: set[str] = set()  # files allowed to keep a history word while it is being reworded


def comment_lines(src: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring-position string of a Python source."""
    out, prev = [], None
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING and prev in (
            None,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.NEWLINE,
            tokenize.NL,
        ):
            out += [(tok.start[0] + i, s) for i, s in enumerate(tok.string.splitlines())]
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    return out


def history_words(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    hits = []
    for n, line in lines:
        for m in HISTORY.finditer(line):
            word = m.group(0)
            if word.lower() == "session" and SESSION_MEANINGS.search(line):
                continue
            hits.append((n, word))
    return hits


def _texts() -> dict[str, list[tuple[int, str]]]:
    files: dict[str, list[tuple[int, str]]] = {}
    for pattern in PROSE:
        for p in ROOT.glob(pattern):
            files[str(p.relative_to(ROOT))] = list(enumerate(p.read_text().splitlines(), 1))
    for folder in CODE:
        for p in (ROOT / folder).rglob("*.py"):
            if p != Path(__file__).resolve():  # this file names the words it looks for
                files[str(p.relative_to(ROOT))] = comment_lines(p.read_text())
    for p in [*(ROOT / "tools").rglob("*.sh"), ROOT / ".ci" / "run"]:
        lines = enumerate(p.read_text().splitlines(), 1)
        files[str(p.relative_to(ROOT))] = [(n, s) for n, s in lines if s.lstrip().startswith("#")]
    return files


def test_no_file_narrates_the_work():
    found = {path: history_words(lines) for path, lines in _texts().items()}
    bad = [
        f"{path}:{n} {w!r}" for path, hits in found.items() if path not in KNOWN for n, w in hits
    ]
    assert not bad, bad
    cleaned = sorted(path for path in KNOWN if path in found and not found[path])
    assert not cleaned, f"no history words left in {cleaned}: drop them from KNOWN"


def test_the_check_catches_each_kind_of_history_word():
    lines = [
        (1, "# 1.864 -> 1.841 ms (nineteenth session, machine B)"),
        (2, "call 3 ran the sweep; I predicted -0.02 ms"),
        (3, "helper-10's fused norm, the twentieth's defaults"),
        (4, "x [T, 2 * I]; N = 2 I rows; I = 37; at any I)"),
        (5, "async with aiohttp.ClientSession() as session: one HTTP session a client"),
        (6, "kipp chat keeps a ChatSession; tests/conftest.py builds it once per test run"),
    ]
    assert history_words(lines) == [
        (1, "nineteenth"),
        (1, "session"),
        (1, "machine B"),
        (2, "call 3"),
        (2, "I p"),
        (3, "helper-1"),
        (3, "twentieth"),
    ]


def test_backends_doc_lists_every_kipp_variable():
    names = re.compile(r"\bKIPP_[A-Z][A-Z0-9_]*[A-Z0-9]\b")
    in_code = {
        m
        for folder in ("kipp_core", "kipp_cuda", "kipp_mlx", "oracle")
        for p in (ROOT / folder).rglob("*.py")
        for m in names.findall(p.read_text())
    }
    doc = (ROOT / "docs" / "backends.md").read_text()
    in_table = {
        m
        for line in doc.splitlines()
        if line.startswith("| `KIPP_")
        for m in names.findall(line[:60])
    }
    assert in_code, "no KIPP_ variable found in the code: the pattern is wrong"
    assert in_table == in_code, (sorted(in_code - in_table), sorted(in_table - in_code))


LINKED = [
    "README.md",
    "BENCHMARKS.md",
    "CONTRIBUTING.md",
    "benchmarks/README.md",
    "benchmarks/LOG.md",
    "tools/README.md",
    *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))),
]


@pytest.mark.parametrize("path", LINKED)
def test_links_to_records_resolve(path):
    """Every relative link of a page and every benchmarks/ record folder it names exists."""
    text = (ROOT / path).read_text()
    base = (ROOT / path).parent
    links = re.findall(r"\]\(([^)#]+)\)", text)
    missing = [ln for ln in links if "://" not in ln and not (base / ln).exists()]
    named = re.findall(r"\bbenchmarks/[0-9]{4}-[0-9]{2}-[0-9]{2}-[0-9a-f]{7}-[a-z0-9-]+", text)
    missing += [n for n in named if not (ROOT / n).is_dir()]
    assert not missing, missing
    assert path != "README.md" or len(links) > 5  # the pattern finds links at all
