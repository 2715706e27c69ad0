"""The interactive shell end to end in a pseudo-terminal: commands, tab completion, help,
unknown words, Ctrl-C during vc, Ctrl-D; and the completion and line handling it is made of."""
import os
import sys

import numpy as np
import pexpect
import pytest

import precision_tool as pt
from precision_tool import hooks
from precision_tool.cli.app import App
from precision_tool.cli.shell import completions, execute, prompt_for
from precision_tool.cli import main

SOFTMAX = "encoder/layer_0/attention/Softmax"
PROMPT = r"PrecisionTool \(.*\) >"          # the workspace shown in it


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A four-layer Transformer step: big enough that vc takes a while to interrupt."""
    root = str(tmp_path_factory.mktemp("shell") / "precision_data")
    m = pt.models.transformer(layers=4)
    d = pt.data.digits(scale=1.0)
    feed = {m.x: d.x_train[:32], m.y: d.y_train[:32]}
    npu = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(precision_mode="allow_mix_precision"), action="dump", data_dir=root))
    cpu = hooks.sess_dump(pt.Session(m.graph), action="dump", data_dir=root)
    npu.run([m.loss, m.train_op], feed)
    cpu.run([m.loss, m.train_op], feed)
    npu.close()
    cpu.close()
    return root


def spawn(root):
    env = dict(os.environ, COLUMNS="80", LINES="50", TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1")
    child = pexpect.spawn(sys.executable, ["-m", "precision_tool", "--data-dir", root, "shell"],
                          env=env, encoding="utf-8", timeout=60, dimensions=(50, 80))
    child.expect(PROMPT)
    return child


def _children(pid):
    """The processes whose parent is pid (from /proc)."""
    kids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return kids


def test_the_shell_in_a_terminal(workspace):
    child = spawn(workspace)
    # tab completion of an option: --by-c<TAB> becomes --by-cosine
    child.send("vcs -l 1 --by-c\t")
    child.expect_exact("osine")                           # the completed rest of the option
    child.send("\r")
    child.expect_exact("op(s) diverge")
    child.expect(PROMPT)
    # completion of an op name from the workspace index
    child.send("ni encoder/layer_3/attention/Soft\t")
    child.expect_exact("max")                              # the rest: Softmax
    child.send("\x1b")                                    # Escape closes the completion menu
    child.send("\x15")                                    # Ctrl-U: clear the line
    child.send("help vcs\r")
    child.expect_exact("Exit code 1 when")
    child.expect(PROMPT)
    child.send("vsc\r")
    child.expect_exact("did you mean")
    child.expect(PROMPT)
    child.send("run echo hello-from-run | tr a-z A-Z\r")   # the user's shell: a pipe
    child.expect_exact("HELLO-FROM-RUN")
    child.expect(PROMPT)
    child.send("clear\r")                                  # a builtin, not an unknown command
    child.expect_exact("\x1b[2J")
    child.expect(PROMPT)
    # Ctrl-C during vc cancels the command, not the shell, and leaves no worker behind (two
    # workers: starting them makes vc outlast the key press, however fast comparing gets)
    child.send("vc -w 2\r")
    child.expect("comparing")
    child.sendintr()
    child.expect_exact("interrupted")
    child.expect(PROMPT)
    if os.path.isdir("/proc"):
        assert _children(child.pid) == []
    child.send("ls -f Softmax\r")
    child.expect_exact("4 op(s) in npu/debug_0")
    child.expect(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    history = open(os.path.join(workspace, ".shell_history")).read()
    assert "ls -f Softmax" in history                     # kept per workspace


def test_completion_words_come_from_the_workspace(workspace):
    app = App(workspace)
    cache = {}
    assert "vcs" in completions(app, "vc", cache) and "vector-summary" in completions(app, "vec", cache)
    assert completions(app, "vcs --by", cache) == ["--by-cosine"]
    assert f"{SOFTMAX}" in completions(app, "ni encoder/layer_0/attention/So", cache)
    files = completions(app, "pt SoftmaxV2.", cache)
    assert files and all(f.endswith(".npy") for f in files)


def test_lines_run_on_one_app(workspace, capsys):
    app = App(workspace)
    assert prompt_for(app).startswith("PrecisionTool (") and prompt_for(app).endswith(") > ")
    assert execute(app, "ls -t SoftmaxV2") == 0
    ws = app.ws
    assert execute(app, "--json ls -t SoftmaxV2") == 0 and app.ws is ws       # index loaded once
    assert execute(app, "exit") is None
    assert execute(app, "clear") == 0 and "clear" in completions(app, "cle", {})
    assert execute(app, 'ni "unterminated') == 2
    assert execute(app, "bogus") == 2 and "unknown command" in capsys.readouterr().err
    app.in_shell = True                      # as run_shell sets it: help is `help CMD` there
    assert execute(app, "pt") == 2 and "(see help pt)" in capsys.readouterr().err
    assert main(["--data-dir", str(workspace), "pt"]) == 2
    assert "(see precision-tool pt --help)" in capsys.readouterr().err


def test_what_a_command_suggests_is_typed_as_the_shell_takes_it(workspace, tmp_path, capsys):
    """vc's pointer to the summary names the command as the user types it: `vcs` in the
    shell, `precision-tool vcs` on the command line."""
    import shutil
    root = str(tmp_path / "precision_data")
    shutil.copytree(workspace, root)          # vc writes its result into the workspace
    for in_shell, want in ((True, "summary: vcs"), (False, "summary: precision-tool vcs")):
        app = App(root)
        app.in_shell = in_shell
        assert execute(app, "vc") == 1             # the softmax overflow diverges
        out = capsys.readouterr().out
        assert want in out.splitlines(), out


# -- the workspace, value completion, run, pipes ----------------------------------------------
def _small_workspace(root):
    """A one-step MLP dump (ops named fc1/..., logits/...): another workspace to switch to."""
    from test_repair import dense_net, dump_step
    dump_step(root, dense_net(), pt.SessionConfig())
    return str(root)


def test_the_shells_workspace_prompt_and_value_completion(workspace, tmp_path):
    other = _small_workspace(tmp_path / "other")
    child = spawn(workspace)
    assert "precision_data)" in child.after
    # --data-dir on one line is that line's: the next line reads the shell's workspace again
    child.send(f"--data-dir {other} ls -t MatMulV2\r")
    child.expect_exact("op(s) in npu/debug_0")
    child.expect(PROMPT)
    child.send("ls -t SoftmaxV2\r")
    child.expect_exact("4 op(s) in npu/debug_0")
    child.expect(PROMPT)
    # use DIR switches: the prompt shows it, and completion offers its names
    child.send(f"use {other}\r")
    child.expect_exact(f"workspace: {other}")
    child.expect(r"PrecisionTool \(.*other\) >")
    child.send("ni logits/Bias\t")
    child.expect_exact("Add")                                # logits/BiasAdd from the new index
    child.send("\x1b\x15")
    # an option's values: dc -f's formats (any case), train -a's actions, the runs
    child.send("dc -f nh\t")
    child.expect_exact("NHWC")
    child.send("\x1b\x15")
    child.send("train -a fu\t")
    child.expect_exact("sion_off")
    child.send("\x1b\x15")
    child.send("ac -rt cp\t")
    child.expect_exact("u/debug_0")
    child.send("\x1b\x15")
    child.sendeof()
    child.expect(pexpect.EOF)


def test_value_completion_reads_the_run_the_command_reads(workspace, tmp_path):
    from precision_tool.cli.shell import _words
    app = App(workspace)
    cache = {}
    assert completions(app, "dc -f n", cache) == ["NCHW", "NHWC"]
    assert completions(app, "train -a ", cache) == ["dump", "overflow", "fusion_off"]
    assert completions(app, "ac -rt ", cache) == ["cpu/debug_0", "npu/debug_0"]
    assert completions(app, "pt -s ", cache) == ["0"]
    assert completions(app, "help vector-", cache) == ["vector-compare", "vector-summary"]
    golden_file = _words(app)["runs"]["cpu/debug_0"]["files"][0]
    stem = golden_file[:-4]
    assert golden_file not in completions(app, f"pt {stem}", cache)        # pt reads the NPU run
    assert golden_file in completions(app, f"pt -r cpu/debug_0 {stem}", cache)
    assert golden_file in completions(app, f"cp SomeNpuFile.npy {stem}", cache)   # cp's RIGHT
    # a new run appears: the words are made anew
    small = _small_workspace(tmp_path / "small")
    app2 = App(small)
    cache2 = {}
    assert completions(app2, "ni fc2/", cache2) == []
    from test_repair import dump_step
    g = pt.Graph("extra", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [None, 4])
        y = pt.placeholder("y", [None], "int32")
        logits = pt.nn.dense(x, 10, name="fc2")
        loss = pt.ops.reduce_mean(pt.ops.sparse_softmax_cross_entropy_with_logits(logits, y))
        train_op = pt.train.SGD(0.1).minimize(loss)
    from test_repair import Net
    dump_step(small, Net(g, [x], y, loss, train_op, [([np.ones((2, 4), np.float32)],
                                                       np.zeros(2, np.int32))]), pt.SessionConfig())
    assert "fc2/MatMul" in completions(app2, "ni fc2/", cache2)


def test_run_goes_through_the_users_shell(workspace, capfd):
    app = App(workspace)
    assert execute(app, "run printf 'a\\nb\\nc\\n' | head -2") == 0
    assert capfd.readouterr().out == "a\nb\n"
    assert execute(app, "run exit 3") == 3


def test_piped_output_keeps_whole_lines(workspace):
    import subprocess
    env = dict(os.environ, COLUMNS="80")
    out = subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir", workspace, "ls",
                          "-n", "Softmax"], capture_output=True, text=True, env=env, timeout=120)
    grep = [line for line in out.stdout.splitlines() if f"{SOFTMAX} " in line]
    assert grep and grep[0].split()[0] == SOFTMAX
    assert max(map(len, out.stdout.splitlines())) > 80          # nothing wrapped at 80
    summary = subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir", workspace,
                              "vcs", "-l", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert any(line.startswith("│ diverges: cosine") and line.rstrip().endswith("│")
               for line in summary.stdout.splitlines()), summary.stdout
