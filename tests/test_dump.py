"""Dump hooks, the precision_data workspace, the writer, the reader and replay bundles."""
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pandas as pd
import pytest

import precision_tool as pt
from precision_tool import hooks
from precision_tool.dump import (DumpConfigError, Workspace, cores, load_bundle, parse_steps,
                                 replay)
from precision_tool.dump.bundle import ReplayError

import refs


def _train(model, root, steps=3, npu_action="dump", cpu_action="dump", **kw):
    d = pt.data.digits()
    cfg = hooks.session_dump_config(pt.SessionConfig(precision_mode="allow_mix_precision"),
                                    action=npu_action, data_dir=root, **kw)
    npu = pt.Session(model.graph, target="npu", config=cfg)
    cpu = hooks.sess_dump(pt.Session(model.graph), action=cpu_action, data_dir=root, **kw)
    for i in range(steps):
        feed = {model.x: d.x_train[32 * i:32 * (i + 1)], model.y: d.y_train[32 * i:32 * (i + 1)]}
        npu.run([model.loss, model.train_op], feed)
        cpu.run([model.loss, model.train_op], feed)
    return npu, cpu


def _tensor_files(path):
    return {f for f in os.listdir(path) if f.endswith(".npy")}


def test_dump_step_selects_steps_and_index_matches_files_exactly(tmp_path):
    m = pt.models.mlp()
    _train(m, str(tmp_path), steps=3, dump_step="0|2")
    ws = Workspace(str(tmp_path))
    for target in ("npu", "cpu"):
        run = ws.run(target)
        assert [s.step for s in run.steps] == [0, 2] and all(s.complete for s in run.steps)
        for step in (0, 2):
            table = ws.index(run, step)
            files = set(table["file"])
            assert files == _tensor_files(ws.step_path(run, step))     # no orphan, none missing
            for row in table.itertuples():
                arr = ws.load(run, step, row.file)
                assert " ".join(map(str, arr.shape)) == str(row.shape)
                if arr.size and np.isfinite(arr).all():
                    assert abs(float(arr.astype(np.float64).max()) - row.max) <= 1e-6 * max(1, abs(row.max))
    info = json.loads((tmp_path / "npu" / "debug_0" / "run.json").read_text())
    assert info["dumped_steps"] == [0, 2] and info["precision_mode"] == "allow_mix_precision"
    assert (tmp_path / "npu" / "debug_0" / "fusion_result.json").is_file()
    assert (tmp_path / "npu" / "debug_0" / "graph" / "mlp.json").is_file()
    assert sorted(os.listdir(tmp_path / "npu" / "debug_0" / "replay")) == ["0", "2"]


def test_later_steps_reuse_the_index_plan_with_their_own_timestamps(tmp_path, monkeypatch):
    from precision_tool.dump import dumper, layout
    plans = []
    build = dumper.DumpObserver._build_plan
    monkeypatch.setattr(dumper.DumpObserver, "_build_plan",
                        lambda self, *a: plans.append(self.target) or build(self, *a))
    m = pt.models.mlp()
    npu, _ = _train(m, str(tmp_path), steps=3, dump_step="0-2")
    npu.close()
    assert sorted(plans) == ["cpu", "npu"]      # built for step 0, filled in for steps 1 and 2
    ws = Workspace(str(tmp_path))
    run = ws.run("npu")
    stamps = []
    for step in range(3):
        table = ws.index(run, step)
        assert set(table["file"]) == _tensor_files(ws.step_path(run, step))
        out = table[table.io == "output"]
        assert len(out) and all(
            r.file == layout.npu_file_name(r.op_type, r.op_name, r.task_id,
                                           r.stream_id, r.timestamp, r.io, r.index)
            for r in out.itertuples())
        for r in table.itertuples():            # an input names the file its producer wrote
            assert f".{r.timestamp}." in r.file or r.io == "input"
        stamps.append(set(table["timestamp"]))
    assert not stamps[0] & stamps[1] and not stamps[1] & stamps[2]


def test_npu_file_names_follow_ascend(tmp_path):
    m = pt.models.mlp()
    _train(m, str(tmp_path), steps=1)
    ws = Workspace(str(tmp_path))
    run = ws.run("npu")
    table = ws.index(run, 0)
    row = table[(table.op_name == "fc1/BiasAdd") & (table.io == "output")].iloc[0]
    assert row.file == f"MatMulV2.fc1_BiasAdd.{row.task_id}.0.{row.timestamp}.output.0.npy"
    assert row.pass_name == "MatMulBiasAddFusionPass" and row["dtype"] == "float16"
    assert ws.load(run, 0, row.file).dtype == np.float16
    gold = ws.index(ws.run("cpu"), 0)
    g = gold[gold.op_name == "fc1/BiasAdd"].iloc[0]
    assert g.file == f"fc1_BiasAdd.0.{g.timestamp}.npy"


@pytest.mark.parametrize("mode, ios", [("input", {"input"}), ("output", {"output"}),
                                       ("all", {"input", "output"})])
def test_dump_mode_is_honoured(tmp_path, mode, ios):
    m = pt.models.mlp()
    _train(m, str(tmp_path), steps=1, cpu_action=None, dump_mode=mode)
    ws = Workspace(str(tmp_path))
    assert set(ws.index(ws.run("npu"), 0)["io"]) == ios


def test_stats_only_dump_writes_rows_and_no_tensor_files(tmp_path):
    m = pt.models.mlp()
    _train(m, str(tmp_path), steps=1, dump_data="stats")
    ws = Workspace(str(tmp_path))
    for target in ("npu", "cpu"):
        run = ws.run(target)
        table = ws.index(run, 0)
        assert len(table) > 50 and (table["file"] == "").all()
        assert _tensor_files(ws.step_path(run, 0)) == set()
        assert table["l2norm"].notna().all()
        with pytest.raises(pt.PrecisionToolError, match="statistics only"):
            ws.load(run, 0, "")


