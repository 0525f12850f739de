"""GPU-only tests never run in CI (it has no GPU), so a rename can leave one calling a name that no
longer exists, as a GPU test once called `bench_specs` on attention modules whose cases had moved
to attention_bench.py (benchmarks/LOG.md, entry 77f53e4). This reads every test file, without
running it, and checks that each attribute it reads from one of kipp's modules (by its import
alias, or by a loop variable over a tuple of them) exists there."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None  # a name imported from a module, not a module


def _aliases(tree: ast.Module) -> dict[str, object]:
    """Names bound to kipp modules by the file's imports."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("kipp", "oracle")):
            for a in node.names:
                mod = _module(f"{node.module}.{a.name}")
                if mod is not None:
                    out[a.asname or a.name] = mod
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(("kipp", "oracle")) and a.asname:
                    out[a.asname] = _module(a.name)
    return {k: v for k, v in out.items() if v is not None}


def _reads(tree: ast.Module, aliases: dict) -> list[tuple[int, object, str]]:
    """(line, module, attribute) of each `alias.attr`, and of `var.attr` inside `for var in
    (alias, ...)`."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in aliases:
                reads.append((node.lineno, aliases[node.value.id], node.attr))
        if (
            isinstance(node, ast.For)
            and isinstance(node.target, ast.Name)
            and isinstance(node.iter, (ast.Tuple, ast.List))
            and node.iter.elts
            and all(isinstance(e, ast.Name) and e.id in aliases for e in node.iter.elts)
        ):
            mods = [aliases[e.id] for e in node.iter.elts]
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == node.target.id
                ):
                    reads += [(sub.lineno, m, sub.attr) for m in mods]
    return reads


FILES = sorted(p for p in TESTS.rglob("test_*.py") if p.name != Path(__file__).name)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(TESTS)))
def test_kipp_attributes_a_test_reads_exist(path):
    tree = ast.parse(path.read_text())
    missing = [
        f"{path.name}:{line} {mod.__name__}.{attr}"
        for line, mod, attr in _reads(tree, _aliases(tree))
        if not hasattr(mod, attr)
    ]
    assert not missing, missing


def test_the_check_catches_a_loop_over_modules():
    """The stale test's own shape: a loop variable over module aliases, one of which lacks the
    attribute (kv_write has bench_specs, decode_attention not)."""
    src = (
        "from kipp_cuda.kernels import decode_attention as dec\n"
        "from kipp_cuda.kernels import kv_write as kvw\n"
        "def test_x():\n"
        "    for mod in (kvw, dec):\n"
        "        mod.bench_specs()\n"
        "    dec.paged_decode_attention\n"
    )
    tree = ast.parse(src)
    reads = _reads(tree, _aliases(tree))
    named = sorted((line, m.__name__.rsplit(".")[-1], a) for line, m, a in reads)
    assert named == [
        (5, "decode_attention", "bench_specs"),
        (5, "kv_write", "bench_specs"),
        (6, "decode_attention", "paged_decode_attention"),
    ]
    missing = sorted(f"{m.__name__}.{a}" for _, m, a in reads if not hasattr(m, a))
    assert missing == ["kipp_cuda.kernels.decode_attention.bench_specs"]
