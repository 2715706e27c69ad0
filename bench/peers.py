"""Whole-process `precision-tool vc` against its peers on the very same files: msprobe's
compare core (mindstudio-probe: compare_by_op's reader, tensor checks and compare_ops_apply
with every column, in one process) and TroubleShooter's compare_npy_dir. Run by hand, not in CI: the peers are installed into a
virtual environment of their own when asked.

    python bench/peers.py --install           # once: the peers into bench/.peers/
    python bench/peers.py [--pairs 100] [--elements 1048576]

One step of a graph of `pairs` float32 ops of `elements` each (4 MiB at the default) is
dumped on the NPU (float32 kept) and on the golden run, fed inputs 1e-3 apart so that every
pair differs: that is precision-tool's workspace. The peers read the same .npy files
through symlinks laid out as each expects: a list of (NPU, golden) paths for msprobe, two
directories of equal file names for TroubleShooter. The three run interleaved as whole
processes (start-up and import included, every package's bytecode compiled as an install
leaves it), twice each, against a warm page cache; the best of each decides, and the ratios
are printed.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from installed import compile_bytecode

HERE = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(HERE, ".peers")
PEERS = ["mindstudio-probe==26.2.0", "troubleshooter==1.0.18"]
# what their compare paths import: installed apart, since the peers' own requirements pull
# in builds this benchmark has no use for (skl2onnx's onnx, tensorboard)
PEER_DEPS = ["numpy", "pandas", "pyyaml", "psutil", "tqdm", "packaging", "prettytable<3.8",
             "protobuf<=3.20.1", "matplotlib", "PySnooper"]

# compare_by_op's steps for one pair (msprobe.core.compare.multiprocessing_compute): its
# reader (read_npy_data's path check, load_npy, squeeze), the tensor checks, every column
MSPROBE = """
import json, sys
import numpy as np
from msprobe.core.common.const import CompareConst
from msprobe.core.common.file_utils import FileCheckConst, FileChecker, load_npy
from msprobe.core.compare.npy_compare import CompareResult, ValidateTensor, compare_ops_apply

def read(path):
    checked = FileChecker(path, FileCheckConst.FILE, FileCheckConst.READ_ABLE,
                          FileCheckConst.NUMPY_SUFFIX).common_check()
    return np.squeeze(load_npy(checked))

rows = []
for n, b in json.load(open(sys.argv[1])):
    checked = ValidateTensor().check_tensor(CompareResult(read(n), read(b)))
    rows.append(compare_ops_apply(checked.n_value, checked.b_value, checked.error_flag,
                                  checked.err_msg, column_names=CompareConst.ALL_COMPARE_INDEX)[0])
