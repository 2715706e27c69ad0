"""The command line: `precision-tool` and `python -m precision_tool`.

Exit codes: 0 nothing found, 1 precision findings, 2 usage or input error (one line on
stderr), 3 internal error.
"""
import click

from .. import __version__

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


@click.group(invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"]},
             epilog="Exit codes: 0 nothing found, 1 precision findings (ops under the threshold, "
                    "overflow), 2 usage or input error, 3 internal error.")
@click.version_option(__version__, "-V", "--version", prog_name="precision-tool")
@click.pass_context
def cli(ctx):
    """Find where a mixed-precision training run on an Ascend-style NPU loses precision, and why.

    precision_tool runs a graph on a simulated NPU and on a CPU golden executor, dumps both
    into a precision_data/ workspace and compares them op by op.
    """
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


def main(argv=None):
    """Console entry point; click maps usage errors to exit code 2."""
    return cli.main(args=argv, prog_name="precision-tool")
