"""The command line: `precision-tool` and `python -m precision_tool`.

Exit codes: 0 nothing found, 1 precision findings, 2 usage or input error (one line on
stderr), 3 internal error.
"""
import sys

import click

from .. import __version__
from ..dump import layout
from .runner import ALIASES, RUNNERS, make_runner

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class _Group(click.Group):
    """Accepts the reference tool's spellings of the runner commands (npu_dump, tf_dump...)."""

    def get_command(self, ctx, name):
        return super().get_command(ctx, ALIASES.get(name, name))


@click.group(cls=_Group, invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"]},
             epilog="Exit codes: 0 nothing found, 1 precision findings (ops under the threshold, "
                    "overflow), 2 usage or input error, 3 internal error.")
@click.version_option(__version__, "-V", "--version", prog_name="precision-tool")
@click.option("--data-dir", default=None, metavar="DIR",
              help=f"The workspace (default: $PRECISION_TOOL_DATA or ./precision_data).")
@click.pass_context
def cli(ctx, data_dir):
    """Find where a mixed-precision training run on an Ascend-style NPU loses precision, and why.

    precision_tool runs a graph on a simulated NPU and on a CPU golden executor, dumps both
    into a precision_data/ workspace and compares them op by op.
    """
    ctx.obj = {"data_dir": layout.resolve_root(data_dir)}
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


for _name in RUNNERS:
    cli.add_command(make_runner(_name))


def main(argv=None):
    """Console entry point. click maps usage errors to exit code 2; so do our input errors
    (one line, no traceback); anything else is an internal error, exit code 3."""
    from ..errors import PrecisionToolError
    try:
        return cli.main(args=argv, prog_name="precision-tool", standalone_mode=False) or 0
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("aborted", err=True)
        sys.exit(EXIT_USAGE)
    except click.ClickException as e:
        e.show()
        sys.exit(EXIT_USAGE)
    except PrecisionToolError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    except Exception as e:  # a bug of ours: say so in one line, keep the traceback for --debug
        click.echo(f"internal error: {type(e).__name__}: {e}", err=True)
        sys.exit(EXIT_INTERNAL)
