"""Lost updates (analysis.diagnosis.updates): an update judged by what it changed, new minus old in the
variable's dtype, against the golden's change. The reference is plain arithmetic on a bf16
weight of 1.0 (ulp 2^-7 above, 2^-8 below): a step of 0.0015 down is under half an ulp
(0.00195), a step of 0.003 is not, so exactly the elements given the small step stay put;
the loss is a finding when the energy lost takes the change's cosine under the criteria's."""
import numpy as np
import pytest

import precision_tool as pt
from precision_tool import hooks
from precision_tool.analysis import auto_check
from precision_tool.analysis.diagnosis.updates import check_updates
from precision_tool.dump import Workspace

N = 64
SMALL, LARGE = 0.0015, 0.003


def _workspace(root, small: int, data: str = "tensor"):
    """One SGD step (lr 1) of loss = sum(w * x) with w a bf16 variable of ones: the step of
    element i is x[i], SMALL for the first `small` elements and LARGE for the rest."""
    g = pt.Graph("bf16_step", seed=0)
    with g.as_default():
        x = pt.placeholder("x", [N], "bfloat16")
        w = pt.variable("w", [N], init="ones", dtype="bfloat16")
        loss = pt.ops.reduce_sum(pt.ops.cast(w * x, "float32"))
        train_op = pt.train.SGD(1.0).minimize(loss)
    feed = np.where(np.arange(N) < small, SMALL, LARGE).astype(np.float32)
    npu = pt.Session(g, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(precision_mode="allow_mix_precision_bf16"), action="dump",
        data_dir=str(root), dump_data=data))
    cpu = hooks.sess_dump(pt.Session(g), action="dump", data_dir=str(root), dump_data=data)
    for sess in (npu, cpu):
        sess.run([loss, train_op], {x: feed})
        sess.close()
    return Workspace(str(root))


def _energy(small: int) -> float:
    """The share of the golden change's sum of squares in the small steps (the golden
    holds the feed as bf16 numbers, in float32)."""
    from ml_dtypes import bfloat16
    steps = np.where(np.arange(N) < small, SMALL, LARGE).astype(bfloat16).astype(np.float64)
    return float(np.sum(steps[:small] ** 2) / np.sum(steps ** 2))


@pytest.mark.parametrize("small", [0, 8, 32, 64])
def test_the_elements_whose_step_is_under_half_an_ulp_are_lost(tmp_path, small):
    ws = _workspace(tmp_path, small)
    check = check_updates(ws, ws.run("npu"), ws.run("cpu"), 0)
    assert check.checked == 1 and not check.partial
    energy = _energy(small)
    if energy <= 1 - 0.98 ** 2:              # the change's cosine stays over the criteria's
        assert check.lost == []
        assert small in (0, 8)                # 8 of 64 stall: 3.4% of the energy, no effect
        return
    (lost,) = check.lost
    assert lost.variable == "w:0" and lost.dtype == "bfloat16" and not lost.by_statistics
    assert (lost.moved, lost.stalled) == (N, small)
    assert lost.energy == pytest.approx(energy, rel=1e-2)
    if energy < 1:      # with the criteria's cosine under what remains, the same loss passes
        loose = check_updates(ws, ws.run("npu"), ws.run("cpu"), 0,
                              {"cosine": float(np.sqrt(1 - energy)) - 1e-3})
        assert loose.lost == []


def test_ac_names_the_lost_update_and_advises_master_weights(tmp_path):
    ws = _workspace(tmp_path, 32)
    r = auto_check(ws, compare=True)
    assert r.has_findings and r.lost_updates["lost"][0]["share"] == 0.5
    advice = " ".join(r.advice)
    assert "Updates are lost" in advice and "fp32 master weights" in advice
    assert "precision looks sound" not in advice
    # the update is named: an optimizer's weight decay is lost as surely as its step
    assert f"of its change) at {r.lost_updates['lost'][0]['op_name']}:" in advice


def test_a_statistics_dump_sees_an_update_lost_whole(tmp_path):
    ws = _workspace(tmp_path, N, data="stats")
    check = check_updates(ws, ws.run("npu"), ws.run("cpu"), 0)
    assert check.by_statistics == 1 and check.partial
    (lost,) = check.lost
    assert lost.by_statistics and lost.share == 1.0


def test_a_statistics_dump_says_a_partial_loss_does_not_show(tmp_path):
    ws = _workspace(tmp_path, 32, data="stats")
    r = auto_check(ws, compare=True)
    assert r.lost_updates is None and r.update_check["by_statistics"] == 1
    advice = " ".join(r.advice)
    assert "only by their statistics" in advice and "--dump-data tensor" in advice


def test_a_variable_held_as_finely_as_the_golden_loses_nothing_of_its_own():
    """An fp32 weight of 1.0 (ulp 2^-23 above): the golden adds 7e-8, over half an ulp, and
    moves by one ulp; the NPU adds 5e-8 (its gradient's rounding differed), under half an
    ulp, and stays. Held in fp32 on both sides, that stall is the same rounding the golden
    does on what it was given: no lost update. The same numbers with the NPU's weight in
    bf16 are a loss, and so is a golden in float64 beside an fp32 NPU."""
    from precision_tool.analysis.diagnosis.updates import _lost
    old = np.ones(4, np.float32)
    g_new, new = old + np.float32(7e-8), old + np.float32(5e-8)
    assert (g_new - old == np.spacing(np.float32(1))).all() and (new == old).all()
    assert _lost("u", "w:0", "float32", old, new, old, g_new, golden_dtype="float32") is None
    lost = _lost("u", "w:0", "bfloat16", old, new, old, g_new, golden_dtype="float32")
    assert (lost.moved, lost.stalled, lost.energy) == (4, 4, 1.0)
    wide = _lost("u", "w:0", "float32", old, new, old.astype(np.float64),
                 old.astype(np.float64) + 7e-8, golden_dtype="float64")
    assert (wide.moved, wide.stalled) == (4, 4)
