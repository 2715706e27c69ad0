"""The dump layer: the precision_data/ workspace layout, the run writer every front-end
writes through (runwriter.py), the dump observers, the workspace reader and replay bundles
(bundle.py). Its names load
with the module that defines them (PEP 562): a replay brings the runtime, which reading a
workspace does not need."""
import importlib

_WHERE = {"DumpHook": "dumper", "DumpObserver": "dumper", "DumpConfigError": "layout",
          "DumpSettings": "layout", "parse_action": "layout", "parse_steps": "layout",
          "Bundle": "bundle", "ReplayError": "bundle", "load_bundle": "bundle", "replay": "bundle",
          "Run": "run", "StepDump": "run", "Workspace": "workspace",
          "WorkspaceError": "workspace", "DumpWriteError": "writer",
          "RunWriter": "runwriter", "OpSpec": "runwriter", "TensorSpec": "runwriter",
          "Record": "runwriter", "Target": "layout"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value

