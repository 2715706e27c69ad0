"""Where results go: a read-only workspace (a shared dump, a read-only mount) works for every
analysis command, its results written beside it; a results directory that cannot be written
either keeps what a long command found (printed, exit 2); a full disk while a script dumps
stops the dump and never the training. The read-only mounts and the small tmpfs are real:
made in a user and mount namespace (`unshare -rm`), so that they refuse even root."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from precision_tool.dump import Workspace, layout


def _namespaces() -> str:
    """Why mounts cannot be made here, or "" when they can."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt "
                            "2>/dev/null || mount -t tmpfs -o size=64k tmpfs /tmp"],
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else \
        f"user and mount namespaces are not allowed here: {probe.stderr.strip()[:200]}"


NO_NAMESPACES = _namespaces()
needs_mounts = pytest.mark.skipif(bool(NO_NAMESPACES), reason=NO_NAMESPACES or "-")


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRECISION_TOOL_")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), COLUMNS="200")
    return env


def _tool(*args) -> str:
    return " ".join([sys.executable, "-m", "precision_tool", *args])


def _in_namespace(tmp_path, setup: str, commands: list, env=None) -> list:
    """Run the shell commands after setup (mounts) in a new user and mount namespace; per
    command (exit code, stdout, stderr)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    lines = ["set -u", setup]
    for k, cmd in enumerate(commands):
        lines.append(f"{cmd} > {out}/{k}.out 2> {out}/{k}.err; echo $? > {out}/{k}.rc")
    script = tmp_path / "ns.sh"
    script.write_text("\n".join(lines) + "\n")
    done = subprocess.run(["unshare", "-rm", "bash", str(script)], env=env or _env(tmp_path),
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return [(int((out / f"{k}.rc").read_text()), (out / f"{k}.out").read_text(),
             (out / f"{k}.err").read_text()) for k in range(len(commands))]


def _read_only(path) -> str:
    return f"mount --bind {path} {path} && mount -o remount,bind,ro {path}"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's workspace: the fused softmax overflows; fix finds SoftmaxFusionPass."""
    root = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRECISION_TOOL_")}
    done = subprocess.run([sys.executable, "-m", "precision_tool", "demo", "--steps", "5"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr
    return root / "precision_data"


def _listing(root) -> list:
    return sorted((os.path.relpath(os.path.join(d, f), root), os.path.getsize(os.path.join(d, f)))
                  for d, _, files in os.walk(root) for f in files)


@needs_mounts
def test_every_analysis_command_works_on_a_read_only_workspace(demo, tmp_path):
    ws = tmp_path / "precision_data"
    shutil.copytree(demo, ws)
    before = _listing(ws)
    commands = [_tool("vc", "-s", "0"), _tool("vcs"), _tool("ac", "-c"), _tool("report"),
                _tool("ni", "encoder/layer_0/attention/Softmax", "-s", "1"),
                _tool("pt", "-c", "encoder/layer_0/attention/Softmax"), _tool("--json", "fo"),
                _tool("--json", "fix"), _tool("ls"), _tool("clean"),
                _tool("train", "-d", "npu"),
                _tool("cp", "encoder/layer_0/attention/Softmax", "encoder/layer_0/attention/Softmax"),
                _tool("check"), _tool("wp")]
    results = _in_namespace(tmp_path, _read_only(ws), commands)
    for cmd, (rc, out, err) in zip(commands, results):
        assert rc in (0, 1), (cmd, rc, err[-800:])
        assert "Traceback" not in err and "Read-only file system" not in err, (cmd, err)
    assert _listing(ws) == before                  # the workspace is as it was
    where, why = layout.resolve_results(str(ws))
    assert why == "workspace"                      # writable again out of the namespace
    elsewhere = tmp_path / "cache" / "precision_tool" / "results"
    (made,) = os.listdir(elsewhere)
    made = elsewhere / made
    # said once per command, by the commands that wrote something
    vc_err = results[0][2]
    assert vc_err.count("cannot be written: results go to") == 1 and str(made) in vc_err
    assert "results go to" not in results[1][2] and "results go to" not in results[8][2]
    # each command's product is there, and the commands after it found it
    assert results[1][0] == 1                      # vcs read vc's result from there
    assert (made / "report.html").is_file() and (made / "config" / "fix.json").is_file()
    assert list((made / "temp" / "op_graph").iterdir())
    assert list((made / "temp" / "print_tensor").iterdir())
    fo = json.loads(results[6][1])
    fix = json.loads(results[7][1])
    assert fix["verified"] and fix["files"][0].startswith(str(made))
    # the replays are runs of the workspace, named after its own runs
    replays = fo["runs"]
    assert replays and all(r != "debug_0" for r in replays) and fo["kept"] == replays[:1]
    assert f"npu/{fo['kept'][0]}" in results[8][1]          # ls lists it
    # clean deleted the replays and the older results beside it, nothing of the workspace
    cleaned = results[9][1]
    assert f"deleted {made / 'npu' / replays[0]} " in cleaned and "a replay of npu/debug_0" in cleaned
    assert str(ws) not in cleaned
    # train replayed into the results directory after clean, and says where
    assert "replayed into npu/debug_" in results[10][1]


@needs_mounts
def test_a_results_directory_that_cannot_be_written_keeps_the_work(demo, tmp_path):
    """fix and vc did their work: the fix and the compare are printed, the error names the
    directory and how to write elsewhere, exit 2."""
    ws = tmp_path / "precision_data"
    shutil.copytree(demo, ws)
    nowhere = tmp_path / "nowhere"
    nowhere.mkdir()
    commands = [_tool("fix", "--results-dir", str(nowhere)),
                _tool("vc", "-s", "0", "--results-dir", str(nowhere)),
                _tool("--results-dir", str(nowhere), "ac", "-c")]
    (fix, vc, ac) = _in_namespace(tmp_path, _read_only(ws) + " && " + _read_only(nowhere),
                                  commands)
    assert fix[0] == 2, fix[2]
    assert "--- fusion_switch.cfg ---" in fix[1] and "SoftmaxFusionPass" in fix[1]
    last = fix[2].strip().splitlines()[-1]
    assert "the fix was found but not saved" in last and str(nowhere) in last
    assert "--results-dir DIR" in last
    assert vc[0] == 2 and "op(s) diverge" in vc[1] and "encoder/layer_0" in vc[1]
    assert "was not saved" in vc[2] and str(nowhere) in vc[2]
    assert ac[0] == 1 and "compare result was not saved" in ac[2]   # the verdict stands


def test_results_go_where_asked_else_the_workspace_else_a_cache_named_after_it(tmp_path,
                                                                             monkeypatch):
    root = tmp_path / "ws"
    root.mkdir()
    monkeypatch.delenv(layout.ENV_RESULTS, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    assert layout.resolve_results(str(root)) == (str(root), "workspace")
    assert layout.resolve_results(str(root), str(tmp_path / "r")) == (str(tmp_path / "r"), "given")
    monkeypatch.setenv(layout.ENV_RESULTS, str(tmp_path / "e"))
    assert layout.resolve_results(str(root)) == (str(tmp_path / "e"), "given")
    monkeypatch.delenv(layout.ENV_RESULTS)
    monkeypatch.setattr(layout, "writable", lambda path: False)
    a, why = layout.resolve_results(str(root))
    assert why == "read-only" and a.startswith(str(tmp_path / "c" / "precision_tool" / "results"))
    assert layout.resolve_results(str(root))[0] == a             # the same every time
    other = tmp_path / "x" / "ws"
    assert layout.resolve_results(str(other))[0] != a            # another workspace, another
    assert os.path.basename(a).startswith("ws-")


def test_replays_beside_a_workspace_are_its_runs_and_never_share_a_name(tmp_path):
    """A run in the results directory is listed with the workspace's; numbering continues
    after the workspace's runs; a compare result there is found."""
    import precision_tool as pt
    from precision_tool import hooks
    root, results = str(tmp_path / "ws"), str(tmp_path / "res")
    m = pt.models.mlp(hidden=(8,))
    d = pt.data.digits()
    feed = {m.x: d.x_train[:4], m.y: d.y_train[:4]}
    for _ in range(2):
        with pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
                pt.SessionConfig(), action="dump", data_dir=root)) as sess:
            sess.run([m.loss, m.train_op], feed)
    ws = Workspace(root, results)
    assert ws.first_free("npu") == 2
    with pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
            pt.SessionConfig(), action="dump", data_dir=ws.results_dir(),
            replay_of="npu/debug_0", first_free=ws.first_free("npu"))) as sess:
        sess.run([m.loss, m.train_op], feed)
    runs = ws.reopened().runs("npu")
    assert [r.name for r in runs] == ["debug_0", "debug_1", "debug_2"]
    assert runs[2].path == os.path.join(results, "npu", "debug_2")
    assert ws.reopened().run("npu").name == "debug_1"     # a replay is never the default
    # a file of the results directory is read as the workspace's own
    again = ws.reopened()
    row = again.index(runs[2], 0).iloc[0]
    assert again.load(runs[2], 0, row.file).size


