"""The compare engines: ranges of a split tensor merge into the single-pass numbers; local
worker processes and a Dask cluster give the local run's result exactly."""
import gc
import json
import os
import threading

import numpy as np
import pandas as pd
import pytest

import precision_tool as pt
from harness import dump_both
from precision_tool import analysis
from precision_tool.analysis.comparing import engine
from precision_tool.analysis.comparing.metrics import compare_tensors, finish
from precision_tool.kernels.totals import Totals, add_kl_sums, block_pairs, kl_sums, range_totals
from precision_tool.dump import Workspace


def _pair(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n).astype(np.float32)
    y = (x + rng.normal(scale=1e-3, size=n)).astype(np.float32)
    x[::997] = np.nan                    # non-finite elements left out, counted per side
    y[5::1013] = np.inf
    y[::7] = 0                           # flushed / relative-error edge cases
    return x, y


def test_ranges_merge_into_the_single_pass_result():
    x, y = _pair(300_000)
    whole = compare_tensors(x, y)
    cuts = [0, 70_000, 131_072, 250_001, 300_000]        # uneven, not block-aligned
    t = Totals()
    for s, e in zip(cuts, cuts[1:]):
        t.merge(range_totals(x, y, s, e))
    sums = None
    for s, e in zip(cuts, cuts[1:]):
        part = kl_sums(block_pairs(x, y, s, e), t.ranges())
        sums = part if sums is None else add_kl_sums(sums, part)
    t.set_kl(sums)
    merged = finish(t)
    assert set(merged) == set(whole)
    for k, v in whole.items():
        if isinstance(v, float) and np.isfinite(v):
            assert merged[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
        else:
            assert merged[k] == v or (v != v and merged[k] != merged[k]), k


def _workspace(root, layers=1):
    m = pt.models.transformer(layers=layers)
    d = pt.data.digits()
    dump_both(root, m.graph, [m.loss, m.train_op], {m.x: d.x_train[:16], m.y: d.y_train[:16]},
              pt.SessionConfig(precision_mode="allow_mix_precision"))
    return Workspace(root)


def _same(a: pd.DataFrame, b: pd.DataFrame):
    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True),
                                  check_exact=True)


def test_worker_processes_give_the_local_result(tmp_path, monkeypatch):
    monkeypatch.setattr(engine, "POOL_SECONDS", 0.0)      # the pool, however small the work
    ws = _workspace(str(tmp_path))
    local = analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
    seen = []
    pooled = analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0, workers=2,
                                     progress=lambda k, n: seen.append((k, n)))
    _same(local, pooled)
    done = [k for k, _ in seen]
    assert done == sorted(done) and seen[-1][0] == seen[-1][1] and len(local) > 100


def test_split_tensors_give_the_same_numbers_on_every_engine(tmp_path, monkeypatch):
    """With tiny split sizes and no batching every tensor is compared on its own or in
    ranges: the serial engine and the worker pool agree bit for bit, and both agree with the
    batched compare to rounding."""
    ws = _workspace(str(tmp_path))
    whole = analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
    monkeypatch.setattr(engine, "BATCH_BYTES", 0)
    monkeypatch.setattr(engine, "SPLIT_ELEMENTS", 300)
    monkeypatch.setattr(engine, "RANGE_ELEMENTS", 256)
    split = analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
    monkeypatch.setattr(engine, "POOL_SECONDS", 0.0)
    _same(split, analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0, workers=2))
    cos_a, cos_b = whole.CosineSimilarity.to_numpy(), split.CosineSimilarity.to_numpy()
    assert np.array_equal(np.isnan(cos_a), np.isnan(cos_b))
    np.testing.assert_allclose(cos_b[~np.isnan(cos_b)], cos_a[~np.isnan(cos_a)], rtol=1e-12)
    assert (whole.Verdict == split.Verdict).all()


def test_a_pool_starts_only_for_work_worth_it(tmp_path, monkeypatch):
    """Work this process finishes in under POOL_SECONDS stays here whatever -w asks (a pool
    costs its start and a round trip a task); more work starts the pool."""
    ws = _workspace(str(tmp_path))
    pairs = [engine.Pair(engine.Side(os.path.join(ws.root, "x.npy")),
                         engine.Side(os.path.join(ws.root, "x.npy")))]
    np.save(os.path.join(ws.root, "x.npy"), np.arange(4096, dtype=np.float32))
    for seconds, started in ((1e9, False), (0.0, True)):
        monkeypatch.setattr(engine, "POOL_SECONDS", seconds)
        e = engine.ProcessEngine(2)
        try:
            (row,) = engine.compare_pairs(ws.root, pairs, e)
            assert (e.pool is not None) == started and row["CosineSimilarity"] == 1.0
        finally:
            e.close()


