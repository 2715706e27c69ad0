"""Interrupted, concurrent and failing writes: a killed dump, two compares at once, a second
dump into the same workspace, a full disk. What is on disk always reads, and the index never
names a missing or partial file."""
import errno
import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import precision_tool as pt
from harness import dump_both
from precision_tool import hooks
from precision_tool.dump import Workspace
from precision_tool.kernels import write as writer

KILLS = int(os.environ.get("PRECISION_TOOL_KILLS", "20"))

# both runs dump every step; "ready" once the sessions exist, then steps until killed, or
# until the test is gone (a test run killed mid-test must not leave it dumping until the
# disk is full: it once wrote 55 GB)
SCRIPT = textwrap.dedent("""
    import os, sys, precision_tool as pt
    from precision_tool import hooks
    parent = os.getppid()
    m = pt.models.mlp(hidden=(32,))
    d = pt.data.digits()
    npu = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(), action="dump", dump_step="all"))
    cpu = hooks.sess_dump(pt.Session(m.graph), action="dump", dump_step="all")
    print("ready", flush=True)
    for k in range(100000):
        if os.getppid() != parent:
            break
        for sess in (npu, cpu):
            sess.run([m.loss, m.train_op], {m.x: d.x_train[:64], m.y: d.y_train[:64]})
""")


def _env(root):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRECISION_TOOL_")}
    env["PRECISION_TOOL_DATA"] = root
    return env


def _check_reads_whole(root):
    """Every complete step's index names files that exist and load; nothing else is read."""
    ws = Workspace(root)
    steps = 0
    for run in ws.runs():
        for s in run.steps:
            assert s.complete
            table = ws.index(run, s.step)
            named = {f for f in table.file if f}
            for f in named:
                ws.load(run, s.step, f)
            on_disk = {f for f in os.listdir(s.path) if f.endswith(".npy")}
            assert named == on_disk, (run.name, s.step)
            steps += 1
    return steps


def test_sigkill_at_random_points_always_leaves_a_readable_workspace(tmp_path):
    rng = random.Random(20261122)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    read_steps = []
    for k in range(KILLS):
        root = str(tmp_path / f"ws{k}")
        proc = subprocess.Popen([sys.executable, str(script)], env=_env(root), cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 1.2))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        read_steps.append(_check_reads_whole(root))
    assert max(read_steps) > 0             # the kills did land after whole steps, too


