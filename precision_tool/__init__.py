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

from . import graph, nn, ops, train
from .errors import (ExecutionError, FeedError, FetchError, GraphError, GraphFormatError,
                     PrecisionToolError)
from .graph import Graph, Tensor
from .io import load_graph, save_graph
from .ops import constant, placeholder, variable
from .runtime import Session, SessionConfig
from .train import amp

# imported when first used (PEP 562): the models and the data are only built on demand, and
# the trainer pulls in the dump hooks and, through the workspace, pandas
_LAZY = {"data": ("data", None), "models": ("models", None), "trainer": ("trainer", None),
         "hooks": ("dump.hooks", None), "analysis": ("analysis", None), "Model": ("trainer", "Model")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'precision_tool' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(f".{module}", __name__)
    value = getattr(value, attr) if attr else value
    globals()[name] = value
    return value


def name_scope(name: str):
    """`with pt.name_scope("encoder"):` on the default graph."""
    return graph.get_default_graph().name_scope(name)


get_default_graph = graph.get_default_graph

__all__ = ["Graph", "Tensor", "Session", "SessionConfig", "placeholder", "variable", "constant",
           "name_scope", "get_default_graph", "load_graph", "save_graph", "ops", "nn", "train",
           "models", "data", "graph", "trainer", "amp", "Model", "PrecisionToolError", "GraphError", "GraphFormatError",
           "FeedError", "FetchError", "ExecutionError"]
