"""The dump layer: the precision_data/ workspace layout, the dump observers and their
writer, the workspace reader and replay bundles."""
from .dumper import DumpHook, DumpObserver
from .layout import DumpConfigError, DumpSettings, parse_action, parse_steps
from .replay import Bundle, ReplayError, load_bundle, replay
from .workspace import Run, StepDump, Workspace, WorkspaceError
from .writer import DumpWriteError

__all__ = ["DumpHook", "DumpObserver", "DumpSettings", "DumpConfigError", "parse_action",
           "parse_steps", "Bundle", "ReplayError", "load_bundle", "replay", "Run", "StepDump",
           "Workspace", "WorkspaceError", "DumpWriteError"]
