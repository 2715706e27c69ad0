"""Optimizers as graph ops: SGD (ApplyGradientDescent), Momentum (ApplyMomentum) and Adam
(ApplyAdam), named as TF names them (`<Optimizer>/update_<var>/Apply...`, slots `<var>/<Slot>`)."""
from __future__ import annotations

import abc
from typing import List, Optional, Sequence, Tuple

from ..errors import GraphError
from ..graph import Tensor
from ..ops import no_op, variable
from ..ops.registry import make
from .autodiff import gradients


def trainable_variables(graph) -> List[Tensor]:
    return [n.output(0) for n in graph.nodes
            if n.type == "Variable" and n.attrs.get("trainable", True)]


class Optimizer(abc.ABC):
    name = "Optimizer"

    def __init__(self, lr: float):
        if not lr > 0:
            raise GraphError(f"{type(self).__name__}: learning rate must be > 0, got {lr}")
        self.lr = float(lr)

    def compute_gradients(self, loss: Tensor, var_list: Optional[Sequence[Tensor]] = None
                          ) -> List[Tuple[Optional[Tensor], Tensor]]:
        variables = list(var_list) if var_list is not None else trainable_variables(loss.graph)
        if not variables:
            raise GraphError(f"{self.name}: the graph has no trainable variables")
        return list(zip(gradients(loss, variables), variables))

    def apply_gradients(self, grads_and_vars, name: Optional[str] = None,
                        gate: Optional[Tensor] = None, extra: Sequence = ()):
        """One update op per variable with a gradient, plus the graph's "update_ops", grouped
        under a NoOp that is the training step's fetch. With a bool scalar `gate`, the
        variable updates happen only when it is true (loss scaling skips overflowed steps);
        `extra` ops join the group."""
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise GraphError(f"{self.name}: no variable receives a gradient from the loss")
        graph = pairs[0][1].graph
        updates = []
        with graph.as_default():
            for g, v in pairs:
                with graph.name_scope(f"{self.name}/update_{v.node.name}/"):
                    op_type, inputs, attrs = self._update(g, v)
                    gate_input = [gate] if gate is not None else []
                    updates.append(make(op_type, inputs + gate_input, attrs))
            updates += graph.get_collection("update_ops") + list(extra)
            return no_op(updates, name=name or self.name)

    def minimize(self, loss: Tensor, var_list: Optional[Sequence[Tensor]] = None,
                 name: Optional[str] = None):
        return self.apply_gradients(self.compute_gradients(loss, var_list), name=name)

    def _slot(self, v: Tensor, slot: str, init="zeros", shape=None) -> Tensor:
        graph = v.graph
        with graph.name_scope(f"{v.node.name}/"):
            return variable(slot, v.shape if shape is None else shape, init=init, dtype=v.dtype,
                            trainable=False)

    @abc.abstractmethod
    def _update(self, g: Tensor, v: Tensor):
        """(op type, inputs, attrs) of the update op of variable v for gradient g."""


class SGD(Optimizer):
    name = "GradientDescent"

    def _update(self, g, v):
        return "ApplyGradientDescent", [v, g], {"lr": self.lr}


class Momentum(Optimizer):
    name = "Momentum"

    def __init__(self, lr: float, momentum: float = 0.9, use_nesterov: bool = False):
        super().__init__(lr)
        self.momentum = float(momentum)
        self.use_nesterov = bool(use_nesterov)

    def _update(self, g, v):
        accum = self._slot(v, "Momentum")
        return "ApplyMomentum", [v, accum, g], {"lr": self.lr, "momentum": self.momentum,
                                                "use_nesterov": self.use_nesterov}


class Adam(Optimizer):
    name = "Adam"

    def __init__(self, lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8):
        super().__init__(lr)
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)

    def _update(self, g, v):
        m, s = self._slot(v, "Adam"), self._slot(v, "Adam_1")
        b1p = self._slot(v, "Adam_beta1_power", init="ones", shape=[])
        b2p = self._slot(v, "Adam_beta2_power", init="ones", shape=[])
        return "ApplyAdam", [v, m, s, b1p, b2p, g], {"lr": self.lr, "beta1": self.beta1,
                                                    "beta2": self.beta2, "epsilon": self.epsilon}