def test_index_statistics_are_the_files_and_a_stats_dump_writes_the_same(tmp_path):
    """Every index row of a tensor dump holds the statistics of the file it names (float64
    reference, as the index text reads back); a statistics-only dump of the same step holds
    the same numbers."""
    m = pt.models.transformer()
    _train(m, str(tmp_path / "tensor"), steps=1, cpu_action=None)
    _train(m, str(tmp_path / "stats"), steps=1, cpu_action=None, dump_data="stats")
    stats = ["max", "min", "mean", "l2norm", "nan_count", "pos_inf_count", "neg_inf_count"]
    tensor_ws, stats_ws = Workspace(str(tmp_path / "tensor")), Workspace(str(tmp_path / "stats"))
    table = tensor_ws.index(tensor_ws.run("npu"), 0)
    only = stats_ws.index(stats_ws.run("npu"), 0)
    assert list(table.tensor) == list(only.tensor) and len(table) > 300
    pd.testing.assert_frame_equal(table[stats], only[stats])
    checked = set()
    for row in table.itertuples():
        if row.file in checked:
            continue
        checked.add(row.file)
        want = refs.tensor_stats(tensor_ws.load(tensor_ws.run("npu"), 0, row.file))
        got = [getattr(row, f) for f in stats]
        assert got[4:] == want[4:], row.file
        if np.isnan(want[0]):
            assert np.isnan(got[:4]).all(), row.file
            continue
        assert got[:2] == want[:2], row.file                  # extremes: exact
        np.testing.assert_allclose(got[2:4], want[2:4], rtol=1e-12, err_msg=row.file)
    assert len(checked) > 200


def test_a_statistics_dump_keeps_no_values_and_writes_what_a_tensor_dump_does(tmp_path,
                                                                            monkeypatch):
    """From its second step a statistics dump keeps no values: the run computes each value's
    statistics as it makes it (the NPU in its rounding pass). Every step's index, on both
    targets, holds the numbers a tensor dump of the same steps computes from the values, and
    the step history the same loss scale, through an overflowed (skipped) step."""
    from precision_tool.dump import dumper
    kept = []
    end_run = dumper.DumpObserver.end_run

    def spy(self, session, trace):
        kept.append((session.target, trace.outputs is not None))
        return end_run(self, session, trace)
    monkeypatch.setattr(dumper.DumpObserver, "end_run", spy)
    opt = pt.train.LossScaleOptimizer(pt.train.SGD(0.1),
                                      pt.train.DynamicLossScaleManager(2.0 ** 10, 2, 1000))
    m = pt.models.mlp(optimizer=opt)
    d = pt.data.digits()
    for data in ("tensor", "stats"):
        root = str(tmp_path / data)
        cfg = hooks.session_dump_config(pt.SessionConfig(precision_mode="allow_mix_precision"),
                                        action="dump", data_dir=root, dump_data=data,
                                        dump_step="all")
        with pt.Session(m.graph, target="npu", config=cfg) as npu, \
                hooks.sess_dump(pt.Session(m.graph), action="dump", data_dir=root,
                                dump_data=data, dump_step="all") as cpu:
            for x in (d.x_train[:32], d.x_train[32:64], d.x_train[:32] * 3e4, d.x_train[64:96]):
                for sess in (npu, cpu):
                    sess.run([m.loss, m.train_op], {m.x: x, m.y: d.y_train[:32]})
    assert kept[:8] == [("npu", True), ("cpu", True)] * 4                     # tensor dump
    assert kept[8:] == [("npu", True), ("cpu", True)] + [("npu", False), ("cpu", False)] * 3
    tensor_ws, stats_ws = Workspace(str(tmp_path / "tensor")), Workspace(str(tmp_path / "stats"))
    stats = ["max", "min", "mean", "l2norm", "nan_count", "pos_inf_count", "neg_inf_count"]
    for target in ("npu", "cpu"):
        for step in range(4):
            want = tensor_ws.index(tensor_ws.run(target), step)
            got = stats_ws.index(stats_ws.run(target), step)
            assert list(want.tensor) == list(got.tensor) and list(want["shape"]) == list(got["shape"])
            pd.testing.assert_frame_equal(want[stats], got[stats])
    history = [ws.step_history(ws.run("npu")) for ws in (tensor_ws, stats_ws)]
    pd.testing.assert_frame_equal(*history)
    assert list(history[1]["loss_scale"]) == [1024.0, 1024.0, 1024.0, 512.0]
    assert list(history[1]["finite"]) == [1, 1, 0, 1] and history[1]["status"][2] != 0


def test_golden_and_npu_dumps_share_op_names(tmp_path):
    m = pt.models.transformer()
    npu, _ = _train(m, str(tmp_path), steps=1)
    ws = Workspace(str(tmp_path))
    npu_ops = set(ws.index(ws.run("npu"), 0)["op_name"])
    gold_ops = set(ws.index(ws.run("cpu"), 0)["op_name"])
    compiled = npu.compiled
    fused_away = set(compiled.fused_away)
    not_kernels = {n.name for n in m.graph.nodes if n.type in ("Placeholder", "Variable", "Const", "NoOp")}
    expected = gold_ops - fused_away - not_kernels
    assert expected and expected <= npu_ops
    npu_only = {n.name for n in compiled.graph.nodes
                if n.attrs.get("inserted_by") or n.attrs.get("pass_name")}
    assert npu_ops - npu_only <= gold_ops


def test_overflow_action_writes_only_overflowing_kernels_and_their_records(tmp_path):
    g = pt.Graph("ovf")
    with g.as_default():
        x = pt.placeholder("x", [4])
        y = pt.ops.relu(pt.ops.exp(pt.ops.mul(x, 2.0)))
    cfg = hooks.session_dump_config(pt.SessionConfig(precision_mode="force_fp16", fusion_switch="off"),
                                    action="overflow", data_dir=str(tmp_path))
    sess = pt.Session(g, target="npu", config=cfg)
    sess.run(y, {x: np.array([1, 2, 3, 4], np.float32)})          # step 0: clean
    sess.run(y, {x: np.array([1, 2, 3, 8], np.float32)})          # step 1: exp(16) overflows
    sess.close()                  # every step is checked: close() waits for the writer
    ws = Workspace(str(tmp_path))
    run = ws.run("npu")
    assert [s.step for s in run.steps] == [1]           # the clean step leaves nothing
    t1 = ws.index(run, 1)
    assert set(t1["op_name"]) == {"Exp"} and set(t1["io"]) == {"input", "output"}
    records = [f for f in os.listdir(ws.step_path(run, 1)) if f.startswith("Opdebug.Node_OpDebug.")]
    assert len(records) == 1
    rec = json.loads(open(os.path.join(ws.step_path(run, 1), records[0])).read())
    assert rec["op_name"] == "Exp" and rec["status"] == 0x20 and rec["step"] == 1
    assert rec["status_bits"] == ["floating-point overflow"]
    assert not (tmp_path / "npu" / "debug_0" / "replay").exists()


