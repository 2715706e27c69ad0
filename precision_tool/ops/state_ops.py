"""Graph inputs and state: Placeholder, Variable (with seeded initializers), the optimizer
update ops, AssignMovingAverage and NoOp.

Update ops name the variables they overwrite through `updates`: output i is the new value of
the Variable at input position updates[i]. Executors apply it after the op runs. A gated
update op takes an optional last input, a bool scalar: when it is false the op changes
nothing (a loss-scaled step that overflowed skips its update this way).
"""
from __future__ import annotations

import math
import zlib

import numpy as np

from ..errors import GraphError
from ..graph import TensorSpec, dtypes, get_default_graph
from . import rules
from .registry import make, register


def _t(node):
    return node.output(0)


def _spec_from_attrs(specs, attrs, where):
    try:
        return [TensorSpec.make(attrs["shape"], attrs["dtype"])]
    except (KeyError, GraphError) as e:
        rules.fail(where, f"needs shape and dtype attributes: {e}")


register("Placeholder", infer=_spec_from_attrs, kernel=None, doc="a value fed at run time")
register("Variable", infer=_spec_from_attrs, kernel=None,
         attrs={"init": {"kind": "zeros"}, "seed": 0, "trainable": True},
         doc="state kept by the session across steps, initialised from attrs.init")
register("NoOp", infer=lambda s, a, w: [], kernel=lambda i, a, c: [], min_inputs=0, max_inputs=-1,
         doc="groups its inputs: running it runs them (a training step's train_op)")


# -- initializers ----------------------------------------------------------------------------
def _fans(shape):
    if len(shape) == 2:
        return shape[0], shape[1]
    if len(shape) == 4:                      # OIHW
        receptive = shape[2] * shape[3]
        return shape[1] * receptive, shape[0] * receptive
    size = int(np.prod(shape)) if shape else 1
    return size, size


def _init_zeros(rng, shape, init):
    return np.zeros(shape)


def _init_ones(rng, shape, init):
    return np.ones(shape)


def _init_constant(rng, shape, init):
    return np.full(shape, float(init["value"]))


def _init_normal(rng, shape, init):
    return rng.normal(0.0, float(init.get("stddev", 1.0)), shape)


def _init_truncated_normal(rng, shape, init):
    std = float(init.get("stddev", 1.0))
    out = rng.normal(0.0, std, shape)
    bad = np.abs(out) > 2 * std
    while bad.any():                         # redraw beyond two standard deviations, as TF does
        out[bad] = rng.normal(0.0, std, int(bad.sum()))
        bad = np.abs(out) > 2 * std
    return out


def _init_uniform(rng, shape, init):
    limit = float(init.get("limit", 1.0))
    return rng.uniform(-limit, limit, shape)


def _init_glorot_uniform(rng, shape, init):
    fan_in, fan_out = _fans(shape)
    limit = math.sqrt(6.0 / max(fan_in + fan_out, 1))
    return rng.uniform(-limit, limit, shape)


def _init_he_normal(rng, shape, init):
    fan_in, _ = _fans(shape)
    return rng.normal(0.0, math.sqrt(2.0 / max(fan_in, 1)), shape)


INITIALIZERS = {
    "zeros": _init_zeros, "ones": _init_ones, "constant": _init_constant,
    "normal": _init_normal, "truncated_normal": _init_truncated_normal,
    "uniform": _init_uniform, "glorot_uniform": _init_glorot_uniform, "he_normal": _init_he_normal,
}


def _normalize_init(init):
    if isinstance(init, str):
        init = {"kind": init}
    elif isinstance(init, (int, float)):
        init = {"kind": "constant", "value": float(init)}
    if not isinstance(init, dict) or init.get("kind") not in INITIALIZERS:
        raise GraphError(f"unknown initializer {init!r}; known: {', '.join(INITIALIZERS)}, "
                         f"or a number for a constant")
    return dict(init)


def initial_value(node, graph_seed: int) -> np.ndarray:
    """The initial value of a Variable node, fixed by (graph seed, variable seed or name)."""
    attrs = node.attrs
    shape = tuple(attrs["shape"])
    if None in shape:
        raise GraphError(f"variable {node.name!r} needs a fully known shape, got {list(shape)}")
    init = _normalize_init(attrs.get("init", "zeros"))
    seed = attrs.get("seed") or zlib.crc32(node.name.encode("utf-8"))
    rng = np.random.Generator(np.random.PCG64([int(graph_seed), int(seed)]))
    value = np.asarray(INITIALIZERS[init["kind"]](rng, shape, init), dtype=np.float64)
    return value.astype(dtypes.to_numpy(attrs["dtype"]))


