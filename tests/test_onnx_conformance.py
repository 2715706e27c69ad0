"""External conformance: the ONNX backend node test cases of every operator that has a
counterpart in our op set, run on the fp32 CPU golden kernels within each case's tolerance.
Cases that need attributes or dtypes we do not support are skipped with the reason.

`python tests/test_onnx_conformance.py` prints passed / skipped per ONNX operator."""
import warnings

import numpy as np
import pytest

onnx_loader = pytest.importorskip("onnx.backend.test.loader")

import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402

import precision_tool as pt  # noqa: E402

from onnx_translate import RULES, Unsupported, translate  # noqa: E402


def _node_tests():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tests = onnx_loader.load_model_tests(kind="node")
    return [t for t in tests if t.model is not None and len(t.model.graph.node) == 1
            and t.model.graph.node[0].op_type in RULES]


CASES = _node_tests()


def run_case(test_case):
    """None when it passes; raises Unsupported or AssertionError otherwise."""
    graph, feeds, outputs, expected = translate(test_case)
    got = pt.Session(graph).run(outputs, feeds)
    assert len(got) == len(expected), f"{len(got)} outputs, ONNX expects {len(expected)}"
    for k, (g, want) in enumerate(zip(got, expected)):
        want = numpy_helper.to_array(want) if isinstance(want, onnx.TensorProto) else np.asarray(want)
        assert g.shape == want.shape, f"output {k}: shape {g.shape}, ONNX expects {want.shape}"
        if want.dtype.kind in "biu":
            np.testing.assert_array_equal(g, want, err_msg=f"output {k}")
        else:
            assert g.dtype.kind == "f"
            np.testing.assert_allclose(g.astype(np.float64), want.astype(np.float64),
                                       rtol=test_case.rtol, atol=test_case.atol,
                                       err_msg=f"output {k}")


def test_every_translated_operator_has_cases():
    ops_with_cases = {t.model.graph.node[0].op_type for t in CASES}
    assert ops_with_cases == set(RULES), sorted(set(RULES) - ops_with_cases)


@pytest.mark.parametrize("test_case", CASES, ids=lambda t: t.name)
def test_onnx_node_case(test_case):
    try:
        run_case(test_case)
    except Unsupported as e:
        pytest.skip(f"unsupported: {e}")


if __name__ == "__main__":
    from collections import Counter
    passed, skipped, failed = Counter(), Counter(), Counter()
    for t in CASES:
        op = t.model.graph.node[0].op_type
        try:
            run_case(t)
            passed[op] += 1
        except Unsupported:
            skipped[op] += 1
        except AssertionError:
            failed[op] += 1
    print(f"{'ONNX operator':26} passed skipped failed")
    for op in sorted(set(passed) | set(skipped) | set(failed)):
        print(f"{op:26} {passed[op]:6} {skipped[op]:7} {failed[op]:6}")
    print(f"{'total':26} {sum(passed.values()):6} {sum(skipped.values()):7} "
          f"{sum(failed.values()):6}")
