"""The interactive shell: `PrecisionTool > `. Every line is a command of the one-shot CLI,
run on the same App (the workspace index stays loaded). Tab completes command names, their
options, op names and dump file names (from the index); history is kept per workspace;
Ctrl-C cancels the running command, Ctrl-D (or exit) leaves. `run CMD` runs a command line
in the user's shell; `use DIR` switches workspace (the prompt shows it)."""
from __future__ import annotations

import difflib
import os
import shlex
import subprocess
from typing import Iterable, List, Optional

import click

from .app import EXIT_USAGE, App

PROMPT = "PrecisionTool > "          # the reference tool's; the shell shows its workspace in it
BUILTINS = {"help": "help [CMD]: the commands, or one command's options",
            "run": "run CMD...: run a command line in your shell (pipes and globs work)",
            "use": "use DIR (or cd DIR): switch to the workspace DIR",
            "clear": "clear (or Ctrl-L): clear the screen",
            "exit": "exit (or Ctrl-D): leave the shell"}
# options whose value is a run, and the commands whose arguments are dump files of one run
RUN_OPTIONS = frozenset({"-r", "--run", "-lt", "--left", "-rt", "--right", "-lr", "--left-run",
                         "-rr", "--right-run"})


def prompt_for(app: App) -> str:
    """PrecisionTool (WORKSPACE) > : the workspace relative to here when it is below here."""
    root = app.ws_root()
    here = os.getcwd()
    label = os.path.relpath(root, here) if root.startswith(here + os.sep) else \
        root.replace(os.path.expanduser("~"), "~", 1)
    if len(label) > 32:                 # a long path: its last two parts, the line stays usable
        label = "..." + os.sep + os.path.join(*label.split(os.sep)[-2:])
    return f"PrecisionTool ({label}) > "


def _signature(root: str) -> tuple:
    """What the completion words are made of: the workspace and its runs (a new run, or
    another workspace, makes them anew)."""
    runs = []
    try:
        targets = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    except OSError:
        targets = []
    for target in targets:          # npu, cpu and any other target's runs
        try:
            runs.append((target, tuple(sorted(os.listdir(os.path.join(root, target))))))
        except OSError:
            pass
    return (root, *runs)


def _words(app: App) -> dict:
    """Completion words of the workspace: op names, and per run its label, complete steps
    and dump file names (from the index of its first complete step)."""
    ops, runs = set(), {}
    try:
        ws = app.ws
        for run in ws.runs():
            graph = ws.compiled_graph(run)
            if graph:
                ops.update(graph.nodes)
            complete = [s.step for s in run.steps if s.complete]
            files = []
            if complete:
                table = ws.index(run, complete[0])
                ops.update(table.op_name)
                files = sorted(f for f in table.file if f)
            runs[run.label] = {"steps": [str(k) for k in complete], "files": files}
    except Exception:           # no workspace yet: commands and options still complete
        pass
    return {"ops": sorted(ops), "runs": runs}


def _cached_words(app: App, cache: dict) -> dict:
    signature = _signature(app.ws_root())
    if cache.get("signature") != signature:
        app.refresh()
        cache.update(signature=signature, words=_words(app))
    return cache["words"]


def _run_of(app: App, cmd_name: str, parts: List[str], words: dict) -> Optional[str]:
    """The run a command line reads its files from: the one named by a run option, else
    the command's default (cp's second tensor: the golden run)."""
    for opt, value in zip(parts, parts[1:]):
        if opt in RUN_OPTIONS:
            return next((label for label in words["runs"]
                         if label == value or label.endswith("/" + value)), None)
    positional = [p for p in parts[1:] if not p.startswith("-")]
    target = "cpu" if cmd_name == "cp" and len(positional) >= 1 else "npu"
    try:
        return app.ws.run(target).label
    except Exception:
        return None


def _commands() -> List[str]:
    from . import LONG_NAMES, cli
    names = set(cli.list_commands(click.Context(cli))) | set(LONG_NAMES) | set(BUILTINS)
    return sorted(names - {"shell"})


def _current_word(text: str) -> str:
    """The word under completion: the last one, or none after a space."""
    parts = text.split()
    return "" if text.endswith(" ") or not parts else parts[-1]


def completions(app: App, text: str, cache: dict) -> Iterable[str]:
    """What may follow `text` (the line before the cursor): a command name first, then the
    command's options, an option's values (its choices, the runs, the dumped steps), and
    op names and dump file names (those of the run the command will read)."""
    from . import cli
    parts = text.split()
    current = _current_word(text)
    if len(parts) == 0 or (len(parts) == 1 and not text.endswith(" ")):
        return [c for c in _commands() if c.startswith(current)]
    if parts[0] == "help":
        return [c for c in _commands() if c.startswith(current)] if len(parts) <= 2 else []
    if parts[0] in ("use", "cd"):
        return _directories(current)
    cmd = cli.get_command(click.Context(cli), parts[0])
    if cmd is None:
        return []
    if current.startswith("-"):
        opts = sorted(o for p in cmd.params for o in getattr(p, "opts", [])
                      if o.startswith("-") and not getattr(p, "hidden", False))
        return [o for o in opts + ["--help"] if o.startswith(current)]
    before = parts[:-1] if current else parts
    option = _option(cmd, before[-1]) if len(before) > 1 else None
    words = _cached_words(app, cache)
    if option is not None:
        return [v for v in _values(app, cmd.name, option, before, words)
                if v.lower().startswith(current.lower())]
    run = _run_of(app, cmd.name, before, words)
    files = words["runs"].get(run, {}).get("files", []) if run else []
    return [w for w in words["ops"] + files if w.startswith(current)][:200]


