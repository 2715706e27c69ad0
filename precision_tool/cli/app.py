"""What every command shares: the workspace (its index read once, also across shell
commands), the output switches (--json, --log-level) and the console, and the one registry
of commands with their short (Ascend) names and readable long aliases."""
from __future__ import annotations

import json
import math
import os
import sys
import textwrap
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, Optional

import click
import numpy as np
from rich.console import Console
from rich.panel import Panel

from ..dump import layout
from ..dump.formats.msprobe import is_dump
from ..fileio import jsonable

if TYPE_CHECKING:                  # the workspace reader brings pandas: loaded when first used
    from ..dump.workspace import Run, Workspace

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
# Ascend's slog levels
LOG_LEVELS = {"0": "debug", "1": "info", "2": "warning", "3": "error", "4": "none"}


class CommandError(click.ClickException):
    """One line on stderr and a documented exit code, never a traceback."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = code

    def show(self, file=None):
        click.echo(self.message, err=True)


# piped output is as wide as its lines: a name split over two lines is not found by grep
PIPED_WIDTH = 100_000


def to_terminal() -> bool:
    return sys.stdout.isatty()


class Finite(click.FloatRange):
    """Every float option's type: a finite number within the range. click's FloatRange takes
    nan (no comparison fails) and inf (an open range): both are usage errors here, naming
    the option, exit 2."""
    name = "number"

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


def discard_stdout() -> None:
    """The reader of stdout went away (`| head`): what is still to print goes nowhere, and
    the command ends with the code its analysis decided (a closed pipe is no finding)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):      # no real stdout (a test's capture): nothing to redirect
        pass


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich's own ends the process with exit code 1, the "findings" code
        discard_stdout()


def _stdout_console() -> Console:
    return _Console(highlight=False, soft_wrap=False, width=None if to_terminal() else PIPED_WIDTH)


PROSE_WIDTH = 100


def prose(lines) -> str:
    """Sentences for a panel: on a terminal as they are (rich wraps them to its width);
    piped, wrapped at PROSE_WIDTH columns between words (a panel there is as wide as its
    longest line, and a path is never broken)."""
    if to_terminal():
        return "\n".join(lines)
    return "\n".join(textwrap.fill(line, PROSE_WIDTH, break_long_words=False,
                                    break_on_hyphens=False) for line in lines)


def panel(body, title: str = "", **kw) -> Panel:
    """A titled panel: as wide as the terminal, or, piped, as wide as its lines."""
    kw.setdefault("title_align", "left")
    return Panel(body, title=title, expand=to_terminal(), **kw)


def echo(text: str) -> None:
    """click.echo to stdout, quiet when its reader has gone (see discard_stdout)."""
    try:
        click.echo(text)
        sys.stdout.flush()
    except BrokenPipeError:
        discard_stdout()


