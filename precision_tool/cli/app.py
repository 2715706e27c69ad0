"""What every command shares: the workspace (its index read once, also across shell
commands), the output switches (--json, --log-level) and the console, and the one registry
of commands with their short (Ascend) names and readable long aliases."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import click
from rich.console import Console

from ..dump import Workspace, layout
from ..dump.workspace import Run, WorkspaceError

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


@dataclass
class App:
    data_dir: str
    as_json: bool = False
    log_level: int = 1
    console: Console = field(default_factory=lambda: Console(highlight=False, soft_wrap=False))
    # messages are not wrapped by rich: a path broken over two lines cannot be copied
    err: Console = field(default_factory=lambda: Console(stderr=True, highlight=False,
                                                         soft_wrap=True))
    in_shell: bool = False
    _ws: Optional[Workspace] = None

    @property
    def ws(self) -> Workspace:
        """Opened once; a command that writes runs calls refresh()."""
        if self._ws is None or self._ws.root != layout.resolve_root(self.data_dir):
            ws = Workspace(self.data_dir)
            ws.runs()                  # a missing workspace fails here, in one line, every time
            self._ws = ws
        return self._ws

    def ws_root(self) -> str:
        return layout.resolve_root(self.data_dir)

    def refresh(self):
        self._ws = None

    def line(self, text: str):
        """A line of the result that names a path: not wrapped by rich (a path broken over two
        lines cannot be copied); panels and tables still fit the terminal."""
        self.console.print(text, soft_wrap=True, markup=False)

    def info(self, message: str):
        if self.log_level <= 1 and not self.as_json:
            self.err.print(message, markup=False)

    def warn(self, message: str):
        if self.log_level <= 2:
            self.err.print(f"warning: {message}", markup=False)

    def emit(self, payload, render: Callable[[], None]):
        """The result: as JSON on stdout with --json, else rendered for a reader."""
        if self.as_json:
            click.echo(json.dumps(jsonable(payload), indent=1, allow_nan=False))
        else:
            render()

    def run(self, spec: Optional[str], target: str) -> Run:
        """A run named as npu/debug_1, debug_1 (this target first) or its directory; by
        default the target's newest run that dumped something."""
        ws = self.ws
        if spec is None:
            return ws.run(target)
        path = os.path.realpath(spec)
        for r in ws.runs():
            if os.path.realpath(r.path) == path:
                return r
        if "/" in spec.strip("/"):
            t, _, name = spec.strip("/").partition("/")
            if t in ("npu", "cpu") and name:
                return ws.run(t, name)
        for t in (target, "cpu" if target == "npu" else "npu"):
            for r in ws.runs(t):
                if r.name == spec:
                    return r
        names = [f"{r.target}/{r.name}" for r in ws.runs()]
        raise WorkspaceError(f"no run {spec!r} in {ws.root}; runs: {names}")


def first_step(run: Run, step: Optional[int] = None) -> int:
    """The step asked for, or the run's first complete dumped step."""
    if step is not None:
        return step
    complete = [s.step for s in run.steps if s.complete]
    if not complete:
        raise WorkspaceError(f"{run.target}/{run.name} has no complete dumped step")
    return complete[0]


def jsonable(value):
    """Plain JSON: NaN and inf become null, numpy scalars and arrays plain numbers and lists,
    dataclasses dicts, DataFrames lists of records."""
    import dataclasses

    import numpy as np
    import pandas as pd
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, pd.DataFrame):
        return jsonable(value.to_dict("records"))
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclass
class CommandInfo:
    name: str            # the reference tool's name: ac, vcs...
    alias: str           # readable: auto-check, vector-summary...
    command: click.Command


COMMANDS: Dict[str, CommandInfo] = {}


def command(name: str, alias: str, **kw):
    """Register a click command under its short name and its long alias."""
    def wrap(fn):
        cmd = click.command(name=name, **kw)(click.pass_obj(fn))
        COMMANDS[name] = CommandInfo(name, alias, cmd)
        return cmd
    return wrap


def alias_of(word: str) -> str:
    """The registered short name for a short name or long alias (unchanged otherwise)."""
    for info in COMMANDS.values():
        if word in (info.name, info.alias):
            return info.name
    return word


def fmt(value, digits: int = 8) -> str:
    """A number as the verdict needs it: full precision (0.99999992, never a rounded 1)."""
    if value is None or (isinstance(value, float) and value != value):
        return "nan"
    if isinstance(value, float):
        if value == int(value) and abs(value) < 1e15:
            return f"{value:.1f}"
        if abs(value) < 1e-3 or abs(value) >= 1e5:
            return f"{value:.{digits}g}"
        text = f"{value:.{digits}f}".rstrip("0")
        # never let rounding print a verdict-deciding 1.0 (or any integer) that is not one
        return repr(value) if float(text) == round(value) else text
    return str(value)
