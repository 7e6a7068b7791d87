#!/usr/bin/env python3
"""Everything a device must prove, in one command that ends inside its budget (called by
tools/gpu_check.sh; docs/gpu.md "On a GPU machine"):

    python3 tools/gpu_check.py [--budget 480] [--emulate] [--out DIR] [--only STAGE,...]
        [--sanitize-formats q8_0|all|F,...] [-- PYTEST_ARGS...]

Stages, in order of value, each a child process (its own process group) under a limit
derived from the time left (its share of the budget, less what the later stages keep):

    facts      nvidia-smi and versions                                   00_facts.log
    build      setup.py build_ext --inplace -j                           01_build.log
    jit        every shipped PTX module loaded in parallel processes (warms the driver's
               JIT cache); per kernel registers, static shared memory and resident blocks
               per SM at 128 threads, as the driver reports them; on a device it runs
               while the build does (it needs only cuda-python)        01_jit.log
    pytest     pytest -m gpu --gpu=device over the gpu test files, --test-timeout per test
                                                                         02_pytest.log
    kernels    tools/gpu_kernels_check.py: every format's append and decode (cache and
               paged pool, 1 and 4 splits), RoPE, a graph replay against the CPU
                                                                         03_kernels.log
    memcheck, racecheck, synccheck: compute-sanitizer over gpu_kernels_check.py --small
               --formats q8_0 (--sanitize-formats)                       04_sanitizer.log
    bench      tools/bench_gpu.py append paged at batch 32/1/128 x 16k/4k (the goals' shapes
               first; each paged row is printed as measured), then tiers 05_bench.log
    ncu        Nsight Compute over the paged decode at batch 32 x 16k (f16, q8_0) and
               torch SDPA's kernel: speed of light, occupancy, warp stalls, memory
                                                                         05_bench.log

A stage that cannot start in the time left (or needs what is missing, or is left out by
--only) is SKIPPED with the reason; the summary table comes last (also summary.txt). Each log keeps at most its first
4 MB and last 256 KB. --emulate is the dry run: the same stages on the CPU emulator at tiny
sizes (no device figure comes out of it). Exit status: 0 all passed, 1 a stage failed or
timed out, 2 a stage was skipped for lack of time or a missing tool.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
DEFAULT_BUDGET = 480
MIN_START = 5                 # a stage given less than this many seconds does not start
HEAD_BYTES, TAIL_BYTES = 4 << 20, 256 << 10
GPU_TESTS = ["tests/test_gpu_host.py", "tests/test_gpu_cache.py", "tests/test_gpu_copy.py",
             "tests/test_gpu_pool.py", "tests/test_gpu_attention.py", "tests/test_gpu_graph.py",
             "tests/test_gpu_pool_graph.py", "tests/test_gpu_prefix.py", "tests/test_gpu_tiers.py",
             "tests/test_gpu_groups.py", "tests/test_gpu_groups_machine.py",
             "tests/test_bench_gpu.py"]
EMU_TESTS = ["tests/test_gpu_graph.py", "-k", "stale or int8"]   # a dry run's few tests
NCU_KERNELS = r"kv_pattn_(f16|q8_0)_d128_g4|flash|fmha"   # the decode kernels ncu profiles, SDPA's too
SANITIZE = [PY, "tools/gpu_kernels_check.py", "--small"]   # + --formats (--sanitize-formats)
ENV = {"CUDA_CACHE_MAXSIZE": str(4 << 30),          # the JIT cache keeps every module warmed
       **os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200",
       "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])}


@dataclasses.dataclass
class Stage:
    """One stage: argv (None: skipped, `why` says why), its log, the most seconds it may
    take (`want`) and the seconds it leaves for the stages after it (`keep`, of the default
    budget: scaled to the budget given); `pattern` picks the summary's detail line."""
    name: str
    log: str
    argv: list[str] | None
    want: int
    keep: int
    pattern: str
    why: str = ""


@dataclasses.dataclass
class Result:
    name: str
    status: str               # PASS, FAIL, TIMEOUT, SKIPPED
    seconds: float
    limit: int
    detail: str


