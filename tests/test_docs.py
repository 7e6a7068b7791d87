"""Every python block of README.md and docs/*.md runs as printed: each `print(...)  # text`
line prints its comment, in order, and nothing else is printed.

A block that imports torch or transformers needs them (skipped, saying so, without them);
one that makes a RedisBackend runs against the suite's own servers (the block's
redis://127.0.0.1:6379 is a server, redis://127.0.0.1:7000 a cluster node); one that uses
kvcore.gpu is a gpu test (a device, or the emulator)."""
import contextlib
import glob
import io
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_URL, CLUSTER_URL = "redis://127.0.0.1:6379", "redis://127.0.0.1:7000"


def _blocks() -> list[tuple[str, str, str]]:
    """(file, the section's heading, code) of every ```python block."""
    found = []
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path) as f:
            text = f.read()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            heads = re.findall(r"^#+ (.*)$", text[:m.start()], re.M)
            found.append((os.path.relpath(path, ROOT), heads[-1] if heads else "", m.group(1)))
    return found


BLOCKS = _blocks()


def _marks(code: str) -> list:
    return [pytest.mark.gpu] if re.search(r"\bkvcore\.gpu\b|from kvcore import gpu", code) else []


@pytest.mark.parametrize("path, heading, code", [
    pytest.param(p, h, c, id=f"{p}: {h}", marks=_marks(c)) for p, h, c in BLOCKS])
def test_block_prints_what_its_comments_say(path, heading, code, tmp_path, monkeypatch, request):
    for lib in ("torch", "transformers"):
        if re.search(rf"^\s*(import|from) {lib}\b", code, re.M):
            pytest.importorskip(lib)
    if "RedisBackend(" in code:
        code = code.replace(SERVER_URL, request.getfixturevalue("redis_server").url)
        code = code.replace(CLUSTER_URL, request.getfixturevalue("redis_cluster").url)
    expected = [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s*#(.*)$", code, re.M)]
    assert expected, f"{path}, {heading}: a block that prints nothing checks nothing"
    monkeypatch.chdir(tmp_path)   # blocks write files (snapshots, a store directory)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{path} ({heading})", "exec"), {"__name__": "__docs__"})
    assert out.getvalue().splitlines() == expected


def test_every_block_is_found():
    """The README's blocks and the docs' are all collected (a changed fence would drop one)."""
    files = {p for p, _, _ in BLOCKS}
    assert "README.md" in files and len([b for b in BLOCKS if b[0] == "README.md"]) >= 5
    for path in [os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "*.md")):
        with open(path) as f:
            text = f.read()
        assert text.count("```python") == sum(p == os.path.relpath(path, ROOT) for p, _, _ in BLOCKS)
