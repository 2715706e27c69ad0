"""Drift (analysis.diagnosis.drift) and what it reads: the loss in the step history, the losses side by
side, each variable's distance from the golden's. References are hand computations on
made-up histories and tables; the end-to-end cases are the scenarios state_drift and
loss_drift_undumped."""
import pandas as pd
import pytest

import precision_tool as pt
from precision_tool import hooks
from precision_tool.analysis.diagnosis.drift import loss_gap, state_distances, state_drift
from precision_tool.dump import Workspace


def _two_runs(root, steps=4, dump_step="1"):
    """The MLP trained `steps` steps on the NPU and the golden, one step dumped: the losses
    each session.run returned, by target."""
    m = pt.models.mlp()
    d = pt.data.digits()
    npu = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(precision_mode="allow_mix_precision"), action="dump",
        dump_step=dump_step, data_dir=str(root)))
    cpu = hooks.sess_dump(pt.Session(m.graph), action="dump", dump_step=dump_step,
                          data_dir=str(root))
    losses = {}
    for name, sess in (("npu", npu), ("cpu", cpu)):
        losses[name] = [float(sess.run([m.loss, m.train_op],
                                       {m.x: d.x_train[32 * k:32 * k + 32],
                                        m.y: d.y_train[32 * k:32 * k + 32]})[0])
                        for k in range(steps)]
        sess.close()
    return Workspace(str(root)), losses


def test_the_step_history_holds_every_steps_loss_dumped_or_not(tmp_path):
    ws, losses = _two_runs(tmp_path)
    for target in ("npu", "cpu"):
        history = ws.step_history(ws.run(target))
        assert list(history.step) == [0, 1, 2, 3]
        assert history.loss.tolist() == losses[target]       # repr round-trips a float


def test_a_history_written_before_the_loss_reads_without_it_and_a_torn_line_goes(tmp_path):
    ws, _ = _two_runs(tmp_path)
    run = ws.run("npu")
    path = run.path + "/step_history.csv"
    rows = open(path).read().splitlines()
    old = ["step,status,loss_scale,next_loss_scale,finite"] + \
        [r.rsplit(",", 1)[0] for r in rows[1:]]
    open(path, "w").write("\n".join(old) + "\n")
    history = Workspace(str(tmp_path)).step_history(run)
    assert list(history.step) == [0, 1, 2, 3] and history.loss.isna().all()
    # a last row cut in its loss (no line end) would parse as another number: it is dropped
    open(path, "w").write("\n".join(rows)[:-3])
    history = Workspace(str(tmp_path)).step_history(run)
    assert list(history.step) == [0, 1, 2]


def _histories(tmp_path, npu_losses, golden_losses):
    ws, _ = _two_runs(tmp_path, steps=1, dump_step="0")
    for target, losses in (("npu", npu_losses), ("cpu", golden_losses)):
        with open(ws.run(target).path + "/step_history.csv", "w") as f:
            f.write("step,status,loss_scale,next_loss_scale,finite,loss\n")
            for k, v in enumerate(losses):
                f.write(f"{k},0,,,,{'' if v is None else repr(v)}\n")
    return Workspace(str(tmp_path))


def test_loss_gap_is_the_relative_difference_step_by_step(tmp_path):
    npu = [2.0, 1.5, 1.02, 0.9, None, 0.8]
    golden = [2.0, 1.49, 1.0, 0.8, 0.7, 0.5]
    ws = _histories(tmp_path, npu, golden)
    gap = loss_gap(ws, ws.run("npu"), ws.run("cpu"), 0.05)
    rel = [abs(a - b) / b for a, b in zip(npu, golden) if a is not None]
    assert gap.steps == 5                       # step 4 has no NPU loss
    assert gap.first_off == 3 and gap.worst_step == 5
    assert gap.worst == pytest.approx(max(rel)) and gap.last == pytest.approx(rel[-1])
    assert loss_gap(ws, ws.run("npu"), ws.run("cpu"), 0.7).first_off is None


def test_a_loss_that_goes_non_finite_on_one_side_is_off_and_a_zero_golden_is_absolute(tmp_path):
    ws = _histories(tmp_path, [1.0, float("nan"), 0.01], [1.0, 0.9, 0.0])
    gap = loss_gap(ws, ws.run("npu"), ws.run("cpu"), 0.05)
    # the nan row has no number to compare (dropped); 0.01 against 0 is 0.01 absolute
    assert gap.steps == 2 and gap.first_off is None and gap.last == pytest.approx(0.01)
    ws = _histories(tmp_path / "inf", [1.0, float("inf")], [1.0, 0.9])
    gap = loss_gap(ws, ws.run("npu"), ws.run("cpu"), 0.05)
    assert gap.first_off == 1 and gap.worst == float("inf")


def _table(rows):
    return pd.DataFrame(rows, columns=["GoldenOpType", "TensorIndex", "GoldenTensor",
                                       "RelativeEuclideanDistance"])


def test_state_distances_take_each_variables_worst_read():
    t = _table([("Variable", "MatMul:input:1", "w:0", 0.01),
                ("Variable", "Grad:input:2", "w:0", 0.03),       # another reader of w
                ("Variable", "Add:input:1", "b:0", "nan"),       # no number: left out
                ("MatMul", "Relu:input:0", "MatMul:0", 0.5),     # not a variable
                ("Variable", "Apply:output:0", "w:0", 0.9)])     # what an update wrote
    assert state_distances(t) == {"w:0": 0.03}


def test_state_drift_ranks_the_variables_and_keeps_their_history():
    tables = {s: _table([("Variable", "M:input:1", "w:0", 0.001 * 2 ** s),
                         ("Variable", "A:input:1", "b:0", 0.002 * s)]) for s in range(20)}
    d = state_drift(tables, 19, shown=2)
    assert [v["variable"] for v in d.variables] == ["w:0", "b:0"]
    w = d.variables[0]
    assert w["distance"] == pytest.approx(0.001 * 2 ** 19)
    # ten points of the nineteen steps before, the first and the last among them
    assert len(w["before"]) == 10 and min(w["before"]) == 0 and max(w["before"]) == 18
    assert all(w["before"][s] == pytest.approx(0.001 * 2 ** s) for s in w["before"])


def test_losses_parting_name_the_dump_command_of_the_runs_front_end():
    """Losses that part while every dumped step matches: the advice names the steps to dump
    with the command that made the runs (npu-dump and cpu-dump for a graph's script,
    torch-run for a PyTorch script's)."""
    from precision_tool.analysis.advice import _drift_advice
    d = {"kind": "loss", "own": [], "shows_first": None,
         "loss": {"steps": 10, "first_off": 7, "worst": 0.2, "worst_step": 9},
         "state": {"step": 6, "variables": [{"variable": "fc.weight", "distance": 0.01,
                                             "before": {}}]}}
    graph = _drift_advice(d, 0, None)
    script = _drift_advice(d, 0, None, "pytorch")
    assert 'npu-dump --dump-step "6-7"' in graph and "cpu-dump likewise" in graph
    assert 'torch-run --dump-step "6-7" -- <your training command>' in script
    assert "npu-dump" not in script and "cpu-dump" not in script