def stages(emulate: bool, pytest_args: list[str], sanitize_formats: str = "q8_0") -> list[Stage]:
    emu = ["--emulate"] if emulate else []
    no_device = "the dry run has no device"
    tests = pytest_args or (EMU_TESTS if emulate else GPU_TESTS)
    sanitizer = shutil.which("compute-sanitizer")
    out = [
        Stage("facts", "00_facts.log", [PY, __file__, "--facts", *emu], 20, 0, r"^device:"),
        Stage("build", "01_build.log", [PY, __file__, "--build"], 200, 220, r"^build: |[Ee]rror"),
        Stage("jit", "01_jit.log", [PY, __file__, "--jit", *emu], 200, 200, r"^jit:"),
        Stage("pytest", "02_pytest.log",
              [PY, "-m", "pytest", "-m", "gpu", f"--gpu={'emu' if emulate else 'device'}", "-v", "-ra",
               "-p", "no:cacheprovider", "--maxfail=20", "--durations=8", "--continue-on-collection-errors",
               "--test-timeout=120", *tests],
              260, 150, r"\d+ (passed|failed|errors?|skipped)|no tests ran|[Ii]nterrupted|^ERROR: "),
        Stage("kernels", "03_kernels.log",
              [PY, "tools/gpu_kernels_check.py", *emu, *(["--small"] if emulate else [])],
              90, 120, r"^gpu_kernels_check: "),
    ]
    for tool, want, keep in (("memcheck", 110, 70), ("racecheck", 60, 70), ("synccheck", 60, 60)):
        argv = None if emulate or sanitizer is None else [
            sanitizer, "--tool", tool, "--error-exitcode", "99", "--print-limit", "30", *SANITIZE,
            *([] if sanitize_formats == "all" else ["--formats", sanitize_formats])]
        why = no_device if emulate else "compute-sanitizer is not on PATH"
        out.append(Stage(tool, "04_sanitizer.log", argv, want, keep,
                         r"(ERROR|RACECHECK) SUMMARY|^gpu_kernels_check: ", why))
    bench = (["--emulate", "--smoke", "append", "paged", "tiers"] if emulate else
             ["append", "paged", "tiers", "--batches", "32,1,128", "--contexts", "16384,4096",
              "--repeat", "10"])
    out.append(Stage("bench", "05_bench.log", [PY, "tools/bench_gpu.py", *bench], 200, 60,
                     r"^bench_gpu: |no usable"))
    ncu = shutil.which("ncu")
    out.append(Stage("ncu", "05_bench.log", None if emulate or ncu is None else [
        ncu, "--kernel-name", f"regex:{NCU_KERNELS}", "--launch-count", "3", "--section", "SpeedOfLight",
        "--section", "Occupancy", "--section", "WarpStateStats", "--section", "MemoryWorkloadAnalysis",
        PY, "tools/bench_gpu.py", "paged", "--batches", "32", "--contexts", "16384", "--formats", "f16,q8_0",
        "--repeat", "1"], 90, 0, r"==PROF== Disconnected|==ERROR==|Memory Throughput",
        no_device if emulate else "ncu is not on PATH"))
    return out


class _Log:
    """A stage's output into its log file: the first HEAD_BYTES, then only the last
    TAIL_BYTES (written when the stage ends) after a line saying how much was dropped."""

    def __init__(self, path: str):
        self.f = open(path, "ab")
        self.head = HEAD_BYTES
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_bytes = self.dropped = 0
        self.lines: collections.deque[str] = collections.deque(maxlen=400)

    def write(self, data: bytes) -> None:
        self.lines.extend(data.decode(errors="replace").splitlines())
        if self.head > 0:
            self.f.write(data[:self.head])
            data, self.head = data[self.head:], self.head - len(data)
        if data:
            self.tail.append(data)
            self.tail_bytes += len(data)
            while self.tail_bytes - len(self.tail[0]) >= TAIL_BYTES:
                self.dropped += len(self.tail[0])
                self.tail_bytes -= len(self.tail.popleft())

    def close(self) -> None:
        if self.dropped:
            self.f.write(f"\n[gpu_check: {self.dropped} bytes of output dropped here]\n".encode())
        self.f.writelines(self.tail)
        self.f.close()


