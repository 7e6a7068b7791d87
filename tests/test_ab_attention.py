"""tools/ab_attention.py: two builds of the attention kernels in one process. A copy of
the installed build's file, loaded as a second module, gives the same bits, and the
module decode_attention calls is the installed one again afterwards."""
import os
import shutil
import sys

import kvcore
import kvcore._attention
import kvcore.attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import ab_attention  # noqa: E402


def test_a_build_against_a_copy_of_itself_gives_the_same_bits(tmp_path):
    copy = tmp_path / os.path.basename(kvcore._attention.__file__)
    shutil.copy(kvcore._attention.__file__, copy)
    again = ab_attention._load(str(copy), "test_build")
    assert again is not kvcore._attention
    for fmt in ("f32", "q8_0/q4_0"):
        row = ab_attention._row(fmt, (kvcore._attention, again), n=70, t=3, calls=2)
        assert row[0] == fmt and row[-1] == "same"
        assert min(row[1:5]) > 0
    assert kvcore.attention._attention is kvcore._attention