def _option(cmd: click.Command, word: str) -> Optional[click.Option]:
    """The option `word` names when it takes a value (a flag takes none)."""
    for p in cmd.params:
        if isinstance(p, click.Option) and word in p.opts and not p.is_flag and p.nargs == 1:
            return p
    return None


def _values(app: App, cmd_name: str, option: click.Option, parts: List[str], words: dict) -> List[str]:
    if isinstance(option.type, click.Choice):
        return list(option.type.choices)
    if RUN_OPTIONS & set(option.opts):
        return sorted(words["runs"])
    if option.name == "step":
        run = _run_of(app, cmd_name, parts, words)
        return words["runs"].get(run, {}).get("steps", []) if run else []
    return []


def _directories(current: str) -> List[str]:
    base = os.path.dirname(current) or "."
    try:
        names = sorted(os.listdir(os.path.expanduser(base)))
    except OSError:
        return []
    prefix = "" if base == "." and not current.startswith("./") else base.rstrip("/") + "/"
    return [prefix + n + "/" for n in names if os.path.isdir(os.path.join(os.path.expanduser(base), n))
            and (prefix + n).startswith(current) and not n.startswith(".")]


def _completer(app: App):
    from prompt_toolkit.completion import Completer, Completion
    cache: dict = {}

    class _C(Completer):
        def get_completions(self, document, complete_event):
            text = document.text_before_cursor
            current = _current_word(text)
            for word in completions(app, text, cache):
                yield Completion(word, start_position=-len(current))
    return _C()


def _history_path(app: App) -> Optional[str]:
    root = app.ws_root()
    return os.path.join(root, ".shell_history") if os.path.isdir(root) else None


def execute(app: App, line: str) -> Optional[int]:
    """Run one shell line; returns its exit code, or None to leave the shell."""
    from . import main
    try:
        words = shlex.split(line)
    except ValueError as e:
        click.echo(f"error: {e}", err=True)
        return EXIT_USAGE
    if not words:
        return 0
    head = words[0]
    if head in ("exit", "quit"):
        return None
    if head == "help":
        if len(words) > 1:
            return main([words[1], "--help"], app=app)
        return main(["--help"], app=app) or _builtins_help()
    if head == "clear":
        click.clear()
        return 0
    if head == "run":
        if len(words) == 1:
            click.echo("usage: run CMD...", err=True)
            return EXIT_USAGE
        shell = os.environ.get("SHELL") or "/bin/sh"     # the user's: pipes, globs, quotes
        try:
            return subprocess.call([shell, "-c", line.split(None, 1)[1]])
        except OSError as e:
            click.echo(f"error: cannot run {shell!r}: {e.strerror}", err=True)
            return EXIT_USAGE
    if head in ("use", "cd"):
        return _use(app, words)
    if head == "shell":
        click.echo("already in the shell", err=True)
        return EXIT_USAGE
    if head not in _commands() and not head.startswith("-"):
        close = difflib.get_close_matches(head, _commands(), n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; type help for the commands"
        click.echo(f"unknown command {head!r}{hint} (shell commands: run CMD)", err=True)
        return EXIT_USAGE
    # a --data-dir or --results-dir given to one command is that command's: the shell stays
    here = (app.data_dir, app.results_dir)
    try:
        return main(words, app=app)
    finally:
        if (app.data_dir, app.results_dir) != here:
            app.data_dir, app.results_dir = here
            app.refresh()


def _use(app: App, words: List[str]) -> int:
    """use DIR: the workspace of the commands that follow (its index read anew)."""
    if len(words) != 2:
        click.echo(f"usage: {words[0]} DIR (the workspace is now {app.ws_root()})", err=True)
        return EXIT_USAGE
    path = os.path.abspath(os.path.expanduser(words[1]))
    if not os.path.isdir(path):
        click.echo(f"error: no directory {path}", err=True)
        return EXIT_USAGE
    app.data_dir = path
    app.refresh()
    click.echo(f"workspace: {path}")
    return 0


def _builtins_help() -> int:
    click.echo("\nIn the shell:")
    for text in BUILTINS.values():
        click.echo(f"  {text}")
    return 0


def run_shell(app: App) -> int:
    app.in_shell = True
    try:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
    except ImportError:                     # pragma: no cover - a declared dependency
        PromptSession = None
    click.echo("precision_tool shell: help for the commands, Ctrl-D to leave.")
    if PromptSession is None or not os.isatty(0):
        return _plain_loop(app)
    path = _history_path(app)
    history = FileHistory(path) if path else InMemoryHistory()
    session = PromptSession(history=history, completer=_completer(app), complete_while_typing=False)
    while True:
        try:
            line = session.prompt(prompt_for(app))
        except KeyboardInterrupt:
            continue
        except EOFError:
            break
        root = app.ws_root()
        if execute(app, line) is None:
            break
        if app.ws_root() != root:           # `use`: that workspace's history from now on
            path = _history_path(app)
            session.history = FileHistory(path) if path else InMemoryHistory()
    return 0


def _plain_loop(app: App) -> int:
    """Without a terminal (piped input): the same commands, one per line."""
    while True:
        try:
            line = input(prompt_for(app))
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo("")
            continue
        if execute(app, line) is None:
            break
    return 0
