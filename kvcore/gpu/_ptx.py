"""What the emulated driver reads from a PTX module: the header (`.version`, `.target`,
`.address_size`) and every `.entry` with its parameters (name, PTX type, byte size), and
which driver release first loads a given PTX ISA version; and the module of one kernel cut
out of a shipped module (`entry_image`), which is what kvcore loads (the driver JIT-compiles
a whole module, and an attention module holds 32 kernel instances).

    mod = ptx.parse(text)
    mod.version          # (9, 0)
    mod.entries["kv_advance"][0].size   # 8 (a .u64 pointer)
    ptx.first_driver((9, 0))            # 13000: a CUDA 13.0 driver or newer loads it
    ptx.entry_image(text, "kv_advance") # the header + kv_advance's block, as PTX text
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# PTX ISA version -> the first CUDA release (cuDriverGetVersion form) whose driver JIT reads
# it; from the release history table of the PTX ISA documentation.
_FIRST_DRIVER = {
    (7, 0): 11000, (7, 1): 11010, (7, 2): 11020, (7, 3): 11030, (7, 4): 11040,
    (7, 5): 11050, (7, 6): 11060, (7, 7): 11070, (7, 8): 11080,
    (8, 0): 12000, (8, 1): 12010, (8, 2): 12020, (8, 3): 12030, (8, 4): 12040,
    (8, 5): 12050, (8, 6): 12070, (8, 7): 12080, (8, 8): 12090,
    (9, 0): 13000, (9, 1): 13010,
}

_SIZES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
          "b32": 4, "u32": 4, "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


class PtxError(ValueError):
    """The text is not a PTX module this parser understands (no header, a malformed entry)."""


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its PTX name, element type (e.g. "u64") and size in bytes."""
    name: str
    type: str
    size: int


@dataclass(frozen=True)
class PtxModule:
    version: tuple[int, int]
    target: str
    address_size: int
    entries: dict[str, tuple[Param, ...]]

    @property
    def version_text(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


def first_driver(version: tuple[int, int]) -> int | None:
    """The first driver version (e.g. 12020 for CUDA 12.2) that loads PTX ISA `version`;
    None for a version the table does not know (newer than it, or older than ISA 7.0)."""
    return _FIRST_DRIVER.get(tuple(version))


def newest_isa(driver_version: int) -> tuple[int, int] | None:
    """The newest PTX ISA a driver of `driver_version` loads (None below CUDA 11.0)."""
    known = [v for v, d in _FIRST_DRIVER.items() if d <= driver_version]
    return max(known) if known else None


_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_VERSION = re.compile(r"^\s*\.version\s+(\d+)\.(\d+)\s*$", re.M)
_TARGET = re.compile(r"^\s*\.target\s+([^\n]+?)\s*$", re.M)
_ADDRESS = re.compile(r"^\s*\.address_size\s+(\d+)\s*$", re.M)
_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$%][\w$]*)\s*\(([^)]*)\)")
_PARAM = re.compile(r"^\.param\s+(.*?)([A-Za-z_$%][\w$]*)\s*(?:\[(\d+)\])?$", re.S)


def _param(text: str, entry: str) -> Param:
    m = _PARAM.match(" ".join(text.split()))
    if m is None:
        raise PtxError(f"invalid parameter of .entry {entry}: {text.strip()!r}")
    qualifiers, name, count = m.group(1).split(), m.group(2), int(m.group(3) or 1)
    types = [q[1:] for q in qualifiers if q.startswith(".") and q[1:] in _SIZES]
    if len(types) != 1:
        raise PtxError(f"invalid parameter of .entry {entry}: {text.strip()!r} names no single type")
    return Param(name, types[0], _SIZES[types[0]] * count)


def parse(text: str | bytes) -> PtxModule:
    """The header and entries of PTX module `text` (bytes are decoded as ASCII; a
    trailing NUL is ignored). Raises PtxError naming what is missing or malformed."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise PtxError("the image is not PTX text (not ASCII)") from None
    body = _COMMENTS.sub("", text)
    version, target, address = _VERSION.search(body), _TARGET.search(body), _ADDRESS.search(body)
    if version is None or target is None:
        raise PtxError("the image is not PTX text: no .version / .target directive")
    entries: dict[str, tuple[Param, ...]] = {}
    for m in _ENTRY.finditer(body):
        name, params = m.group(1), m.group(2).strip()
        entries[name] = tuple(_param(p, name) for p in params.split(",")) if params else ()
    return PtxModule((int(version.group(1)), int(version.group(2))),
                     target.group(1).split(",")[0].strip(),
                     int(address.group(1)) if address else 32, entries)


_GLOBL = b"\t// .globl\t"


def entry_image(text: bytes, kernel: str) -> bytes:
    """The PTX module of kernel `kernel` alone: `text`'s header (everything before its first
    `// .globl` line) and the kernel's block (its `// .globl` line up to the next one, or the
    end), as nvcc writes modules that share no module-scope variable and, when they hold
    several kernels, no `.func` (kvcore's: tests/test_gpu_layer.py checks every shipped module).
    Raises PtxError when the module has no such kernel."""
    text = bytes(text).rstrip(b"\0")
    first = text.find(_GLOBL)
    mark = _GLOBL + kernel.encode() + b"\n"
    start = text.find(mark) if first >= 0 else -1
    if start < 0:
        raise PtxError(f"the module has no kernel {kernel!r} (a `// .globl {kernel}` block)")
    end = text.find(_GLOBL, start + len(mark))
    return text[:first] + text[start:end if end >= 0 else len(text)]