def run_stage(st: Stage, out_dir: str, deadline: float, scale: float) -> Result:
    left = deadline - time.monotonic()
    limit = int(min(st.want, left - st.keep * scale))
    if st.argv is None:
        return Result(st.name, "SKIPPED", 0, 0, st.why)
    if limit < MIN_START:
        return Result(st.name, "SKIPPED", 0, max(limit, 0),
                      f"no time left: {max(left, 0):.0f} s of the budget, {st.keep * scale:.0f} s kept for later stages")
    log = _Log(os.path.join(out_dir, st.log))
    log.write(f"=== {st.name} (limit {limit} s): {' '.join(st.argv)}\n".encode())
    print(f"=== {st.name} (limit {limit} s)", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(st.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=ENV)
    pump = threading.Thread(target=lambda: [log.write(b) for b in iter(lambda: proc.stdout.read1(65536), b"")])
    pump.start()
    try:
        rc = proc.wait(timeout=limit)
        status = "PASS" if rc == 0 else "FAIL"
    except subprocess.TimeoutExpired:
        _kill(proc)
        rc, status = None, "TIMEOUT"
    pump.join()
    seconds = time.monotonic() - t0
    log.write(f"=== {st.name}: {status} (rc {rc}) after {seconds:.0f} s\n".encode())
    log.close()
    found = [line for line in log.lines if re.search(st.pattern, line)]
    detail = (found[-1] if found else log.lines[-2] if len(log.lines) > 1 else "").strip("= \t")
    if status == "TIMEOUT":
        detail = f"ran past its {limit} s; last: {detail}"
    elif status == "FAIL":
        detail = f"rc {rc}; {detail}"
    print(f"    {status} after {seconds:.0f} s: {detail}", flush=True)
    return Result(st.name, status, seconds, limit, detail)


def run_stages(chosen: list[Stage], out_dir: str, deadline: float, scale: float, overlap: bool) -> list[Result]:
    """Each stage in order; with `overlap` (a device run) jit starts with the build and is
    waited for after it (the dry run's JIT imports kvcore, which the build is writing)."""
    results: list[Result] = []
    names = [st.name for st in chosen]
    side: dict[str, Result] = {}
    thread = None
    for st in chosen:
        if st.name == "jit" and thread is not None:
            thread.join()
            results.append(side["jit"])
            continue
        if st.name == "build" and overlap and "jit" in names and chosen[names.index("jit")].argv is not None:
            jit_st = chosen[names.index("jit")]
            thread = threading.Thread(target=lambda: side.update(jit=run_stage(jit_st, out_dir, deadline, scale)))
            thread.start()
        results.append(run_stage(st, out_dir, deadline, scale))
    return results


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group, SIGKILL 5 s later."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


def summary(results: list[Result], out_dir: str, budget: int, spent: float, emulate: bool) -> tuple[str, int]:
    """The summary text and the exit status."""
    failed = [r for r in results if r.status in ("FAIL", "TIMEOUT")]
    short = [r for r in results if r.status == "SKIPPED" and not r.detail.startswith("the dry run")]
    overall, rc = (("FAILED", 1) if failed else ("INCOMPLETE", 2) if short else ("PASSED", 0))
    mode = "EMULATED dry run (CPU emulator: no figure here is a device figure)" if emulate else "device run"
    lines = [f"=== gpu_check summary: {mode}; {spent:.0f} s of a {budget} s budget; logs in {out_dir}",
             f"{'stage':10s} {'status':8s} {'secs':>5s} {'limit':>5s}  detail"]
    lines += [f"{r.name:10s} {r.status:8s} {r.seconds:5.0f} {r.limit:5d}  {r.detail[:150]}" for r in results]
    pytest_log = os.path.join(out_dir, "02_pytest.log")
    if os.path.exists(pytest_log):
        with open(pytest_log, errors="replace") as f:
            bad = [line.rstrip() for line in f if re.match(r"(FAILED|ERROR) ", line)]
        lines += [f"  pytest: {line[:160]}" for line in bad[:10]]
    lines.append(f"overall: {overall}")
    return "\n".join(lines), rc


# ------------------------------------------------------------------ helpers run as stages

def facts(emulate: bool) -> int:
    import importlib
    print(f"python {sys.version.split()[0]} ({PY}); {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    for name in ("numpy", "Cython", "cuda.bindings", "torch", "cupy", "ml_dtypes", "pytest", "transformers"):
        try:
            print(f"{name:14s} {getattr(importlib.import_module(name), '__version__', '?')}")
        except Exception as e:
            print(f"{name:14s} -- ({type(e).__name__})")
    for tool in ("nvcc", "ptxas", "compute-sanitizer", "g++"):
        print(f"{tool:14s} {shutil.which(tool) or '-- (not on PATH)'}")
    if emulate:
        print("device: none (EMULATED dry run: nvidia-smi not run)")
        return 0
    try:
        print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=15).stdout)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                              "clocks.max.mem", "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"device: nvidia-smi failed: {e}")
        return 1
    print(f"device: {smi.stdout.strip() or smi.stderr.strip()}")
    return smi.returncode


