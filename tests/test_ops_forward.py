"""Every op's kernel against an independent float64 reference, in fp64 and fp32 runs."""
import numpy as np
import pytest

import precision_tool as pt
from precision_tool.ops import registry

import harness
from op_cases import CASES, STRUCTURAL

TOLERANCE = {"float64": dict(rtol=1e-10, atol=1e-12), "float32": dict(rtol=2e-5, atol=2e-6)}


def test_every_registered_op_has_a_forward_case():
    covered = {c.op for c in CASES} | set(STRUCTURAL)
    missing = sorted(set(registry.REGISTRY) - covered)
    assert not missing, f"ops without a forward test case: {missing}"
    unknown = sorted(covered - set(registry.REGISTRY))
    assert not unknown, f"test cases for unregistered ops: {unknown}"


@pytest.mark.parametrize("golden_dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_matches_reference(case, golden_dtype):
    outputs, _ = harness.run(case, golden_dtype)
    expected = harness.as_list(case.ref(*harness.round_inputs(case)))
    assert len(outputs) >= len(expected)
    for got, want in zip(outputs, expected):
        want = np.asarray(want)
        assert got.shape == want.shape
        if want.dtype.kind == "b" or got.dtype.kind in "biu":
            np.testing.assert_array_equal(got, want)
        else:
            assert got.dtype == np.dtype(golden_dtype)
            np.testing.assert_allclose(got.astype(np.float64), want, **TOLERANCE[golden_dtype])


def test_update_ops_write_their_variables():
    case = next(c for c in CASES if c.op == "ApplyAdam")
    outputs, sess = harness.run(case, "float64")
    state = sess.variables()
    for k, value in zip(registry.get("ApplyAdam").updates, outputs):
        np.testing.assert_array_equal(state[f"v{k}"], value)


def test_dropout_mask():
    """Dropout keeps each element with probability 1 - rate and scales it by 1/(1 - rate); the
    mask is fixed by (graph seed, op seed, step): new every step, reproducible across sessions."""
    g = pt.Graph("drop", seed=3)
    with g.as_default():
        x = pt.placeholder("x", [200, 100])
        node = registry.make("Dropout", [x], {"rate": 0.3, "seed": 11})
    xv = np.random.default_rng(0).normal(size=(200, 100)).astype(np.float32)
    sess = pt.Session(g)
    y0, m0 = sess.run([node.output(0), node.output(1)], {x: xv})
    y1, m1 = sess.run([node.output(0), node.output(1)], {x: xv})
    assert set(np.unique(m0)) == {np.float32(0.0), np.float32(1 / 0.7)}
    assert abs((m0 == 0).mean() - 0.3) < 0.01
    np.testing.assert_array_equal(y0, xv * m0)
    assert (m0 != m1).any()
    again = pt.Session(g).run(node.output(1), {x: xv})
    np.testing.assert_array_equal(again, m0)


def test_reductions_of_empty_tensors_are_defined():
    g = pt.Graph("empty")
    with g.as_default():
        x = pt.placeholder("x", [0, 3])
        s = pt.ops.reduce_sum(x, 0)
        m = pt.ops.reduce_max(x, 0)
    out_s, out_m = pt.Session(g).run([s, m], {x: np.zeros((0, 3), np.float32)})
    np.testing.assert_array_equal(out_s, [0, 0, 0])
    np.testing.assert_array_equal(out_m, [-np.inf] * 3)


def test_erf_matches_math_erf_to_a_few_ulp():
    import math
    from precision_tool.ops.special import erf
    xs = np.concatenate([np.linspace(-7, 7, 20001), [0.0, -0.0, 2.9999999, 3.0, 1e-300,
                                                      np.inf, -np.inf]])
    want = np.array([math.erf(v) for v in xs])
    np.testing.assert_allclose(erf(xs), want, rtol=0, atol=4e-15)
    assert np.isnan(erf(np.array([np.nan])))[0]
    assert erf(np.float32([0.5])).dtype == np.float32