@dataclass
class App:
    data_dir: str
    as_json: bool = False
    log_level: int = 1
    console: Console = field(default_factory=_stdout_console)
    # messages are not wrapped by rich: a path broken over two lines cannot be copied
    err: Console = field(default_factory=lambda: Console(stderr=True, highlight=False,
                                                         soft_wrap=True))
    in_shell: bool = False
    noted: set = field(default_factory=set)     # runs whose interrupted steps were named
    results_dir: Optional[str] = None   # where results go (None: layout.resolve_results)
    _ws: Optional["Workspace"] = None
    _opened: tuple = ()                 # (root, results_dir) _ws was opened with

    @property
    def ws(self) -> Workspace:
        """Opened once; a command that writes runs calls refresh()."""
        # what it was opened with: the workspace's results directory is resolved when first
        # written to, never by a look at the index
        wanted = (layout.resolve_root(self.data_dir), self.results_dir)
        if self._ws is None or self._opened != wanted:
            from ..dump.workspace import Workspace
            ws = Workspace(self.data_dir, self.results_dir)
            ws.runs()                  # a missing workspace fails here, in one line, every time
            self._ws, self._opened = ws, wanted
            ws.announce = self._results_elsewhere
        return self._ws

    def _results_elsewhere(self, path: str) -> None:
        if ("results", path) not in self.noted:
            self.noted.add(("results", path))
            self.warn(f"the workspace {self.ws_root()} cannot be written: results go to "
                      f"{path} (choose with --results-dir or {layout.ENV_RESULTS})")

    def ws_root(self) -> str:
        return layout.resolve_root(self.data_dir)

    def refresh(self):
        self._ws = None

    def line(self, text: str):
        """A line of the result that names a path: not wrapped by rich (a path broken over two
        lines cannot be copied); panels and tables still fit the terminal."""
        self.console.print(text, soft_wrap=True, markup=False)

    def command(self, words: str) -> str:
        """A command as the user types it here: in the shell without the program's name."""
        return words if self.in_shell else f"precision-tool {words}"

    def info(self, message: str):
        if self.log_level <= 1 and not self.as_json:
            self.err.print(message, markup=False)

    def warn(self, message: str):
        if self.log_level <= 2:
            self.err.print(f"warning: {message}", markup=False)

    @contextmanager
    def progress(self, what: str):
        """A progress bar on stderr for long work: yields progress(done, total), which draws
        ten times a second at most (quiet with --json or a log level above info). Refreshed
        from the callback, not by rich's thread: with no other thread running, a pool of
        workers starts by fork in milliseconds instead of by spawn."""
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeRemainingColumn)
        with Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=self.err, transient=True, auto_refresh=False,
                      disable=self.as_json or self.log_level > 1) as bar:
            task = bar.add_task(what, total=None)
            shown = [0.0]

            def progress(k: int, n: int) -> None:
                refresh = k == n or time.monotonic() - shown[0] > 0.1
                if refresh:
                    shown[0] = time.monotonic()
                bar.update(task, completed=k, total=n, refresh=refresh)
            yield progress

    def emit(self, result, render: Callable[[], None]):
        """The result: as JSON on stdout with --json, else rendered for a reader. A result is
        what the library returned: an object with to_dict, or a list of such (one per
        file, per op): a command's --json is its result's to_dict, never a dict the command
        line made up."""
        if self.as_json:
            items = result if isinstance(result, list) else [result]
            for item in items:
                if not callable(getattr(item, "to_dict", None)):
                    raise TypeError(f"a command's result has to_dict; got {type(item).__name__}")
            payload = [r.to_dict() for r in result] if isinstance(result, list) else result.to_dict()
            echo(json.dumps(jsonable(payload), indent=1, allow_nan=False))
        else:
            render()

    def run(self, spec: Optional[str], target: str) -> Run:
        """A run named as npu/debug_1, debug_1 (this target first) or its directory; by
        default the target's newest original run that dumped something. Its interrupted
        steps are named on stderr, once per command."""
        if spec is not None and is_dump(spec):
            return self.noting(self.imported(spec, target)[0])
        return self.noting(self.ws.resolve_run(spec, target))

    def reference(self, spec: Optional[str], run: Run) -> Run:
        """The reference run to compare `run` with: the one named, else the same rank's of
        the same launch where run is one rank of several (Workspace.reference_for), else
        the newest golden run (Workspace.default_reference)."""
        if spec is None:
            return self.noting(self.ws.default_reference(run))
        if is_dump(spec):            # a dump's ranks: the one of the compared run's rank
            return self.noting(self.ws.reference_for(run, self.imported(spec, "cpu")))
        return self.run(spec, "cpu")

    def imported(self, path: str, target: str) -> list:
        """The runs an msprobe dump is in the workspace (one per rank), imported on first
        use, into a workspace made for it where there is none yet; each named on stderr."""
        from ..dump.workspace import Workspace
        ws = self._ws if self._ws is not None else Workspace(self.data_dir, self.results_dir)
        ws.announce = self._results_elsewhere
        runs = ws.imported(path, target)
        self._ws, self._opened = ws, (layout.resolve_root(self.data_dir), self.results_dir)
        if ("import", path, target) not in self.noted:
            self.noted.add(("import", path, target))
            for k, run in enumerate(runs):
                more = " (used here: give a rank's directory, step<N>/<rank>, for another)" \
                    if k == 0 and len(runs) > 1 else ""
                self.info(f"{run.info.get('source')} {run.info.get('rank')}: {run.label} "
                          f"(msprobe {run.info.get('task', '?')} dump, level "
                          f"{run.info.get('level', '?')}, steps "
                          f"{layout.format_steps(run.complete_steps) or 'none'}){more}")
        return runs

    def runs(self, target: Optional[str] = None) -> list:
        """Every run (of the target), their interrupted steps named as run() names them."""
        return [self.noting(run) for run in self.ws.runs(target)]

    def noting(self, run: Run) -> Run:
        """The run, its interrupted steps (and a script that ended early) named on stderr
        once per command."""
        if run.ended_early and (run.path, "ended") not in self.noted:
            self.noted.add((run.path, "ended"))
            self.warn(f"{run.label}: {run.ended_early}")
        if run.interrupted and run.path not in self.noted:
            self.noted.add(run.path)
            # an imported dump is another tool's: clean leaves it as it is
            tail = "" if run.info.get("source") else f" ({self.command('clean')} deletes them)"
            self.warn(f"{run.label}: step(s) {', '.join(map(str, run.interrupted))} are "
                      f"partial ({run.why_partial}); not read{tail}")
        return run

    def step(self, run: Run, step: Optional[int] = None) -> int:
        """The step asked for, checked to be dumped in the run, or its first complete one."""
        return self.ws.resolve_step(run, step)


