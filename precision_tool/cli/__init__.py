"""The command line: `precision-tool` and `python -m precision_tool`, one-shot or as the
interactive `PrecisionTool >` shell (`precision-tool shell`, or no command on a terminal).

Exit codes: 0 nothing found, 1 precision findings, 2 usage or input error (one line on
stderr), 3 internal error.
"""
import sys

import click

import importlib
from dataclasses import asdict, dataclass
from typing import List

from ..version import __version__
from ..dump import layout
from .app import (COMMANDS, EXIT_FINDINGS, EXIT_INTERNAL, EXIT_OK,  # noqa: F401 (re-exported)
                  EXIT_USAGE, LOG_LEVELS, App, CommandError, echo)
from .runner import ALIASES, RUNNERS, make_runner

# The module that registers each command (and its long name): it is imported when the command
# is first asked for, so that --version, help of one command or a light command does not load
# the whole analysis (tests/test_cli_usability.py checks this table against the registry)
COMMAND_MODULES = {"analyse": ("ac", "vc", "vcs", "fo", "report"),
                   "inspect": ("ls", "ni", "pt", "cp", "dc"),
                   "jobs": ("train", "demo", "clean"), "fix": ("fix",), "precheck": ("check", "wp"),
                   "onnx_model": ("onnx",), "torch_run": ("torch-run",),
                   "interop": ("import", "export")}
LONG_NAMES = {"auto-check": "ac", "vector-compare": "vc", "vector-summary": "vcs",
              "fusion-off": "fo", "html-report": "report", "list": "ls", "node-info": "ni",
              "print-tensor": "pt", "compare-pair": "cp", "convert": "dc", "replay": "train",
              "repair": "fix", "pre-check": "check", "watchpoints": "wp",
              "onnx-model": "onnx", "import-dump": "import", "export-dump": "export"}
_MODULE_OF = {name: module for module, names in COMMAND_MODULES.items() for name in names}


def load_all_commands() -> None:
    """Import every command module (help lists them all; the shell completes them all)."""
    for module in COMMAND_MODULES:
        importlib.import_module(f".{module}", __name__)

EXIT_INTERRUPTED = 130
EXIT_CODES = ("Exit codes: 0 nothing found; 1 precision findings (an op under the threshold, an "
              "overflow); 2 usage or input error (one line on stderr); 3 internal error; 130 "
              "interrupted (Ctrl-C).")


