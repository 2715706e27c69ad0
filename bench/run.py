"""All benchmarks, one command: `python bench/run.py [--quick]`.

Every figure is a ratio (or a rate) measured side by side in this one run: the machine is
shared and noisy, so absolute times are only indicative. Prints the table and writes it to
bench/RESULTS.md with the date, the machine and the commit. --quick shrinks every size for
a smoke run (its figures are not the results).
"""
import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import compare as compare_bench  # noqa: E402
from installed import compile_bytecode  # noqa: E402
import executors  # noqa: E402
import onnx_import as onnx_bench  # noqa: E402
import repair as repair_bench  # noqa: E402
import precision_tool as pt  # noqa: E402


class Table:
    def __init__(self):
        self.rows = []

    def add(self, name, value, target=None, met=None, note=""):
        mark = "" if met is None else ("met" if met else "not met")
        self.rows.append((name, value, target or "", mark, note))
        print(f"{name}: {value}" + (f" (target {target}: {mark})" if target else "") +
              (f"; {note}" if note else ""), flush=True)

    def markdown(self):
        lines = ["| benchmark | measured | target | | how |", "|---|---|---|---|---|"]
        lines += [f"| {n} | {v} | {t} | {m} | {h} |" for n, v, t, m, h in self.rows]
        return "\n".join(lines)