def test_each_npu_run_gets_the_next_debug_dir_and_a_named_one_is_used(tmp_path):
    m = pt.models.mlp()
    for _ in range(2):
        _train(m, str(tmp_path), steps=1, cpu_action=None)
    _train(m, str(tmp_path), steps=1, cpu_action=None, debug_dir="debug_7")
    assert sorted(os.listdir(tmp_path / "npu")) == ["debug_0", "debug_1", "debug_7"]
    with pytest.raises(DumpConfigError, match="debug_<k>"):
        hooks.session_dump_config(action="dump", data_dir=str(tmp_path), debug_dir="../evil")
        pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
            action="dump", data_dir=str(tmp_path), debug_dir="../evil"))


@pytest.mark.parametrize("kw, message", [
    ({"action": "dump|explode"}, "unknown action 'explode'"),
    ({"action": "fusion_off|fusion_switch"}, "exclude each other"),
    ({"action": "dump", "dump_step": "1-x"}, "is not a step"),
    ({"action": "dump", "dump_step": "5-3"}, "runs backwards"),
    ({"action": "dump", "dump_mode": "some"}, "dump_mode must be one of"),
    ({"action": "dump", "dump_data": "bits"}, "dump_data must be one of"),
])
def test_bad_dump_settings_are_refused(tmp_path, kw, message):
    with pytest.raises(DumpConfigError, match=message):
        hooks.session_dump_config(data_dir=str(tmp_path), **kw)


def test_dump_step_syntax():
    assert parse_steps("0|3-5|10") == {0, 3, 4, 5, 10}
    assert parse_steps(" 2 ") == {2} and parse_steps("all") is None and parse_steps(None) is None


def test_steps_are_shown_in_dump_step_syntax_and_read_back():
    from precision_tool.dump.layout import format_steps
    assert format_steps([]) == "" and format_steps([7]) == "7"
    assert format_steps([5, 0, 1, 2, 9, 10]) == "0-2|5|9-10"
    steps = set(np.random.default_rng(0).choice(400, 150, replace=False).tolist())
    assert parse_steps(format_steps(steps)) == steps


def test_actions_combine_with_spaces_and_fusion_off(tmp_path):
    m = pt.models.transformer()
    cfg = hooks.session_dump_config(action="dump | fusion_off", data_dir=str(tmp_path))
    sess = pt.Session(m.graph, target="npu", config=cfg)
    assert sess.compiled.fusion == {} and cfg.fusion_switch == "off"
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "fusion_switch.cfg").write_text(json.dumps(
        {"Switch": {"GraphFusion": {"ALL": "off", "GeluFusionPass": "on"}, "UBFusion": {"ALL": "off"}}}))
    cfg = hooks.session_dump_config(action="fusion_switch", data_dir=str(tmp_path))
    assert list(pt.Session(m.graph, target="npu", config=cfg).compiled.fusion) == ["GeluFusionPass"]


def test_op_names_that_look_like_paths_stay_inside_the_step(tmp_path):
    g = pt.Graph("names")
    with g.as_default():
        x = pt.placeholder("x", [3])
        with pt.name_scope("../../etc"):
            y = pt.ops.relu(x, name="pass wd..\\évil")
        z = pt.ops.neg(y, name="n" * 300)
    cfg = hooks.session_dump_config(action="dump|fusion_off", data_dir=str(tmp_path))
    pt.Session(g, target="npu", config=cfg).run(z, {x: np.ones(3, np.float32)})
    ws = Workspace(str(tmp_path))
    run = ws.run("npu")
    table = ws.index(run, 0)
    assert "../../etc/pass wd..\\évil" in set(table["op_name"])
    step_dir = ws.step_path(run, 0)
    for f in table["file"]:
        assert "/" not in f and "\\" not in f and len(f.encode()) < 255
        assert os.path.isfile(os.path.join(step_dir, f))
    assert not (tmp_path / "etc").exists()


def test_the_index_is_read_once(tmp_path, monkeypatch):
    m = pt.models.mlp()
    _train(m, str(tmp_path), steps=1, cpu_action=None)
    ws = Workspace(str(tmp_path))
    calls = []
    from precision_tool.dump.formats import ours
    real = ours.read_csv
    monkeypatch.setattr(ours, "read_csv", lambda *a, **k: calls.append(1) or real(*a, **k))
    run = ws.run("npu")
    a = ws.index(run, 0)
    b = ws.index(run, 0)
    t = ws.index_table(run, 0)
    assert len(calls) == 1 and a.equals(b) and t is ws.index_table(run, 0)
    assert list(a.columns) == t.columns and a.op_name.tolist() == t["op_name"].tolist()
    a.loc[0, "op_name"] = "changed"                  # callers of index() get copies
    assert ws.index(run, 0).loc[0, "op_name"] != "changed" and t["op_name"][0] != "changed"


@pytest.mark.parametrize("damage, says", [
    (lambda f: f.__setitem__(14, "abc"), "row 3 is incomplete or not a tensor row (was the file "
                                        "cut off?): column max: not a number"),
    (lambda f: f.pop(), "row 3 is incomplete or not a tensor row (was the file cut off?): "),
    (lambda f: f.__setitem__(5, "inout"), "row 3 is incomplete or not a tensor row"),
    (lambda f: f.__setitem__(1, ""), "row 3 is incomplete or not a tensor row")])
