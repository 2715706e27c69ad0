"""The interactive shell end to end in a pseudo-terminal: commands, tab completion, help,
unknown words, Ctrl-C during vc, Ctrl-D; and the completion and line handling it is made of."""
import os
import sys

import pexpect
import pytest

import precision_tool as pt
from precision_tool import hooks
from precision_tool.cli.app import App
from precision_tool.cli.shell import PROMPT, completions, execute
from precision_tool.cli import main

SOFTMAX = "encoder/layer_0/attention/Softmax"


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
    child.expect_exact(PROMPT.strip())
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
    child.expect_exact(PROMPT.strip())
    # completion of an op name from the workspace index
    child.send("ni encoder/layer_3/attention/Soft\t")
    child.expect_exact("max")                              # the rest: Softmax
    child.send("\x1b")                                    # Escape closes the completion menu
    child.send("\x15")                                    # Ctrl-U: clear the line
    child.send("help vcs\r")
    child.expect_exact("Exit code 1 when")
    child.expect_exact(PROMPT.strip())
    child.send("vsc\r")
    child.expect_exact("did you mean")
    child.expect_exact(PROMPT.strip())
    child.send("run echo hello-from-run\r")
    child.expect_exact("hello-from-run")
    child.expect_exact(PROMPT.strip())
    child.send("clear\r")                                  # a builtin, not an unknown command
    child.expect_exact("\x1b[2J")
    child.expect_exact(PROMPT.strip())
    # Ctrl-C during vc cancels the command, not the shell, and leaves no worker behind (two
    # workers: starting them makes vc outlast the key press, however fast comparing gets)
    child.send("vc -w 2\r")
    child.expect("comparing")
    child.sendintr()
    child.expect_exact("interrupted")
    child.expect_exact(PROMPT.strip())
    if os.path.isdir("/proc"):
        assert _children(child.pid) == []
    child.send("ls -f Softmax\r")
    child.expect_exact("4 op(s) in npu/debug_0")
    child.expect_exact(PROMPT.strip())
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