def test_two_compares_at_once_write_separate_results(tmp_path):
    root = str(tmp_path / "ws")
    m = pt.models.mlp(hidden=(8,))
    d = pt.data.digits()
    dump_both(root, m.graph, [m.loss, m.train_op], {m.x: d.x_train[:4], m.y: d.y_train[:4]})
    procs = [subprocess.Popen([sys.executable, "-m", "precision_tool", "--data-dir", root,
                               "--json", "vc"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    import json
    files = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode in (0, 1), err
        files.append(json.loads(out)["result_file"])
    assert files[0] != files[1] and os.path.dirname(files[0]) != os.path.dirname(files[1])
    import pandas as pd
    a, b = (pd.read_csv(f) for f in files)
    assert len(a) == len(b) > 0


def test_a_second_dump_does_not_clobber_the_first(tmp_path):
    root = str(tmp_path / "ws")
    m = pt.models.mlp(hidden=(8,))
    d = pt.data.digits()

    def dump(batch):
        sess = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
            pt.SessionConfig(), action="dump", data_dir=root))
        sess.run([m.loss, m.train_op], {m.x: d.x_train[:batch], m.y: d.y_train[:batch]})
        sess.close()

    def digest(path):
        h = hashlib.sha256()
        for dirpath, _, files in sorted(os.walk(path)):
            for f in sorted(files):
                if f != "run.json" and f != "step_history.csv":
                    h.update(f.encode() + open(os.path.join(dirpath, f), "rb").read())
        return h.hexdigest()
    dump(4)
    first = digest(os.path.join(root, "npu", "debug_0"))
    dump(8)
    assert digest(os.path.join(root, "npu", "debug_0")) == first
    assert [r.name for r in Workspace(root).runs("npu")] == ["debug_0", "debug_1"]


THREADS = ["C writer thread", "Python writer thread"]


def _full_on_step_1(tmp_path, monkeypatch, thread):
    """ENOSPC on the third tensor file of step 1. The C module's thread writes that file into
    /dev/full (a real ENOSPC from write(2)); the Python path's write call raises it. Returns
    where the path that failed will be."""
    calls = {"path": None}
    if thread == "C writer thread":
        from precision_tool.kernels import native
        from precision_tool.dump.stepplan import StepPlan
        if native._reduce is None:
            pytest.skip("the C module is not built here")
        monkeypatch.delenv("PRECISION_TOOL_NUMPY_ONLY", raising=False)
        full = str(tmp_path / "full.npy")
        os.symlink("/dev/full", full)
        fill = StepPlan.fill

        def fill_one_full(self, directory, stamps, values):
            filled = fill(self, directory, stamps, values)
            if directory.endswith(".1.partial") and calls["path"] is None:
                calls["path"] = full
                filled.paths[2] = full
            return filled
        monkeypatch.setattr(StepPlan, "fill", fill_one_full)
    else:
        monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")
        real = writer.write_files

        def full_disk(paths, arrays, headers, halves, links=(), renames=(), dirs=()):
            paths = [os.fsdecode(p) for p in paths]
            if "/.1.partial/" in paths[0].replace(os.sep, "/") and calls["path"] is None:
                real(paths[:2], arrays[:2], headers[:2], halves[:2], dirs=dirs)
                calls["path"] = paths[2]
                raise OSError(errno.ENOSPC, "No space left on device", paths[2])
            return real(paths, arrays, headers, halves, links, renames, dirs)
        monkeypatch.setattr("precision_tool.dump.stepplan.write_files", full_disk)
    return calls


@pytest.mark.parametrize("thread", THREADS)
def test_a_full_disk_raises_when_asked_naming_the_path_and_keeps_what_was_written(
        tmp_path, monkeypatch, thread):
    """on_write_error="raise": the error names the file, step 0 stays whole, step 1 is
    never read."""
    root = str(tmp_path / "ws")
    calls = _full_on_step_1(tmp_path, monkeypatch, thread)
    m = pt.models.mlp(hidden=(8,))
    d = pt.data.digits()
    sess = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(), action="dump", dump_step="0|1|2", data_dir=root,
        on_write_error="raise"))
    feed = {m.x: d.x_train[:4], m.y: d.y_train[:4]}
    with pytest.raises(pt.PrecisionToolError) as err:
        for _ in range(3):
            sess.run([m.loss, m.train_op], feed)
        sess.close()
    message = str(err.value)
    assert "No space left on device" in message and calls["path"] in message
    assert "\n" not in message
    ws = Workspace(root)
    run = ws.run("npu")
    assert [s.step for s in run.steps if s.complete] == [0]
    assert run.interrupted == [1]
    _check_reads_whole_complete(ws, run)


@pytest.mark.parametrize("thread", THREADS)
def test_a_full_disk_stops_the_dump_and_never_the_training(tmp_path, monkeypatch, thread,
                                                           capsys):
    """The default: the step that cannot be written ends the dump with one warning naming
    the cause and the step; every training step still runs, to the same weights as an
    undumped run; its partial files are gone, run.json says why, and readers say it too."""
    root = str(tmp_path / "ws")
    calls = _full_on_step_1(tmp_path, monkeypatch, thread)
    m = pt.models.mlp(hidden=(8,))
    d = pt.data.digits()
    feed = {m.x: d.x_train[:4], m.y: d.y_train[:4]}
    sess = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(), action="dump", dump_step="0|1|2|3", data_dir=root))
    plain = pt.Session(m.graph, target="npu")
    for _ in range(5):
        sess.run([m.loss, m.train_op], feed)
        plain.run([m.loss, m.train_op], feed)
    sess.close()
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "dumping stopped" in line]
    assert len(warnings) == 1, err
    assert "dumping stopped at step 1 of " in warnings[0]
    assert "No space left on device" in warnings[0] and calls["path"] in warnings[0]
    assert "steps on disk: 0;" in warnings[0] and "training goes on" in warnings[0]
    assert sess.step == 5
    for name, value in plain.variables().items():
        np.testing.assert_array_equal(sess.variables()[name], value, err_msg=name)
    ws = Workspace(root)
    run = ws.run("npu")
    assert [s.step for s in run.steps if s.complete] == [0]
    assert run.partials == [] and run.interrupted == []     # its files were deleted
    assert run.info["dump_stopped"]["step"] == 1
    assert "No space left on device" in run.info["dump_stopped"]["error"]
    assert run.info["dumped_steps"] == [0]
    _check_reads_whole_complete(ws, run)
    # every observed step is in the history, the dump's end did not lose them
    assert list(ws.step_history(run).step) == [0, 1, 2, 3, 4]