def test_a_damaged_index_row_is_named_with_what_is_wrong(tmp_path, damage, says):
    m = pt.models.mlp()
    _train(m, str(tmp_path), steps=1, cpu_action=None)
    ws = Workspace(str(tmp_path))
    run = ws.run("npu")
    path = os.path.join(ws.step_path(run, 0), "index.csv")
    lines = open(path, encoding="utf-8").read().splitlines()
    assert lines[0].split(",")[14] == "max" and lines[0].split(",")[5] == "io"
    fields = lines[2].split(",")
    damage(fields)
    lines[2] = ",".join(fields)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    want = re.escape(f"{path} is not a readable index: {says}")
    with pytest.raises(pt.PrecisionToolError, match=want):
        Workspace(str(tmp_path)).index_table(run, 0)


def test_ascend_named_dumps_are_read_without_an_index(tmp_path):
    step = tmp_path / "npu" / "debug_0" / "dump" / "20240101000000" / "0" / "ge_default" / "1" / "0"
    step.mkdir(parents=True)
    np.save(step / "MatMul.fc1_MatMul.12.0.1700000000000001.output.0.npy", np.ones((2, 3), np.float16))
    np.save(step / "Add.fc1_add.13.1700000000000002.input.1.npy", np.zeros(4, np.float32))
    (step / "notes.txt").write_text("not a tensor")
    ws = Workspace(str(tmp_path))
    run = ws.run("npu")
    table = ws.index(run, 0).sort_values("task_id")
    assert list(table["op_name"]) == ["fc1_MatMul", "fc1_add"]
    assert list(table["task_id"]) == [12, 13] and table["stream_id"].isna().tolist() == [False, True]
    assert list(table["io"]) == ["output", "input"] and list(table["shape"]) == ["2 3", "4"]
    assert ws.load(run, 0, table.iloc[0]["file"]).dtype == np.float16


def test_missing_workspace_and_run_are_clear_errors(tmp_path):
    with pytest.raises(pt.PrecisionToolError, match="no workspace at"):
        Workspace(str(tmp_path / "nothing")).runs()
    (tmp_path / "cpu").mkdir()
    with pytest.raises(pt.PrecisionToolError, match="has no npu run"):
        Workspace(str(tmp_path)).run("npu")


def test_pickled_or_outside_files_are_refused(tmp_path):
    m = pt.models.mlp()
    _train(m, str(tmp_path), steps=1, cpu_action=None)
    ws = Workspace(str(tmp_path))
    run = ws.run("npu")
    evil = os.path.join(ws.step_path(run, 0), "evil.npy")
    np.save(evil, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(pt.PrecisionToolError, match="only unpickling could read"):
        ws.load(run, 0, "evil.npy")
    with pytest.raises(pt.PrecisionToolError, match=r"^\S+x\.npy is outside the workspace"):
        ws.load_file(str(tmp_path / ".." / "x.npy"))
    # a file that is a link: followed inside the workspace, refused when it leads out
    table = ws.index(run, 0)
    step_dir = ws.step_path(run, 0)
    inside = os.path.join(step_dir, "inside.npy")
    os.symlink(os.path.join(step_dir, table.file[0]), inside)
    assert np.array_equal(ws.load(run, 0, "inside.npy"), ws.load(run, 0, table.file[0]))
    outside = tmp_path.parent / "outside.npy"
    np.save(outside, np.zeros(3, np.float32))
    os.symlink(outside, os.path.join(step_dir, "out.npy"))
    with pytest.raises(pt.PrecisionToolError, match=r"^\S+out\.npy is outside the workspace"):
        ws.load(run, 0, "out.npy")


@pytest.mark.parametrize("mapped", [False, True])
def test_tensor_files_read_back_exactly_mapped_or_not(tmp_path, monkeypatch, mapped):
    """Small files are read whole, large ones memory-mapped (the threshold lowered here):
    the same values, shapes and orders, empty ones included; a mapped one is read-only."""
    from precision_tool.dump.formats import npy
    if mapped:
        monkeypatch.setattr(npy, "MMAP_BYTES", 0)
    arrays = {"f.npy": np.arange(12, dtype=np.float32).reshape(3, 4),
              "h.npy": np.linspace(-2, 2, 7).astype(np.float16),
              "fortran.npy": np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
              "empty.npy": np.zeros((0, 5), np.float32), "scalar.npy": np.array(2.5)}
    for name, a in arrays.items():
        np.save(tmp_path / name, a)
    ws = Workspace(str(tmp_path))
    for name, a in arrays.items():
        got = ws.load_file(str(tmp_path / name))
        assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a), name
        if mapped and a.size:
            assert isinstance(got, np.memmap) and not got.flags.writeable


@pytest.mark.parametrize("elements", [0, 1, 16352, 16354, 40000])
def test_a_tensor_file_read_short_by_a_signal_is_read_on_to_its_end(tmp_path, monkeypatch,
                                                                      elements):
    """A small file is taken in one read, without asking its size; a read that a signal cut
    short is not taken for a cut-off file: the file's size decides and the rest is read.
    Sizes about the one read's 64 KiB (a header of 128 bytes: 16352 float32 are 64 KiB)."""
    from precision_tool.dump import workspace
    a = np.random.default_rng(elements).normal(size=elements).astype(np.float32)
    np.save(tmp_path / "t.npy", a)
    ws = Workspace(str(tmp_path))
    real_read, cuts = os.read, []

    def short_read(fd, n):              # every first read of a file stops after 100 bytes
        if not cuts or cuts[-1] != fd:
            cuts.append(fd)
            return real_read(fd, min(n, 100))
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", short_read)
    got = ws.load_file(str(tmp_path / "t.npy"))
    assert cuts and got.flags.writeable and np.array_equal(got, a)
    monkeypatch.setattr(os, "read", real_read)
    assert np.array_equal(ws.load_file(str(tmp_path / "t.npy")), a)
    # cut off for real: said so, read short or not
    with open(tmp_path / "t.npy", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "t.npy") - 1)
    for read in (real_read, short_read):
        monkeypatch.setattr(os, "read", read)
        cuts.clear()
        with pytest.raises(workspace.WorkspaceError, match="is corrupt"):
            ws.load_file(str(tmp_path / "t.npy"))