def vcs_rows(root, rows):
    """A result CSV of `rows` rows (one real step's rows, repeated under new op names), then
    the vcs command in this process: reading, summarising and rendering."""
    from click.testing import CliRunner

    import numpy as np
    import pandas as pd
    from precision_tool import analysis
    from precision_tool.cli import cli
    from precision_tool.dump import Workspace
    compare_bench.dump_transformer_step(root, pixel_scale=1.0)
    ws = Workspace(root)
    table = analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
    copies = -(-rows // len(table))
    big = pd.concat([table.assign(NPUDump=table.NPUDump + f"_{k}",
                                  TensorIndex=table.TensorIndex + f"_{k}") for k in range(copies)],
                    ignore_index=True).iloc[:rows]
    big["Index"] = np.arange(len(big))
    path = os.path.join(root, "big_result.csv")
    big.to_csv(path, index=False)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        out = CliRunner().invoke(cli, ["--data-dir", root, "vcs", "-f", path, "-c", "0.98", "-l", "10"])
        times.append(time.perf_counter() - start)
        assert out.exit_code in (0, 1), out.output
    return min(times), len(big)


def startup(root):
    """How much longer than `python -c pass` a fresh process takes for --version and for vcs
    on the demo workspace (best of 5 each: the import is what is measured)."""
    def best(argv):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times.append(time.perf_counter() - start)
        return min(times)
    base = best([sys.executable, "-c", "pass"])
    tool = [sys.executable, "-m", "precision_tool", "--data-dir", root]
    return [("precision-tool --version", best(tool + ["--version"]) - base),
            ("precision-tool vcs (demo)", best(tool + ["vcs"]) - base)]


def workers_on_demo(root):
    """Whole-process `vc -w 2` against `vc -w 1` on the demo workspace (a small step: the
    pool must not cost more than it saves), interleaved, best of 5 each."""
    tool = [sys.executable, "-m", "precision_tool", "--data-dir", root, "--log-level", "4", "vc"]
    times = {1: [], 2: []}
    for _ in range(5):
        for w in (1, 2):
            start = time.perf_counter()
            subprocess.run(tool + ["-w", str(w)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            times[w].append(time.perf_counter() - start)
    return min(times[2]) / min(times[1]), min(times[1]), min(times[2])


def ac_on_demo(root):
    from click.testing import CliRunner
    from precision_tool.cli import cli
    demo = CliRunner().invoke(cli, ["--data-dir", root, "--log-level", "4", "demo"])
    assert demo.exit_code in (0, 1), demo.output
    times = []
    for _ in range(3):
        start = time.perf_counter()
        out = CliRunner().invoke(cli, ["--data-dir", root, "--log-level", "4", "ac", "-c"])
        times.append(time.perf_counter() - start)
        assert out.exit_code in (0, 1), out.output
    return min(times)


def machine():
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                           capture_output=True, text=True).stdout.strip()
    return (f"{os.cpu_count()} cores, {mem:.0f} GiB memory, {platform.machine()}, Python "
            f"{platform.python_version()}, numpy {__import__('numpy').__version__}; commit "
            f"{commit}{' with local changes' if dirty else ''}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not results")
    ap.add_argument("--output", default=os.path.join(HERE, "RESULTS.md"),
                    help="where to write the table (default bench/RESULTS.md)")
    args = ap.parse_args()
    q = args.quick
    started = time.perf_counter()
    compile_bytecode()           # the whole-process rows time a start-up, not a compile
    t = Table()
    work = tempfile.mkdtemp(prefix="bench-", dir=".")
    digits = pt.data.digits()
    try:
        frac, how = compare_bench.large(os.path.join(work, "large"), 1 << (20 if q else 25))
        t.add("compare, large fp32 tensors, fraction of the memory bound (one np.dot pass)",
              f"{frac:.3f}", "≥ 0.5", frac >= 0.5, how)
        rate, how = compare_bench.small_pairs(os.path.join(work, "small"), 500 if q else 5000)
        t.add("compare, small tensors, pairs per second (vector_compare)", f"{rate:,.0f}",
              "≥ 10,000", rate >= 10000, how)
        rate, how = compare_bench.small(os.path.join(work, "step"), 1 if q else 4)
        t.add("compare, one Transformer step, pairs per second", f"{rate:,.0f}", note=how)
        speedup, how = compare_bench.scaling(os.path.join(work, "scale"), 4 if q else 48,
                                             1 << (20 if q else 23))
        t.add("compare, scaling: time on 1 worker ÷ time on 2", f"{speedup:.2f}", "≈ 2 (≥ 1.7)",
              speedup >= 1.7, how)
        budget = (256 if q else 512) * 2 ** 20
        peak, how = compare_bench.streaming(os.path.join(work, "stream"), budget)
        t.add("compare, peak anonymous memory, dump 4x the budget (budget enforced, RLIMIT_DATA)",
              f"{peak / 2**20:,.0f} MiB", f"≤ {budget / 2**20:.0f} MiB", peak <= budget, how)
        for batch in ((32,) if q else (32, 256)):
            for label, where in (("workspace on disk", "."), ("workspace on tmpfs", "/dev/shm")):
                if os.path.isdir(where):
                    tensor, stats, kept, counted = executors.dump_overhead(digits, where, batch)
                    what = f"Transformer NPU step at batch {batch}"
                    disk = ("as fast as this file system creates files: its recent deletions "
                            "and its page cache move it (docs/design-notes.md)"
                            if where == "." else "")
                    t.add(f"dump overhead, {what}, tensor dump ÷ none, {label}",
                          f"{tensor:.2f}", "≤ 1.5", tensor <= 1.5, disk)
                    t.add(f"dump overhead, {what}, stats dump ÷ none, {label}",
                          f"{stats:.2f}", "≤ 1.1", stats <= 1.1)
                    if where != ".":        # the floors write nothing: once per batch
                        t.add(f"dump floor, {what}: keeping each step's outputs until the "
                              f"next step ends, nothing written ÷ none", f"{kept:.2f}",
                              note="what a tensor dump costs before it writes anything")
                        t.add(f"statistics floor, {what}: the run computing every value's "
                              f"statistics as it makes it, nothing written ÷ none",
                              f"{counted:.2f}",
                              note="what a statistics dump costs before it writes anything")
                        alt = executors.stats_dump_alternating(digits, where, batch,
                                                               50 if q else 300)
                        t.add(f"dump overhead, {what}, stats dump ÷ none, {label}, one session "
                              f"dumping every other step", f"{alt:.3f}", "≤ 1.1", alt <= 1.1,
                              note="median of each dumped step ÷ its two undumped "
                                   "neighbours; the steadiest measure here (no close, no "
                                   "block boundaries, no drift between the two)")
        for batch in ((32,) if q else (32, 256)):
            ratio = executors.watch_alternating(digits, batch, 50 if q else 300)
            t.add(f"watchpoints, Transformer NPU step at batch {batch}, every condition on: "
                  f"watched ÷ unwatched", f"{ratio:.3f}", "≤ 1.1", ratio <= 1.1,
                  note="one session watching every other step; median of each watched step ÷ "
                       "its two neighbours (the statistics floor is most of it)")
        cpu = executors.writer_cpu(digits, "/dev/shm" if os.path.isdir("/dev/shm") else ".",
                                   32, 10 if q else 40)
        if cpu is not None:
            (tw, tt), (sw, st) = cpu["tensor"], cpu["stats"]
            t.add("dump CPU per Transformer step at batch 32, tensor dump / stats dump: writer "
                  "thread; training thread beyond an undumped step",
                  f"{tw * 1e3:.2f} / {sw * 1e3:.2f} ms; {tt * 1e3:.2f} / {st * 1e3:.2f} ms",
                  note="the C module's writer thread's user+system time (/proc), the training "
                       "thread's thread_time less an undumped step's (a difference of two "
                       "measured times: near zero, noise can make it negative); workspace on "
                       "tmpfs")
        for name, ratio, how in executors.step_ratios(digits, q):
            t.add(name, f"{ratio:.2f}", "≤ 1.5", ratio <= 1.5, how)
        peer = executors.torch_ratio(digits)
        if peer is None:
            t.add("CPU-golden ÷ PyTorch eager step time, MLP and CNN", "skipped",
                  note="torch is not installed (optional peer)")
        else:
            for name, ratio, how in peer:
                t.add(name, f"{ratio:.2f}", note=how)
        onnx_row = onnx_bench.resnet18_golden_vs_ort(5 if q else 20)
        if onnx_row is None:
            t.add("CPU-golden ÷ ONNX Runtime step time, imported ResNet-18", "skipped",
                  note=f"needs {', '.join(onnx_bench.missing())} (optional)")
        else:
            ratio, ours, theirs = onnx_row
            t.add("CPU-golden ÷ ONNX Runtime step time, imported ResNet-18 (batch 1, 224x224)",
                  f"{ratio:.2f}", "≤ 2", ratio <= 2,
                  note=f"medians, interleaved: {ours:.1f} ms against {theirs:.1f} ms; ORT's "
                       f"default optimisations and threads, its pool not spinning between runs")
        seconds = ac_on_demo(os.path.join(work, "demo"))
        for what, over in startup(os.path.join(work, "demo")):
            t.add(f"start-up: `{what}` − `python -c pass`, wall time", f"{over:.2f} s", "≤ 0.3 s",
                  over <= 0.3, note="best of 5 fresh processes each")
        t.add("`ac -c` wall time on the demo workspace", f"{seconds:.2f} s",
              note="in-process, after the demo's 100 steps")
        ratio, one, two = workers_on_demo(os.path.join(work, "demo"))
        t.add("`vc -w 2` ÷ `vc -w 1`, whole process, demo workspace", f"{ratio:.2f}",
              "≤ 1 (beyond noise: 1.05)", ratio <= 1.05,
              note=f"best of 5 interleaved: {one:.2f} s and {two:.2f} s")
        seconds, rows = vcs_rows(os.path.join(work, "vcs"), 10_000 if q else 100_000)
        t.add(f"`vcs` on a {rows:,}-row result", f"{seconds:.2f} s", "< 1 s", seconds < 1)
        for what, n, k, replays, seconds, verified in repair_bench.transformer_rows(q):
            t.add(f"`fix` replays, Transformer, {what}", f"{replays} for {n} candidates",
                  note=f"a fix of {k} change(s), {'verified' if verified else 'NOT verified'}, "
                       f"{seconds:.1f} s on 2 workers")
        seconds, step, healthy = repair_bench.healthy_row(2 if q else 8)
        t.add(f"`fix` on a healthy step, {2 if q else 8}-layer Transformer, standardised, "
              f"allow_mix_precision", f"{seconds:.2f} s", "< 5 s", seconds < 5,
              note=f"{'none needed, no replay' if healthy else 'REPLAYED or not healthy'}; "
                   f"{seconds / step:.0f} NPU steps of the model ({step * 1e3:.0f} ms each)")
        for n, k, used, bound in repair_bench.synthetic_rows((16, 64, 256) if q else
                                                             (16, 64, 256, 1024)):
            t.add(f"`fix` search alone, {k} culprit(s) among {n} candidates: tests",
                  str(used), note=f"k log2 n = {bound:.0f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = (f"# Benchmark results\n\n`python bench/run.py{' --quick' if q else ''}` on "
            f"{datetime.date.today().isoformat()}: {machine()}. Ratios and rates are measured "
            f"side by side in one run; absolute times on this shared machine are indicative "
            f"only. The whole run took {time.perf_counter() - started:.0f} s.\n\n"
            f"{t.markdown()}\n")
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"\nwritten to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