def test_pairs_side_by_side_on_threads_give_the_serial_result(tmp_path, monkeypatch):
    """Here, pair tasks run on kernels.threads() threads: the same rows as one at a time."""
    ws = _workspace(str(tmp_path))
    monkeypatch.setattr(engine, "BATCH_BYTES", 0)          # every pair a task of its own
    monkeypatch.setenv("PRECISION_TOOL_THREADS", "1")
    serial = analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
    monkeypatch.setenv("PRECISION_TOOL_THREADS", "2")
    _same(serial, analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0))


def test_a_pair_is_planned_by_its_index_size_and_compared_by_its_file(tmp_path, monkeypatch):
    """compare_pairs plans a side by the size its index gave (no stat per file) and falls
    back to the file's size where the index gave none; an index that understates a file
    changes the plan, never the numbers: the file is what is read (mapped if large)."""
    x, y = _pair(3_000_000, seed=5)            # 12 MB a side: above BATCH_BYTES, MAP_BYTES
    for name, a in (("x", x), ("y", y)):
        np.save(tmp_path / f"{name}.npy", a)
    sides = [str(tmp_path / f"{name}.npy") for name in "xy"]
    stats = []
    real_getsize = os.path.getsize
    monkeypatch.setattr(os.path, "getsize", lambda p: stats.append(p) or real_getsize(p))
    rows = {}
    for nbytes in (-1, x.nbytes, 64):              # unknown, what the index says, a lie
        pair = engine.Pair(*(engine.Side(p, nbytes=nbytes) for p in sides))
        stats.clear()
        (rows[nbytes],) = engine.compare_pairs(str(tmp_path), [pair], engine.Engine())
        assert stats == (sides if nbytes < 0 else []), nbytes
    expected = compare_tensors(x, y)
    for row in rows.values():
        for k, v in expected.items():
            assert row[k] == v or (v != v and row[k] != row[k]), k


def test_totals_of_the_c_pass_have_every_field_of_totals():
    """Totals.from_native makes its object without __init__ (thousands of small pairs):
    it must set every field __init__ does, whatever is added to Totals later."""
    from precision_tool.kernels import native
    if not native.enabled():
        pytest.skip("the C module's totals are what this is about")
    x, y = _pair(1000)
    for hint in (None, (0.0, 1.0, 0.0, 1.0)):
        t = Totals.from_native(native.compare(x, y, 0, x.size, hint), hint)
        assert set(vars(t)) == set(vars(Totals())), hint
        assert t.kl != t.kl and t.reasons == [] and not t.empty
    empty = Totals.from_native(native.compare(x[:0], y[:0], 0, 0))
    assert set(vars(empty)) == set(vars(Totals())) and empty.moments == Totals().moments


def test_the_metrics_square_root_is_numpys_on_every_edge():
    """kernels.totals.sqrt stands for np.sqrt on the totals' floats: the same value, bit for
    bit, nan below zero and for nan, inf for inf, -0.0 for -0.0."""
    from precision_tool.kernels.totals import sqrt
    values = [0.0, -0.0, 5e-324, 1e-310, 0.25, 2.0, 1e308, float("inf"), float("nan"), -1e-300,
              -1.0, float("-inf")] + list(np.random.default_rng(0).uniform(0, 1e6, 100))
    with np.errstate(invalid="ignore"):
        for v in values:
            want, got = float(np.sqrt(v)), sqrt(float(v))
            assert (want == got and np.signbit(want) == np.signbit(got)) or \
                (want != want and got != got), v


def test_split_ranges_go_in_groups_here_and_one_a_task_to_workers(monkeypatch):
    monkeypatch.setattr(engine, "RANGE_ELEMENTS", 10)
    monkeypatch.setattr(engine, "GROUP_ELEMENTS", 30)
    spans = [(s, min(s + 10, 75)) for s in range(0, 75, 10)]
    here = engine.Engine().tasks_of(spans)
    assert here == [spans[0:3], spans[3:6], spans[6:8]]
    assert engine._WorkerEngine().tasks_of(spans) == [[s] for s in spans]


def test_a_dask_cluster_gives_the_local_result(tmp_path):
    distributed = pytest.importorskip("distributed")
    ws = _workspace(str(tmp_path))
    local = analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster:
        on_cluster = analysis.vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0,
                                             scheduler=cluster.scheduler_address)
    _same(local, on_cluster)


def test_vc_takes_workers_and_an_unreachable_scheduler_is_one_line_exit_2(tmp_path):
    pytest.importorskip("distributed")
    from click.testing import CliRunner
    from precision_tool.cli import cli
    root = str(tmp_path)
    _workspace(root)
    runner = CliRunner()
    ok = runner.invoke(cli, ["--data-dir", root, "--json", "vc", "-w", "2"])
    assert ok.exit_code in (0, 1), ok.output
    bad = runner.invoke(cli, ["--data-dir", root, "vc", "--scheduler", "tcp://127.0.0.1:9"])
    assert bad.exit_code == 2
    assert "cannot reach the Dask scheduler tcp://127.0.0.1:9" in bad.output
    assert "Traceback" not in bad.output