# -- replay ----------------------------------------------------------------------------------
def _by_key(ws, run, step):
    table = ws.index(run, step)
    return {(r.op_name, r.io, r.index): ws.load(run, step, r.file) for r in table.itertuples()}


@pytest.mark.parametrize("target", ["npu", "cpu"])
def test_replaying_a_bundle_reproduces_the_dumped_tensors_bit_for_bit(tmp_path, target):
    m = pt.models.transformer()
    _train(m, str(tmp_path), steps=3, dump_step="2")
    ws = Workspace(str(tmp_path))
    original = ws.run(target)
    bundle = load_bundle(os.path.join(original.path, "replay", "2"))
    assert bundle.meta["session_step"] == 2
    cfg = hooks.session_dump_config(bundle.config(), action="dump", dump_step="2",
                                    data_dir=str(tmp_path)) if target == "npu" else bundle.config()
    sess, _ = replay(bundle, target, cfg)
    if target == "cpu":
        # golden replay through the CPU hook
        sess2 = hooks.sess_dump(pt.Session(bundle.graph), action="dump", dump_step="2",
                                data_dir=str(tmp_path))
        sess2.load_variables(bundle.variables, exact=True)
        sess2.step = 2
        sess2.run(bundle.meta["fetch_tensors"] + bundle.meta["fetch_nodes"], dict(bundle.feeds))
    ws = Workspace(str(tmp_path))
    replayed = ws.runs(target)[-1]
    assert replayed.name != original.name
    want, got = _by_key(ws, original, 2), _by_key(ws, replayed, 2)
    assert want.keys() == got.keys()
    for key in want:
        assert want[key].dtype == got[key].dtype and want[key].tobytes() == got[key].tobytes(), key


def test_replaying_a_step_dumped_after_blas_was_cut_reproduces_it_bit_for_bit(tmp_path):
    """A dump runs BLAS one thread short once its first dumped step has run, and OpenBLAS's
    sums depend on its thread count: each bundle records the count its step ran with, and a
    replay runs with it, whatever the replaying process has, and gives back its own after."""
    m = pt.models.transformer()
    full = cores.usable_cores()
    keep = max(1, full - 1)
    with cores.blas_threads_as(full):     # a fresh process's pool, whatever earlier tests left
        npu, cpu = _train(m, str(tmp_path), steps=3, cpu_action=None, dump_step="all")
        npu.close(), cpu.close()
        original = Workspace(str(tmp_path)).run("npu")
        bundles = [load_bundle(os.path.join(original.path, "replay", str(k))) for k in range(3)]
        assert [b.meta["blas_threads"] for b in bundles] == [full, keep, keep]
        for step in (0, 2):
            replay(bundles[step], "npu", hooks.session_dump_config(
                bundles[step].config(), action="dump", dump_step=str(step),
                data_dir=str(tmp_path)))
            assert cores.WriterCore().threads() == full
            ws = Workspace(str(tmp_path))
            want, got = _by_key(ws, original, step), _by_key(ws, ws.runs("npu")[-1], step)
            assert want.keys() == got.keys()
            for key in want:
                assert want[key].tobytes() == got[key].tobytes(), (step, key)


def test_a_bundle_with_a_malformed_blas_thread_count_is_refused(tmp_path):
    m = pt.models.mlp()
    npu, _ = _train(m, str(tmp_path), steps=1, cpu_action=None, dump_step="0")
    path = os.path.join(Workspace(str(tmp_path)).run("npu").path, "replay", "0")
    meta_path = os.path.join(path, "replay.json")
    with open(meta_path) as f:
        meta = json.load(f)
    assert isinstance(meta["blas_threads"], int) or meta["blas_threads"] is None
    for bad in (0, -2, "4", 1.5, True):
        meta["blas_threads"] = bad
        with open(meta_path, "w") as f:
            json.dump(meta, f)
        with pytest.raises(ReplayError, match="blas_threads must be a positive integer"):
            load_bundle(path)
    del meta["blas_threads"]                # a bundle written before the count was kept
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    assert load_bundle(path).meta.get("blas_threads") is None


@pytest.mark.skipif(cores.usable_cores() < 2, reason="with one core a dump leaves BLAS as it is")
def test_a_dump_computes_every_step_up_to_its_first_dumped_one_as_an_undumped_run(tmp_path):
    """The step a user dumps (after an overflow check found it, say) holds the numbers the
    run without the dump computed: BLAS is cut only once the first dumped step has run."""
    m = pt.models.transformer()
    d = pt.data.digits()
    feeds = [{m.x: d.x_train[32 * i:32 * (i + 1)], m.y: d.y_train[32 * i:32 * (i + 1)]}
             for i in range(3)]

    def losses(config):
        sess = pt.Session(m.graph, target="npu", config=config)
        out = [sess.run([m.loss, m.train_op], feed)[0] for feed in feeds]
        variables = sess.variables()
        sess.close()
        return out, variables

    base = pt.SessionConfig(precision_mode="allow_mix_precision")
    with cores.blas_threads_as(cores.usable_cores()):    # whatever earlier tests left
        plain, plain_vars = losses(base)
        dumped, dumped_vars = losses(hooks.session_dump_config(
            base, action="dump", dump_step="2|3", data_dir=str(tmp_path)))
    assert [x.tobytes() for x in dumped] == [x.tobytes() for x in plain]
    for name in plain_vars:
        assert dumped_vars[name].tobytes() == plain_vars[name].tobytes(), name