@dataclass
class CommandInfo:
    name: str            # the reference tool's name: ac, vcs...
    alias: str           # readable: auto-check, vector-summary...
    command: click.Command


COMMANDS: Dict[str, CommandInfo] = {}


def _data_dir_here(ctx, param, value):
    """`vc --data-dir X`, the global option given after the command, as users type it."""
    if value is not None and isinstance(ctx.obj, App):
        ctx.obj.data_dir = value
    return value


def _results_dir_here(ctx, param, value):
    """`vc --results-dir X`, likewise."""
    if value is not None and isinstance(ctx.obj, App):
        ctx.obj.results_dir = value
    return value


def command(name: str, alias: str, **kw):
    """Register a click command under its short name and its long alias. Each also takes
    the global --data-dir and --results-dir after its name (not listed in its own help: the
    global help lists them)."""
    def wrap(fn):
        cmd = click.command(name=name, **kw)(click.pass_obj(fn))
        cmd = click.option("--data-dir", "data_dir_here", metavar="DIR", hidden=True,
                           expose_value=False, is_eager=True, callback=_data_dir_here)(cmd)
        cmd = click.option("--results-dir", "results_dir_here", metavar="DIR", hidden=True,
                           expose_value=False, is_eager=True, callback=_results_dir_here)(cmd)
        COMMANDS[name] = CommandInfo(name, alias, cmd)
        return cmd
    return wrap


def fmt(value, digits: int = 8) -> str:
    """A number as the verdict needs it: full precision (0.99999992, never a rounded 1);
    nan, inf and -inf by name."""
    if value is None:
        return "nan"
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if value != value:
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value == int(value) and abs(value) < 1e15:
            return f"{value:.1f}"
        if abs(value) < 1e-3 or abs(value) >= 1e5:
            return f"{value:.{digits}g}"
        text = f"{value:.{digits}f}".rstrip("0")
        # never let rounding print a verdict-deciding 1.0 (or any integer) that is not one
        return repr(value) if float(text) == round(value) else text
    return str(value)