class _Group(click.Group):
    """Every command answers to its short name (ac, vcs...) and its long alias (auto-check,
    vector-summary...); the runners also to the reference tool's spellings (npu_dump...).
    A command's return value is the exit code; errors become one line and code 2 (input)
    or 3 (ours), the same through main(), click's runner and the shell."""

    def get_command(self, ctx, name):
        name = ALIASES.get(name) or LONG_NAMES.get(name, name)
        if name not in self.commands and name in _MODULE_OF:
            importlib.import_module(f".{_MODULE_OF[name]}", __name__)
            self.add_command(COMMANDS[name].command)
        return super().get_command(ctx, name)

    def list_commands(self, ctx):
        return sorted(set(self.commands) | set(_MODULE_OF))

    def resolve_command(self, ctx, args):
        name = args[0] if args else ""
        if args and not name.startswith("-") and self.get_command(ctx, name) is None:
            import difflib
            words = sorted(set(self.list_commands(ctx)) | set(LONG_NAMES))
            close = difflib.get_close_matches(name, words, n=3)
            # main() adds where to look (--help, or help in the shell): said once
            ctx.fail(f"no command {name!r}" + (f"; did you mean {' or '.join(close)}?" if close else ""))
        return super().resolve_command(ctx, args)

    def invoke(self, ctx):
        from ..errors import PrecisionToolError
        try:
            code = super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort, KeyboardInterrupt):
            raise
        except PrecisionToolError as e:
            raise CommandError(f"error: {e}", EXIT_USAGE) from None
        except OSError as e:         # a full disk, a missing or unwritable directory
            where = f": {e.filename}" if e.filename else ""
            raise CommandError(f"error: {e.strerror or e}{where}", EXIT_USAGE) from None
        except Exception as e:       # a bug of ours: one line, not a traceback
            app = ctx.obj
            if app is not None and getattr(app, "log_level", 1) == 0:   # debug: the whole story
                import traceback
                click.echo(traceback.format_exc().rstrip(), err=True)
            raise CommandError(f"internal error: {type(e).__name__}: {e}", EXIT_INTERNAL) from None
        if isinstance(code, int) and code:
            ctx.exit(code)
        return code

    def format_commands(self, ctx, formatter):
        load_all_commands()
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            info = COMMANDS.get(name)
            label = f"{name}, {info.alias}" if info and info.alias != name else name
            rows.append((label, cmd.get_short_help_str(limit=60)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_Group, invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES)
@click.version_option(__version__, "-V", "--version", prog_name="precision-tool")
@click.option("--data-dir", default=None, metavar="DIR",
              help="The workspace (default: $PRECISION_TOOL_DATA or ./precision_data).")
@click.option("--results-dir", default=None, metavar="DIR",
              help="Where commands write what they make: compare results, replays, reports, "
                   "fix configs (default: $PRECISION_TOOL_RESULTS, else the workspace when it "
                   "can be written, else a directory of ~/.cache named after it).")
@click.option("--json", "as_json", is_flag=True, help="Print every result as JSON on stdout.")
@click.option("--log-level", type=click.Choice(list(LOG_LEVELS)), default="1", show_default=True,
              help="Ascend's slog levels: 0 debug, 1 info, 2 warning, 3 error, 4 none.")
@click.pass_context
def cli(ctx, data_dir, results_dir, as_json, log_level):
    """Find where a mixed-precision training run on an Ascend-style NPU loses precision, and why.

    precision_tool runs a graph on a simulated NPU and on a CPU golden executor, dumps both
    into a precision_data/ workspace and compares them op by op. Start with
    `precision-tool demo`, then `precision-tool ac -c`.
    """
    app = ctx.obj if isinstance(ctx.obj, App) else None
    if app is None:
        app = App(layout.resolve_root(data_dir))
    else:                         # the shell: the same App (its workspace index) for every line
        if data_dir is not None:
            app.data_dir = layout.resolve_root(data_dir)
    if results_dir is not None:
        app.results_dir = results_dir
    app.as_json, app.log_level = as_json, int(log_level)
    app.noted = set()                # each command names a run's interrupted steps again
    ctx.obj = app
    if ctx.invoked_subcommand is None:
        if sys.stdin.isatty() and sys.stdout.isatty() and not app.in_shell:
            from .shell import run_shell
            return run_shell(app)
        echo(ctx.get_help())


for _name in RUNNERS:
    cli.add_command(make_runner(_name))


def _plain(default):
    """An option's default as JSON shows it: None for a callable or click's "no default"
    marker (a sentinel object in click 8.2)."""
    return default if isinstance(default, (str, int, float, bool, list, tuple, type(None))) \
        else None


@dataclass
class CommandList:
    """`help` with --json: each command's name, the reference tool's alias and summary."""
    commands: List[dict]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CommandHelp:
    """`help CMD` with --json: its usage, help and options (names, help, default)."""
    command: str
    usage: str
    help: str
    options: List[dict]

    def to_dict(self) -> dict:
        return asdict(self)


@cli.command("help", short_help="The commands, or one command's options (help CMD).")
@click.argument("command_name", metavar="[CMD]", required=False)
@click.pass_context
def help_cmd(ctx, command_name):
    """The commands, or with CMD that command's options: the same as --help (with --json,
    as data: each command's names and summary, or each option's names, help and default)."""
    group = ctx.parent.command
    as_json = isinstance(ctx.obj, App) and ctx.obj.as_json
    if command_name is None:
        if as_json:
            load_all_commands()
            ctx.obj.emit(CommandList([
                {"name": name, "alias": COMMANDS[name].alias if name in COMMANDS else name,
                 "summary": group.get_command(ctx.parent, name).get_short_help_str(limit=200)}
                for name in group.list_commands(ctx.parent)]), lambda: None)
        else:
            echo(group.get_help(ctx.parent))
        return EXIT_OK
    cmd = group.get_command(ctx.parent, command_name)
    if cmd is None:
        raise click.UsageError(f"no command {command_name!r}", ctx=ctx.parent)
    with click.Context(cmd, info_name=command_name, parent=ctx.parent) as sub:
        if as_json:
            ctx.obj.emit(CommandHelp(cmd.name, " ".join(cmd.collect_usage_pieces(sub)),
                                     cmd.help or "", [
                              {"names": p.opts + p.secondary_opts, "help": p.help or "",
                               "default": _plain(p.default)}
                              for p in cmd.params
                              if isinstance(p, click.Option) and not p.hidden]), lambda: None)
        else:
            echo(cmd.get_help(sub))
    return EXIT_OK


@cli.command("shell", short_help="The interactive PrecisionTool > shell.")
@click.pass_obj
def shell_cmd(app):
    """The interactive shell: the same commands, the workspace index loaded once, tab
    completion of commands, options, op names and dump files, history kept per workspace."""
    from .shell import run_shell
    return run_shell(app)


def main(argv=None, app=None):
    """Console entry point (and the shell's, per line): returns the exit code."""
    try:
        code = cli.main(args=argv, prog_name="precision-tool", standalone_mode=False, obj=app)
        return code if isinstance(code, int) else EXIT_OK
    except click.exceptions.Exit as e:
        return e.exit_code
    except (click.Abort, KeyboardInterrupt):     # click turns Ctrl-C into Abort
        click.echo("interrupted", err=True)
        return EXIT_INTERRUPTED
    except click.UsageError as e:     # one line: the reason, and where to look
        hint = ""
        if e.ctx is not None:       # in the shell the way to a command's help is `help CMD`
            shell = app is not None and app.in_shell and e.ctx.command_path != "precision-tool"
            hint = (f" (see help {e.ctx.info_name})" if shell
                    else f" (see {e.ctx.command_path} --help)")
        click.echo(f"error: {e.format_message()}{hint}", err=True)
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code

