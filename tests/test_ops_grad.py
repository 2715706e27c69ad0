"""Every gradient rule against central finite differences in float64."""
import numpy as np
import pytest

import precision_tool as pt
from precision_tool.ops import registry

import harness
from op_cases import CASES, Case, normal

# Ops without a gradient rule, and why none is needed.
NOT_DIFFERENTIABLE = {
    "Placeholder": "graph input", "Variable": "gradients stop at variables",
    "Const": "constant", "NoOp": "no outputs",
    "Equal": "bool output", "NotEqual": "bool output", "Greater": "bool output",
    "GreaterEqual": "bool output", "Less": "bool output", "LessEqual": "bool output",
    "LogicalAnd": "bool output", "LogicalOr": "bool output", "LogicalNot": "bool output",
    "IsNan": "bool output", "IsInf": "bool output",
    "ZerosLike": "constant in its input", "OnesLike": "constant in its input",
    "OneHot": "integer input",
    "ApplyGradientDescent": "update op", "ApplyMomentum": "update op", "ApplyAdam": "update op",
    "AssignMovingAverage": "update op",
    # kernels that only appear inside gradient graphs (no second derivatives are built)
    "ReluGrad": "gradient kernel", "TanhGrad": "gradient kernel", "SigmoidGrad": "gradient kernel",
    "SqrtGrad": "gradient kernel", "RsqrtGrad": "gradient kernel", "GeluGrad": "gradient kernel",
    "SumToLike": "gradient kernel", "BroadcastLike": "gradient kernel", "Slice": "gradient kernel",
    "BiasAddGrad": "gradient kernel", "GatherGrad": "gradient kernel",
    "Conv2DBackpropInput": "gradient kernel", "Conv2DBackpropFilter": "gradient kernel",
    "MaxPoolGrad": "gradient kernel", "AvgPoolGrad": "gradient kernel",
    "BatchNormGrad": "gradient kernel",
    # compiled NPU graphs are run, never differentiated
    "LayerNorm": "NPU fused kernel", "RmsNorm": "NPU fused kernel",
    "SoftmaxV2": "NPU fused kernel", "FastGelu": "NPU fused kernel",
    "MatMulV2": "NPU fused kernel", "BatchMatMulV2": "NPU fused kernel",
    "Conv2DBatchNorm": "NPU fused kernel", "FusedEltwise": "NPU fused kernel",
    "TransData": "NPU format conversion", "NPUGetFloatStatus": "status op",
    "NPUClearFloatStatus": "status op", "UpdateLossScale": "update op",
}

EXTRA = [Case("Dropout", [normal(4, 5)], None, attrs={"rate": 0.4, "seed": 5})]
GRAD_CASES = [c for c in CASES if c.grad and registry.get(c.op).grad is not None] + EXTRA


def test_every_op_is_differentiable_or_says_why_not():
    for name, op in registry.REGISTRY.items():
        if op.grad is None:
            assert name in NOT_DIFFERENTIABLE, f"{name} has no gradient rule and no stated reason"
        else:
            assert name not in NOT_DIFFERENTIABLE, f"{name} has a gradient rule"
            assert any(c.op == name for c in GRAD_CASES), f"{name}'s gradient is not tested"


def _loss_graph(case):
    g, node, inputs, feeds, _ = harness.build(case, float_dtype="float64")
    y = node.output(0)
    weights = np.random.default_rng(99).normal(size=[d for d in y.shape])
    with g.as_default():
        loss = pt.ops.reduce_sum(pt.ops.mul(y, pt.constant(weights, dtype=y.dtype)))
    return g, loss, inputs, feeds


def _evaluate(g, loss, feeds):
    # a fresh session each time: ops drawing random numbers (Dropout) see the same step
    return float(pt.Session(g, config=pt.SessionConfig(golden_dtype="float64")).run(loss, feeds))


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.name)
def test_gradient_matches_finite_differences(case):
    g, loss, inputs, feeds = _loss_graph(case)
    wrt = case.wrt if case.wrt is not None else [
        k for k, v in enumerate(case.inputs) if v.dtype.kind == "f"]
    xs = [inputs[k] for k in wrt]
    grads = pt.train.gradients(loss, xs)
    assert all(gr is not None for gr in grads), "a float input got no gradient"
    analytic = pt.Session(g, config=pt.SessionConfig(golden_dtype="float64")).run(grads, feeds)
    eps = 1e-6
    for x, got in zip(xs, analytic):
        base = feeds[x]
        numeric = np.zeros_like(base, dtype=np.float64)
        for idx in np.ndindex(base.shape):
            for sign in (1, -1):
                moved = base.astype(np.float64).copy()
                moved[idx] += sign * eps
                numeric[idx] += sign * _evaluate(g, loss, {**feeds, x: moved})
        numeric /= 2 * eps
        np.testing.assert_allclose(got, numeric, rtol=1e-6, atol=1e-7,
                                   err_msg=f"d loss / d {x.node.name} of {case.name}")


def test_inference_batch_norm_gives_no_gradient_to_moving_statistics():
    case = next(c for c in CASES if c.op == "BatchNorm" and c.id == "inference")
    g, loss, inputs, _ = _loss_graph(case)
    grads = pt.train.gradients(loss, inputs)
    assert grads[3] is None and grads[4] is None
    assert all(gr is not None for gr in grads[:3])


def test_an_op_without_gradient_on_the_path_is_named():
    g = pt.Graph("g")
    with g.as_default():
        w = pt.variable("w", [3])
        hot = pt.ops.cast(pt.ops.greater(w, 0.0), "float32")
        loss = pt.ops.reduce_sum(pt.ops.mul(hot, w))
    grads = pt.train.gradients(loss, [w])     # Greater is cut off: bool has no gradient path
    assert grads[0] is not None
    g2 = pt.Graph("g2")
    with g2.as_default():
        v = pt.variable("v", [2, 2])
        z = pt.ops.zeros_like(v)
        loss2 = pt.ops.reduce_sum(pt.ops.add(z, 1.0))
    with pytest.raises(pt.GraphError, match="ZerosLike.*no gradient"):
        pt.train.gradients(loss2, [v])
