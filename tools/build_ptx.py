#!/usr/bin/env python3
"""Compiles cuda/*.cu to the checked-in cuda/*.ptx, or checks that they match.

    python3 tools/build_ptx.py            # rebuild cuda/*.ptx in place
    python3 tools/build_ptx.py --check    # rebuild into a temp dir, fail on any difference,
                                          # then ptxas -arch=sm_80 and sm_90 -v each PTX, fail on spills
    python3 tools/build_ptx.py --check --no-cache   # the same, ignoring earlier passes
    python3 tools/build_ptx.py --check --no-ptxas   # the PTX only, against nvcc and the
                                          # build's record of it (the test suite's check)

A passed check of one source is remembered (like ccache) under
$XDG_CACHE_HOME/kvcore/ptx-check (default ~/.cache), keyed by a hash of every cuda/*.cu
and *.cuh, that shipped PTX, the flags and the nvcc/ptxas releases: an unchanged tree is
checked again in seconds; any change to those inputs runs the full check.

Flags: nvcc -ptx -arch=compute_80 -O3 with IEEE division and square root and no
flush-to-zero (the encoders must equal the CPU's bit for bit); never --use_fast_math.
The PTX text depends on the nvcc release: the checked-in files come from the release that
--check prints, and --check needs that release.

PTX ISA: nvcc writes the newest ISA it knows (`.version 9.0` for CUDA 13), which only a
CUDA 13 driver loads. The kernels need no more than ISA 7.0 (.target sm_80, cp.async), so
the `.version` line is rewritten to PTX_ISA, which every driver from CUDA 11.0 on loads
(R535 = CUDA 12.2 reads up to 8.2); ptxas then assembles each shipped file for sm_80 and
sm_90, which proves that no instruction needs a newer ISA.

Resources: cuda/resources.json records, for every kernel, the registers and static shared
memory ptxas assigns it on sm_90 (from the same -v report); the emulated driver answers
cuFuncGetAttribute and the occupancy query from it, so the emulator picks the split counts
a device picks. A build rewrites it; --check fails when it differs from ptxas' report.
It also records each PTX's sha256 and whether any of its kernels spills on sm_80 or sm_90:
--check --no-ptxas (the test suite's form: nvcc alone, 2 of the full check's 7 CPU minutes
on a 2-core machine) fails when the shipped PTX is not the one recorded, or spills; the
full check runs ptxas again and so also proves the record itself.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_DIR = os.path.join(ROOT, "cuda")
NVCC_FLAGS = ["-ptx", "-arch=compute_80", "-O3", "-std=c++17",
              "-prec-div=true", "-prec-sqrt=true", "-ftz=false"]
PTX_ISA = "7.0"           # the .version every shipped module declares (see above)
VERSION_LINE = re.compile(rb"^\.version \d+\.\d+$", re.M)
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
RESOURCES = os.path.join(CUDA_DIR, "resources.json")
NO_PTXAS = False          # --no-ptxas (with --check)
ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_90'(.*?)(?=Compiling entry|\Z)", re.S)


def sources() -> list[str]:
    return sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu")))


def nvcc_version() -> str:
    out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def compile_ptx(src: str, out_dir: str) -> str:
    """nvcc src -> out_dir/<name>.ptx, run inside cuda/ so that no absolute path ends up
    in the PTX; returns the output path."""
    name = os.path.splitext(os.path.basename(src))[0] + ".ptx"
    out = os.path.join(out_dir, name)
    cmd = ["nvcc", *NVCC_FLAGS, os.path.basename(src), "-o", out]
    res = subprocess.run(cmd, cwd=CUDA_DIR, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"nvcc failed on {os.path.basename(src)}:\n{res.stderr}")
    with open(out, "rb") as f:
        text = f.read()
    text, n = VERSION_LINE.subn(b".version " + PTX_ISA.encode(), text, count=1)
    if n != 1:
        sys.exit(f"nvcc wrote no .version line into {name}")
    with open(out, "wb") as f:
        f.write(text)
    return out


def ptxas_report(ptx: str) -> tuple[str, bool]:
    """ptxas -v for sm_80 and sm_90 (both must assemble the file at its .version):
    (the sm_90 report, whether any kernel spills on either)."""
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("sm_80", "sm_90"):
            res = subprocess.run(["ptxas", f"-arch={arch}", "-v", ptx, "-o", os.path.join(tmp, "a.cubin")],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                sys.exit(f"ptxas -arch={arch} failed on {os.path.basename(ptx)}:\n{res.stderr}")
            reports.append(res.stderr)
    spills = any(int(a) or int(b) for r in reports for a, b in SPILL.findall(r))
    return reports[-1], spills


def resources(report: str) -> dict[str, list[int]]:
    """{kernel: [registers, static shared bytes]} from an sm_90 ptxas -v report."""
    out = {}
    for name, body in ENTRY.findall(report):
        regs = re.search(r"Used (\d+) registers", body)
        smem = re.search(r"(\d+) bytes smem", body)
        out[name] = [int(regs.group(1)) if regs else 0, int(smem.group(1)) if smem else 0]
    return dict(sorted(out.items()))


def _recorded(key: str = "modules") -> dict:
    """cuda/resources.json's `modules` (or another of its tables; {} when absent)."""
    if not os.path.exists(RESOURCES):
        return {}
    with open(RESOURCES) as f:
        return json.load(f).get(key, {})


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_resources() -> None:
    """cuda/resources.json from ptxas -v (sm_90) of every shipped PTX, with each PTX's
    sha256 and whether any of its kernels spills on sm_80 or sm_90 (what --no-ptxas
    checks in ptxas' stead)."""
    names = [os.path.splitext(os.path.basename(s))[0] for s in _largest_first(sources())]
    reports = _parallel(lambda n: ptxas_report(os.path.join(CUDA_DIR, n + ".ptx")), names)
    modules = {n: resources(r) for n, (r, _) in sorted(zip(names, reports))}
    ptx = {n: {"sha256": _sha256(os.path.join(CUDA_DIR, n + ".ptx")), "spills": spills}
           for n, (_, spills) in sorted(zip(names, reports))}
    text = json.dumps({"arch": "sm_90", "ptxas": _tool_versions().strip().splitlines()[-1],
                       "kernel": "[registers, static shared bytes]", "modules": modules,
                       "ptx": ptx}, indent=1)
    with open(RESOURCES, "w") as f:   # one line per kernel, one per PTX
        text = re.sub(r"\[\s+(\d+),\s+(\d+)\s+\]", r"[\1, \2]", text)
        f.write(re.sub(r'\{\s+("sha256": "\w+"),\s+("spills": \w+)\s+\}', r"{\1, \2}", text) + "\n")
    print(f"wrote {os.path.relpath(RESOURCES, ROOT)}")