def _check_reads_whole_complete(ws, run):
    for s in run.steps:
        if s.complete:
            for f in ws.index(run, s.step).file:
                if f:
                    ws.load(run, s.step, f)


def test_buffers_written_in_short_writes_arrive_whole(tmp_path, monkeypatch):
    """writev may write less than asked (a signal, a nearly full disk): the rest follows."""
    from precision_tool import fileio
    real = os.writev
    calls = []

    def short(fd, views):
        calls.append(len(views))
        return real(fd, [bytes(views[0])[:5]])
    monkeypatch.setattr(fileio.os, "writev", short)
    buffers = [np.arange(n, dtype=np.uint8) for n in (0, 3, 17, 1, 0, 40)]
    path = tmp_path / "b.bin"
    fileio.write_buffers(str(path), buffers)
    assert path.read_bytes() == b"".join(b.tobytes() for b in buffers)
    assert len(calls) > 3
    monkeypatch.setattr(fileio.os, "writev", lambda fd, views: 0)
    with pytest.raises(OSError, match="accepted no bytes"):   # never a silent endless loop
        fileio.write_buffers(str(path), buffers)


def test_a_bundle_that_cannot_be_written_names_its_file(tmp_path):
    from precision_tool import fileio
    with pytest.raises(OSError) as err:
        fileio.write_buffers(str(tmp_path / "missing" / "b.bin"), [b"abc"])
    assert err.value.errno == errno.ENOENT and "b.bin" in err.value.filename


def test_a_workspace_that_cannot_be_made_is_a_one_line_dump_error(tmp_path, capsys):
    """The workspace root under a file: asked to raise, the session that would dump fails at
    once with a DumpWriteError naming the path, not an OSError from deep inside the dump
    layer; by default it warns once and trains undumped."""
    (tmp_path / "a-file").write_text("x")
    m = pt.models.mlp(hidden=(8,))
    where = str(tmp_path / "a-file" / "ws")
    cfg = hooks.session_dump_config(pt.SessionConfig(), action="dump", data_dir=where,
                                    on_write_error="raise")
    with pytest.raises(pt.PrecisionToolError) as err:
        pt.Session(m.graph, target="npu", config=cfg)
    message = str(err.value)
    assert message.startswith("cannot write the dump: Not a directory (")
    assert str(tmp_path / "a-file") in message and "\n" not in message
    sess = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(), action="dump", data_dir=where))
    d = pt.data.digits()
    for _ in range(2):
        sess.run([m.loss, m.train_op], {m.x: d.x_train[:4], m.y: d.y_train[:4]})
    sess.close()
    err = capsys.readouterr().err
    assert err.count("dumping stopped") == 1 and "Not a directory" in err, err
    assert hooks.dump_dirs(sess) == []


def test_how_a_script_ended_names_a_step_before_it_cut_off_while_written():
    """A killed script's run: the warning says which steps before the one it died in are
    on disk, and names the one its writer was still writing (partial) as not."""
    from precision_tool.dump.run import Run
    failed = {"script_failed": {"step": 3, "error": "killed by SIGKILL"}}
    assert Run("cpu", "debug_0", "/ws/cpu/debug_0", dict(failed)).ended_early == (
        "the script ended in step 3 (killed by SIGKILL): that step is not dumped, the steps "
        "before it are")
    cut = Run("cpu", "debug_0", "/ws/cpu/debug_0", dict(failed), interrupted=[2])
    assert cut.ended_early.endswith("the steps before it are but 2, cut off while written")
    assert Run("cpu", "debug_0", "/ws/cpu/debug_0", {}).ended_early == ""