@pytest.mark.parametrize("links", [True, False])
def test_bundles_of_a_run_share_one_graph_file_and_each_stands_alone(tmp_path, monkeypatch,
                                                                     links):
    """Later bundles hard-link the first one's graph.json; where the file system refuses
    links, each bundle gets its own copy. Either way every bundle loads by itself, also once
    the others are removed."""
    if not links:       # the Python path (the C module's fallback: test_native)
        monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")

        def refuse(src, dst):
            raise OSError(1, "Operation not permitted", src)
        monkeypatch.setattr(os, "link", refuse)
    m = pt.models.mlp()
    npu, cpu = _train(m, str(tmp_path), steps=3, dump_step="all")
    npu.close(), cpu.close()
    for target in ("npu", "cpu"):
        replays = os.path.join(Workspace(str(tmp_path)).run(target).path, "replay")
        graphs = [os.path.join(replays, str(step), "graph.json") for step in range(3)]
        with open(graphs[0], "rb") as f:
            first = f.read()
        for path in graphs[1:]:
            with open(path, "rb") as f:
                assert f.read() == first
            assert os.path.samefile(path, graphs[0]) is links
        shutil.rmtree(os.path.join(replays, "0"))
        for step in (1, 2):
            bundle = load_bundle(os.path.join(replays, str(step)))
            assert bundle.meta["session_step"] == step
            assert [n.name for n in bundle.graph.nodes] == [n.name for n in m.graph.nodes]


def test_each_bundle_holds_its_own_steps_feeds_and_variables(tmp_path):
    """The bundle's layout is worked out once and reused while the arrays keep their shapes:
    a step fed another batch size gets a layout of its own."""
    m = pt.models.mlp()
    d = pt.data.digits()
    sess = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(
        pt.SessionConfig(), action="dump", dump_step="all", data_dir=str(tmp_path)))
    fed, held = [], []
    for batch in (32, 32, 7, 32):
        feed = {m.x: d.x_train[:batch] * (1 + len(fed)), m.y: d.y_train[:batch]}
        fed.append(feed)
        held.append(sess.variables())
        sess.run([m.loss, m.train_op], feed)
    sess.close()
    run = Workspace(str(tmp_path)).run("npu")
    for step, (feed, variables) in enumerate(zip(fed, held)):
        bundle = load_bundle(os.path.join(run.path, "replay", str(step)))
        assert bundle.meta["session_step"] == step
        assert bundle.feeds.keys() == {t.name for t in feed}
        for tensor, value in feed.items():
            got = bundle.feeds[tensor.name]
            assert got.shape == value.shape and got.tobytes() == \
                np.asarray(value, dtype=got.dtype).tobytes()
        assert bundle.variables.keys() == variables.keys()
        for name, value in variables.items():
            assert bundle.variables[name].tobytes() == value.tobytes(), (step, name)


@pytest.mark.parametrize("c_module", [True, False])
def test_a_bundle_holds_any_array_it_is_given(tmp_path, monkeypatch, c_module):
    """bfloat16 (whose numpy code, '<V2', would read back as raw bytes), strided, 0-d and
    empty arrays go into a bundle and come back as they were, with the C module and without
    it; a changed shape gets entries of its own; Python objects are refused."""
    import ml_dtypes
    from precision_tool.dump.bundle import BundleWriter
    from precision_tool.kernels.write import write_files
    if not c_module:
        monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")
    m = pt.models.mlp()
    sess = pt.Session(m.graph, target="npu")
    writer = BundleWriter(sess)
    rng = np.random.default_rng(0)
    for step, rows in enumerate((3, 5)):
        feeds = {"bf": rng.normal(size=(rows, 2)).astype(ml_dtypes.bfloat16),
                 "strided": rng.normal(size=(rows, 6)).astype(np.float32)[:, ::3],
                 "scalar": np.float64(rows), "empty": np.zeros((0, rows), np.int32)}
        files = writer.files(str(tmp_path) + os.sep, str(step), sess, feeds, ["a:0"], [])
        write_files([p for p, _ in files.files], [d for _, d in files.files],
                    [b""] * len(files.files), links=[files.link], dirs=[files.partial],
                    renames=[(files.partial, files.path)])
        bundle = load_bundle(files.path)
        assert bundle.feeds.keys() == feeds.keys()
        for name, want in feeds.items():
            got = bundle.feeds[name]
            assert got.dtype == want.dtype and got.shape == np.shape(want), name
            assert got.tobytes() == np.ascontiguousarray(want).tobytes(), name
        held = sess.variables()
        assert all(bundle.variables[k].tobytes() == v.tobytes() for k, v in held.items())
        assert bundle.meta["feeds"][0]["dtype"] == "bfloat16"
    from precision_tool.dump.bundle import ReplayError
    with pytest.raises(ReplayError, match="'objects' holds Python objects"):
        writer.files(str(tmp_path) + os.sep, "9", sess, {"objects": np.array([{}, None], dtype=object)}, [], [])


# -- the script runner and interrupted dumps -------------------------------------------------
SCRIPT = textwrap.dedent("""
    import sys, numpy as np, precision_tool as pt
    from precision_tool import hooks
    m = pt.models.{model}()
    d = pt.data.digits()
    npu = pt.Session(m.graph, target="npu", config=hooks.session_dump_config(pt.SessionConfig()))
    cpu = hooks.sess_dump(pt.Session(m.graph))
    for i in range({steps}):
        feed = {{m.x: d.x_train[:{batch}], m.y: d.y_train[:{batch}]}}
        npu.run([m.loss, m.train_op], feed)
        cpu.run([m.loss, m.train_op], feed)
        print("step", i, flush=True)
""")


def _script(tmp_path, model="mlp", steps=2, batch=32):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(model=model, steps=steps, batch=batch))
    return path


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRECISION_TOOL_")}
    env["PRECISION_TOOL_DATA"] = str(tmp_path / "ws")
    return env


