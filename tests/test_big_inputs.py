"""Big inputs (marker `heavy`, not in CI: `python -m pytest -m heavy`): a dump of 100,000
tensors per side and a single 2 GiB tensor. The commands answer with their usual exit codes
and their memory stays bounded (figures: bench/big_inputs.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import big_inputs  # noqa: E402

pytestmark = pytest.mark.heavy


def test_a_hundred_thousand_tensors(tmp_path):
    root = str(tmp_path / "wide")
    big_inputs.dump_wide(root, 100_000)
    for argv in (["ls"], ["ni", "block_7/scale_777"], ["vc"], ["vcs", "-l", "10"]):
        code, seconds, anon, rss = big_inputs.measure(root, *argv)
        assert code in (0, 1) and anon < 2048, (argv, code, anon)


def test_a_two_gib_tensor_is_compared_in_bounded_memory(tmp_path):
    root = str(tmp_path / "big")
    big_inputs.dump_big(root, 1 << 29)
    for argv in (["ni", "scale"], ["pt", "scale"], ["vc"]):
        code, seconds, anon, rss = big_inputs.measure(root, *argv)
        assert code in (0, 1) and anon < 512, (argv, code, anon)