def _largest_first(paths: list[str]) -> list[str]:
    """Sources with the most kernels take longest; starting them first keeps every core
    busy to the end (the attention modules include attention.cuh)."""
    return sorted(paths, key=lambda p: ("attention" not in p, p))


JOBS = os.cpu_count() or 1   # --jobs


def _parallel(fn, items):
    """fn over items on JOBS threads (nvcc and ptxas run as child processes)."""
    with ThreadPoolExecutor(max_workers=JOBS) as pool:
        return list(pool.map(fn, items))


def build() -> None:
    for out in _parallel(lambda src: compile_ptx(src, CUDA_DIR), _largest_first(sources())):
        print(f"built {os.path.relpath(out, ROOT)}")
    write_resources()


def _check_one(src: str, tmp: str) -> tuple[str, list[str]]:
    """Rebuilds one source into tmp and compares it with the shipped PTX, then runs ptxas
    on it: (the line to print, failures)."""
    fresh = compile_ptx(src, tmp)
    name = os.path.basename(fresh)
    shipped = os.path.join(CUDA_DIR, name)
    if not os.path.exists(shipped):
        return "", [f"cuda/{name} is missing: run python3 tools/build_ptx.py"]
    with open(fresh, "rb") as a, open(shipped, "rb") as b:
        if a.read() != b.read():
            return "", [f"cuda/{name} differs from what {os.path.basename(src)} compiles to: "
                        f"run python3 tools/build_ptx.py"]
    module = os.path.splitext(name)[0]
    record = _recorded("ptx").get(module, {})
    stale = [] if record.get("sha256") == _sha256(shipped) else [
        f"cuda/resources.json does not record cuda/{name} (its sha256): run python3 tools/build_ptx.py"]
    if NO_PTXAS:
        spilled = [f"cuda/{name} spills registers (cuda/resources.json)"] if record.get("spills") else []
        return f"cuda/{name}: up to date; resources as recorded", stale + spilled
    report, spills = ptxas_report(shipped)
    kernels = re.findall(r"entry function '(\w+)'", report)
    regs = re.findall(r"Used (\d+) registers", report)
    line = (f"cuda/{name}: up to date; ptxas sm_90 registers: "
            + ", ".join(f"{k} {r}" for k, r in zip(kernels, regs)))
    failed = stale + ([f"cuda/{name} spills registers on sm_80 or sm_90:\n{report}"] if spills else [])
    if _recorded().get(module) != resources(report):
        failed.append(f"cuda/resources.json does not hold ptxas' registers and shared memory "
                      f"of cuda/{name}: run python3 tools/build_ptx.py")
    return line, failed