# -- a full disk while a training script dumps -----------------------------------------------
TRAIN = textwrap.dedent("""
    import sys, numpy as np, precision_tool as pt
    from precision_tool import hooks
    m = pt.models.mlp(hidden=(64,))
    d = pt.data.digits()
    npu = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(), action="dump", dump_step="all", data_dir=sys.argv[1]))
    plain = pt.Session(m.graph, target="npu")
    feed = {m.x: d.x_train[:64], m.y: d.y_train[:64]}
    for k in range(int(sys.argv[2])):
        npu.run([m.loss, m.train_op], feed)
        plain.run([m.loss, m.train_op], feed)
    npu.close()
    same = all(np.array_equal(v, npu.variables()[k]) for k, v in plain.variables().items())
    print(f"trained {npu.step} steps; same weights as undumped: {same}")
""")


@needs_mounts
def test_a_full_tmpfs_stops_the_dump_and_the_training_finishes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    disk = tmp_path / "disk"
    disk.mkdir()
    ws = disk / "precision_data"
    other = tmp_path / "other"
    other.mkdir()
    runner = _tool("--data-dir", str(other / "pd"), "npu-dump", "--dump-step", "0-39", "--",
                   sys.executable, str(script), "''", "40")
    commands = [f"{sys.executable} {script} {ws} 40", _tool("--data-dir", str(ws), "--json", "ls"),
                f"df -k {disk}", _tool("--data-dir", str(ws), "clean"), runner]
    train, ls, df, clean, ran = _in_namespace(
        tmp_path, f"mount -t tmpfs -o size=1200k tmpfs {disk} && "
                  f"mount -t tmpfs -o size=1200k tmpfs {other}", commands)
    assert train[0] == 0, train[2]
    assert "trained 40 steps; same weights as undumped: True" in train[1]
    warnings = [line for line in train[2].splitlines() if "dumping stopped" in line]
    assert len(warnings) == 1, train[2]
    assert "No space left on device" in warnings[0] and "training goes on" in warnings[0]
    (run,) = json.loads(ls[1])["runs"]
    assert 0 < len(run["steps"]) < 40 and run["partial_steps"] == []
    assert run["dump_stopped"]["step"] == len(run["steps"])
    assert "No space left on device" in run["dump_stopped"]["error"]
    assert ls[0] == 0 and "dumping stopped" not in ls[2]
    assert clean[0] == 0
    # under the script runner: the script finishes, the job says its dump stopped, exit 2
    assert ran[0] == 2, ran[2]
    assert "trained 40 steps; same weights as undumped: True" in ran[1]
    assert "the dump stopped at step" in ran[1] and "No space left on device" in ran[1]
    assert ran[2].strip().splitlines()[-1].startswith("error: the dump of npu/debug_0 stopped")
