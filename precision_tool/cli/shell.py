"""The interactive shell: `PrecisionTool > `. Every line is a command of the one-shot CLI,
run on the same App (the workspace index stays loaded). Tab completes command names, their
options, op names and dump file names (from the index); history is kept per workspace;
Ctrl-C cancels the running command, Ctrl-D (or exit) leaves. `run CMD` is the only way to
run a shell command."""
from __future__ import annotations

import difflib
import os
import shlex
import subprocess
from typing import Iterable, List, Optional

import click

from .app import COMMANDS, EXIT_USAGE, App

PROMPT = "PrecisionTool > "
BUILTINS = {"help": "help [CMD]: the commands, or one command's options",
            "run": "run CMD...: run a shell command",
            "clear": "clear (or Ctrl-L): clear the screen",
            "exit": "exit (or Ctrl-D): leave the shell"}


def _words(app: App) -> dict:
    """Completion words, read once from the workspace: op names and dump file names."""
    ops, files = set(), set()
    try:
        ws = app.ws
        for run in ws.runs():
            graph = ws.graph_json(run)
            if graph:
                ops.update(n["name"] for n in graph.get("nodes", []))
            complete = [s.step for s in run.steps if s.complete]
            if complete:
                table = ws.index(run, complete[0])
                ops.update(table.op_name)
                files.update(f for f in table.file if f)
    except Exception:           # no workspace yet: commands and options still complete
        pass
    return {"ops": sorted(ops), "files": sorted(files)}


def _commands() -> List[str]:
    from . import cli
    names = set(cli.commands) | {i.alias for i in COMMANDS.values()} | set(BUILTINS)
    return sorted(names - {"shell"})


def _current_word(text: str) -> str:
    """The word under completion: the last one, or none after a space."""
    parts = text.split()
    return "" if text.endswith(" ") or not parts else parts[-1]


def completions(app: App, text: str, cache: dict) -> Iterable[str]:
    """What may follow `text` (the line before the cursor): a command name first, then the
    command's options, op names and dump file names."""
    from . import cli
    parts = text.split()
    current = _current_word(text)
    if len(parts) == 0 or (len(parts) == 1 and not text.endswith(" ")):
        return [c for c in _commands() if c.startswith(current)]
    cmd = cli.get_command(click.Context(cli), parts[0])
    if current.startswith("-") and cmd is not None:
        opts = sorted(o for p in cmd.params for o in getattr(p, "opts", []) if o.startswith("-"))
        return [o for o in opts + ["--help"] if o.startswith(current)]
    if "words" not in cache:
        cache["words"] = _words(app)
    words = cache["words"]["ops"] + cache["words"]["files"]
    return [w for w in words if w.startswith(current)][:200]


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
        try:
            return subprocess.call(words[1:])
        except OSError as e:
            click.echo(f"error: cannot run {words[1]!r}: {e.strerror}", err=True)
            return EXIT_USAGE
    if head == "shell":
        click.echo("already in the shell", err=True)
        return EXIT_USAGE
    if head not in _commands() and not head.startswith("-"):
        close = difflib.get_close_matches(head, _commands(), n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; type help for the commands"
        click.echo(f"unknown command {head!r}{hint} (shell commands: run CMD)", err=True)
        return EXIT_USAGE
    return main(words, app=app)


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
            line = session.prompt(PROMPT)
        except KeyboardInterrupt:
            continue
        except EOFError:
            break
        if execute(app, line) is None:
            break
    return 0


def _plain_loop(app: App) -> int:
    """Without a terminal (piped input): the same commands, one per line."""
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            break
        except KeyboardInterrupt:
            click.echo("")
            continue
        if execute(app, line) is None:
            break
    return 0