def build() -> int:
    """setup.py build_ext --inplace -j, then kvcore imported from the checkout."""
    rc = subprocess.run([PY, "setup.py", "build_ext", "--inplace", "-j", str(os.cpu_count() or 2)], cwd=ROOT).returncode
    if rc:
        return rc
    probe = "import kvcore, kvcore.gpu; print('build: kvcore imports from', kvcore.__file__)"
    return subprocess.run([PY, "-c", probe], cwd=ROOT, env=ENV).returncode


def _driver(emulate: bool):
    """The driver module: cuda-python's (not kvcore, so it runs while kvcore builds), or
    the emulated one."""
    if emulate:
        from kvcore import gpu
        gpu.use_emulator()
        return gpu.driver.cuda()
    from cuda.bindings import driver
    return driver


def jit_module(path: str, emulate: bool) -> int:
    """Loads one kernel cut out of a PTX module, as kvcore does (kernels.py: the image
    NUL-terminated, the JIT error log), then the whole module; prints both load times (the
    JIT cold for each) and each kernel's resources."""
    d = _driver(emulate)
    name = os.path.basename(path)[:-4]

    def ok(res, what):
        if res[0] != d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {res[0]!r}")
        return res[1] if len(res) == 2 else None

    def attr(a, fn):
        res = d.cuFuncGetAttribute(getattr(d.CUfunction_attribute, a), fn)
        return res[1] if res[0] == d.CUresult.CUDA_SUCCESS else "n/a"

    ok(d.cuInit(0), "cuInit")
    dev = ok(d.cuDeviceGet(0), "cuDeviceGet")
    ok(d.cuCtxPushCurrent(ok(d.cuDevicePrimaryCtxRetain(dev), "retain")), "push")
    with open(path, "rb") as f:
        image = f.read() + b"\0"
    log = bytearray(16384)
    opts = [d.CUjit_option.CU_JIT_ERROR_LOG_BUFFER, d.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES]
    _ptx = _load_ptx_parser()
    kernel = next(iter(_ptx.parse(image).entries))
    t0 = time.perf_counter()
    err, cut = d.cuModuleLoadDataEx(_ptx.entry_image(image, kernel) + b"\0", len(opts), opts, [log, len(log)])
    print(f"module {name}: one kernel ({kernel}) loaded alone in {time.perf_counter() - t0:.2f} s: {err!r}")
    t0 = time.perf_counter()
    err, mod = d.cuModuleLoadDataEx(image, len(opts), opts, [log, len(log)])
    dt = time.perf_counter() - t0
    if err != d.CUresult.CUDA_SUCCESS:
        jit_log = bytes(log).split(b"\0")[0].decode(errors="replace")
        print(f"module {name}: LOAD FAILED after {dt:.1f} s: {err!r}\n{jit_log}")
        return 1
    rows = []
    for k in re.findall(rb"^\s*(?:\.visible\s+)?\.entry\s+(\w+)", image, re.M):
        fn = ok(d.cuModuleGetFunction(mod, k), f"cuModuleGetFunction {k!r}")
        blocks = ok(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, 128, 0), "occupancy")
        rows.append((k.decode(), attr("CU_FUNC_ATTRIBUTE_NUM_REGS", fn),
                     attr("CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES", fn), attr("CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES", fn), blocks))
    fewest = min(rows, key=lambda r: r[4])
    print(f"module {name}: loaded in {dt:.1f} s, {len(rows)} kernels, fewest blocks/SM at 128 threads "
          f"{fewest[4]} ({fewest[0]})")
    for r in rows:
        print(f"    {r[0]:34s} regs {r[1]!s:>4s}  smem {r[2]!s:>6s}  local {r[3]!s:>4s}  blocks/SM@128 {r[4]}")
    return 0


