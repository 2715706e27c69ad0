"""The console entry points."""
import subprocess
import sys

from click.testing import CliRunner

import precision_tool as pt
from precision_tool.cli import cli


def test_help_and_version_through_click():
    runner = CliRunner()
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "Usage: " in result.output and "Exit codes: 0 nothing found" in result.output
    result = runner.invoke(cli, ["--version"])
    assert result.exit_code == 0 and pt.__version__ in result.output
    result = runner.invoke(cli, ["--no-such-option"])
    assert result.exit_code == 2 and "No such option" in result.output


def test_python_dash_m_runs_the_same_cli():
    out = subprocess.run([sys.executable, "-m", "precision_tool", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and f"precision-tool, version {pt.__version__}" in out.stdout


def test_every_package_directory_is_a_package():
    """`pip install .` ships only directories setuptools finds: each needs its __init__.py."""
    import os
    root = os.path.dirname(pt.__file__)
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
        if any(f.endswith(".py") for f in files):
            assert "__init__.py" in files, f"{os.path.relpath(dirpath, root)} is not a package"