def test_a_plain_run_writes_nothing_and_the_runner_dumps_the_same_script(tmp_path):
    script = _script(tmp_path)
    env = _env(tmp_path)
    out = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "ws").exists() and not (tmp_path / "precision_data").exists()
    # the script as a command, or only its file name (it runs with this Python)
    for cmd, command in ((["npu-dump", "--dump-step", "0|1"], [sys.executable, str(script)]),
                         (["tf_dump"], [script.name])):
        out = subprocess.run([sys.executable, "-m", "precision_tool", *cmd, "--", *command],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert "debug_0: steps [" in out.stdout
    ws = Workspace(str(tmp_path / "ws"))
    assert [s.step for s in ws.run("npu").steps] == [0, 1]
    assert [s.step for s in ws.run("cpu").steps] == [0]
    assert len(ws.runs("npu")) == 1 and len(ws.runs("cpu")) == 1
    failing = tmp_path / "fail.py"
    failing.write_text("raise SystemExit(4)")
    out = subprocess.run([sys.executable, "-m", "precision_tool", "npu-dump", "--",
                          sys.executable, str(failing)], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "exited with status 4" in out.stderr


def test_sigkill_mid_step_leaves_a_workspace_that_reads_cleanly(tmp_path):
    script = _script(tmp_path, model="transformer", steps=200, batch=256)
    env = _env(tmp_path)
    env["PRECISION_TOOL_NPU_ACTION"] = "dump"
    env["PRECISION_TOOL_DUMP_STEP"] = "all"
    proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        proc.stdout.readline()                   # step 0 is complete
        deadline = time.time() + 120
        while time.time() < deadline:            # kill while step 1 is being written
            partial = list((tmp_path / "ws" / "npu" / "debug_0" / "dump").glob("*/0/*/0/.1.partial"))
            if partial and any(p.suffix == ".npy" for p in partial[0].iterdir()):
                break
            time.sleep(0.001)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    ws = Workspace(str(tmp_path / "ws"))
    run = ws.run("npu")
    complete = [s for s in run.steps if s.complete]
    assert complete and complete[0].step == 0
    for s in complete:
        table = ws.index(run, s.step)
        for f in table["file"]:
            ws.load(run, s.step, f)              # every named file exists and loads
    for s in run.steps:                          # no file with a final name is partial
        for f in _tensor_files(s.path):
            np.load(os.path.join(s.path, f), allow_pickle=False)
    assert all(s.complete for s in run.steps) and 1 not in [s.step for s in run.steps]
    assert run.interrupted == [1]                # the partial step is reported, never read
    with pytest.raises(pt.PrecisionToolError, match="step 1 of npu/debug_0 is partial .the dump was killed"):
        ws.index(run, 1)


def test_the_overflow_runner_exits_1_on_overflow(tmp_path):
    script = tmp_path / "ovf.py"
    script.write_text(textwrap.dedent("""
        import sys, numpy as np, precision_tool as pt
        from precision_tool import hooks
        g = pt.Graph("g")
        with g.as_default():
            x = pt.placeholder("x", [2])
            y = pt.ops.exp(x)
        cfg = hooks.session_dump_config(pt.SessionConfig(precision_mode="force_fp16"))
        s = pt.Session(g, target="npu", config=cfg)
        s.run(y, {x: np.array([1.0, float(sys.argv[1])], np.float32)})
    """))
    env = _env(tmp_path)
    runs = []
    for value in ("2", "20"):
        runs.append(subprocess.run([sys.executable, "-m", "precision_tool", "npu_overflow", "--",
                                    sys.executable, str(script), value], env=env,
                                   capture_output=True, text=True, timeout=120))
    assert runs[0].returncode == 0 and "no overflow" in runs[0].stdout
    assert runs[1].returncode == 1 and "overflow found: 1 kernel(s)" in runs[1].stdout


def test_the_default_run_is_the_newest_that_dumped_something(tmp_path):
    m = pt.models.mlp()
    _train(m, str(tmp_path), steps=1, cpu_action=None)               # npu/debug_0 with step 0
    g = pt.Graph("quiet")
    with g.as_default():
        x = pt.placeholder("x", [2])
        y = pt.ops.relu(x)
    cfg = hooks.session_dump_config(action="overflow", data_dir=str(tmp_path))
    with pt.Session(g, target="npu", config=cfg) as s:               # npu/debug_1: no overflow
        s.run(y, {x: np.ones(2, np.float32)})
    ws = Workspace(str(tmp_path))
    assert [r.name for r in ws.runs("npu")] == ["debug_0", "debug_1"]
    assert ws.run("npu").name == "debug_0" and ws.run("npu", "debug_1").steps == []


def _plan_step():
    """A step of three kernels whose values cover every way a file is written: fp16 held in
    float32 (nan included), bf16, ints, an empty tensor, a strided view, a tensor read twice,
    names that need CSV quotes or are not ASCII."""
    import ml_dtypes
    from precision_tool.dump.stepplan import Row, StepPlan, csv_field as _q, disk_dtype
    rng = np.random.default_rng(3)
    half = rng.normal(size=(4, 5)).astype(np.float16).astype(np.float32)
    half[1, 2] = np.nan
    bf = rng.normal(size=6).astype(ml_dtypes.bfloat16)
    strided = rng.normal(size=(6, 4)).astype(np.float32)[:, ::2]
    records = [(None, [half], [bf], None, 1700000000000001),
               (None, [bf, np.arange(5, dtype=np.int32)], [np.zeros((0, 3), np.float32)], None, 5),
               (None, [], [strided, np.array(2.5, np.float64)], None, 1700000000000333)]
    specs = {(0, 1, 0): ("x", "float16"), (0, 2, 0): ('MatMul,"a":0', "bfloat16"),
             (1, 1, 0): ('MatMul,"a":0', "bfloat16"), (1, 1, 1): ("ids", "int32"),
             (1, 2, 0): ("ünï:0", "float32"), (2, 2, 0): ("t:0", "float32"), (2, 2, 1): ("t:1", "float64")}
    rows = []
    for (r, side, k), (tensor, dtype) in specs.items():
        value = records[r][side][k]
        rows.append(Row(r, side, k, tensor, f"op{r},", f",{side},{k},{_q(tensor)},{dtype}",
                        (f"{tensor}.", f".{side}.{k}.npy"), disk_dtype(value, dtype)))
    values = [records[r.record][r.side][r.k] for r in rows]
    return StepPlan("key", "head", rows, values, True), records


def test_the_c_and_python_paths_write_the_same_step(tmp_path, monkeypatch):
    written = {}
    for path in ("c", "numpy"):
        if path == "numpy":
            monkeypatch.setenv("PRECISION_TOOL_NUMPY_ONLY", "1")
        plan, records = _plan_step()
        out, partial = tmp_path / path, tmp_path / f".{path}.partial"
        partial.mkdir()
        values = plan.gather(records)
        assert plan.fits(values)
        filled = plan.fill(str(partial), [r[4] for r in records], values)
        assert not os.listdir(partial)          # the training thread's part writes nothing
        plan.write(filled, [(str(partial / "more.json"), b"{}\n")],
                   renames=[(str(partial), str(out))])
        assert not partial.exists()
        written[path] = {f: (out / f).read_bytes() for f in sorted(os.listdir(out))}
    assert written["c"] == written["numpy"]
    files = written["c"]
    assert files.pop("more.json") == b"{}\n"
    assert len(files) == 7              # six distinct tensors and the index
    lines = files["index.csv"].decode("utf-8").splitlines()
    assert lines[0] == "head" and len(lines) == 8
    # the bf16 tensor read by op1 is op0's file, named with op0's timestamp, quoted for CSV
    assert lines[3].startswith('op1,5,1,0,"MatMul,""a"":0",bfloat16,'
                               '"MatMul,""a"":0.1700000000000001.2.0.npy",')
    index = pd.read_csv(io.BytesIO(files["index.csv"]), header=None, skiprows=1,
                        keep_default_na=False)
    assert len(index.columns) == 14 and set(index[6]) == {f for f in files if f.endswith(".npy")}
    _, records = _plan_step()
    half = np.load(tmp_path / "c" / "x.1700000000000001.1.0.npy", allow_pickle=False)
    assert half.dtype == np.float16 and np.array_equal(half, records[0][1][0].astype(np.float16),
                                                       equal_nan=True)
    bf = np.load(tmp_path / "c" / 'MatMul,"a":0.1700000000000001.2.0.npy', allow_pickle=False)
    assert bf.dtype == np.float32 and np.array_equal(bf, records[0][2][0].astype(np.float32))
    strided = np.load(tmp_path / "c" / "t:0.1700000000000333.2.0.npy", allow_pickle=False)
    assert np.array_equal(strided, records[2][2][0])


def test_a_plan_does_not_fit_other_shapes_or_dtypes():
    plan, records = _plan_step()
    values = plan.gather(records)
    assert plan.fits(values)
    other = list(values)
    other[-1] = np.array([2.5])
    assert not plan.fits(other)
    other = list(values)
    other[3] = other[3].astype(np.int64)
    assert not plan.fits(other)


class _Pool:
    """A BLAS thread pool as threadpoolctl shows one."""

    def __init__(self, threads):
        self.num_threads, self.calls = threads, []

    def set_num_threads(self, n):
        self.calls.append(n)
        self.num_threads = n


def test_a_dump_leaves_the_writer_a_core_while_it_is_open(tmp_path, monkeypatch):
    """At the first dumped step BLAS is cut to one thread short of the cores, once; close()
    gives back what it took, unless the pool was set again meanwhile; an overflow check,
    which writes only overflowing steps, leaves BLAS alone."""
    wide, narrow = _Pool(4), _Pool(2)
    monkeypatch.setattr(cores, "_blas_pools", lambda: [wide, narrow])
    monkeypatch.setattr(cores, "usable_cores", lambda: 3)
    m = pt.models.mlp(hidden=(8,))
    npu, cpu = _train(m, str(tmp_path / "a"), steps=3, cpu_action=None, dump_step="1|2")
    assert wide.calls == [2, 4] and narrow.calls == []      # steps 1-2, then restored at 2
    npu.close()
    assert wide.num_threads == 4 and wide.calls == [2, 4]

    wide.calls.clear()
    npu, _ = _train(m, str(tmp_path / "b"), steps=2, cpu_action=None, dump_step="all")
    assert wide.calls == [2] and wide.num_threads == 2
    wide.set_num_threads(1)                     # the script's own setting wins
    npu.close()
    assert wide.num_threads == 1

    wide.num_threads, wide.calls = 4, []
    npu, _ = _train(m, str(tmp_path / "c"), steps=2, npu_action="overflow", cpu_action=None)
    npu.close()
    assert wide.calls == []


def test_the_writer_core_asks_the_blas_libraries_this_process_loaded():
    """threadpoolctl finds numpy's BLAS here; limit() and restore() work on the real pool."""
    pools = cores._blas_pools()
    assert pools, "numpy's BLAS is not visible to threadpoolctl"
    before = [p.num_threads for p in pools]
    core = cores.WriterCore()
    core.limit()
    keep = max(1, cores.usable_cores() - 1)
    assert [p.num_threads for p in pools] == [min(b, keep) for b in before]
    core.restore()
    assert [p.num_threads for p in pools] == before


def test_a_python_dump_writer_thread_ends_with_its_writer():
    """Without the C module each dump session writes on a Python thread: it ends once its
    writer is collected (a fusion bisection opens a dump session per replay)."""
    import gc
    from precision_tool.dump.writer import AsyncWriter
    w = AsyncWriter(2)
    thread, done = w._thread, []
    w.put(lambda: done.append(1))
    w.flush()
    del w
    gc.collect()
    thread.join(timeout=10)
    assert done == [1] and not thread.is_alive()


def test_a_file_is_read_in_the_shape_its_index_line_gives():
    """in_row_shape: a linked view's file holds what it views in that tensor's shape; the
    line's shape wins where it names the same elements, and nothing else is changed."""
    from precision_tool.dump.workspace import in_row_shape
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert in_row_shape(a, "2 6").shape == (2, 6)
    assert np.array_equal(in_row_shape(a, "2 6").reshape(-1), a.reshape(-1))
    assert in_row_shape(a, "3 4") is a
    assert in_row_shape(a, "5 4") is a                  # another size: left to the compare
    assert in_row_shape(a, "[3, 4]") is a and in_row_shape(a, "None 4") is a
    assert in_row_shape(a, float("nan")) is a           # an index without a shape
    one = np.ones((1,), np.float16)
    assert in_row_shape(one, "").shape == ()            # a scalar's line
    assert in_row_shape(one, None) is one               # no line given
    assert in_row_shape(np.ones(0), "0 5").shape == (0, 5)