def _load_ptx_parser():
    """kvcore/gpu/_ptx.py by its path: it needs nothing else of kvcore, so the device's JIT
    warm-up runs while the extensions build (importing kvcore needs them)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_kvcore_ptx", os.path.join(ROOT, "kvcore", "gpu", "_ptx.py"))
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # dataclasses look it up
    spec.loader.exec_module(mod)
    return mod


def jit(emulate: bool) -> int:
    """Every shipped module at once, one process each; a line 'jit: ...' last."""
    paths = sorted(glob.glob(os.path.join(ROOT, "cuda", "*.ptx")))
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for p in paths:
            f = open(os.path.join(tmp, os.path.basename(p) + ".log"), "w+")
            argv = [PY, __file__, "--jit-module", p] + (["--emulate"] if emulate else [])
            procs.append((subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=ENV), f))
        failed, loads = 0, []
        for proc, f in procs:
            failed += proc.wait() != 0
            f.seek(0)
            text = f.read()
            f.close()
            sys.stdout.write(text)
            loads += re.findall(r"^module (\w+): loaded in ([\d.]+) s.* at 128 threads (\d+) \((\w+)\)", text, re.M)
    slowest = max(loads, key=lambda x: float(x[1]), default=("-", "0", "", ""))
    fewest = min(loads, key=lambda x: int(x[2]), default=("", "", "-", "-"))
    print(f"jit: {len(paths) - failed}/{len(paths)} modules loaded; slowest {slowest[0]} {slowest[1]} s; "
          f"fewest blocks/SM {fewest[2]} ({fewest[3]})" + (" (EMULATED: no registers)" if emulate else ""))
    return 1 if failed or not paths else 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage=__doc__.split("\n\n")[1].strip())
    ap.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="seconds for all stages (default 480)")
    ap.add_argument("--emulate", action="store_true", help="the dry run: the CPU emulator, tiny sizes")
    ap.add_argument("--out", help="the directory for the logs (default: a new temporary one)")
    ap.add_argument("--only", help="comma-separated stages to run (a rerun with the time left); "
                                   "the others are reported as not selected")
    ap.add_argument("--sanitize-formats", default="q8_0",
                    help="the formats compute-sanitizer runs over (comma-separated, or all; default q8_0)")
    ap.add_argument("--facts", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--jit", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--jit-module", help=argparse.SUPPRESS)
    ap.add_argument("pytest_args", nargs="*", help="after --: the pytest stage's files and options")
    args = ap.parse_args(argv)
    if args.facts:
        return facts(args.emulate)
    if args.build:
        return build()
    if args.jit:
        return jit(args.emulate)
    if args.jit_module:
        return jit_module(args.jit_module, args.emulate)
    out_dir = args.out or tempfile.mkdtemp(prefix="kvcore-gpu-check.")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.monotonic()
    deadline, scale = t0 + args.budget, args.budget / DEFAULT_BUDGET
    chosen = stages(args.emulate, args.pytest_args, args.sanitize_formats)
    only = args.only.split(",") if args.only else [st.name for st in chosen]
    if set(only) - {st.name for st in chosen}:
        ap.error(f"--only: unknown stages {sorted(set(only) - {st.name for st in chosen})}")
    for st in chosen:
        if st.name not in only:
            st.argv, st.why = None, "not selected (--only)"
    results = run_stages(chosen, out_dir, deadline, scale, overlap=not args.emulate)
    text, rc = summary(results, out_dir, args.budget, time.monotonic() - t0, args.emulate)
    bench_log = os.path.join(out_dir, "05_bench.log")
    if os.path.exists(bench_log):              # the benchmark's tables, then the summary
        with open(bench_log, errors="replace") as f:
            tables = [("\n" if line.startswith("###") else "") + line.rstrip()
                      for line in f if line.startswith(("###", "|"))]
        text = "\n".join(tables[:120] + [""]) + text
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print("\n" + text, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
