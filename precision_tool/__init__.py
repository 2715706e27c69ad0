"""precision_tool: find where a mixed-precision training run on an Ascend-style NPU loses
precision, and why.

    import precision_tool as pt
    g = pt.Graph("mlp")
    with g.as_default():
        x = pt.placeholder("x", [None, 64])
        ...
    sess = pt.Session(g, target="cpu")
"""
import importlib

from .version import __version__
from .errors import (ExecutionError, FeedError, FetchError, GraphError, GraphFormatError,
                     PrecisionToolError)

# Every name below is imported when first used (PEP 562): `import precision_tool` costs
# numpy alone, so the command line and the dump hooks start fast; the graph, the ops, the
# runtime, the models and the trainer (which brings pandas) load on demand.
# name -> (module, attribute; None: the module itself)
_LAZY = {"graph": ("graph", None), "nn": ("nn", None), "ops": ("ops", None),
         "train": ("train", None), "data": ("data", None), "models": ("models", None),
         "trainer": ("trainer", None), "hooks": ("dump.hooks", None),
         "analysis": ("analysis", None), "amp": ("train", "amp"),
         "Graph": ("graph", "Graph"), "Tensor": ("graph", "Tensor"),
         "get_default_graph": ("graph", "get_default_graph"),
         "load_graph": ("graph_files", "load_graph"), "save_graph": ("graph_files", "save_graph"),
         "constant": ("ops", "constant"), "placeholder": ("ops", "placeholder"),
         "variable": ("ops", "variable"), "Session": ("runtime", "Session"),
         "SessionConfig": ("runtime", "SessionConfig"), "Model": ("trainer", "Model")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'precision_tool' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(f".{module}", __name__)
    value = getattr(value, attr) if attr else value
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def name_scope(name: str):
    """`with pt.name_scope("encoder"):` on the default graph."""
    return __getattr__("graph").get_default_graph().name_scope(name)


__all__ = ["Graph", "Tensor", "Session", "SessionConfig", "placeholder", "variable", "constant",
           "name_scope", "get_default_graph", "load_graph", "save_graph", "ops", "nn", "train",
           "models", "data", "graph", "trainer", "amp", "Model", "PrecisionToolError", "GraphError", "GraphFormatError",
           "FeedError", "FetchError", "ExecutionError"]
