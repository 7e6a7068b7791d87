"""The README's quick start runs as printed: every `print(...)  # expected` line prints
its comment."""
import contextlib
import io
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quick_start(section: str = "Quick start") -> str:
    """The first python block of a section, after its prose."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    return re.search(rf"## {section}\n\n[^#]*?```python\n(.*?)```", text, re.S).group(1)


def test_quick_start_prints_what_its_comments_say(tmp_path, monkeypatch):
    _runs_as_printed(_quick_start(), tmp_path, monkeypatch)


def test_pool_example_prints_what_its_comments_say(tmp_path, monkeypatch):
    _runs_as_printed(_quick_start("Many sequences: KVPool"), tmp_path, monkeypatch)


def test_prefix_example_prints_what_its_comments_say(tmp_path, monkeypatch):
    _runs_as_printed(_quick_start("Prefix cache"), tmp_path, monkeypatch)


def test_store_example_prints_what_its_comments_say(tmp_path, monkeypatch):
    _runs_as_printed(_quick_start(r"Storing and sharing prefixes \(disk, Redis/Valkey\)"),
                     tmp_path, monkeypatch)


def test_interop_example_prints_what_its_comments_say(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    _runs_as_printed(_quick_start("Arrays from any library"), tmp_path, monkeypatch)


def _runs_as_printed(code: str, tmp_path, monkeypatch) -> None:
    expected = [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s*#(.*)$", code, re.M)]
    assert len(expected) >= 6
    monkeypatch.chdir(tmp_path)  # the example writes a snapshot file
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md quick start", "exec"), {})
    assert out.getvalue().splitlines() == expected