print(len(rows), rows[0])
"""

TROUBLESHOOTER = """
import sys
from troubleshooter.migrator import compare_npy_dir
compare_npy_dir(sys.argv[1], sys.argv[2])
"""


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def install(venv: str):
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [venv_python(venv), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + ["--no-deps", *PEERS], check=True)
    subprocess.run(pip + PEER_DEPS, check=True)
    print(f"installed {', '.join(PEERS)} into {venv}")


def dump(root: str, pairs: int, elements: int):
    """The workspace: `pairs` Mul ops on a float32 placeholder, one step on each side."""
    import precision_tool as pt
    from precision_tool import hooks
    g = pt.Graph("peers")
    with g.as_default():
        x = pt.placeholder("x", [elements])
        outs = [pt.ops.multiply(x, pt.constant(np.float32(1.0 + k / pairs), name=f"c{k}"),
                                name=f"op{k}") for k in range(pairs)]
    rng = np.random.default_rng(0)
    value = rng.normal(size=elements).astype(np.float32)
    npu = pt.Session(g, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(precision_mode="must_keep_origin_dtype"), action="dump",
        dump_mode="output", data_dir=root))
    npu.run(outs, {x: value + rng.normal(scale=1e-3, size=elements).astype(np.float32)})
    npu.close()
    cpu = hooks.sess_dump(pt.Session(g), action="dump", dump_mode="output", data_dir=root)
    cpu.run(outs, {x: value})
    cpu.close()
    from precision_tool.dump import Workspace
    ws = Workspace(root)
    files = []
    for target in ("npu", "cpu"):
        run = ws.run(target)
        index = ws.index(run, 0)
        rows = index[(index.io == "output") & index.op_name.str.startswith("op")]
        files.append({r.op_name: os.path.join(ws.step_path(run, 0), r.file)
                      for r in rows.itertuples()})
    return [(files[0][op], files[1][op]) for op in sorted(files[0]) if op in files[1]]


def lay_out(work: str, pairs, python: str):
    """msprobe's list of pairs, TroubleShooter's two directories (symlinks, equal names)."""
    listing = os.path.join(work, "pairs.json")
    with open(listing, "w") as f:
        json.dump(pairs, f)
    orig, target = os.path.join(work, "golden"), os.path.join(work, "npu")
    for d in (orig, target):
        os.makedirs(d, exist_ok=True)
    for k, (n, b) in enumerate(pairs):
        os.symlink(b, os.path.join(orig, f"t{k:04d}.npy"))
        os.symlink(n, os.path.join(target, f"t{k:04d}.npy"))
    scripts = {}
    for name, text in (("msprobe", MSPROBE), ("troubleshooter", TROUBLESHOOTER)):
        scripts[name] = os.path.join(work, f"run_{name}.py")    # not the package's name
        with open(scripts[name], "w") as f:
            f.write(text)
    return {"precision-tool vc": [sys.executable, "-m", "precision_tool", "--data-dir",
                                  os.path.join(work, "precision_data"), "--log-level", "4", "vc"],
            "msprobe compare core": [python, scripts["msprobe"], listing],
            "TroubleShooter compare_npy_dir": [python, scripts["troubleshooter"], orig, target]}


def timed(name, argv) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - start
    if done.returncode not in ((0, 1) if name == "precision-tool vc" else (0,)):
        raise SystemExit(f"{name} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return took


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--install", action="store_true",
                    help="install the peers into the virtual environment --venv and stop")
    ap.add_argument("--venv", default=VENV, help=f"the peers' virtual environment ({VENV})")
    ap.add_argument("--workers", type=int, default=1, help="vc -w (default 1)")
    ap.add_argument("--pairs", type=int, default=100)
    ap.add_argument("--elements", type=int, default=1 << 20,
                    help="float32 elements per tensor (default 1048576: 4 MiB)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.install:
        return install(args.venv)
    python = venv_python(args.venv)
    if not os.path.exists(python):
        raise SystemExit(f"the peers are not installed: python {sys.argv[0]} --install")
    work = tempfile.mkdtemp(prefix="peers-", dir=HERE)
    try:
        pairs = dump(os.path.join(work, "precision_data"), args.pairs, args.elements)
        runs = lay_out(work, pairs, python)
        compile_bytecode()                          # as the peers' pip install did for them
        runs["precision-tool vc"] += ["-w", str(args.workers)]
        for name, argv in runs.items():             # warm the page cache and the imports
            timed(name, argv)
        times = {name: [] for name in runs}
        for _ in range(args.repeats):               # interleaved: all see the same load
            for name, argv in runs.items():
                times[name].append(timed(name, argv))
        ours = min(times["precision-tool vc"])
        read = 2 * len(pairs) * args.elements * 4 / 1e9
        print(f"{len(pairs)} pairs of {args.elements * 4 / 2**20:.0f} MiB float32 "
              f"({read:.2f} GB read per compare), whole processes, best of {args.repeats}:")
        for name, t in times.items():
            ratio = "" if name == "precision-tool vc" else f"   vc is {min(t) / ours:.1f}x faster"
            print(f"  {name:32s} {min(t):7.2f} s{ratio}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