def test_an_unreadable_tensor_is_a_row_with_its_reason(tmp_path):
    ws = _workspace(str(tmp_path))
    run = ws.run("npu")
    table = ws.index(run, 0)
    victim = table.file[table.file != ""].iloc[0]
    path = f"{ws.step_path(run, 0)}/{victim}"
    with open(path, "r+b") as f:
        f.truncate(20)
    result = analysis.vector_compare(Workspace(ws.root), ws.run("npu"), ws.run("cpu"), 0)
    bad = result[result.CompareFailReason.str.contains("corrupt|unreadable|cannot be loaded",
                                                       regex=True, na=False)]
    assert len(bad) >= 1 and (bad.Verdict == "error").all()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are a POSIX thing")
def test_a_named_pipe_where_a_file_should_be_is_an_error_never_a_wait(tmp_path):
    """A named pipe in place of a tensor file, or of a run's compiled graph, is said to be
    what it is (no open or read waits for a writer that never comes): vc, as a process, with
    a deadline, so that a wait fails this test instead of hanging the suite."""
    import subprocess
    import sys
    ws = _workspace(str(tmp_path))
    run = ws.run("npu")
    step_dir = ws.step_path(run, 0)
    victim = ws.index(run, 0).file.iloc[0]
    os.remove(os.path.join(step_dir, victim))
    os.mkfifo(os.path.join(step_dir, victim))
    vc = [sys.executable, "-m", "precision_tool", "--data-dir", ws.root, "--json", "vc"]
    out = subprocess.run(vc, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr                   # incomplete: one tensor unread
    assert "is not a regular file (a pipe, a socket or a device)" in out.stdout + out.stderr \
        or "not a regular file" in open(json.loads(out.stdout)["result_file"]).read()
    graph_dir = os.path.join(run.path, "graph")
    (graph,) = os.listdir(graph_dir)
    os.remove(os.path.join(graph_dir, graph))
    os.mkfifo(os.path.join(graph_dir, graph))
    out = subprocess.run(vc, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"cannot read compiled graph {os.path.join(graph_dir, graph)}: not a regular " \
           f"file (a pipe, a socket or a device)" in out.stderr, out.stderr


def test_a_compare_maps_files_above_map_bytes_where_a_plain_load_reads_them(tmp_path):
    """The engine only reads its tensors: a file over MAP_BYTES is mapped read-only (no copy
    out of the page cache), one under it read whole; Workspace.load_file keeps reading files
    up to MMAP_BYTES, as writable arrays. The values are the same either way."""
    from precision_tool.dump.formats import MMAP_BYTES
    ws = Workspace(str(tmp_path))
    big = np.random.default_rng(3).normal(size=engine.MAP_BYTES // 4 + 16).astype(np.float32)
    small = big[:1000].copy()
    assert big.nbytes < MMAP_BYTES
    for name, a in (("big", big), ("small", small)):
        np.save(tmp_path / f"{name}.npy", a)
    mapped = engine._load(ws, engine.Side(str(tmp_path / "big.npy")))
    assert isinstance(mapped, np.memmap) and not mapped.flags.writeable
    assert np.array_equal(mapped, big)
    read = engine._load(ws, engine.Side(str(tmp_path / "small.npy")))
    assert not isinstance(read, np.memmap) and np.array_equal(read, small)
    plain = ws.load_file(str(tmp_path / "big.npy"))
    assert not isinstance(plain, np.memmap) and plain.flags.writeable
    assert np.array_equal(plain, big)


def test_a_closed_dump_writer_is_not_taken_for_a_running_one():
    """A joined thread stays in /proc for a moment while the kernel finishes its exit (a
    fifth of the time here, right after close()): the writer renames itself as it ends, so
    a pool started right after a dump closed may fork."""
    from precision_tool.kernels import native
    from precision_tool.dump.writer import NativeWriter
    if not native.enabled() or not os.path.isdir("/proc/self/task"):
        pytest.skip("the C module's writer thread, as Linux lists it, is what this is about")
    for _ in range(300):
        w = NativeWriter()
        assert native.writer_running()
        w.close()
        assert not native.writer_running()


def test_worker_processes_are_not_forked_while_a_dump_writer_runs(tmp_path):
    """fork copies other threads' locks as they are: with a dump's C writer thread alive
    (which threading does not list) the pool spawns its workers; once it stops, it forks."""
    from precision_tool.kernels import native
    from precision_tool.dump.writer import NativeWriter
    if not native.enabled():
        pytest.skip("the C module's writer thread is what this is about")

    def start_method():
        e = engine.ProcessEngine(1)
        try:
            e.start()
            return e.pool._mp_context.get_start_method()
        finally:
            e.close()
    gc.collect()                # the writers of sessions other tests left open
    assert not native.writer_running()
    if threading.active_count() == 1:       # (a Python dump writer thread counts too)
        assert start_method() == "fork"
    w = NativeWriter()
    try:
        assert native.writer_running()
        assert start_method() == "spawn"
    finally:
        w.close()
    assert not native.writer_running()
