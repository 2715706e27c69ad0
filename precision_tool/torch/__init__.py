"""The PyTorch front-end: a real PyTorch script's API calls dumped on the golden (the script as
written) and on the simulated NPU (every kernel through the graph executor's precision
policy), into a workspace every command reads. torch is an extra
(pip install 'precision_tool[torch]'); without it, importing a name here says so in one line.
"""
import importlib

_WHERE = {"PrecisionDebugger": "debugger", "TorchFrontEndError": "debugger",
          "SimulatedNPU": "simulate"}

__all__ = sorted(_WHERE)


class TorchMissingError(ImportError):
    """torch is not installed: the PyTorch front-end is an extra."""


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise TorchMissingError("the PyTorch front-end needs torch: "
                                "pip install 'precision_tool[torch]'") from None
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
