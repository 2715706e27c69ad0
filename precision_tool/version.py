"""The package's version, in one place: read by setup.cfg, run.json and --version without
importing the package's layers."""
__version__ = "0.1.0"