def placeholder(name, shape, dtype="float32"):
    """A graph input fed at run time; None marks a dimension of any size (e.g. the batch)."""
    spec = TensorSpec.make(shape, dtype)
    return _t(make("Placeholder", [], {"shape": list(spec.shape), "dtype": spec.dtype}, name=name))


def variable(name, shape, init="glorot_uniform", seed=None, dtype="float32", trainable=True):
    """Session state with a seeded initializer: 'zeros', 'ones', 'normal', 'truncated_normal',
    'uniform', 'glorot_uniform', 'he_normal', a number (constant) or a dict {'kind': ..., ...}.
    Without a seed the variable's full name seeds it, so a model's values never depend on the
    order in which its variables were made. The name must be free: variables are never renamed."""
    graph = get_default_graph()
    spec = TensorSpec.make(shape, dtype)
    if None in spec.shape:
        raise GraphError(f"variable {name!r} needs a fully known shape, got {list(spec.shape)}")
    full = f"{graph.current_scope}/{name}" if graph.current_scope else name
    if full in graph:
        raise GraphError(f"a variable or op named {full!r} already exists")
    attrs = {"shape": list(spec.shape), "dtype": spec.dtype, "init": _normalize_init(init),
             "seed": int(seed) if seed is not None else 0, "trainable": bool(trainable)}
    return _t(make("Variable", [], attrs, name=name, graph=graph))


# -- update ops ------------------------------------------------------------------------------
def _update_infer(n_state):
    def infer(specs, attrs, where):
        if specs[-1].dtype == "bool":          # the optional gate: update only when true
            if specs[-1].shape != ():
                rules.fail(where, f"the gate must be a bool scalar, got {specs[-1]}")
            specs = specs[:-1]
        var = specs[0]
        rules.require_float(var, where, "variable")
        for k, s in enumerate(specs[1:], 1):
            if s.dtype != var.dtype:
                rules.fail(where, f"input {k} is {s}, the variable is {var}")
        if len(specs[-1].shape) != len(var.shape) or not all(
                rules.dims_equal(a, b) for a, b in zip(specs[-1].shape, var.shape)):
            rules.fail(where, f"gradient {specs[-1]} does not match variable {var}")
        return [specs[k] for k in range(n_state)]
    return infer


def _sgd_kernel(i, a, c):
    var, grad = i
    return [var - var.dtype.type(a["lr"]) * grad]


def _momentum_kernel(i, a, c):
    var, accum, grad = i
    lr, mu = var.dtype.type(a["lr"]), var.dtype.type(a["momentum"])
    accum = accum * mu + grad
    step = grad + mu * accum if a["use_nesterov"] else accum
    return [var - lr * step, accum]


def _adam_kernel(i, a, c):
    var, m, v, b1p, b2p, grad = i
    t = var.dtype.type
    b1, b2, eps = t(a["beta1"]), t(a["beta2"]), t(a["epsilon"])
    b1p, b2p = b1p * b1, b2p * b2           # beta^t for this step (the powers start at 1)
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad * grad
    lr_t = t(a["lr"]) * np.sqrt(1 - b2p) / (1 - b1p)
    return [var - lr_t * m / (np.sqrt(v) + eps), m, v, b1p, b2p]


def _moving_average_kernel(i, a, c):
    var, value = i
    d = var.dtype.type(a["decay"])
    return [var * d + value * (1 - d)]


register("ApplyGradientDescent", infer=_update_infer(1), kernel=_sgd_kernel, updates=(0,),
         min_inputs=2, max_inputs=3, gated=True, attrs={"lr": 0.01}, doc="(var, grad): var -= lr * grad")
register("ApplyMomentum", infer=_update_infer(2), kernel=_momentum_kernel, updates=(0, 1),
         min_inputs=3, max_inputs=4, gated=True, attrs={"lr": 0.01, "momentum": 0.9, "use_nesterov": False},
         doc="(var, accum, grad): accum = momentum*accum + grad; var -= lr*accum (TF semantics)")
register("ApplyAdam", infer=_update_infer(5), kernel=_adam_kernel, updates=(0, 1, 2, 3, 4),
         min_inputs=6, max_inputs=7, gated=True, attrs={"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
         doc="(var, m, v, beta1_power, beta2_power, grad): TF's Adam; unlike TF the op also "
             "advances its own beta powers, so each variable carries its step count")
register("AssignMovingAverage", infer=_update_infer(1), kernel=_moving_average_kernel,
         updates=(0,), min_inputs=2, max_inputs=3, gated=True, attrs={"decay": 0.9},
         doc="(var, value): var = decay*var + (1-decay)*value (BatchNorm moving statistics)")


def no_op(inputs, name="NoOp"):
    return make("NoOp", list(inputs), name=name)
