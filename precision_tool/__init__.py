"""precision_tool: find where a mixed-precision training run on an Ascend-style NPU loses
precision, and why.

    import precision_tool as pt
    g = pt.Graph("mlp")
    with g.as_default():
        x = pt.placeholder("x", [None, 64])
        ...
    sess = pt.Session(g, target="cpu")
"""
__version__ = "0.1.0"

from . import data, graph, models, nn, ops, train
from .errors import (ExecutionError, FeedError, FetchError, GraphError, GraphFormatError,
                     PrecisionToolError)
from .graph import Graph, Tensor
from .io import load_graph, save_graph
from .ops import constant, placeholder, variable
from .runtime import Session, SessionConfig
from . import trainer
from .train import amp
from .trainer import Model


def name_scope(name: str):
    """`with pt.name_scope("encoder"):` on the default graph."""
    return graph.get_default_graph().name_scope(name)


get_default_graph = graph.get_default_graph

__all__ = ["Graph", "Tensor", "Session", "SessionConfig", "placeholder", "variable", "constant",
           "name_scope", "get_default_graph", "load_graph", "save_graph", "ops", "nn", "train",
           "models", "data", "graph", "trainer", "amp", "Model", "PrecisionToolError", "GraphError", "GraphFormatError",
           "FeedError", "FetchError", "ExecutionError"]