def _tool_versions() -> str:
    return "".join(subprocess.run([t, "--version"], capture_output=True, text=True,
                                  check=True).stdout for t in ("nvcc", "ptxas"))


def _pass_record(src: str, versions: str) -> str:
    """The file that records a passed check of src: named by a hash of every input."""
    h = hashlib.sha256(versions.encode() + repr((NVCC_FLAGS, PTX_ISA, NO_PTXAS)).encode())
    for path in sorted(glob.glob(os.path.join(CUDA_DIR, "*.cu*"))) + [RESOURCES,
            src, os.path.join(CUDA_DIR, os.path.splitext(os.path.basename(src))[0] + ".ptx")]:
        h.update(os.path.basename(path).encode())
        if os.path.exists(path):
            with open(path, "rb") as f:
                h.update(f.read())
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvcore", "ptx-check", h.hexdigest())


def _check_cached(src: str, tmp: str, versions: str | None) -> tuple[str, list[str]]:
    """_check_one, skipped when a pass with the same inputs is recorded (versions None:
    no records read or written)."""
    record = _pass_record(src, versions) if versions is not None else None
    if record is not None and os.path.exists(record):
        with open(record) as f:
            return f.read(), []
    line, failed = _check_one(src, tmp)
    if record is not None and not failed:
        os.makedirs(os.path.dirname(record), exist_ok=True)
        with open(record + ".tmp", "w") as f:
            f.write(line)
        os.replace(record + ".tmp", record)
    return line, failed


def check(use_cache: bool = True) -> int:
    failures = []
    versions = _tool_versions() if use_cache else None
    with tempfile.TemporaryDirectory() as tmp:
        for line, failed in _parallel(lambda src: _check_cached(src, tmp, versions),
                                      _largest_first(sources())):
            if line:
                print(line)
            failures += failed
    stale = sorted(set(glob.glob(os.path.join(CUDA_DIR, "*.ptx")))
                   - {os.path.splitext(s)[0] + ".ptx" for s in sources()})
    failures += [f"{os.path.relpath(p, ROOT)} has no source .cu" for p in stale]
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    if failures:
        print(f"(nvcc here: {nvcc_version()})", file=sys.stderr)
    return 1 if failures else 0


def main() -> int:
    global JOBS, NO_PTXAS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="fail if a checked-in PTX is stale, does not assemble for sm_80 and "
                         "sm_90, or a kernel spills")
    ap.add_argument("--no-cache", action="store_true",
                    help="with --check: ignore and do not record earlier passes")
    ap.add_argument("--jobs", type=int, default=JOBS,
                    help=f"sources compiled at once (default: the cores, {JOBS})")
    ap.add_argument("--no-ptxas", action="store_true",
                    help="with --check: no ptxas; the shipped PTX must be the one whose "
                         "ptxas report cuda/resources.json records (its sha256), without spills")
    args = ap.parse_args()
    NO_PTXAS = args.no_ptxas
    if args.jobs < 1:
        ap.error(f"--jobs takes 1 or more, got {args.jobs}")
    JOBS = args.jobs
    for tool in ("nvcc", "ptxas"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found on PATH")
    if args.check:
        return check(use_cache=not args.no_cache)
    build()
    return 0


if __name__ == "__main__":
    sys.exit(main())
