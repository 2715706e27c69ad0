"""The dump layer: the precision_data/ workspace layout, the dump observers and their
writer (kernels.write), the workspace reader and replay bundles. Its names load with the module that defines
them (PEP 562): the workspace reader brings pandas, which a dump alone does not need."""
import importlib

_WHERE = {"DumpHook": "dumper", "DumpObserver": "dumper", "DumpConfigError": "layout",
          "DumpSettings": "layout", "parse_action": "layout", "parse_steps": "layout",
          "Bundle": "replay", "ReplayError": "replay", "load_bundle": "replay", "replay": "replay",
          "Run": "workspace", "StepDump": "workspace", "Workspace": "workspace",
          "WorkspaceError": "workspace", "DumpWriteError": ".kernels.write"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


# `replay` is also a submodule's name, and importing a submodule binds the package's
# attribute to it: the replay module (no pandas in it) is imported here, the function bound
# after it, so that `from precision_tool.dump import replay` is always the function
from .replay import replay  # noqa: E402
