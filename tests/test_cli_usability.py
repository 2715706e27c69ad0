"""The command line as people use it, one-shot: housekeeping (clean, ls's runs), help as a
command, one hint per unknown word, runner options per target, demo's exit code."""
import json
import os
import re

import pytest

from click.testing import CliRunner

import precision_tool as pt
from precision_tool.cli import cli
from test_repair import dense_net, dump_step


def invoke(root, *args):
    return CliRunner().invoke(cli, ["--data-dir", str(root), *args])


def test_clean_deletes_replays_and_old_results_and_nothing_else(tmp_path):
    dump_step(tmp_path, dense_net(), pt.SessionConfig(precision_mode="allow_mix_precision"))
    assert invoke(tmp_path, "train", "-d", "npu").exit_code in (0, 1)      # a replay run
    for _ in range(3):
        assert invoke(tmp_path, "vc").exit_code in (0, 1)                 # three results
    listing = json.loads(invoke(tmp_path, "--json", "ls").output)
    replays = [r["run"] for r in listing["runs"] if r["replay_of"]]
    assert replays == ["npu/debug_1"] and "npu/debug_1" not in listing["counts"]
    results = os.listdir(tmp_path / "temp" / "vector_compare")
    dry = json.loads(invoke(tmp_path, "--json", "clean", "-n").output)
    assert dry["dry_run"] and len(dry["deleted"]) == 1 + len(results) - 1
    assert os.path.isdir(tmp_path / "npu" / "debug_1")                   # a dry run deletes nothing
    done = invoke(tmp_path, "clean", "--keep", "2")
    assert done.exit_code == 0 and "deleted" in done.output
    assert not os.path.exists(tmp_path / "npu" / "debug_1")
    assert sorted(os.listdir(tmp_path / "temp" / "vector_compare")) == sorted(results)[-2:]
    assert os.path.isdir(tmp_path / "npu" / "debug_0") and os.path.isdir(tmp_path / "cpu" / "debug_0")
    assert "nothing to delete" in invoke(tmp_path, "clean", "--no-results").output


def test_help_is_a_command_and_unknown_words_get_one_hint(tmp_path):
    out = invoke(tmp_path, "help")
    assert out.exit_code == 0 and "Commands" in out.output
    assert "Exit code 1 when" in invoke(tmp_path, "help", "vcs").output
    unknown = CliRunner().invoke(cli, ["xyzzy"])
    assert unknown.exit_code == 2 and unknown.output.count("--help") == 1
    assert "--fusion-off" not in invoke(tmp_path, "cpu-dump", "--help").output
    assert "--fusion-off" in invoke(tmp_path, "npu-dump", "--help").output
    assert "REF" not in invoke(tmp_path, "pt", "--help").output


def test_dc_takes_the_format_in_any_case(tmp_path):
    out = invoke(tmp_path, "dc", "x.npy", "-f", "nhwc")
    assert "invalid choice" not in out.output


def test_demo_exit_zero_for_chains(tmp_path):
    out = invoke(tmp_path / "pd", "--log-level", "4", "demo", "--steps", "2", "--exit-zero")
    assert out.exit_code == 0, out.output
    assert invoke(tmp_path / "pd", "--log-level", "4", "ac", "-c").exit_code == 1


def test_the_readme_lists_every_command_and_option():
    """README's command table names each command with every option it shows in --help."""
    import click
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    table = readme[readme.index("| command | what it does |"):readme.index("Global options, one-shot")]
    rows = table.splitlines()
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        cmd = cli.get_command(ctx, name)
        row = next((r for r in rows if r.startswith(f"| `{name}") or f"`{name} " in r
                    or f"`{name}`" in r), None)
        assert row is not None, f"no README row for {name}"
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                longest = max(p.opts + p.secondary_opts, key=len)
                assert longest in row, (name, longest)


def test_the_lazy_command_table_matches_the_registry():
    """cli.COMMAND_MODULES and LONG_NAMES (what loads a command when it is asked for) say
    what the modules register, once all are loaded."""
    from precision_tool import cli as cli_package
    from precision_tool.cli.app import COMMANDS
    cli_package.load_all_commands()
    registered = {name: info.alias for name, info in COMMANDS.items()}
    assert set(registered) == set(cli_package._MODULE_OF)
    assert {alias: name for name, alias in registered.items() if alias != name} == cli_package.LONG_NAMES


