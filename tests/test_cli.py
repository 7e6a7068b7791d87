"""python -m kvcore demo | info."""
import io
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvcore
from kvcore import _demo
from kvcore.__main__ import main


def _pool(rng, heads=2, head_dim=64):
    return (rng.standard_normal((_demo.POOL, heads, head_dim)).astype(np.float32),
            rng.standard_t(3, (_demo.POOL, heads, head_dim)).astype(np.float32))


@pytest.mark.parametrize("fmt", kvcore.formats.ROW_FORMATS)
def test_demo_row_reads_back_by_the_rule(fmt, rng):
    keys, vals = _pool(rng)
    row = _demo.run_format(fmt, keys, vals, layers=3, capacity=70)
    name, mib, per_pos, ratio, step_us, check, err_g, err_t = row
    assert name == fmt and check == ("exact" if fmt == "f32" else "as rule")
    spec = kvcore.KVSpec(num_layers=3, num_kv_heads=2, head_dim=64, capacity=70, format=fmt)
    assert per_pos == spec.bytes_per_position and float(ratio) == round(spec.compression_ratio, 2)
    assert float(step_us) > 0
    bound = {"f32": 0, "f16": 1e-3, "bf16": 5e-3, "int8": 2e-2, "q8_0": 2e-2,
             "fp8_e4m3": 6e-2, "fp8_e5m2": 1.2e-1, "q4_0": 2e-1, "q4_1": 1.5e-1}[fmt]
    assert float(err_g) <= bound and float(err_t) <= bound


def test_demo_reports_a_mismatch(rng, monkeypatch):
    keys, vals = _pool(rng)
    wrong = lambda x, fmt: kvcore.quantize(x + 1, fmt)  # noqa: E731
    monkeypatch.setattr(_demo, "_expected_codes", wrong)
    assert _demo.run_format("int8", keys, vals, layers=1, capacity=4)[5] == "MISMATCH"


def test_demo_store_round_trip_is_bit_identical():
    row = _demo.store_demo(layers=2, prompt=3 * 16 + 5, chunk=16, fmt="q8_0")
    assert row[:2] == [48, 3] and row[-1] == "bit-identical"


def test_demo_serving_counts_pages_of_the_running_requests():
    requests = [(40, 3), (5, 6), (17, 2)]
    rows = _demo.serve(requests, layers=2, capacity=64, every=2, page_size=8, batch=2)
    spec = kvcore.KVSpec(num_layers=2, num_kv_heads=_demo.KV_HEADS, head_dim=_demo.HEAD_DIM,
                         capacity=64, num_heads=_demo.Q_HEADS, format="int8")
    for step, running, lengths, pages, mib, full in rows:
        lens = [] if lengths == "-" else [int(x) for x in lengths.split()]
        assert len(lens) == running <= 2
        assert pages == sum(-(-n // 8) for n in lens)
        assert float(full) == round(running * spec.memory_bytes / 2**20, 1)
    assert rows[0][:3] == [1, 1, "41"] and rows[-1][1:4] == [0, "-", 0]
    assert [r[0] for r in rows] == [1, 3, 5, 6, 8]   # joins at steps 0, 2, 4; ends at 3, 6, 8


def test_demo_shared_prompt_is_matched_and_exact():
    rows = _demo.shared_prompt([5, 20, 3], system=40, layers=2, page_size=8)
    # the first request computes all; the others find the system prompt's 5 full pages
    assert [r[1] for r in rows] == [0, 40, 40]
    assert [r[2] for r in rows] == [45, 20, 3]
    assert [r[3] for r in rows] == [6, 6 + 3, 6 + 3 + 1]     # shared pages count once
    assert all(r[5] == "yes" for r in rows)


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"kvcore {kvcore.__version__}" in out
    assert ("OpenMP on" if kvcore.openmp_enabled() else "OpenMP off") in out
    assert f"threads: {kvcore.max_threads()}" in out
    for name in kvcore.FORMATS:
        assert f"\n{name} " in out
    assert "cuda-python: " in out and "GPU: " in out


def test_module_entry_point():
    run = subprocess.run([sys.executable, "-m", "kvcore", "info"], capture_output=True, text=True)
    assert run.returncode == 0 and "formats (per head row, head_dim 128)" in run.stdout
    bad = subprocess.run([sys.executable, "-m", "kvcore", "bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice: 'bogus'" in bad.stderr


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal():
    """Drawn on a terminal, ending with a newline; nothing into a file or a pipe."""
    tty, log = _Terminal(), io.StringIO()
    for stream in (tty, log):
        bar = _demo.Progress(4, width=8, stream=stream)
        for _ in range(4):
            bar.step("int8")
    assert tty.getvalue().count("\r") == 4 and tty.getvalue().endswith("\n")
    assert "\rdecode [########] 100% int8" in tty.getvalue()
    assert log.getvalue() == ""


def test_decode_rows_write_no_progress_into_a_pipe():
    """The demo's decode table run with stderr a pipe (as under a CI log) writes no bar."""
    code = """
        import numpy as np
        from kvcore import _demo
        pools = _demo.model_pools(np.random.default_rng(0), 8, 2, 4, 32)
        rows = _demo.decode_rows(["f32", "int8"], pools, layers=2, prompt=4, steps=3)
        print(len(rows))
    """
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "2", run.stderr
    assert run.stderr == ""


def test_demo_quick_runs_every_part_and_names_its_threads():
    run = subprocess.run([sys.executable, "-m", "kvcore", "demo", "--quick", "--threads", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith(f"kvcore {kvcore.__version__} demo: 4 layers")
    assert "\n1 thread of " in out and "tokens/s" in out
    for part in ("\nDecode: ", "\nServing: ", "\nStore: ", "\nPrefix cache: "):
        assert part in out
    assert "MISMATCH" not in out and "bit-identical" in out


def test_demo_refuses_a_bad_thread_count():
    run = subprocess.run([sys.executable, "-m", "kvcore", "demo", "--quick", "--threads", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--threads -1: threads must be in [0, " in run.stderr