def test_the_command_line_starts_without_the_command_modules():
    import subprocess
    import sys
    code = ("import sys; import precision_tool.cli; print(sorted(m for m in sys.modules if "
            "m.startswith('precision_tool.cli.') or m in ('pandas', 'precision_tool.analysis')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "['precision_tool.cli.app', 'precision_tool.cli.runner']", out.stdout


def test_a_closed_output_pipe_keeps_the_exit_code_the_analysis_decided(tmp_path):
    """`precision-tool ls | head -1` under pipefail: the reader is gone before the command
    writes. rich's console used to end the process with 1, the findings code; now what is
    left goes nowhere, quietly, and the code is the command's: 0 for ls and a clean vcs,
    1 for an ac -c with findings."""
    import subprocess
    import sys
    clean, bad = tmp_path / "clean", tmp_path / "bad"
    dump_step(clean, dense_net(), pt.SessionConfig(precision_mode="allow_mix_precision"))
    dump_step(bad, dense_net(scale=1e5), pt.SessionConfig(precision_mode="allow_mix_precision"))
    cases = [(clean, ["ls"], 0), (clean, ["--json", "ls"], 0), (clean, ["vcs"], 0),
             (clean, ["help"], 0), (bad, ["ac", "-c"], 1), (bad, ["--json", "vc"], 1)]
    for root, args, code in cases:
        p = subprocess.Popen([sys.executable, "-m", "precision_tool", "--data-dir", str(root),
                              "--log-level", "3", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        p.stdout.close()                        # the reader goes before anything is written
        err = p.stderr.read().decode()
        assert p.wait() == code, (args, err)
        assert err == "", (args, err)


@pytest.mark.parametrize("args, option", [
    (["vc", "-c", "nan"], "--cosine"), (["vc", "--norm", "nan"], "--norm"),
    (["ac", "-c", "-t", "nan"], "--cosine"), (["vcs", "--flushed", "inf"], "--flushed"),
    (["vc", "--rel-error", "-inf"], "--rel-error"), (["cp", "a", "b", "-al", "nan"], "--atol"),
    (["cp", "a", "b", "-rl", "inf"], "--rtol"), (["fix", "--loss-rtol", "nan"], "--loss-rtol"),
    (["fix", "--proof-rtol", "inf"], "--proof-rtol"), (["vc", "-c", "1.5"], "--cosine"),
    (["vc", "--norm", "-0.1"], "--norm")])
def test_every_float_option_refuses_nan_inf_and_out_of_range(tmp_path, args, option):
    """Parsed in one place (cli.app.Finite): a usage error naming the option, exit 2, before
    any work (the workspace here does not exist)."""
    from precision_tool.cli import main
    import io
    import contextlib
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--data-dir", str(tmp_path / "none"), *args])
    assert code == 2, err.getvalue()
    line = err.getvalue().strip()
    assert option in line and "Traceback" not in line and len(line.splitlines()) == 1, line


def test_every_float_option_of_every_command_is_finite():
    """No float option escapes the check: each one's type is Finite."""
    import click
    from precision_tool.cli import load_all_commands
    from precision_tool.cli.app import COMMANDS, Finite
    load_all_commands()
    floats = [(name, p.name) for name, info in COMMANDS.items() for p in info.command.params
              if isinstance(p.type, click.types.FloatParamType) or
              isinstance(p.type, click.FloatRange)]
    assert floats, "no float option found: the check would pass on nothing"
    for name, param in floats:
        p = next(x for x in COMMANDS[name].command.params if x.name == param)
        assert isinstance(p.type, Finite), (name, param)


def test_workspace_files_take_the_umask_not_a_private_mode(tmp_path):
    """Files of a dump and of a fix (written atomically through mkstemp, which makes them
    0600) get 0666 less the umask, as any new file does: a workspace shared by a group
    under umask 002 is readable and writable by the group."""
    import stat
    from test_repair import run_repair
    old = os.umask(0o002)
    try:
        ws = dump_step(tmp_path, dense_net(scale=1e5, optimizer=pt.train.Adam(0.01)),
                       pt.SessionConfig(precision_mode="allow_mix_precision"))
        result = run_repair(ws)
        assert result.files
    finally:
        os.umask(old)
    modes = {}
    for folder, _, names in os.walk(tmp_path):
        for name in names:
            path = os.path.join(folder, name)
            modes[os.path.relpath(path, tmp_path)] = stat.S_IMODE(os.stat(path).st_mode)
    assert any(p.endswith("fix.json") for p in modes) and any(p.endswith("run.json") for p in modes)
    wrong = {p: oct(m) for p, m in modes.items() if m != 0o664}
    assert not wrong, wrong


def test_data_dir_after_the_command_and_the_parent_of_precision_data(tmp_path):
    """`vc --data-dir X` works as `--data-dir X vc`; naming the folder that holds
    precision_data says to name precision_data itself."""
    root = tmp_path / "precision_data"
    dump_step(root, dense_net(), pt.SessionConfig(precision_mode="allow_mix_precision"))
    runner = CliRunner()
    before = runner.invoke(cli, ["--data-dir", str(root), "--json", "vc"])
    after = runner.invoke(cli, ["--json", "vc", "--data-dir", str(root)])
    assert after.exit_code == before.exit_code == 0, after.output
    assert json.loads(after.stdout)["verdicts"] == json.loads(before.stdout)["verdicts"]
    parent = runner.invoke(cli, ["--data-dir", str(tmp_path), "vc"])
    assert parent.exit_code == 2
    assert f"it holds {root}: give --data-dir that" in parent.stderr


def test_piped_the_next_panel_wraps_between_words(tmp_path):
    """Piped (not a terminal), a panel is as wide as its longest line: the advice, several
    hundred characters a sentence, is wrapped at 100 columns between words."""
    dump_step(tmp_path, dense_net(scale=1e5), pt.SessionConfig(precision_mode="allow_mix_precision"))
    r = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--log-level", "4", "ac", "-c"])
    assert r.exit_code == 1, r.output
    lines = r.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "Next" in line and line.startswith("╭"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("╰"))
    body = lines[start + 1:end]
    assert len(body) > 2 and all(len(line) <= 100 + 4 for line in body), body
    words = " ".join(" ".join(line.strip("│ ").split()) for line in body)
    assert "The first overflow is" in words


def test_ctrl_c_in_fix_ends_in_one_line_with_130_workers_included(tmp_path):
    """Ctrl-C reaches the whole foreground process group, fix's pool workers too: they used
    to print a traceback each before "interrupted". Now the workers leave it to the parent."""
    import signal
    import subprocess
    import sys
    import time
    dump_step(tmp_path, dense_net(scale=1e5, optimizer=pt.train.Adam(0.01)),
              pt.SessionConfig(precision_mode="allow_mix_precision"))
    p = subprocess.Popen([sys.executable, "-m", "precision_tool", "--data-dir", str(tmp_path),
                          "fix", "-j", "2", "--dry-run"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    seen = b""
    deadline = time.monotonic() + 120
    # wait for the first batch replayed on the pool ("replay 13-14 ..."): by then the workers
    # are forked (a SIGINT that lands while a process forks is dropped by CPython's at-fork
    # hooks, "Exception ignored", and the run goes on: a race of the test, not of the tool)
    while not re.search(rb"replay \d+-\d+", seen) and time.monotonic() < deadline:
        line = p.stderr.readline()
        if not line:
            break
        seen += line
    assert re.search(rb"replay \d+-\d+", seen), seen
    os.killpg(p.pid, signal.SIGINT)                    # as a terminal sends it
    out, err = p.communicate(timeout=120)
    err = (seen + err).decode()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.rstrip().endswith("interrupted"), err[-500:]


def test_json_help_is_json(tmp_path):
    """`--json help` was the text help: now the commands as data, and for one command its
    options (names, help, default), the same as --help says."""
    runner = CliRunner()
    r = runner.invoke(cli, ["--json", "help"])
    assert r.exit_code == 0
    names = {c["name"]: c for c in json.loads(r.stdout)["commands"]}
    assert names["vc"]["alias"] == "vector-compare" and "ac" in names and "fix" in names
    r = runner.invoke(cli, ["--json", "help", "vc"])
    data = json.loads(r.stdout)
    options = {o["names"][-1]: o for o in data["options"]}
    assert data["command"] == "vc" and options["--cosine"]["default"] == 0.98
    text = runner.invoke(cli, ["help", "vc"]).stdout
    assert all(o["names"][-1] in text for o in data["options"])


def test_every_numeric_option_with_nan_inf_minus_one_and_zero_is_never_an_internal_error(tmp_path):
    """Each command's every int and float option given nan, inf, -1 and 0, on a small dumped
    workspace: exit 0, 1 or 2 (what the analysis decided, or a usage error naming the
    option), never 3 or a traceback. The long jobs (demo, onnx, check's script) are left out:
    their options are parsed by the same types."""
    import click
    from precision_tool.cli import load_all_commands, main
    from precision_tool.cli.app import COMMANDS
    from precision_tool.dump import Workspace
    import contextlib
    import io
    root = tmp_path / "precision_data"
    dump_step(root, dense_net(), pt.SessionConfig(precision_mode="allow_mix_precision"))
    ws = Workspace(str(root))
    run = ws.run("npu")
    index = ws.index(run, 0)
    tensor = os.path.join(run.path, "dump", "0", str(index.file.iloc[0]))
    op = str(index.op_name.iloc[0])
    needs = {"cp": [tensor, tensor], "pt": [tensor], "dc": [tensor], "ni": [op]}
    load_all_commands()
    tried = 0
    for name, info in sorted(COMMANDS.items()):
        if name in ("demo", "onnx", "check"):
            continue
        numeric = [p for p in info.command.params if isinstance(p, click.Option) and
                   isinstance(p.type, (click.types.FloatParamType, click.types.IntParamType))]
        for p in numeric:
            for value in ("nan", "inf", "-1", "0"):
                args = ["--data-dir", str(root), "--log-level", "4", name, *needs.get(name, []),
                        p.opts[-1], value]
                if name == "fix":
                    args.append("--dry-run")
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    code = main(args)
                tried += 1
                text = out.getvalue() + err.getvalue()
                assert code in (0, 1, 2), (args, code, text[-800:])
                assert "Traceback" not in text and "internal error" not in text, (args, text[-800:])
    assert tried > 150


def test_at_60_columns_ls_keeps_every_column_and_whole_names_and_titles_their_role(tmp_path):
    """At COLUMNS=60 `ls -n` dropped its columns and cut op names with no ellipsis (.../Mul
    and .../Mul/Cast_fp16 looked the same); the panels' titles lost their [role] tag at the
    end. Now each op takes two lines when the columns do not fit, and the role leads."""
    import io
    from rich.console import Console
    from precision_tool.cli import main
    from precision_tool.cli.app import App
    dump_step(tmp_path, dense_net(scale=1e5), pt.SessionConfig(precision_mode="allow_mix_precision"))

    def narrow(*args):
        out = io.StringIO()
        app = App(str(tmp_path), console=Console(width=60, file=out, highlight=False))
        code = main(["--data-dir", str(tmp_path), "--log-level", "4", *args], app=app)
        return code, out.getvalue()
    code, text = narrow("ls", "-n", "MatMul")
    wide = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ls", "-n", "MatMul"])
    found = json.loads(wide.stdout)
    assert code == 0 and len(found) > 2
    lines = text.splitlines()
    for op in found:                   # each name whole on a line of its own, then its columns
        i = lines.index(op["name"])
        assert f"type {op['type']}" in lines[i + 1] and op["kernel"] in lines[i + 1]
    code, text = narrow("vcs", "-l", "3")
    titles = [line for line in text.splitlines() if line.startswith("╭")]
    assert code == 1 and titles and all(re.match(r"╭─ \[[a-z, /]+\] ", t) for t in titles), titles
