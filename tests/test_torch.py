"""The PyTorch front-end: PrecisionDebugger on real PyTorch training loops, golden (bit for bit
the script without the tool) and simulated NPU (the policy's dtypes at the kernel level), and
torch-run on an unchanged script; every run read by the analysis."""
import gc
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch front-end is an extra "
                                            "(pip install 'precision_tool[torch]')")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from precision_tool.analysis import vector_compare  # noqa: E402
from precision_tool.analysis.comparing.verdicts import evaluate  # noqa: E402
from precision_tool.cli import cli  # noqa: E402
from precision_tool.dump import Workspace, layout  # noqa: E402
from precision_tool.torch import PrecisionDebugger, TorchFrontEndError  # noqa: E402


class Attention(nn.Module):
    """One attention block and a classifier: linear, matmul, softmax, layer norm, GELU."""

    def __init__(self, d=16, classes=4, scaled=True):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, classes)
        self.scaled = scaled

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.scaled:                 # before the product, as fp16 kernels scale
            q = q / q.shape[-1] ** 0.5
        s = torch.matmul(q, k.transpose(-1, -2))
        h = self.norm(F.gelu(torch.softmax(s, -1) @ v + x))
        return self.out(h).mean(1)


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _train(make, root=None, target=None, steps=3, scale=1.0, optimizer="adam", **kw):
    """The script: seeded model and data, `steps` training steps; with a target, under the
    debugger. Its losses and final parameters."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2) if optimizer == "adam" else \
        torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    shape = (8, 16) if isinstance(model, nn.Sequential) else (2, 6, 16)
    x, y = scale * torch.randn(*shape, generator=g), torch.randint(0, 4, (shape[0],), generator=g)
    debugger = PrecisionDebugger(root, target=target, dump_step="all", **kw) if target else None
    losses = _steps(model, lambda: F.cross_entropy(model(x), y), opt, debugger, steps)
    return losses, [p.detach().clone() for p in model.parameters()]


_LOSS_LINE = _train.__code__.co_firstlineno + 11      # the line of the loss lambda above
_MATMUL_LINE = Attention.forward.__code__.co_firstlineno + 4     # q·k in Attention.forward


def _steps(model, loss_of, opt, debugger, steps, prepare=None):
    """The training loop, under the debugger when one is given (prepare: what the script
    does once the debugger has started): its losses."""
    if debugger:
        debugger.start(model)
    if prepare:
        prepare()
    losses = []
    for _ in range(steps):
        loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if debugger:
            debugger.step(loss)
    if debugger:
        debugger.stop()
    return losses


@pytest.mark.parametrize("make", [_mlp, Attention], ids=["mlp", "attention"])
def test_the_golden_run_is_the_script_bit_for_bit(tmp_path, make):
    """With the debugger dumping every step, the golden's losses and parameters are those of
    the script without the tool, bit for bit; the simulated NPU's are not."""
    plain = _train(make)
    golden = _train(make, str(tmp_path), "golden")
    assert golden[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(golden[1], plain[1]))
    npu = _train(make, str(tmp_path), "npu")
    assert npu[0] != plain[0]
    ws = Workspace(str(tmp_path))
    assert [r.kind for r in ws.runs()] == [layout.DEVICE, layout.REFERENCE]
    assert ws.run("cpu").complete_steps == ws.run("npu").complete_steps == [0, 1, 2]


def test_both_runs_name_the_same_calls_as_msprobe_does(tmp_path):
    """Every API call and its backward, named Functional/Tensor/Torch.<api>.<index>.forward
    or .backward, the same in both runs; the losses recorded in the step history."""
    _train(Attention, str(tmp_path), "golden", steps=1)
    _train(Attention, str(tmp_path), "npu", steps=1)
    ws = Workspace(str(tmp_path))
    npu, cpu = ws.index(ws.run("npu"), 0), ws.index(ws.run("cpu"), 0)
    names = list(dict.fromkeys(npu.op_name))
    assert names == list(dict.fromkeys(cpu.op_name))
    for want in ("Functional.linear.0.forward", "Functional.linear.0.backward",
                 "Torch.matmul.0.forward", "Torch.softmax.0.forward",
                 "Functional.layer_norm.0.forward", "Functional.gelu.0.forward",
                 "Functional.cross_entropy.0.forward", "Functional.cross_entropy.0.backward",
                 "Tensor.transpose.0.forward"):
        assert want in names, want
    calls = [n for n in names if not n.startswith(("q.", "k.", "v.", "norm.", "out."))
             and ".grad_sum." not in n]
    assert all(n.endswith((".forward", ".backward")) for n in calls)
    # the state a step reads is a Variable named as the parameter, the same on both sides;
    # autograd's sum of the gradients a tensor read twice gets is an op too
    t = npu.drop_duplicates("op_name")
    variables = set(t[t.op_type == "Variable"].op_name)
    assert {"q.weight", "q.bias", "norm.weight", "out.bias"} <= variables
    assert set(names) - set(calls) == \
        variables | set(t[t.op_type == "Autograd.accumulate"].op_name)
    history = ws.step_history(ws.run("cpu"))
    assert history.loss.notna().all()


def test_the_npu_run_holds_the_policys_dtypes_on_their_grid(tmp_path):
    """allow_mix_precision: a linear (MatMul, white list) computes in fp16 from fp16 inputs
    and its output is on the fp16 grid, dumped as fp16; layer norm (black list) stays fp32.
    Against a float64 reference of the same call on the same dumped inputs, the fp16 linear
    is off by the fp16 grid and no more."""
    _train(_mlp, str(tmp_path), "npu", steps=1, precision_mode="allow_mix_precision")
    ws = Workspace(str(tmp_path))
    run = ws.run("npu")
    t = ws.index(run, 0)
    out = t[(t.op_name == "Functional.linear.0.forward") & (t.io == "output")].iloc[0]
    assert out["dtype"] == "float16"
    y = ws.load(run, 0, out.file)
    assert y.dtype == np.float16
    ins = t[(t.op_name == "Functional.linear.0.forward") & (t.io == "input")]
    x, w, b = (ws.load(run, 0, f).astype(np.float64) for f in ins.sort_values("index").file)
    exact = x.astype(np.float16).astype(np.float64) @ w.astype(np.float16).astype(np.float64).T \
        + b.astype(np.float16).astype(np.float64)
    ulp = np.spacing(np.abs(exact).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(y.astype(np.float64) - exact) <= ulp)     # one rounding to fp16
    norm = t[(t.op_name == "Functional.layer_norm.0.forward") & (t.io == "output")].iloc[0]
    assert norm["dtype"] == "float32"
    assert run.info["precision_mode"] == "allow_mix_precision"
    assert run.config.precision_mode == "allow_mix_precision"
    # ni reads a graphless run's call from its index: what it read, what it made
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ni",
                                   "Functional.linear.0.forward"])
    assert out.exit_code == 0, out.output
    info = json.loads(out.stdout)
    assert len(info["inputs"]) == 3 and info["outputs"] == [{"dtype": "float16", "shape": [8, 32]}]
    # and where the call was made: the module path named_modules gives, the script's line
    assert info["module"] == "0"
    assert info["source"] == f"{__file__}:{_LOSS_LINE} in <lambda>"
    back = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ni",
                                    "Functional.layer_norm.0.backward"])
    assert json.loads(back.stdout)["module"] == "2"        # a backward is its forward's call
    # a calls.json that is not what the writer writes is refused in one line
    sites = os.path.join(run.step(0).path, layout.CALLS_FILE)
    with open(sites, "w") as f:
        f.write('{"Functional.linear.0.forward": [1, 2]}')
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "ni", "-s", "0",
                                   "Functional.linear.0.forward"])
    assert out.exit_code == 2 and "call sites" in out.output and "broken" in out.output


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device: none on this machine")
def test_a_script_on_cuda_runs_on_both_targets(tmp_path):
    """A model and its data on CUDA: the debugger reads the tensors through host memory, the
    simulated kernels round there and write back to the device. The golden's losses are the
    script's own; the NPU's linear output is on fp16's grid; ac -c calls the run sound."""
    def train(target=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32),
                              nn.Linear(32, 4)).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 4, (8,), device="cuda")
        d = PrecisionDebugger(str(tmp_path), target=target, dump_step="all") if target \
            else None
        return _steps(model, lambda: F.cross_entropy(model(x), y), opt, d, 3)
    assert train("golden") == train()
    train("npu")
    ws = Workspace(str(tmp_path))
    run = ws.run("npu")
    t = ws.index(run, 0)
    out = t[(t.op_name == "Functional.linear.0.forward") & (t.io == "output")].iloc[0]
    y = ws.load(run, 0, out.file).astype(np.float64)
    assert out["dtype"] == "float16" and np.array_equal(y, y.astype(np.float16))
    done = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c"])
    assert done.exit_code == 0, done.output


def _drifting_mlp(root, dump_mode="tensor"):
    """A healthy MLP (Linear, BatchNorm, ReLU) under fp16 autocast, SGD with momentum at a
    high learning rate, a new batch each step, 12 steps, every step dumped on both
    targets; ac -c's exit code and JSON."""
    def train(target):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(),
                              nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(),
                              nn.Linear(64, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        proto = torch.randn(10, 32, generator=g)

        def loss_of():
            y = torch.randint(0, 10, (16,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                return F.cross_entropy(model(proto[y] + torch.randn(16, 32, generator=g)), y)
        _steps(model, loss_of, opt, PrecisionDebugger(str(root), target=target,
                                                      dump_step="all", dump_mode=dump_mode), 12)
    train("golden")
    train("npu")
    out = CliRunner().invoke(cli, ["--data-dir", str(root), "--json", "ac", "-c"])
    return out.exit_code, json.loads(out.stdout)


def test_a_step_that_starts_from_drifted_state_blames_no_op(tmp_path):
    """The drifting MLP, by tensors: each step's rounding crosses the threshold gradually
    or changes nothing (the bias gradients of the Linears a BatchNorm follows are noise),
    and the momentum buffers carry it on, until step 10 starts from state that differs
    beyond the criteria. Nothing can replay a script's step from the NPU's state, so ac -c
    says drift, not replayed: no op is blamed or to keep in fp32, and the state's variables
    and the fp64 golden's command are named (exit 1: the runs part). Before, it sent the
    user to step 8, which had no finding."""
    code, r = _drifting_mlp(tmp_path)
    assert code == 1
    assert r["origin"] is None and r["step"] > 0
    assert r["drift"]["kind"] == "state" and r["drift"]["own"] is None
    assert "not made by torch-run" in r["drift"]["not_replayed"]
    assert r["drift"]["written_at"] < r["step"] and r["drift"]["state"]["variables"]
    advice = " ".join(r["advice"])
    assert "no op is blamed for it" in advice and "--golden-dtype float64" in advice
    assert "--keep-fp32" not in advice and "came in with the state" not in advice


DRIFTING = textwrap.dedent("""
    import torch, torch.nn as nn, torch.nn.functional as F
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(),
                          nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    proto = torch.randn(10, 32, generator=g)
    for step in range(12):
        y = torch.randint(0, 10, (16,), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(proto[y] + torch.randn(16, 32, generator=g)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
""")


def _ac_with_replay_loss_made_larger(ws, replay, step) -> dict:
    """The replay run's loss at `step` made 1.5x (as a faulty kernel would make the NPU's
    differ from it), then ac -c's JSON (its exit code 1)."""
    t = ws.index(replay, step)
    row = t[(t.op_name == "Functional.cross_entropy.0.forward") & (t.io == "output")].iloc[0]
    path = os.path.join(ws.step_path(replay, step), row.file)
    np.save(path + ".new.npy", np.load(path) * 1.5)
    os.replace(path + ".new.npy", path)
    out = CliRunner().invoke(cli, ["--data-dir", ws.root, "--json", "ac", "-c"])
    assert out.exit_code == 1, out.output
    return json.loads(out.stdout)


def test_a_script_whose_steps_drift_while_its_losses_hold_is_sound(tmp_path):
    """The MLP with dropout under AdamW and GradScaler, 14 steps: from step 5 on, some steps
    diverge from the golden's, each from state that drifted (Adam's moments of the biases a
    BatchNorm follows), while the losses stay within 5% at every step. Each such step is
    replayed from the NPU's own state (dropout's masks drawn as the NPU's were, Adam's
    moments set) and computes as the golden does: drift that changes no loss is no
    finding, every step is looked at, and ac -c calls the run sound (exit 0). All of them
    are replayed by one rerun of the script. Where one of them still fails from the NPU's
    state, ac -c stops there: the steps after it are left out of what it reports."""
    _, ws_dir = _dumped_script(tmp_path, DRIFTING.replace(
        "lr=0.5, momentum=0.9", "lr=3e-2").replace("torch.optim.SGD", "torch.optim.AdamW").replace(
        "nn.ReLU(), nn.Linear(64, 64)", "nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 64)").replace(
        "range(12)", "range(14)"), "adam.py")
    out = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "--json", "ac", "-c"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.stdout)
    looked = {x["step"]: x for x in r["steps"]}
    assert sorted(looked) == list(range(14))
    drifted = [k for k, x in looked.items() if x.get("drift_replayed")]
    assert drifted and all(looked[k]["diverging_ops"] > 0 for k in drifted)
    assert r["verdict"] == "sound" and r["origin"] is None and r["drift"]["own"] == []
    assert r["drift"]["loss"]["first_off"] is None
    assert "The drift changes no loss beyond the criteria: no finding" in " ".join(r["advice"])
    ws = Workspace(str(ws_dir))
    assert [x.label for x in ws.runs("cpu")] == ["cpu/debug_0", "cpu/debug_1"]
    replay = ws.run("cpu", "debug_1")
    assert replay.complete_steps == drifted == replay.info["state_from"]["steps"]
    assert all(replay.info["state_from"]["variables"][str(k)] > 0 for k in drifted)
    # the second drifting step's loss made 1.5x in the replay: that step still fails, and
    # is where ac -c stops (the steps after it left out)
    assert 1 < len(drifted) and drifted[1] < 13
    failing = drifted[1]
    r = _ac_with_replay_loss_made_larger(ws, replay, failing)
    assert r["step"] == failing and [x["step"] for x in r["steps"]] == list(range(failing + 1))
    assert r["drift"]["own"] == ["Functional.cross_entropy.0.forward"]
    assert r["steps"][drifted[0]]["drift_replayed"] and "drift_replayed" not in r["steps"][-1]
    assert [x.label for x in ws.reopened().runs("cpu")] == ["cpu/debug_0", "cpu/debug_1"]
    # a file of the NPU's state gone at the second drifting step: the rerun leaves that step
    # out (the others are replayed), and ac stops there saying why
    shutil.rmtree(replay.path)
    npu = ws.run("npu")
    t = ws.index(npu, failing)
    os.remove(os.path.join(ws.step_path(npu, failing), t[t.op_type == "Variable"].iloc[0].file))
    out = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "--json", "ac", "-c"])
    r = json.loads(out.stdout)
    assert r["step"] == failing and r["steps"][drifted[0]]["drift_replayed"], out.output
    assert "the NPU state of step %d cannot be read" % failing in r["drift"]["not_replayed"]
    again = Workspace(str(ws_dir)).run("cpu", "debug_1")
    assert failing not in again.info["state_from"]["steps"] and drifted[0] in again.complete_steps
    # with --no-verify nothing is replayed: the first such step stays a finding
    quick = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "--json", "ac", "-c",
                                     "--no-verify"])
    assert quick.exit_code == 1 and json.loads(quick.stdout)["step"] == drifted[0]


def test_the_npu_state_is_read_by_name_and_set_by_size_and_refused_without_values(tmp_path):
    """torch.state's edges: "<run>:<step>[,<step>...]" parsed and a bad spec refused; values set in
    each tensor's own dtype and shape where the sizes agree (a scalar dumped as one
    element), and the names that matched no live tensor, or not its size, listed; a
    statistics dump refused with the reason; state_from refused on the NPU target."""
    from precision_tool.torch.state import (StateError, missing_state, npu_state,
                                            parse_state_from, set_state)
    assert parse_state_from("/a:b/npu/debug_0:12") == ("/a:b/npu/debug_0", (12,))
    assert parse_state_from("d:9,5,9") == ("d", (5, 9))
    for bad in ("npu/debug_0", "npu/debug_0:x", ":3", "d:5,", "d:5,,6", "d:-1"):
        with pytest.raises(StateError):
            parse_state_from(bad)
    w, count = torch.zeros(2, 3, dtype=torch.float16), torch.tensor(0)
    done, missing = set_state([(w, "w"), (count, "n")],
                              {"w": np.arange(6, dtype=np.float32).reshape(3, 2),
                               "n": np.array([7]), "gone": np.ones(2), "other": np.ones(5)})
    assert done == 2 and missing == ["gone", "other"]
    assert w.dtype == torch.float16 and w.shape == (2, 3) and w.flatten().tolist() == list(range(6))
    assert count.shape == () and int(count) == 7
    _drifting_mlp(tmp_path, "statistics")
    with pytest.raises(StateError, match="statistics only"):
        npu_state(Workspace(str(tmp_path)).run("npu").path, 3)
    with pytest.raises(StateError, match="cannot be read"):
        npu_state(str(tmp_path / "npu" / "debug_9"), 3)
    _drifting_mlp(tmp_path / "t")                # a tensor dump with a value's file gone
    ws = Workspace(str(tmp_path / "t"))
    npu = ws.run("npu")
    t = ws.index(npu, 3)
    os.remove(os.path.join(ws.step_path(npu, 3), t[t.op_type == "Variable"].iloc[0].file))
    with pytest.raises(StateError, match="cannot be read: .*is missing"):
        npu_state(npu.path, 3)
    assert len(npu_state(npu.path, 4)) == len(t[t.op_type == "Variable"])
    # found without reading a value: what a rerun of several steps leaves out
    assert re.search(r"step 3 cannot be read: tensor file .* is missing",
                     missing_state(ws, npu, 3))
    assert missing_state(ws, npu, 4) == ""
    stats = Workspace(str(tmp_path))
    assert "statistics only" in missing_state(stats, stats.run("npu"), 3)
    assert "cannot be read" in missing_state(ws, npu, 99)
    with pytest.raises(TorchFrontEndError, match="state_from is a setting of the golden"):
        PrecisionDebugger(str(tmp_path), target="npu", state_from="x:1")


def test_a_script_step_from_drifted_state_is_replayed_from_the_npus_state(tmp_path):
    """The drifting MLP as a script under torch-run: ac -c reruns it on the golden, sets
    every variable step 10 read to the NPU's value where the step begins, and ends it
    after that step (a replay run, not the default golden). Against that, step 10 computes
    as the golden does: drift, replayed, no op blamed (exit 1: the runs part). The replay's
    variables are the NPU's values bit for bit, and a second ac -c reuses it."""
    script, ws_dir = _dumped_script(tmp_path, DRIFTING, "mlp.py")
    # the script gone: the rerun fails, says why, and leaves nothing behind
    script.rename(tmp_path / "away.py")
    out = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "--json", "ac", "-c"])
    d = json.loads(out.stdout)["drift"]
    assert out.exit_code == 1 and d["own"] is None and d["replayed_by"] is None
    assert d["not_replayed"].startswith("its rerun failed: the script exited with status")
    assert [x.label for x in Workspace(str(ws_dir)).runs("cpu")] == ["cpu/debug_0"]
    (tmp_path / "away.py").rename(script)
    out = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "--json", "ac", "-c"])
    assert out.exit_code == 1, out.output
    r = json.loads(out.stdout)
    step, d = r["step"], r["drift"]
    assert d["kind"] == "state" and d["own"] == [] and d["replayed_by"] == "cpu/debug_1"
    assert r["origin"] is None
    advice = " ".join(r["advice"])
    assert "replayed on the golden from the NPU's own state (cpu/debug_1" in advice
    assert f"step {step} computes as the golden does" in advice and "--keep-fp32" not in advice
    ws = Workspace(str(ws_dir))
    replay, npu = ws.run("cpu", "debug_1"), ws.run("npu")
    assert replay.complete_steps == [step] and replay.info["replay_of"] == "npu/debug_0"
    made = replay.info["state_from"]
    assert made["steps"] == [step] and made["variables"][str(step)] > 0 and not made["not_set"]
    assert ws.run("cpu").label == "cpu/debug_0"               # not the default golden
    a, b = ws.index(npu, step), ws.index(replay, step)
    for row in a[(a.op_type == "Variable") & (a.dtype == "float32")].itertuples():
        other = b[(b.op_name == row.op_name) & (b.op_type == "Variable")].iloc[0]
        assert np.array_equal(ws.load(npu, step, row.file), ws.load(replay, step, other.file))
    again = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "--json", "ac", "-c"])
    assert json.loads(again.stdout)["drift"]["replayed_by"] == "cpu/debug_1"
    assert [x.label for x in Workspace(str(ws_dir)).runs("cpu")] == ["cpu/debug_0", "cpu/debug_1"]
    # fix searches nothing there: the step is drift, which no setting of it fixes
    fixed = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "--json", "fix"])
    assert fixed.exit_code == 1, fixed.output
    f = json.loads(fixed.stdout)
    assert f["step"] == step and f["trials"] == [] and not f["verified"]
    assert any("which no setting of the step fixes" in n and "cpu/debug_1" in n
               for n in f["notes"])
    assert [x.label for x in Workspace(str(ws_dir)).runs("npu")] == ["npu/debug_0"]
    # the replay's loss 1.5x (as a faulty kernel would make the NPU's differ from it): from
    # the NPU's own state the step still fails there, which is the step's own (the loss is
    # what the step puts out: its backward's reading it absorbs nothing)
    r = _ac_with_replay_loss_made_larger(ws, replay, step)
    assert r["drift"]["own"] == ["Functional.cross_entropy.0.forward"]
    assert "the step still fails in 1 output(s) or update(s), the first " \
        "Functional.cross_entropy.0.forward: that much is the step's own" in \
        " ".join(r["advice"])


def test_losses_that_part_over_dumped_steps_ask_for_their_tensors_not_a_dump(tmp_path):
    """The drifting MLP by statistics: no step has a finding, and the losses part beyond 5%
    at a step that was dumped with the one before it. ac -c says those steps were compared
    by their statistics and offers their tensors (exit 1); before, it asked the user to
    dump the steps that were dumped already."""
    code, r = _drifting_mlp(tmp_path, "statistics")
    assert code == 1 and r["drift"]["kind"] == "loss"
    first = r["drift"]["loss"]["first_off"]
    advice = " ".join(r["advice"])
    assert f"Steps {first - 1}-{first} were dumped and compared by their statistics" in advice
    assert f'--dump-mode tensor --dump-step "{first - 1}-{first}"' in advice
    assert 'torch-run --dump-step "' not in advice


class FusedQKV(nn.Module):
    """Attention with one linear for query, key and value (GPT-2's c_attn), its bias starting
    at zero: the key's third of it gets a gradient of zero in exact arithmetic (a softmax
    does not see a constant added to a row of scores)."""

    def __init__(self, d=64, classes=4):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        nn.init.zeros_(self.qkv.bias)
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        return self.out((F.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1) @ v).mean(1))


def test_adam_turning_a_key_bias_rounding_into_full_steps_is_called_sound(tmp_path):
    """A healthy fused-QKV attention under AdamW: the NPU's fp16 matmuls round the key bias's
    zero gradient to elements above eps, where the golden's lie below it, so Adam steps them
    in full where the golden barely moves, and the bias differs in norm from the first
    update on. Nothing reads that difference (each row of scores moves by a constant):
    every step is compared and ac -c calls the run sound (exit 0)."""
    def train(target):
        torch.manual_seed(0)
        model = FusedQKV()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        x, y = torch.randn(8, 32, 64), torch.randint(0, 4, (8,))
        _steps(model, lambda: F.cross_entropy(model(x), y), opt,
               PrecisionDebugger(str(tmp_path), target=target, dump_step="all"), 3)
    train("golden")
    train("npu")
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    assert [s["step"] for s in result["steps"]] == [0, 1, 2]
    assert "op(s), among them Tensor.addcdiv_." in result["advice"][0]
    assert "an Adam step that turns the rounding of near-zero gradient elements into full " \
           "steps: precision looks sound" in result["advice"][0]


def test_a_clean_run_is_called_sound(tmp_path):
    """A healthy script, every step dumped on both targets: ac -c finds nothing (exit 0)."""
    _train(_mlp, str(tmp_path), "golden", steps=4)
    _train(_mlp, str(tmp_path), "npu", steps=4)
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["verdict"] == "sound"


@pytest.mark.parametrize("target", ["golden", "npu"])
def test_a_statistics_dump_holds_the_tensor_dumps_statistics(tmp_path, target):
    """A statistics dump keeps each value's statistics as it is made, not a copy: its
    index is the tensor dump's line for line, with the same numbers (the weights Adam
    updates in place read as they were when read; the backward's summed gradients), and
    no files; ac -c over statistics dumps of both targets calls the clean run sound."""
    for mode in ("tensor", "statistics"):
        _train(Attention, str(tmp_path / mode), target, steps=2, dump_mode=mode)
    runs = [Workspace(str(tmp_path / mode)).run("npu" if target == "npu" else "cpu")
            for mode in ("tensor", "statistics")]
    columns = ["op_name", "io", "index", "tensor", "dtype", "shape", "max", "min", "mean",
               "l2norm", "nan_count", "pos_inf_count", "neg_inf_count"]
    for step in (0, 1):
        held, summed = (Workspace(str(r.path).rsplit("/", 2)[0]).index(r, step) for r in runs)
        assert len(held) > 50 and held[columns].equals(summed[columns])
        assert summed.file.fillna("").eq("").all() and held.file.astype(bool).all()
    assert not [f for f in os.listdir(runs[1].path) if f.endswith(".npy")]
    other = "npu" if target == "golden" else "golden"
    _train(Attention, str(tmp_path / "statistics"), other, steps=2, dump_mode="statistics")
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "statistics"), "--json", "ac",
                                   "-c"])
    assert out.exit_code == 0, out.output
    # what a statistics dump cannot show is said, with the option of this front-end
    advice = " ".join(json.loads(out.stdout)["advice"])
    assert "only by their statistics" in advice and "torch-run --dump-mode tensor" in advice


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "gradscaler"])
def test_gradients_written_in_place_by_list_kernels_are_dumped_as_written(tmp_path, scaled):
    """clip_grad_norm_ scales the gradients in place with torch._foreach_mul_, which under
    the simulated NPU's dispatch mode leaves their version counters alone, and GradScaler's
    unscale (torch._amp_foreach_non_finite_check_and_unscale_) leaves them alone always
    (torch's doing): the dump took the clipped gradients for the unclipped ones (norm
    +3858%), and the unscaled for the scaled. The unscale's gradients are now its outputs,
    the clip reads them, and each clipped gradient is dumped as clipped, against a float64
    reference; the clean run compares sound."""
    def train(target):
        torch.manual_seed(0)
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=scaled)
        debugger = PrecisionDebugger(str(tmp_path), target=target, dump_step="all",
                                     dump_mode="statistics")
        debugger.start(model)
        for _ in range(2):
            scaler.scale(model(torch.randn(8, 16)).pow(2).mean()).backward()
            grads = [p.grad.double() / (1024.0 if scaled else 1.0) for p in model.parameters()]
            total = torch.cat([g.flatten() for g in grads]).norm()
            clipped = [g * min(1.0, 0.01 / (float(total) + 1e-6)) for g in grads]
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            debugger.step()
        debugger.stop()
        return [float(g.norm()) for g in grads], [float(g.norm()) for g in clipped]
    unscale = "Torch._amp_foreach_non_finite_check_and_unscale_.0.forward"
    for target in ("golden", "npu"):
        unclipped, clipped = train(target)
        ws = Workspace(str(tmp_path))
        table = ws.index(ws.run("npu" if target == "npu" else "cpu"), 1)

        def norms(op, io):
            return table[(table.op_name == op) & (table.io == io)].l2norm.astype(float)
        mul = norms("Torch._foreach_mul_.0.forward", "output")
        assert np.allclose(mul, clipped, rtol=2e-3), (target, mul.tolist(), clipped)
        norm_in = table[(table.op_name == "Torch._foreach_norm.0.forward") &
                        (table.io == "input")]
        assert np.allclose(norm_in.l2norm.astype(float), unclipped, rtol=2e-3)
        if scaled:
            assert norm_in.tensor.str.startswith(unscale + ":").all(), norm_in.tensor.tolist()
            assert np.allclose(norms(unscale, "output")[:len(unclipped)], unclipped, rtol=2e-3)
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["verdict"] == "sound"


def test_an_input_beyond_fp16s_range_is_fixed_where_it_comes_from(tmp_path):
    """Inputs of ±30000 sigma into a Linear (a MatMulBiasAdd fused kernel on the NPU): its
    inputs reach past 65504, which no fp16 kernel holds, fused or not; the advice leads with
    what feeds it and offers switching the pass off last."""
    for target in ("golden", "npu"):
        _train(lambda: nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)),
               str(tmp_path), target, steps=1, scale=30000.0, optimizer="sgd")
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c"])
    assert out.exit_code == 1, out.output
    result = json.loads(out.stdout)
    assert result["first_overflow"]["op_name"] == "Functional.linear.0.forward"
    line = next(a for a in result["advice"] if a.startswith("The first overflow"))
    assert "That is beyond fp16's largest value (65504), fused kernel or not." in line
    feeds = min(line.index(t) for t in ("normalise what feeds it", "cale what feeds it down")
                if t in line)
    assert feeds < line.index("keep ") < line.index("MatMulBiasAddFusionPass off"), line


def test_unscaled_attention_scores_overflowing_fp16_are_named(tmp_path):
    """A planted cause: attention scores left unscaled, on inputs large enough that q·k
    passes 65504, under force_fp16 with inf/nan overflow: ac -c names the matmul that made
    the inf as the origin (exit 1), and the status word is in the step history."""
    for target in ("golden", "npu"):
        _train(lambda: Attention(scaled=False), str(tmp_path), target, steps=1, scale=100.0,
               optimizer="sgd", precision_mode="force_fp16", overflow_mode="inf_nan")
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c"])
    assert out.exit_code == 1, out.output
    result = json.loads(out.stdout)
    assert result["origin"]["op_name"] == "Torch.matmul.0.forward"
    # the overflow report sees the call whose kernel overflowed (its Opdebug record)
    assert result["first_overflow"]["op_name"] == "Torch.matmul.0.forward"
    assert result["first_overflow"]["status_bits"] == ["cube accumulation overflow"]
    assert result["origin"]["module"] == "Attention"
    assert result["origin"]["call_site"] == f"{__file__}:{_MATMUL_LINE} in forward"
    ws = Workspace(str(tmp_path))
    assert int(ws.step_history(ws.run("npu")).status.iloc[0]) != 0
    # scaled before the product, the matmul holds at the same inputs; the fused kernels
    # overflow (in fp16 the softmax skips the max subtraction, the layer norm's one-pass
    # variance squares values over 255.9), and with fusion off nothing does
    scaled = tmp_path / "scaled"
    _train(Attention, str(scaled), "npu", steps=1, scale=100.0, optimizer="sgd",
           precision_mode="force_fp16", overflow_mode="inf_nan")
    out = CliRunner().invoke(cli, ["--data-dir", str(scaled), "--json", "ac"])
    assert json.loads(out.stdout)["first_overflow"]["op_name"] == "Torch.softmax.0.forward"
    clean = tmp_path / "unfused"
    _train(Attention, str(clean), "npu", steps=1, scale=100.0, optimizer="sgd",
           precision_mode="force_fp16", overflow_mode="inf_nan", fusion_switch="off")
    ws = Workspace(str(clean))
    assert int(ws.step_history(ws.run("npu")).status.iloc[0]) == 0


def _low_precision(root=None, target=None, cast=None, steps=2, **kw):
    """The MLP trained with the script asking for low precision: cast="autocast" (bf16
    autocast around the forward), "checkpoint" (that forward under activation
    checkpointing: recomputed inside the backward), "half" (the model and inputs cast with
    .half() after the debugger starts) or None (the same script in fp32). Its losses and
    parameters."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    debugger = PrecisionDebugger(root, target=target, dump_step="all", **kw) if target else None
    inputs = {"x": x}

    def halve():
        if cast == "half":
            model.half()
            inputs["x"] = inputs["x"].half()

    def loss_of():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast in AUTOCAST):
            out = model(inputs["x"]) if cast != "checkpoint" else \
                torch.utils.checkpoint.checkpoint(model, inputs["x"], use_reentrant=False)
        return F.cross_entropy(out.float(), y)
    losses = _steps(model, loss_of, opt, debugger, steps, halve)
    return losses, [p.detach().float().clone() for p in model.parameters()]


AUTOCAST = ("autocast", "checkpoint")


@pytest.mark.parametrize("cast", ["autocast", "checkpoint", "half"])
def test_a_script_asking_for_low_precision_gets_an_fp32_golden(tmp_path, cast):
    """A script that runs under autocast or halves its model: its golden is the same script
    in fp32, bit for bit (every kernel in fp32 whatever the script asked; a checkpointed
    forward too, which the backward recomputes under the autocast state it saved: torch
    refused the golden's float32 against the recompute's bfloat16), and run.json
    says which kernels asked; the NPU run honours the script's casts on top of the precision
    mode (must_keep_origin_dtype keeps what the script asked for: bf16 or fp16 linears)."""
    fp32 = _low_precision()
    as_written = _low_precision(cast=cast)
    assert as_written[0] != fp32[0]             # the script's own low precision shows
    enter = torch.amp.autocast_mode.autocast.__enter__
    golden = _low_precision(str(tmp_path), "golden", cast)
    assert torch.amp.autocast_mode.autocast.__enter__ is enter      # given back at stop()
    assert golden[0] == fp32[0]
    assert all(torch.equal(a, b) for a, b in zip(golden[1], fp32[1]))
    ws = Workspace(str(tmp_path))
    cpu = ws.run("cpu")
    assert cpu.info["lifted_to_float32"] == (["autocast"] if cast in AUTOCAST else ["Tensor.half"])
    assert set(ws.index(cpu, 0).dtype) == {"float32", "int64"}
    _low_precision(str(tmp_path), "npu", cast, precision_mode="must_keep_origin_dtype")
    ws = Workspace(str(tmp_path))
    t = ws.index(ws.run("npu"), 0)
    out = t[(t.op_name == "Functional.linear.0.forward") & (t.io == "output")].iloc[0]
    assert out["dtype"] == ("bfloat16" if cast in AUTOCAST else "float16")


def test_a_scripts_cast_to_float32_is_float32_on_the_device():
    """`.float()` of a bf16 tensor is a float32 tensor on the device: what reads it
    computes in float32 even under allow_mix_precision_bf16, whose gray list would follow
    bf16 inputs down (float64 numpy's product, rounded once to float32)."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(2))

    def script(x):
        c = (x.bfloat16() * 1.5).float()
        return c, c * (1 + 2 ** -10)
    (c, d), npu = _on_npu(script, x, mode="allow_mix_precision_bf16")
    assert npu.dtype_of(c) == "float32" and npu.dtype_of(d) == "float32"
    want = (c.double() * (1 + 2 ** -10)).float()
    assert torch.equal(d, want)
    assert not torch.equal(d, d.bfloat16().float())          # off bf16's grid


def test_a_cast_only_the_npu_run_makes_stands_for_what_it_casts(tmp_path):
    """The halved script's `out.float()`: on the NPU a real cast with a backward; in the
    golden, whose tensors are float32 already, a call that returns its input and records no
    backward. The NPU's cast backward and what reads it are compared with the gradient it
    casts, as a Cast the compiler inserts is: the compare is complete."""
    _low_precision(str(tmp_path), "golden", "half")
    _low_precision(str(tmp_path), "npu", "half")
    ws = Workspace(str(tmp_path))
    npu, cpu = ws.run("npu"), ws.run("cpu")
    t = ws.index(npu, 0)
    assert "Tensor.float.0.backward" in set(t.op_name)
    assert "Tensor.float.0.backward" not in set(ws.index(cpu, 0).op_name)
    res = vector_compare(ws, npu, cpu, 0)
    failed = res[res.Verdict.isin(["error", "npu-only"])]
    assert failed.empty, failed[["TensorIndex", "CompareFailReason"]].to_string()
    cast = res[res.NPUDump == "Tensor.float.0.backward"]
    reader = res[res.TensorIndex == "Functional.linear.1.backward:input:0"]
    assert set(cast.GoldenTensor) == set(reader.GoldenTensor) == \
        {"Functional.cross_entropy.0.backward:0"}
    assert cast.CosineSimilarity.min() > 0.999 and reader.CosineSimilarity.min() > 0.999
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c"])
    assert json.loads(out.stdout)["verdict"] != "incomplete", out.output


def test_keep_fp32_keeps_a_calls_kernels_in_fp32_forward_and_backward(tmp_path):
    """keep_fp32 names an API (every call of it) or a module path (every call made in it):
    those calls' kernels compute and keep fp32, their backward's too; the others stay as the
    policy places them. A call's backward record holds the gradients it hands each of its
    inputs (the weight's gradient has the weight's shape), not its last node's."""
    _train(Attention, str(tmp_path / "api"), "npu", steps=1, keep_fp32=["Torch.matmul"])
    _train(Attention, str(tmp_path / "module"), "npu", steps=1, keep_fp32=["q"])

    def dtypes(root, name, io="output"):
        ws = Workspace(str(root))
        t = ws.index(ws.run("npu"), 0)
        return list(t[(t.op_name == name) & (t.io == io)].sort_values("index").dtype)
    api, module = tmp_path / "api", tmp_path / "module"
    assert dtypes(api, "Torch.matmul.0.forward") == ["float32"]
    assert dtypes(api, "Torch.matmul.0.backward") == ["float32", "float32"]
    assert dtypes(api, "Functional.linear.1.forward") == ["float16"]
    assert dtypes(module, "Functional.linear.0.forward") == ["float32"]       # q
    assert dtypes(module, "Functional.linear.0.backward") == ["float32", "float32"]
    assert dtypes(module, "Functional.linear.1.forward") == ["float16"]       # k
    assert dtypes(module, "Torch.matmul.0.forward") == ["float16"]
    with pytest.raises(TorchFrontEndError, match="keep_fp32 is a setting of the simulated NPU"):
        PrecisionDebugger(str(tmp_path), target="golden", keep_fp32=["Torch.matmul"])


def test_a_calls_backward_record_is_the_gradients_of_its_inputs(tmp_path):
    """The golden's Functional.linear.3.backward (the classifier, on a 3-d input: a view,
    an addmm and the weight's transpose in autograd) holds the gradients of its input, its
    weight and its bias, bit for bit what autograd gives them in the script without the
    tool."""
    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1])
    received = []
    model.out.register_full_backward_hook(lambda m, gin, gout: received.append(gout[0]))
    F.cross_entropy(model(x), y).backward()
    want = [model.out.weight.grad.numpy(), model.out.bias.grad.numpy()]
    torch.manual_seed(0)
    model = Attention()
    d = PrecisionDebugger(str(tmp_path), target="golden", dump_step="all")
    d.start(model)
    F.cross_entropy(model(x), y).backward()
    d.step()
    d.stop()
    ws = Workspace(str(tmp_path))
    run = ws.run("cpu")
    t = ws.index(run, 0)
    rows = t[(t.op_name == "Functional.linear.3.backward") & (t.io == "output")]
    got = [ws.load(run, 0, f) for f in rows.sort_values("index").file]
    assert [g.shape for g in got] == [(2, 6, 16), (4, 16), (4,)]
    assert np.array_equal(got[1], want[0]) and np.array_equal(got[2], want[1])
    # its input is the gradient its output received, named as the backward output that
    # made it (the mean's), and holds autograd's values: the value that record kept
    (given,) = t[(t.op_name == "Functional.linear.3.backward") & (t.io == "input")].itertuples()
    assert given.tensor == "Tensor.mean.0.backward:0"
    assert np.array_equal(ws.load(run, 0, given.file), received[0].numpy())


def _lstm_in_float64(rnn, x, grid):
    """nn.LSTM's forward written out in float64, time step by time step, with what the
    Cube reads (the input, the weights, the biases and the hidden state of each matmul)
    put on `grid`'s values first."""
    out = x.double()
    for layer in range(rnn.num_layers):
        w_ih, w_hh, b_ih, b_hh = (getattr(rnn, f"{n}_l{layer}").detach().double()
                                  for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
        h = torch.zeros(x.shape[1], rnn.hidden_size, dtype=torch.float64)
        c, steps = torch.zeros_like(h), []
        for t in out:
            gates = grid(t) @ grid(w_ih).T + grid(b_ih) + grid(h) @ grid(w_hh).T + grid(b_hh)
            i, f, g, o = gates.chunk(4, 1)
            c = f.sigmoid() * c + i.sigmoid() * g.tanh()
            h = o.sigmoid() * c.tanh()
            steps.append(h)
        out = torch.stack(steps)
    return out


def test_a_recurrent_layer_is_simulated_cell_by_cell_and_its_backward_recorded(tmp_path):
    """nn.LSTM on the simulated NPU: torch's CPU runs a whole layer as one oneDNN kernel
    (mkldnn_rnn_layer) the policy cannot see into, which ran in the script's dtype and was
    only listed as not simulated. The NPU now runs the cell's matmuls and gates as kernels
    of their own: under allow_fp32_to_fp16 the output is float64's LSTM with every matmul
    read from fp16's grid (to float32's rounding), which float32's own LSTM is 100x
    further from. The layer makes thousands of autograd nodes (40 steps, 2 layers): its
    backward is still one record, every weight's gradient in it as autograd gave it."""
    torch.manual_seed(0)
    rnn = nn.LSTM(6, 8, num_layers=2)
    x = torch.randn(40, 3, 6)
    d = PrecisionDebugger(str(tmp_path), target="npu", dump_step="0",
                          precision_mode="allow_fp32_to_fp16")
    d.start(rnn)
    y, _ = rnn(x)
    y.sum().backward()
    d.step()
    d.stop()
    on_fp16 = _lstm_in_float64(rnn, x, lambda t: t.half().double())
    with torch.no_grad():
        as_fp32 = rnn(x)[0].double()
    assert (y.double() - on_fp16).abs().max() < 2e-7
    assert (as_fp32 - on_fp16).abs().max() > 2e-5
    ws = Workspace(str(tmp_path))
    run = ws.run("npu")
    assert "aten.mkldnn_rnn_layer" not in (run.info.get("not_simulated") or [])
    t = ws.index(run, 0)
    rows = t[(t.op_name == "Torch.lstm.0.backward") & (t.io == "output")]
    got = [ws.load(run, 0, f) for f in rows.sort_values("index").file]
    want = [p.grad.numpy() for p in rnn._flat_weights]
    assert [g.shape for g in got] == [w.shape for w in want]
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_a_bf16_lstms_gradients_are_read_by_name_where_each_time_step_adds_to_them(tmp_path):
    """An LSTM cast to bf16 (no autocast) on the NPU: unfused, every time step's matmul reads
    the bias leaves, so one call reaches each leaf by many edges, and its .grad had no name
    (the first edge named it, the next unnamed it): the update read an input from outside,
    with no golden, and the compare was incomplete. One call's edges count once: SGD reads
    every weight's gradient as the call's backward output, with the value autograd summed
    in bf16 (the .grad the update reads), not the record's."""
    torch.manual_seed(0)
    rnn = nn.LSTM(6, 8, num_layers=2).bfloat16()
    opt = torch.optim.SGD(rnn.parameters(), lr=0.1)
    x = torch.randn(12, 3, 6, dtype=torch.bfloat16)
    d = PrecisionDebugger(str(tmp_path), target="npu", dump_step="all")
    d.start(rnn)
    try:
        rnn(x)[0].float().sum().backward()
        grads = [p.grad.clone() for p in rnn.parameters()]
        opt.step()
        records = [r for r in d._records if r.op.type == "Tensor.add_"]
        read = [r.op.inputs[1] for r in records]
        values = [r.inputs[1] for r in records]
    finally:
        d.stop()
    assert sorted(read) == [f"Torch.lstm.0.backward:{k}" for k in range(8)], read
    by_name = dict(zip(read, values))
    for k, g in enumerate(grads):
        assert np.array_equal(np.asarray(by_name[f"Torch.lstm.0.backward:{k}"], dtype=np.float32),
                              g.float().numpy()), k


def test_an_in_place_write_keeps_its_tensors_dtype_on_the_npu(tmp_path):
    """A float32 tensor given a bf16 value in place (`total.add_(x_bf16)`, the unfused
    LSTM's cell state under autocast) computes in float32 on the NPU, as torch does: it
    was computed in bf16 on a copy, and the write lost (the LSTM's output was all zero).
    A bf16 tensor's in-place activation still writes it."""
    d = PrecisionDebugger(str(tmp_path), target="npu", dump_step="0")
    d.start()
    total = torch.ones(4)
    total.add_(torch.full((4,), 1 / 3, dtype=torch.bfloat16))
    gate = torch.zeros(3, dtype=torch.bfloat16)
    gate.sigmoid_()
    d.step()
    d.stop()
    assert torch.equal(total, torch.ones(4) + torch.tensor(1 / 3, dtype=torch.bfloat16).float())
    assert torch.equal(gate, torch.full((3,), 0.5, dtype=torch.bfloat16))


def test_sgds_momentum_buffer_reads_the_gradient_by_its_name(tmp_path):
    """SGD with momentum starts each buffer as `grad.detach().clone()`: the detached
    gradient (no recorded call) stands for the backward output it is, so the clone reads
    `Functional.linear.0.backward:k` on both targets, not an input from outside that a
    gradual crossing upstream would make a divergence with no op to start it."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    d = PrecisionDebugger(str(tmp_path), target="golden", dump_step="all")
    d.start(lin)
    try:
        F.cross_entropy(lin(torch.randn(3, 6)), torch.tensor([0, 1, 3])).backward()
        opt.step()
        records = {r.op.name: r for r in d._records}
    finally:
        d.stop()
    assert [records[f"Tensor.clone.{k}.forward"].op.inputs[0] for k in (0, 1)] == \
        ["Functional.linear.0.backward:0", "Functional.linear.0.backward:1"]


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_a_view_of_a_kept_tensor_is_kept_once_until_a_write(tmp_path, mode):
    """A view, reshape or flatten of a contiguous tensor is its memory in the same order:
    what was kept of it serves (one copy; a statistics dump's numbers), in the view's
    shape, until a write in place changes the memory. A tensor on the same buffer that
    is no view of it (its own version counter, which the other's writes do not bump) gets
    its own."""
    d = PrecisionDebugger(str(tmp_path), target="golden", dump_mode=mode)
    base = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    kept = d._snapshot(base)
    flat = base.view(24)
    seen = d._snapshot(flat)
    assert seen.shape == (24,)
    if mode == "tensor":
        assert np.shares_memory(seen, kept) and np.array_equal(seen, base.numpy().reshape(24))
    else:
        assert seen.stats is kept.stats
    base.add_(1.0)                                  # the view's memory changes
    fresh = d._snapshot(base.reshape(6, 4))
    if mode == "tensor":
        assert not np.shares_memory(fresh, kept)
        assert np.array_equal(fresh, base.numpy().reshape(6, 4))
    else:
        assert fresh.stats[2] == pytest.approx(float(base.double().mean()))
    buffer = np.arange(6, dtype=np.float32)
    one, other = torch.from_numpy(buffer), torch.from_numpy(buffer)
    d._snapshot(one)
    buffer += 1.0                       # a write neither counter sees; other is read after
    other_seen = d._snapshot(other)
    if mode == "tensor":
        assert np.array_equal(other_seen, buffer)
    else:
        assert other_seen.stats[2] == pytest.approx(float(buffer.mean()))


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_a_gradient_is_kept_once_for_its_backward_and_for_the_update(tmp_path, mode):
    """A gradient's value (a copy, or its statistics) is kept once: a view's backward
    hands on its input gradient reshaped, and that is the same value; the update that reads
    a parameter's .grad reads the value its backward kept (the weight's, made by a node of
    the call after the bias's); the numbers are autograd's."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    d = PrecisionDebugger(str(tmp_path), target="golden", dump_mode=mode, dump_step="all")
    d.start(lin)
    try:
        lin(torch.randn(3, 6)).view(12).pow(2).sum().backward()
        grads = [lin.weight.grad.clone(), lin.bias.grad.clone()]
        opt.step()
        records = {r.op.name: r for r in d._records}
    finally:
        d.stop()
    backward = records["Functional.linear.0.backward"]
    for k, name in enumerate(("Tensor.add_.0.forward", "Tensor.add_.1.forward")):
        update = records[name]
        assert update.op.inputs[1] == f"Functional.linear.0.backward:{k}"
        assert update.inputs[1] is backward.outputs[k]
        held = backward.outputs[k]
        if mode == "tensor":
            assert np.array_equal(held, grads[k].numpy())
        else:
            assert held.stats[2] == pytest.approx(float(grads[k].double().mean()), rel=1e-12)
    view = records["Tensor.view.0.backward"]
    if mode == "tensor":
        assert np.shares_memory(view.inputs[0], view.outputs[0])
    else:
        assert view.inputs[0].stats is view.outputs[0].stats


def test_the_heap_before_start_is_left_out_of_the_collector_until_stop(tmp_path):
    """While started, what was alive at start() is frozen (full collections would scan it
    each time the dump's objects set them off); cyclic garbage made while started is still
    collected; stop() gives the heap back. A heap the script froze itself is left alone."""
    assert gc.get_freeze_count() == 0
    d = PrecisionDebugger(str(tmp_path), target="golden", dump_mode="statistics")
    d.start()
    try:
        assert gc.get_freeze_count() > 0
        d.start()                           # resumed: frozen once
        frozen = gc.get_freeze_count()
        cycle = [0]
        cycle[0] = cycle
        gone = weakref.ref(_Cycle(cycle))
        del cycle
        gc.collect()
        assert gone() is None and gc.get_freeze_count() == frozen
    finally:
        d.stop()
    assert gc.get_freeze_count() == 0
    gc.freeze()                             # the script's own
    try:
        mine = gc.get_freeze_count()
        d2 = PrecisionDebugger(str(tmp_path), target="golden", dump_mode="statistics")
        d2.start()
        d2.stop()
        # left frozen (an unfreeze empties it) and not frozen again; a frozen object that
        # dies meanwhile (a weak set's entry) leaves it, so a few may go
        assert mine - 16 <= gc.get_freeze_count() <= mine
    finally:
        gc.unfreeze()


class _Cycle:
    def __init__(self, other):
        self.other = other
        other.append(self)


def test_what_the_policy_does_not_classify_is_listed(tmp_path):
    """An op outside the table runs as the script asks and run.json lists it once."""
    def make():
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 4)

            def forward(self, x):
                return self.fc(torch.cumprod(x.abs() + 1, -1) / 1e3).mean(1)
        return M()
    _train(make, str(tmp_path), "npu", steps=1, optimizer="sgd")
    info = Workspace(str(tmp_path)).run("npu").info
    assert "aten.cumprod" in info["not_simulated"]


def test_what_is_not_simulated_is_said_by_torch_run_and_ac(tmp_path):
    """torch-run and ac -c each print the kernels the NPU's run computed as on the CPU
    (the --json results hold them too); an op on booleans alone (`~mask`) computes exactly
    and is not among them."""
    script = tmp_path / "cum.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        torch.manual_seed(0)
        fc = nn.Linear(16, 4)
        opt = torch.optim.SGD(fc.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(8, 16)
            keep = ~(x > 2)
            loss = fc(torch.cumprod(x.abs() + 1, -1) / 1e3 * keep).mean()
            opt.zero_grad(); loss.backward(); opt.step()
    """))
    done = _torch_run(tmp_path / "ws", "--", str(script))
    assert done.returncode == 0, done.stderr
    line = "not simulated on the NPU (computed as on the CPU, in the script's dtype): "
    listed = [x for x in done.stdout.splitlines() if x.startswith(line)]
    assert len(listed) == 1 and "aten.cumprod" in listed[0], done.stdout
    assert "bitwise_not" not in done.stdout
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "ac", "-c"])
    assert [x for x in out.output.splitlines() if x.startswith(line)] == listed, out.output
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "--json", "ac", "-c"])
    assert "aten.cumprod" in json.loads(out.stdout)["not_simulated"]


def test_bad_settings_are_refused_in_one_line(tmp_path):
    with pytest.raises(TorchFrontEndError, match="target must be one of"):
        PrecisionDebugger(str(tmp_path), target="gpu")
    with pytest.raises(TorchFrontEndError, match="dump_mode"):
        PrecisionDebugger(str(tmp_path), dump_mode="everything")
    with pytest.raises(layout.DumpConfigError):
        PrecisionDebugger(str(tmp_path), dump_step="x")
    with pytest.raises(TorchFrontEndError, match="skip_steps is a setting of the golden"):
        PrecisionDebugger(str(tmp_path), target="npu", skip_steps="2")
    with pytest.raises(TorchFrontEndError, match="skip_steps must be step numbers"):
        PrecisionDebugger(str(tmp_path), target="golden", skip_steps="2,x")
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "torch-run", "--target", "npu",
                                   "--golden-skips-as-npu", "--", "train.py"])
    assert out.exit_code == 2 and "--golden-skips-as-npu needs --target both" in out.output


def _on_npu(fn, *xs, mode="force_fp32", fusion=None, overflow="saturation"):
    """fn(*xs) on the simulated NPU: its output and the device (its status word)."""
    from precision_tool.runtime.config import SessionConfig
    from precision_tool.torch.simulate import SimulatedNPU
    npu = SimulatedNPU(SessionConfig(precision_mode=mode, overflow_mode=overflow,
                                     fusion_switch=fusion))
    with npu:
        out = fn(*xs)
    return out, npu


def test_a_diffusion_unets_ops_are_simulated(tmp_path):
    """GroupNorm, nearest and bilinear upsampling, `1 - t` and the MSE loss, forward and
    backward, are classified (a UNet's run listed them all as not simulated). In fp16
    (force_fp16) the group norm reads its input on fp16's grid and rounds its output once:
    float64's group norm of the rounded input, within half an fp16 ulp plus float32's
    error, where the float32 norm of the unrounded input is further off."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 8, 6, 6, generator=g) * 3 + 1).requires_grad_(True)
    norm = nn.GroupNorm(4, 8)

    def unet_bits(x):
        h = F.interpolate(norm(x), scale_factor=2, mode="nearest")
        h = F.interpolate(h, scale_factor=0.5, mode="bilinear")
        loss = F.mse_loss(1 - h, torch.zeros_like(h))
        loss.backward()
        return norm(x)
    out, npu = _on_npu(unet_bits, x, mode="force_fp16")
    assert npu.unclassified == set()
    want = F.group_norm(x.detach().half().double(), 4, norm.weight.double(),
                        norm.bias.double())
    ulp = torch.finfo(torch.float16).eps * want.abs().clamp_min(2 ** -14)
    assert ((out.double() - want).abs() <= ulp / 2 + 1e-6).all()
    assert torch.equal(out, out.half().float())
    unrounded = F.group_norm(x.detach().double(), 4, norm.weight.double(), norm.bias.double())
    assert not ((unrounded - want).abs() <= ulp / 2 + 1e-6).all()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_norms_weight_and_bias_gradients_are_sums(tmp_path):
    """A batch norm's backward kernel makes three outputs: the input's gradient, and the
    weight's and bias's, sums over the batch that cancellation can make small (the
    compare's sum kinds, by kernel: a MobileNetV3 BN bias gradient zero up to rounding in
    both runs, 958x the golden's tiny norm in fp16, was the root cause of a healthy run)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    d = PrecisionDebugger(str(tmp_path), target="npu", dump_step="0")
    d.start(bn)
    bn(torch.randn(8, 4, requires_grad=True)).pow(2).sum().backward()
    d.step()
    d.stop()
    ws = Workspace(str(tmp_path))
    sites = ws.call_sites(ws.run("npu"), 0)
    assert sites["Functional.batch_norm.0.backward"]["kernels"] == \
        "BatchNormGrad,ReduceSum,ReduceSum"


def test_common_training_kernels_are_classified():
    """clip_grad_norm_'s norms and scaling, a mixture of experts' routing (index_add_,
    `x[rows] = v`, scatter, the indexing's backward), sin, remainder, MobileNetV3's hard
    swish and hard sigmoid: each was listed
    as not simulated in real scripts' runs. Classified, and in force_fp32 exactly what
    torch computes without the simulator."""
    def script(x, w):
        h = torch.sin(x @ w) + torch.remainder(x, 0.7) + F.hardswish(x) * F.hardsigmoid(x)
        rows = torch.tensor([0, 2, 2, 5])
        out = torch.zeros_like(h)
        out.index_add_(0, rows, h[rows] * 2)
        out[rows[:2]] = h[:2]
        out = out.scatter(1, torch.zeros(6, 1, dtype=torch.long), 0.5)
        out.pow(2).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_([w], 0.1)
        return out.detach(), w.grad.clone(), norm
    g = torch.Generator().manual_seed(4)
    x, w0 = torch.randn(6, 5, generator=g), torch.randn(5, 5, generator=g)
    w = w0.clone().requires_grad_(True)
    want = script(x, w)
    w = w0.clone().requires_grad_(True)
    got, npu = _on_npu(script, x, w)
    assert npu.unclassified == set()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_scaled_dot_product_attention_is_one_fused_kernel_in_fp16():
    """F.scaled_dot_product_attention is one fused Cube kernel on the device: fp16 inputs,
    float32 inside, its output rounded once (within half an fp16 ulp of float64 attention
    on the same inputs), its log-sum-exp kept in float32 for the backward (whose gradients
    are then within 2e-3 of float64's; rounded, they are off by 6e-3). Scores beyond 65504
    overflow nothing inside it, where the same attention written as matmul and softmax
    overflows in the fp16 product."""
    g = torch.Generator().manual_seed(0)
    q, k, v = ((3 * torch.randn(2, 2, 8, 16, generator=g)).half().float() for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_(True)
    weights = torch.linspace(-1, 1, 16)

    def attention(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (out * weights).sum().backward()
        return out
    out, npu = _on_npu(attention, q, k, v, mode="allow_mix_precision")
    assert npu.unclassified == set() and npu.status == 0 and npu.dtype_of(out) == "float16"
    wide = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*wide, is_causal=True)
    (ref * weights.double()).sum().backward()
    r, o = ref.detach().numpy(), out.detach().double().numpy()
    assert np.array_equal(o, o.astype(np.float16))                  # on fp16's grid
    assert np.all(np.abs(o - r) <= 0.5 * np.spacing(np.abs(r).astype(np.float16)))
    for t, w in zip((q, k, v), wide):
        assert torch.equal(t.grad, t.grad.half().float())
        assert float((t.grad.double() - w.grad).abs().max() / w.grad.abs().max()) < 2e-3

    big = [200 * t.detach() for t in (q, k, v)]       # scores up to about 1.6e5
    fused, npu = _on_npu(lambda *t: F.scaled_dot_product_attention(*t), *big,
                         mode="allow_mix_precision")
    assert npu.status == 0 and torch.isfinite(fused).all()
    written, npu = _on_npu(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v,
                           *big, mode="allow_mix_precision", overflow="inf_nan")
    assert npu.status != 0 and not torch.isfinite(written).all()
    # with FlashAttentionFusionPass off the call is the ops it fuses: they overflow as the
    # written attention does
    unfused, npu = _on_npu(lambda *t: F.scaled_dot_product_attention(*t), *big,
                           mode="allow_mix_precision", overflow="inf_nan", fusion=_FLASH_OFF)
    assert npu.status != 0 and not torch.isfinite(unfused).all()
    assert "FlashAttentionFusionPass" not in npu.fired and npu.unclassified == set()


_FLASH_OFF = {"Switch": {"GraphFusion": {"FlashAttentionFusionPass": "off"}, "UBFusion": {}}}


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_attention_with_dropout_in_a_low_precision_script_is_one_kernel_in_its_dtype(tmp_path,
                                                                                     low):
    """F.scaled_dot_product_attention with dropout on bf16 (or fp16) tensors: torch's CPU
    takes it through its math path, which casts the tensors up to float32 and the result
    back. On the device it is one FlashAttentionScore on the script's dtype, float32
    inside. The NPU run (allow_mix_precision, whose own low dtype is fp16) used to place
    those inner float32 matmuls in fp16: a bf16 BERT's key gradients lost 39% of their
    elements to fp16's range (its smallest step, 2^-24, where float64's are 1e-10). Now the
    call computes as the fused kernel does, dumped step or not: what torch's own kernel on
    the same tensors with the same dropout mask gives, bit for bit, the forward and the
    gradients, and no gradient element is flushed but those under half the dtype's
    smallest step."""
    g = torch.Generator().manual_seed(2)
    base = [torch.randn(4, 2, 16, 8, generator=g) for _ in range(3)]
    mask = torch.zeros(4, 1, 16, 16)

    def attention(debugger=None):
        q, k, v = (t.to(low).requires_grad_(True) for t in base)
        torch.manual_seed(7)            # the same dropout mask in every run
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(low), dropout_p=0.1)
        (out.float() * 1e-4).sum().backward()
        if debugger is not None:
            debugger.step()
        return [out.detach(), q.grad, k.grad, v.grad]
    want = attention()
    d = PrecisionDebugger(str(tmp_path), target="npu", dump_step="0")
    d.start()
    got = [attention(d), attention(d)]          # step 0 dumped, step 1 not
    d.stop()
    for each in got:
        for a, b in zip(each, want):
            assert a.dtype == low and torch.equal(a, b)
    wide = [t.to(low).double().requires_grad_(True) for t in base]
    torch.manual_seed(7)
    ref = F.scaled_dot_product_attention(*wide, attn_mask=mask.double(), dropout_p=0.1)
    (ref * 1e-4).sum().backward()
    # a zero only where float64's value is under half the dtype's smallest step (fp16's
    # 2^-25: an fp16 script's own range; none in bf16's)
    tiny = torch.finfo(low).smallest_normal * torch.finfo(low).eps
    for t, r in zip(got[0][1:], wide):
        flushed = (t == 0) & (r.grad != 0)
        assert (r.grad[flushed].abs() <= tiny / 2).all()
        assert low == torch.float16 or not flushed.any()


def test_attention_with_dropout_and_its_pass_off_computes_in_the_scripts_dtype(tmp_path):
    """FlashAttentionFusionPass off, a bf16 script's attention with dropout: on the device
    the ops the kernel fuses, each on bf16 tensors. torch's CPU computes them upcast to
    float32, which the policy (allow_mix_precision: fp16 is its own low dtype) used to place
    in fp16, flushing the key gradient's small elements; now they are bf16 kernels. The
    reference is the same decomposition written here on bf16 tensors (torch's bf16 kernels:
    float32 inside, one rounding): the forward within a bf16 step of it, the gradients
    within 2% in norm, no element flushed to zero that float64 keeps, and the output and
    gradients off fp16's grid (what fp16 kernels would have rounded them to)."""
    g = torch.Generator().manual_seed(2)
    base = [torch.randn(4, 2, 16, 8, generator=g) for _ in range(3)]
    scale = 1 / math.sqrt(8)

    def attention(debugger=None):
        q, k, v = (t.bfloat16().requires_grad_(True) for t in base)
        torch.manual_seed(7)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        (out.float() * 1e-4).sum().backward()
        if debugger is not None:
            debugger.step()
        return [out.detach(), q.grad, k.grad, v.grad]
    torch.manual_seed(7)            # the mask torch's math path draws: the same shape
    keep = torch.empty(4, 2, 16, 16).bernoulli_(0.9)
    q, k, v = (t.bfloat16().requires_grad_(True) for t in base)
    w = torch.softmax((q * math.sqrt(scale)) @ (k * math.sqrt(scale)).transpose(-2, -1), -1)
    ref = (w * keep.bfloat16() / 0.9) @ v
    (ref.float() * 1e-4).sum().backward()
    d = PrecisionDebugger(str(tmp_path), target="npu", dump_step="0", fusion_switch=_FLASH_OFF)
    d.start()
    got = attention(d)
    d.stop()
    assert (got[0].float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max()
    wide = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ((torch.softmax(wide[0] * scale @ wide[1].transpose(-2, -1), -1) * keep / 0.9)
     @ wide[2] * 1e-4).sum().backward()
    for t, r, x in zip(got[1:], (q.grad, k.grad, v.grad), wide):
        assert t.dtype == torch.bfloat16
        assert (t.float() - r.float()).norm() <= 0.02 * r.float().norm()
        assert not ((t == 0) & (x.grad != 0)).any()
    on_fp16 = [torch.equal(t.float(), t.half().float()) for t in got]
    assert not all(on_fp16)


@pytest.mark.parametrize("case", ["causal", "float mask", "grouped heads"])
def test_attention_with_its_pass_off_is_the_ops_it_fuses_forward_and_backward(case):
    """FlashAttentionFusionPass off: the attention runs as torch's math attention, kernel by
    kernel, and its backward as the unfused ops' (the weights again, P^T dO, dO V^T,
    softmax's backward, the products with the scale), written here by hand: in float32
    both match float64 autograd; in fp16 the output is on fp16's grid and the pass is not
    among those that fired, while with the pass on it is."""
    g = torch.Generator().manual_seed(1)
    heads = 2 if case == "grouped heads" else 4
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = (torch.randn(2, heads, 6, 8, generator=g) for _ in range(2))
    mask = torch.randn(6, 6, generator=g) if case == "float mask" else None
    kw = dict(is_causal=case == "causal", attn_mask=mask, enable_gqa=case == "grouped heads")
    w = torch.linspace(-1, 1, 8)

    def attention(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        (out * w).sum().backward()
        return out
    wide = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*wide, **dict(kw, attn_mask=None if mask is None
                                                        else mask.double()))
    (ref * w.double()).sum().backward()
    for mode in ("force_fp32", "allow_mix_precision"):
        ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, npu = _on_npu(attention, *ins, mode=mode, fusion=_FLASH_OFF)
        assert "FlashAttentionFusionPass" not in npu.fired and npu.unclassified == set()
        if mode == "force_fp32":
            assert float((out.double() - ref).abs().max().detach()) < 1e-5
            for t, r in zip(ins, wide):
                assert float((t.grad.double() - r.grad).abs().max()) < 1e-5
        else:
            assert npu.dtype_of(out) == "float16" and torch.equal(out, out.half().float())
            assert float((out.double() - ref).abs().max().detach()) < 2e-2
    _, npu = _on_npu(attention, *[t.clone().requires_grad_(True) for t in (q, k, v)],
                     mode="allow_mix_precision")
    assert "FlashAttentionFusionPass" in npu.fired


def test_fused_kernels_compute_as_the_devices_and_unfused_as_the_ops_they_fuse():
    """Each fused kernel against a float64 numpy reference of the device's formula, and
    with its pass off against the formula of the ops it fuses."""
    import math
    x = torch.linspace(-5, 5, 101)
    xd = x.double().numpy()
    tanh_gelu = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    erf_gelu = 0.5 * xd * (1 + np.array([math.erf(v / math.sqrt(2)) for v in xd]))
    fused, npu = _on_npu(F.gelu, x)
    assert np.abs(fused.double().numpy() - tanh_gelu).max() < 1e-6     # GeluFusionPass
    assert np.abs(fused.double().numpy() - erf_gelu).max() > 1e-4
    assert npu.fired == {"GeluFusionPass"}
    unfused, npu = _on_npu(F.gelu, x, fusion="off")
    assert np.abs(unfused.double().numpy() - erf_gelu).max() < 1e-6
    assert npu.fired == set()

    # layer norm: the fused kernel's one-pass variance E[x^2] - E[x]^2 cancels when
    # |mean| >> std, even in fp32; the unfused ops' two-pass variance does not
    g = torch.Generator().manual_seed(0)
    x = 1000 + 0.01 * torch.randn(4, 64, generator=g)
    xd = x.double().numpy()
    ref = (xd - xd.mean(-1, keepdims=True)) / np.sqrt(xd.var(-1, keepdims=True) + 1e-5)
    fused, _ = _on_npu(lambda t: F.layer_norm(t, (64,)), x)
    unfused, _ = _on_npu(lambda t: F.layer_norm(t, (64,)), x, fusion="off")
    assert np.abs(unfused.double().numpy() - ref).max() < 0.05
    err = np.abs(fused.double().numpy() - ref)
    assert not np.all(err < 0.5)                # nan or far off: the cancellation

    # softmax in fp16: the fused kernel skips the max subtraction, so a logit over
    # ln(65504) = 11.09 overflows; unfused it is the float64 softmax on fp16's grid
    x = torch.tensor([[12.0, 0.0, -1.0], [1.0, 2.0, 3.0]])
    xd = x.double().numpy()
    ref = np.exp(xd - xd.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    fused, npu = _on_npu(lambda t: torch.softmax(t, -1), x, mode="force_fp16",
                         overflow="inf_nan")
    assert torch.isnan(fused[0, 0]) and npu.status != 0          # inf / inf
    assert np.abs(fused[1].double().numpy() - ref[1]).max() < 1e-3
    unfused, npu = _on_npu(lambda t: torch.softmax(t, -1), x, mode="force_fp16",
                           overflow="inf_nan", fusion="off")
    assert np.abs(unfused.double().numpy() - ref).max() < 1e-3 and npu.status == 0
    # over another axis than the last the pass does not fuse it
    other, npu = _on_npu(lambda t: torch.softmax(t, 0), x.T.contiguous(), mode="force_fp16",
                         overflow="inf_nan")
    assert torch.isfinite(other).all() and npu.fired == set()

    # a matmul with its bias in fp16: fused, the bias is added in the fp32 accumulator and
    # the sum rounded once; unfused, the product is rounded before the add
    a, b, bias = torch.tensor([[512.0, 0.25]]), torch.tensor([[2.0], [1.25]]), torch.tensor([0.375])
    product = a.double().numpy() @ b.double().numpy()          # 1024.3125, exact
    once = np.float16(product[0, 0] + 0.375)
    twice = np.float16(np.float64(np.float16(product[0, 0])) + 0.375)
    assert once != twice
    fused, _ = _on_npu(torch.addmm, bias, a, b, mode="force_fp16")
    unfused, _ = _on_npu(torch.addmm, bias, a, b, mode="force_fp16", fusion="off")
    assert fused.item() == float(once) and unfused.item() == float(twice)


def _rms_reference(x, w, dy, eps=1e-6):
    """F.rms_norm's output and the gradients of sum(y dy) in float64: autograd over the
    formula x / sqrt(mean(x^2) + eps) w, independent of the kernels under test."""
    xd, wd = (t.double().requires_grad_(True) for t in (x, w))
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * wd
    (y * dy.double()).sum().backward()
    return y.detach(), xd.grad, wd.grad


@pytest.mark.parametrize("fusion", [None, "off"], ids=["fused", "unfused"])
def test_rms_norm_is_one_fused_kernel_whose_squares_stay_float32(fusion):
    """F.rms_norm, which torch takes apart before the dispatcher, is one kernel on the NPU
    while RmsNormFusionPass is on (the debugger's calls go through SimulatedNPU.call): its
    squares and their mean in float32 whatever the mode, so under force_fp16 inputs of
    |x| > 255.9 overflow nothing, and its output, x's gradient and the weight's are within
    fp16 rounding of float64's. With the pass off it is the ops torch takes it into, and
    their fp16 square overflows (status set, the output far off)."""
    from precision_tool.runtime.config import SessionConfig
    from precision_tool.torch.simulate import SimulatedNPU
    g = torch.Generator().manual_seed(2)
    x = (400 * torch.randn(4, 6, 32, generator=g)).half().float().requires_grad_(True)
    w = (1 + 0.1 * torch.randn(32, generator=g)).half().float().requires_grad_(True)
    dy = torch.randn(4, 6, 32, generator=g).half().float()
    ref, ref_dx, ref_dw = _rms_reference(x.detach(), w.detach(), dy)
    npu = SimulatedNPU(SessionConfig(precision_mode="force_fp16", overflow_mode="inf_nan",
                                     fusion_switch=fusion))
    with npu:
        y = npu.call(F.rms_norm, (x, (32,), w, 1e-6), {})
        (y * dy).sum().backward()
    assert npu.unclassified == set()
    if fusion == "off":
        assert "RmsNormFusionPass" not in npu.fired and npu.status != 0
        assert float((y.detach().double() - ref).abs().max()) > 0.5
        return
    assert npu.fired == {"RmsNormFusionPass"} and npu.status == 0
    o, r = y.detach().double().numpy(), ref.numpy()
    assert npu.dtype_of(y) == "float16" and np.array_equal(o, o.astype(np.float16))
    assert np.all(np.abs(o - r) <= 0.51 * np.spacing(np.abs(r).astype(np.float16)))
    for got, want in ((x.grad, ref_dx), (w.grad, ref_dw)):
        assert torch.equal(got, got.half().float())                 # on fp16's grid
        assert float((got.double() - want).abs().max() / want.abs().max()) < 2e-3


def test_rms_norm_without_weight_or_eps_and_in_the_scripts_dtype():
    """The fused call keeps F.rms_norm's contract: no weight, eps None (the dtype's machine
    epsilon), several normalised dims, an fp16 script's own tensors (its output fp16, its
    gradients those of float64 within fp16 rounding), and a shape that does not fit gets
    torch's own error."""
    from precision_tool.runtime.config import SessionConfig
    from precision_tool.torch.simulate import SimulatedNPU
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 8, generator=g)
    npu = SimulatedNPU(SessionConfig(precision_mode="force_fp32"))
    with npu:
        y = npu.call(F.rms_norm, (x, (4, 8)), {})
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean((-2, -1), keepdim=True) + torch.finfo().eps)
    assert npu.fired == {"RmsNormFusionPass"} and float((y.double() - ref).abs().max()) < 1e-6
    half = x.half().requires_grad_(True)
    w = torch.ones(8, dtype=torch.float16, requires_grad=True)
    with npu:
        y = npu.call(torch.rms_norm, (half, [8], w, 1e-5), {})
        y.float().sum().backward()
    assert y.dtype == torch.float16 and half.grad.dtype == torch.float16
    _, ref_dx, ref_dw = _rms_reference(half.detach().float(), w.detach().float(),
                                       torch.ones(3, 4, 8), eps=1e-5)
    assert float((half.grad.double() - ref_dx).abs().max()) < 2e-3
    assert float((w.grad.double() - ref_dw).abs().max() / ref_dw.abs().max()) < 2e-3
    with npu, pytest.raises(RuntimeError, match="normalized_shape"):
        npu.call(F.rms_norm, (x, (5,)), {})


def _rms_mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.RMSNorm(32), nn.Linear(32, 4))


def test_a_scripts_rms_norm_is_dumped_as_one_fused_call_and_compares_clean(tmp_path):
    """nn.RMSNorm in a script: the NPU run records Functional.rms_norm's forward and backward
    as one call fused by RmsNormFusionPass (fusion_result.json), the golden is the script
    bit for bit, and ac -c calls the clean run sound (exit 0). With the pass switched off
    the call runs as the ops torch takes it into: no pass recorded for it."""
    root = str(tmp_path)
    plain = _train(_rms_mlp)
    assert _train(_rms_mlp, root, "golden")[0] == plain[0]
    _train(_rms_mlp, root, "npu", precision_mode="allow_mix_precision")
    ws = Workspace(root)
    npu = ws.run("npu")
    assert ws.fusion_result(npu)["RmsNormFusionPass"] == ["Functional.rms_norm.0.forward"]
    names = set(ws.index(npu, 0).op_name)
    assert {"Functional.rms_norm.0.forward", "Functional.rms_norm.0.backward"} <= names
    out = CliRunner().invoke(cli, ["--data-dir", root, "ac", "-c"])
    assert out.exit_code == 0 and "precision looks sound" in out.output, out.output
    off = {"Switch": {"GraphFusion": {"RmsNormFusionPass": "off"}, "UBFusion": {}}}
    _train(_rms_mlp, root, "npu", precision_mode="allow_mix_precision", fusion_switch=off)
    unfused = Workspace(root).runs("npu")[-1]
    assert "RmsNormFusionPass" not in unfused.info["fusion_passes"]
    assert "RmsNormFusionPass" not in Workspace(root).fusion_result(unfused)


class _RmsBlock(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.ff(self.norm(x))


def _rms_lm(root, target, **kw):
    """A Llama-like stack (nn.RMSNorm before each feed-forward, residuals, a final norm)
    whose embedding is 400x too large, two AdamW steps under the debugger."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), _RmsBlock(), _RmsBlock(), nn.RMSNorm(32),
                          nn.Linear(32, 50))
    with torch.no_grad():
        model[0].weight.mul_(400)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    debugger = PrecisionDebugger(root, target=target, dump_step="all", **kw)
    _steps(model, lambda: F.cross_entropy(model(ids).reshape(-1, 50),
                                          ids.roll(-1, 1).reshape(-1)), opt, debugger, 2)


def test_unfused_rms_norm_overflows_and_its_zeros_are_a_finding(tmp_path):
    """The residual stream 400x too large under force_fp16: the fused RMS norm keeps its
    squares in float32 and the run is sound (exit 0); with the pass off the squares
    overflow fp16, every norm's output is zero and the logits are far off, while the loss
    at the start and every weight (an AdamW step beside the weight) still match. The
    updates take steps that differ: an effect, so the first norm is the origin (exit 1),
    not a divergence every reader absorbs."""
    for name, switch in (("fused", None), ("unfused", "off")):
        root = str(tmp_path / name)
        _rms_lm(root, "golden")
        _rms_lm(root, "npu", precision_mode="force_fp16", overflow_mode="inf_nan",
                fusion_switch=switch)
        out = CliRunner().invoke(cli, ["--data-dir", root, "--json", "ac", "-c"])
        r = json.loads(out.stdout)
        if switch is None:
            assert out.exit_code == 0 and r["verdict"] == "sound", out.output
            continue
        assert out.exit_code == 1, out.output
        assert r["first_overflow"]["op_name"] == "Functional.rms_norm.0.forward"
        assert r["origin"]["op_name"] == "Functional.rms_norm.0.forward"


def test_a_switch_turns_one_pass_off_and_bad_switches_are_refused(tmp_path):
    switch = {"Switch": {"GraphFusion": {"SoftmaxFusionPass": "off"}}}
    x = torch.tensor([[12.0, 0.0, -1.0]])
    out, npu = _on_npu(lambda t: F.gelu(torch.softmax(t, -1)), x, mode="force_fp16",
                       overflow="inf_nan", fusion=switch)
    assert torch.isfinite(out).all() and npu.fired == {"GeluFusionPass"}
    with pytest.raises(TorchFrontEndError, match="unknown GraphFusion pass"):
        PrecisionDebugger(str(tmp_path), fusion_switch={"Switch": {"GraphFusion": {"Nope": "off"}}})
    with pytest.raises(TorchFrontEndError, match="setting of the simulated NPU"):
        PrecisionDebugger(str(tmp_path), target="golden", fusion_switch="off")
    bad = tmp_path / "switch.cfg"
    bad.write_text("{not json")
    out = _torch_run(tmp_path, "--fusion-switch", str(bad), "--", "python", "train.py")
    assert out.returncode == 2 and "fusion switch" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    torch.nn.init.kaiming_uniform_(m[0].weight)     # made in step 0: its memory is not read
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    x = torch.randn(8, 16); y = torch.randint(0, 4, (8,))
    for i in range(int(sys.argv[1])):
        loss = F.cross_entropy(m(x), y); loss.backward()
        if i == int(sys.argv[2]):
            raise RuntimeError("planted failure")      # in the middle of step i
        opt.step(); opt.zero_grad()
    print(repr(loss.item()))
""")


def _torch_run(root, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRECISION_TOOL_")}
    return subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir", str(root),
                           "torch-run", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def _dumped_script(tmp_path, text: str, name: str):
    """The script `text` as tmp_path/name, run by torch-run on both targets with every step
    dumped into tmp_path/ws: (the script's path, the workspace)."""
    script = tmp_path / name
    script.write_text(text)
    ws_dir = tmp_path / "ws"
    done = _torch_run(ws_dir, "--dump-step", "all", "--", str(script))
    assert done.returncode == 0, done.stderr
    return script, ws_dir


def test_torch_run_dumps_an_unchanged_script_on_both_targets(tmp_path):
    """torch-run -- python train.py: golden then NPU with the same seed, one step per
    optimizer step; the golden's loss is the script's own, run plainly with the same seed."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = _torch_run(tmp_path / "ws", "--dump-step", "all", "--", "python", str(script), "3", "-1")
    assert done.returncode == 0, done.stderr
    plain = subprocess.run([sys.executable, "-c", "import random, numpy, torch, runpy, sys; "
                            "random.seed(0); numpy.random.seed(0); torch.manual_seed(0); "
                            f"sys.argv = [{str(script)!r}, '3', '-1']; "
                            f"runpy.run_path({str(script)!r}, run_name='__main__')"],
                           capture_output=True, text=True)
    golden_loss = done.stdout.split()[0]
    assert golden_loss == plain.stdout.strip()
    ws = Workspace(str(tmp_path / "ws"))
    assert ws.run("cpu").complete_steps == ws.run("npu").complete_steps == [0, 1, 2]
    # one history row per optimizer step (the final loss.item() is no step), with the loss
    # backward() ran from: the script's own last loss
    history = ws.step_history(ws.run("cpu"))
    assert list(history.step) == [0, 1, 2]
    assert repr(float(history.loss.iloc[-1])) == golden_loss
    # an initialiser reads nothing of the memory it fills (it may hold anything, nan too)
    index = ws.index(ws.run("cpu"), 0)
    inits = index[index.op_name.str.contains("kaiming_uniform_")]
    assert len(inits) >= 3 and set(inits.io) == {"output"}
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "ac", "-c"])
    assert out.exit_code == 0, out.output


INFERENCE = textwrap.dedent("""
    import torch, torch.nn as nn
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    model.eval()
    with torch.no_grad():
        for batch in range(3):
            print(model(torch.randn(4, 16)).argmax(-1).tolist())
""")


def test_a_script_that_never_steps_has_a_step_per_forward(tmp_path):
    """A script that calls no optimizer and no backward (an evaluation): each forward of its
    model is a step, on both targets, and ac -c reads them."""
    script = tmp_path / "eval.py"
    script.write_text(INFERENCE)
    done = _torch_run(tmp_path / "ws", "--dump-step", "all", "--", str(script))
    assert done.returncode == 0, done.stderr
    ws = Workspace(str(tmp_path / "ws"))
    assert ws.run("cpu").complete_steps == ws.run("npu").complete_steps == [0, 1, 2]
    for step in (0, 1, 2):          # one forward each: one call of each layer
        names = set(ws.index(ws.run("npu"), step).op_name)
        assert {"Functional.linear.0.forward", "Functional.linear.1.forward"} <= names
        assert "Functional.linear.2.forward" not in names
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "ac", "-c"])
    assert out.exit_code == 0, out.output


def test_a_script_that_raises_keeps_its_dumped_steps(tmp_path):
    """The script's traceback and exit code pass through; the steps before the failure are
    on disk, the one it was in is not, and run.json says so."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = _torch_run(tmp_path / "ws", "--target", "golden", "--dump-step", "all", "--",
                      str(script), "5", "2")
    assert done.returncode == 1
    assert "RuntimeError: planted failure" in done.stderr
    assert "the script exited with status 1 on the golden; kept: cpu/debug_0 (step(s) 0, 1 " \
        "complete; it ended in step 2, not dumped)" in done.stderr
    run = Workspace(str(tmp_path / "ws")).run("cpu")
    assert run.complete_steps == [0, 1]
    assert run.info["script_failed"]["step"] == 2
    assert "planted failure" in run.info["script_failed"]["error"]
    # every command reading the run says so
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "ni", "-r",
                                   "cpu/debug_0", "Functional.linear.0.forward"])
    assert "the script ended in step 2 (RuntimeError: planted failure)" in out.stderr
    # a script a signal kills says nothing itself: the runner records it
    killed = tmp_path / "killed.py"
    killed.write_text(SCRIPT.replace('raise RuntimeError("planted failure")',
                                     'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'))
    done = _torch_run(tmp_path / "ws", "--target", "golden", "--dump-step", "all", "--",
                      str(killed), "5", "3")
    # exit statuses are 8 bits: a signal's death is the shell's 128 + 9, not -9 (247)
    assert done.returncode == 137
    assert "the script was killed by SIGKILL (status -9)" in done.stderr
    # a step is written while the next one runs: the kill may catch step 2 being written,
    # and what is said is then what is on disk
    run = Workspace(str(tmp_path / "ws")).runs("cpu")[-1]
    if run.complete_steps == [0, 1, 2]:
        assert "(step(s) 0, 1, 2 complete; it ended in step 3, not dumped)" in done.stderr
        assert run.ended_early.endswith("not dumped, the steps before it are")
    else:
        assert run.complete_steps == [0, 1] and len(run.partials) == 1
        assert "(step(s) 0, 1 complete; step(s) 2 partial; it ended in step 3, not dumped)" \
            in done.stderr
        # what the commands warn says so too
        assert run.ended_early.endswith("the steps before it are but 2, cut off while written")
    assert run.info["script_failed"] == {"step": 3, "error": "killed by SIGKILL"}
    # killed on the NPU, which --golden-skips-as-npu runs first: the golden is not run
    done = _torch_run(tmp_path / "mirrored", "--golden-skips-as-npu", "--dump-step", "all",
                      "--", str(killed), "5", "3")
    assert done.returncode == 137
    assert "on the npu; kept: npu/debug_0" in done.stderr and \
        "; not run on the golden" in done.stderr
    assert not Workspace(str(tmp_path / "mirrored")).runs("cpu")


SCALED = textwrap.dedent("""
    import torch, torch.nn as nn, torch.nn.functional as F
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=2)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for step in range(6):
        loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
""")


@pytest.mark.parametrize("overflow", ["inf_nan", "saturation"])
def test_gradscalers_decisions_are_the_step_history(tmp_path, overflow):
    """A script under torch.amp.GradScaler, started at 2**20 (beyond fp16): on the NPU each
    step's scaled loss overflows and the scaler halves the scale and skips the step, until
    it fits. In saturation mode no inf reaches the gradients: the scaler finds the overflow
    in the step's status word, as torch_npu's reads the device's flag. The history holds
    every decision (scale, next scale, finite), one row per iteration, skipped or not, and
    the loss before scaling; ac -c compares the skipped step whole (the update the NPU
    skipped is no gap) and says to start the scaler lower."""
    script = tmp_path / "train.py"
    script.write_text(SCALED)
    done = _torch_run(tmp_path / "ws", "--precision-mode", "force_fp16", "--overflow-mode",
                      overflow, "--", str(script))
    assert done.returncode == 0, done.stderr
    ws = Workspace(str(tmp_path / "ws"))
    npu, cpu = ws.step_history(ws.run("npu")), ws.step_history(ws.run("cpu"))
    assert list(npu.step) == list(cpu.step) == list(range(6))
    assert list(npu.loss_scale) == [2.0 ** (20 - k) for k in range(6)]
    assert list(npu.next_loss_scale) == [2.0 ** (19 - k) for k in range(5)] + [2.0 ** 15]
    assert list(npu.finite) == [0, 0, 0, 0, 0, 1]
    assert list(cpu.finite) == [1] * 6 and list(cpu.loss_scale[:3]) == [2.0 ** 20] * 2 + [2.0 ** 21]
    # the loss before scaling: the golden's first, within fp16's rounding on the NPU
    assert abs(npu.loss.iloc[0] - cpu.loss.iloc[0]) < 1e-2 * cpu.loss.iloc[0]
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "--json", "ac", "-c"])
    assert out.exit_code == 1, out.output
    result = json.loads(out.stdout)
    assert result["coverage"]["tensors"] == result["coverage"]["compared"]
    assert "torch.amp.GradScaler(init_scale=2**15) or less" in " ".join(result["advice"])


MASKED_LOG = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
m = nn.Linear(8, 8)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
distance = torch.arange(8.0)
for step in range(3):
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        # a log-spaced bucket per distance, as T5's relative positions: log(0), masked
        bucket = torch.where(distance > 0, torch.log(distance), torch.zeros(8))
        h = m(x)
        if h.dtype != m.weight.dtype:       # T5's own cast: where autocast made h fp16
            h = h.to(m.weight.dtype)
        loss = F.mse_loss(h * (1 + bucket), torch.ones(4, 8)) * 0.01
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


ROUTED = """
import torch, torch.nn as nn
torch.manual_seed(0)
gate = nn.Linear(4, 3, bias=False)
with torch.no_grad():
    gate.weight.copy_(torch.tensor([[1.0, 5.0, 0, 0], [1.002, 0, 0, 0], [1.001, 4.0, 0, 0]]))
experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
opt = torch.optim.SGD(list(experts.parameters()), lr=0.1)
x = torch.zeros(6, 4)
x[:3, 0] = 1          # near-tied between the three experts: float32 picks 1 and 2
x[3:, 1] = 1          # clearly experts 0 and 2
for step in range(2):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        top, idx = gate(x).softmax(-1).topk(2, -1)
        out = torch.zeros(6, 4)
        for k, expert in enumerate(experts):
            rows = (idx == k).any(-1).nonzero().squeeze(1)
            out = out.index_add(0, rows, expert(x[rows]).float())
        loss = out.pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_routing_flipped_by_low_precision_is_named_where_the_runs_part(tmp_path):
    """A mixture of experts whose gate, in bf16, ties three experts that float32 tells
    apart: the top-k sends rows to another expert, and every tensor after it has another
    shape. ac -c names the top-k's indices as where the runs part (the first integer
    tensor that differs, before any shape does), in each step, and gives no clean verdict
    without sending the user to dump the step again (no file is missing)."""
    script = tmp_path / "route.py"
    script.write_text(ROUTED)
    done = _torch_run(tmp_path / "ws", "--dump-step", "all", "--", str(script))
    assert done.returncode == 0, done.stderr
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "--json", "ac", "-c"])
    assert out.exit_code == 2, out.output
    result = json.loads(out.stdout)
    parted = result["steps"][0]["parted"]
    assert {k: parted[k] for k in ("tensor", "dtype", "max_diff")} == \
        {"tensor": "Tensor.topk.0.forward:output:1", "dtype": "int64", "max_diff": 1.0}
    assert parted["source"].startswith(f"{script}:14 ")     # the script's top-k line
    advice = " ".join(result["advice"])
    assert "the runs take different paths: Tensor.topk.0.forward:output:1 (int64, " \
        f"{script}:14 " in advice
    assert "dump the step again" not in advice


def test_where_the_runs_part_is_the_first_discrete_tensor_before_a_shape_differs():
    """first_parting's edges: no shape differs (None); an integer or boolean tensor that
    differs after the first shape mismatch is not it (None); a float tensor is never it;
    a boolean mask is."""
    from precision_tool.analysis.comparing.result import first_parting
    shape = "shape mismatch: npu [3] vs golden [4]"

    def table(rows):
        return pd.DataFrame(rows, columns=["TensorIndex", "NpuDataType", "MaxAbsoluteError",
                                           "CompareFailReason"])
    assert first_parting(table([("a:0", "int64", 1.0, "")])) is None
    assert first_parting(table([("a:0", "float32", 2.0, ""), ("b:0", "int64", None, shape),
                                ("c:0", "int64", 1.0, "")])) is None
    assert first_parting(table([("a:0", "int32", 0.0, ""), ("m:0", "bool", 1.0, ""),
                                ("b:0", "int64", None, shape)])) == \
        {"tensor": "m:0", "dtype": "bool", "max_diff": 1.0}


@pytest.mark.parametrize("overflow", ["saturation", "inf_nan"])
def test_an_inf_the_script_makes_skips_steps_only_where_the_scaler_reads_the_flag(tmp_path,
                                                                                  overflow):
    """A script that takes log(0) and masks it (T5's relative position buckets) under
    autocast fp16 and GradScaler. The -inf is the golden's too; on the device it sets the
    status word. In saturation mode torch_npu's scaler reads that flag: every update is
    skipped, and ac -c says so, names the value as the script's, and advises inf_nan mode,
    offering no fix (kept in fp32 the log still makes it). In inf_nan mode the scaler
    checks the gradients, as torch's does, and skips nothing: the run is sound. Both
    compares are complete: the flag the NPU's check raises keeps the check's name, and
    the cast the script makes on the NPU only (`h.to(m.weight.dtype)`, h being fp16 there)
    stands for what it casts, forward and backward."""
    script = tmp_path / "t5_like.py"
    script.write_text(MASKED_LOG)
    done = _torch_run(tmp_path / "ws", "--overflow-mode", overflow, "--dump-step", "all",
                      "--", str(script))
    assert done.returncode == 0, done.stderr
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "--json", "ac", "-c"])
    result = json.loads(out.stdout)
    assert result["coverage"]["tensors"] == result["coverage"]["compared"], result["coverage"]
    assert result["first_overflow"]["op_name"] == "Torch.log.0.forward"
    advice = " ".join(result["advice"])
    if overflow == "inf_nan":
        assert out.exit_code == 0, out.output
        assert result["loss_scale"]["skipped_steps"] == []
        return
    assert out.exit_code == 1, out.output
    assert result["loss_scale"]["skipped_steps"] == [0, 1, 2]
    assert "The script makes that value itself" in advice
    assert "skipped the update of 3 of 3 observed step(s)" in advice
    assert "torch-run --overflow-mode inf_nan" in advice
    assert "fix -s" not in advice and "Keep Torch.log in fp32" not in advice
    assert "decide nothing" not in advice and "not the NPU" not in advice
    # asked anyway, fix reruns nothing and says why
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "ws"), "--json", "fix"])
    assert out.exit_code == 1, out.output
    repair = json.loads(out.stdout)
    assert repair["trials"] == [] and repair["fix"] is None
    assert any("is a value the script makes itself" in n and "made no rerun" in n and
               "--overflow-mode inf_nan" in n for n in repair["notes"]), repair["notes"]


def test_the_scalers_unscale_reads_the_status_word_only_while_started_on_the_npu(tmp_path):
    """GradScaler's unscale is wrapped on the simulated NPU while the debugger runs, and
    given back at stop(); the golden leaves the scaler as it is."""
    own = torch.amp.GradScaler._unscale_grads_
    npu = PrecisionDebugger(str(tmp_path / "n"), target="npu")
    npu.start()
    try:
        assert torch.amp.GradScaler._unscale_grads_ is not own
    finally:
        npu.stop()
    assert torch.amp.GradScaler._unscale_grads_ is own
    golden = PrecisionDebugger(str(tmp_path / "g"), target="golden")
    golden.start()
    try:
        assert torch.amp.GradScaler._unscale_grads_ is own
    finally:
        golden.stop()


PLANTED = textwrap.dedent("""
    import torch, torch.nn as nn, torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self, d=16, classes=4):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
            self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, classes)

        def forward(self, x):
            q, k, v = self.q(x), self.k(x), self.v(x)
            s = torch.matmul(q, k.transpose(-1, -2))        # unscaled: q.k passes fp16's range
            h = self.norm(F.gelu(torch.softmax(s, -1) @ v + x))
            return self.out(h).mean(1)

    model = Attention()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = 300 * torch.randn(2, 6, 16), torch.randint(0, 4, (2,))
    for step in range(4):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
""")


def test_fix_reruns_the_script_and_its_fix_makes_a_fresh_run_match(tmp_path):
    """A planted cause (attention scores unscaled, under force_fp16 with inf/nan
    overflow): ac -c names the matmul and offers fix; fix reruns the script keeping the
    calls the finding names in fp32, finds the fewest that pass (the matmul, the
    softmax that reads its scores and the fused layer norm after them) over every step of the script, keeps the fixed run and
    deletes the other reruns, and writes config/fix.json. torch-run --fix applies it to a
    fresh run, which ac -c calls sound."""
    script = tmp_path / "attn.py"
    script.write_text(PLANTED)
    ws_dir = tmp_path / "ws"
    done = _torch_run(ws_dir, "--precision-mode", "force_fp16", "--overflow-mode", "inf_nan",
                      "--dump-step", "all", "--", str(script))
    assert done.returncode == 0, done.stderr
    out = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "--json", "ac", "-c"])
    assert out.exit_code == 1
    advice = " ".join(json.loads(out.stdout)["advice"])
    assert "torch-run --keep-fp32 Torch.matmul" in advice and "precision-tool fix -s 0" in advice
    fixed = subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir", str(ws_dir),
                            "--json", "fix", "-b", "16"], capture_output=True, text=True,
                           timeout=900)
    assert fixed.returncode == 0, fixed.stderr
    result = json.loads(fixed.stdout)
    # the matmul and the softmax that reads its scores; under force_fp16 the fused layer
    # norm after them too (its one-pass variance in fp16 squares the residual's values)
    kept = result["config"]["keep_fp32"]
    assert result["config"]["precision_mode"] == "force_fp16"
    assert kept == ["Torch.matmul", "Torch.softmax", "Functional.layer_norm"]
    assert result["minimal"] and result["verified"]
    # every rerun that kept them all passed, every one without one of them failed
    assert all(t["passed"] == (set(kept) <= set(t["keep_fp32"])) for t in result["trials"])
    runs = [r.label for r in Workspace(str(ws_dir)).runs("npu")]
    assert runs == ["npu/debug_0", result["fix"]["run"]]        # the other reruns are gone
    fix_file = ws_dir / "config" / "fix.json"
    assert json.loads(fix_file.read_text())["front_end"] == "pytorch"
    again = _torch_run(ws_dir, "--target", "npu", "--fix", str(fix_file), "--dump-step", "all",
                       "--", str(script))
    assert again.returncode == 0, again.stderr
    fresh = [r.label for r in Workspace(str(ws_dir)).runs("npu")][-1]
    assert Workspace(str(ws_dir)).run("npu", fresh.split("/")[1]).info["keep_fp32"] == kept
    out = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "ac", "-c", "-lt", fresh])
    assert out.exit_code == 0, out.output
    # a graph run's fix is not a script's: refused in one line
    graph_fix = tmp_path / "graph_fix.json"
    graph_fix.write_text(json.dumps({"config": {"precision_mode": "allow_mix_precision",
                                                "modify_mixlist": {"black-list": {}}}}))
    refused = _torch_run(ws_dir, "--fix", str(graph_fix), "--", str(script))
    assert refused.returncode == 2 and "a graph run's fix" in refused.stderr
    assert "Traceback" not in refused.stderr


class _Planted(nn.Module):
    """An MLP with two faults check can see in a script's dumps: a weight initialised to
    zero and a parameter no loss depends on (its gradient is zero)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.gate = nn.Parameter(torch.ones(4))
        with torch.no_grad():
            self.fc2.weight.zero_()

    def forward(self, x):
        return (self.fc2(torch.relu(self.fc1(x))) + 0 * self.gate).mean(1)


def test_check_reads_a_scripts_dumped_steps(tmp_path):
    """check on a script's runs (no bundle to replay): a healthy MLP gets only the advice to
    scale its fp16 gradients (exit 0) and says which checks a script cannot have; planted
    faults are each named from the dumped steps: inputs beyond fp16, a zero weight, the
    parameters that never change, golden values beyond 65504 in a call the NPU computes in
    fp16 (exit 1)."""
    healthy = tmp_path / "healthy"
    for target in ("golden", "npu"):
        _train(_mlp, str(healthy), target, steps=3)
    out = CliRunner().invoke(cli, ["--data-dir", str(healthy), "--json", "check"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["run"] == "npu/debug_0" and report["golden_steps"] == 3
    assert [f["check"] for f in report["findings"]] == ["hyperparameter.loss_scale"]
    assert "determinism" in report["notes"][0] and "data.nonfinite" in report["checks"]
    planted = tmp_path / "planted"
    for target in ("golden", "npu"):
        _train(_Planted, str(planted), target, steps=2, scale=5e4)
    out = CliRunner().invoke(cli, ["--data-dir", str(planted), "--json", "check"])
    assert out.exit_code == 1, out.output
    findings = json.loads(out.stdout)["findings"]
    found = {(f["check"], f["severity"]): f for f in findings}
    assert "reaches" in found["data.fp16_range", "error"]["message"]
    assert found["init.scale", "error"]["evidence"]["variable"] == "fc2.weight"
    # the gate, and fc1 behind the zero weight: no gradient reaches either
    assert {f["evidence"]["variable"] for f in findings if f["check"] == "graph.never_updated"} \
        == {"gate", "fc1.weight", "fc1.bias"}
    assert {f["evidence"]["op"] for f in findings if f["check"] == "graph.fp16_range"} == \
        {"Functional.linear.0.forward", "Torch.relu.0.forward"}
    # a golden run checked: the NPU run beside it says where fp16 is
    golden = CliRunner().invoke(cli, ["--data-dir", str(planted), "--json", "check", "-r",
                                      "cpu/debug_0"])
    assert golden.exit_code == 1 and json.loads(golden.stdout)["run"] == "cpu/debug_0"


def _data_in_step(root, nan=False, scale=1.0, dump_mode="tensor"):
    """A golden run whose data the step makes, as a script under torch-run does (its
    `torch.randn` at the top is a call of step 0): the batch, scaled, with a nan written
    into it by indexing (no call records it), a mask of 0 and -inf added to the logits and
    one of 0 and finfo.min to their sum."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 4, (8,), generator=g)

    def loss_of():
        x = torch.randn(8, 16, generator=g) * scale
        if nan:
            x[3, 5] = float("nan")
        mask = torch.zeros(8, 4)
        mask[:, 3] = float("-inf")
        lowest = torch.zeros(8, 4)
        lowest[:, 2] = torch.finfo(torch.float32).min
        return F.cross_entropy(model(x) + mask + lowest, y)
    _steps(model, loss_of, opt, PrecisionDebugger(root, target="golden", dump_step="all",
                                                  dump_mode=dump_mode), 2)


@pytest.mark.parametrize("dump_mode", ["tensor", "statistics"])
@pytest.mark.parametrize("planted", ["healthy", "nan", "scaled"])
def test_check_finds_the_data_a_step_makes(tmp_path, planted, dump_mode):
    """Data made inside the step is data all the same: the tensor the model reads beside its
    weights is the feed, whatever call made it; a nan written by indexing is seen (the
    name of what randn made ends with the write); the masks are not data. A statistics
    dump's feeds are checked by the index's numbers, masks told apart by them too."""
    _data_in_step(str(tmp_path), nan=planted == "nan", scale=1e5 if planted == "scaled" else 1,
                  dump_mode=dump_mode)
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "check", "-r",
                                   "cpu/debug_0"])
    findings = [(f["check"], f["severity"], f["evidence"].get("feed")) for f in
                json.loads(out.stdout)["findings"] if f["check"].startswith("data.")]
    if planted == "healthy":
        assert out.exit_code == 0 and findings == [], out.output
    elif planted == "nan":
        # the write ends randn's name: the linear reads an input from outside, as dumped
        assert out.exit_code == 1 and findings == [
            ("data.nonfinite", "error", "Functional.linear.0.forward.input:0")], out.output
    else:
        assert out.exit_code == 1 and findings == [
            ("data.fp16_range", "error",
             "Tensor.mul.0.forward:0 (read by Functional.linear.0.forward)")], out.output


@pytest.mark.parametrize("masked", ["other class", "target class"])
def test_infinities_both_runs_hold_decide_nothing_unless_they_reach_the_loss(tmp_path, masked):
    """A -inf mask on the logits is held by both runs and decides nothing; the same mask on
    the class every label names makes the loss inf in both runs: the training is broken
    (not the NPU), and ac -c says the golden's inf reaches the loss (exit 1), never
    "precision looks sound"."""
    column = 0 if masked == "target class" else 3
    for target in ("golden", "npu"):
        torch.manual_seed(0)
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 16, generator=g), torch.zeros(8, dtype=torch.long)
        mask = torch.zeros(8, 4)
        mask[:, column] = float("-inf")
        losses = _steps(model, lambda: F.cross_entropy(model(x) + mask, y), opt,
                        PrecisionDebugger(str(tmp_path), target=target, dump_step="all"), 2)
        assert np.isinf(losses).all() == (masked == "target class")
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c"])
    advice = " ".join(json.loads(out.stdout)["advice"])
    if masked == "target class":
        assert out.exit_code == 1, out.output
        assert "reaches Functional.cross_entropy.0.forward:0" in advice
        assert "looks sound" not in advice and "decide nothing" not in advice
    else:
        assert out.exit_code == 0, out.output
        assert "decide nothing" in advice and "reaches" not in advice


HALF_ADAM = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 16).half()
    y = torch.randint(0, 3, (64,))
    mask = torch.zeros(4, dtype=torch.bool)
    mask[3] = True                     # class 3 never occurs: masked out
    for step in range(2):
        logits = model(x).masked_fill(mask, float("-inf"))
        loss = F.cross_entropy(logits.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
""")


def test_a_half_model_under_adam_is_named_in_its_update_and_the_mask_decides_nothing(tmp_path):
    """A cause nobody planted: a model cast with .half() and trained by AdamW. Its second
    moment (grad**2 / 1000) flushes to zero in fp16, eps (1e-8) too, and the update divides
    by zero. The golden's -inf mask, which the NPU holds at -65504 (saturation), comes
    first in the step and is read by nothing that differs: it is no lead, and its rows
    pass. The origin is the moment's addcmul_; the advice never offers --keep-fp32 for a
    call in place (it computes in its tensor's dtype), nor scaling what feeds a moment
    up (it is kept in fp32), and fix, finding that even
    force_fp32 fails, says that the failing tensors are the script's own fp16."""
    _, ws_dir = _dumped_script(tmp_path, HALF_ADAM, "half_adam.py")
    out = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "--json", "ac", "-c"])
    assert out.exit_code == 1, out.output
    result = json.loads(out.stdout)
    assert result["origin"]["op_name"].startswith("Tensor.addcmul_.")
    advice = " ".join(result["advice"])
    assert "--keep-fp32 Tensor.addcmul_" not in advice
    assert "which --keep-fp32 does not change" in advice
    assert "scale what feeds them up" not in advice      # an optimizer's moment: kept, not scaled
    assert "decide nothing" in advice and "The golden run itself holds" not in advice
    ws = Workspace(str(ws_dir))
    table = vector_compare(ws, ws.run("npu"), ws.run("cpu"), 0)
    fill = table[table.TensorIndex == "Tensor.masked_fill.0.forward:output:0"]
    assert (fill.GoldenInfCount == 64).all() and (fill.NpuAtFp16Max == 64).all()
    assert set(evaluate(fill).verdicts) == {"pass"}
    fixed = subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir", str(ws_dir),
                            "--json", "fix", "-b", "3"], capture_output=True, text=True,
                           timeout=900)
    assert fixed.returncode == 1, fixed.stderr
    notes = " ".join(json.loads(fixed.stdout)["notes"])
    assert "the script's own dtype" in notes and "fp32 master weights" in notes


# the planted script with its scores scaled before the product and smaller inputs: q.k
# fits fp16, but the scores still pass ln(65504)
FUSED_SOFTMAX = PLANTED.replace("q, k, v = self.q(x), ", "q, k, v = self.q(x) / 4.0, ") \
    .replace("300 * torch.randn", "30 * torch.randn")


def test_fo_reruns_a_script_with_fusion_off_and_names_the_pass(tmp_path):
    """Scaled attention scores over large inputs, force_fp16 with inf/nan: the scores fit
    fp16 but pass ln(65504), so the fused softmax (no max subtraction in fp16) overflows.
    The run records which calls each pass fused (fusion_result.json, the index's pass);
    fo reruns the script with fusion off and bisects to SoftmaxFusionPass (exit 1), keeping
    only the fusion-off rerun; fix finds that pass off is enough, and with it switched off
    in a fresh run (by hand, or by fix's config) nothing overflows."""
    assert "self.q(x) / 4.0" in FUSED_SOFTMAX and "= 30 * torch.randn" in FUSED_SOFTMAX
    script = tmp_path / "attn.py"
    script.write_text(FUSED_SOFTMAX)
    ws_dir = tmp_path / "ws"
    done = _torch_run(ws_dir, "--precision-mode", "force_fp16", "--overflow-mode", "inf_nan",
                      "--", str(script))
    assert done.returncode == 0, done.stderr
    ws = Workspace(str(ws_dir))
    npu = ws.run("npu")
    fired = ws.fusion_result(npu)
    assert fired["SoftmaxFusionPass"] == ["Torch.softmax.0.forward"]
    assert fired["MatMulBiasAddFusionPass"] == [f"Functional.linear.{k}.forward" for k in range(4)]
    t = ws.index(npu, 0)
    assert set(t[t.op_name == "Torch.softmax.0.forward"].pass_name) == {"SoftmaxFusionPass"}
    # ac names the fused kernel's pass and offers to switch it off
    out = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "--json", "ac"])
    result = json.loads(out.stdout)
    assert result["first_overflow"]["op_name"] == "Torch.softmax.0.forward"
    assert result["first_overflow"]["pass_name"] == "SoftmaxFusionPass"
    assert "SoftmaxFusionPass off in fusion_switch.cfg (torch-run --fusion-switch" in \
        " ".join(result["advice"])
    out = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "--json", "fo"])
    assert out.exit_code == 1, out.output
    verdict = json.loads(out.stdout)
    assert verdict["fusion_to_blame"] and verdict["culprits"] == ["SoftmaxFusionPass"]
    assert verdict["fused_nodes"] == {"SoftmaxFusionPass": ["Torch.softmax.0.forward"]}
    runs = [r.label for r in Workspace(str(ws_dir)).runs("npu")]
    assert runs == ["npu/debug_0", f"npu/{verdict['kept'][0]}"]      # the others deleted
    unfused = Workspace(str(ws_dir)).run("npu", verdict["kept"][0])
    assert unfused.info["fusion_passes"] == [] and ws.fusion_result(unfused) == {}
    # a rerun is a replay of the run: commands still take the original by default
    assert unfused.info["replay_of"] == "npu/debug_0"
    assert Workspace(str(ws_dir)).run("npu").label == "npu/debug_0"
    # fix tries the pass off before any call in fp32, and that alone is the fix
    fixed = subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir", str(ws_dir),
                            "--json", "fix", "-lt", "npu/debug_0"], capture_output=True,
                           text=True, timeout=900)
    assert fixed.returncode == 0, fixed.stderr
    result = json.loads(fixed.stdout)
    assert result["candidates"][0] == "fusion:SoftmaxFusionPass"
    assert result["config"]["keep_fp32"] == [] and \
        result["config"]["fusion_off"] == ["SoftmaxFusionPass"] and result["minimal"]
    switch = tmp_path / "switch.cfg"
    switch.write_text(json.dumps({"Switch": {"GraphFusion": {"SoftmaxFusionPass": "off"}}}))
    for how in (["--fusion-switch", str(switch)], ["--fix", str(ws_dir / "config" / "fix.json")]):
        again = _torch_run(ws_dir, "--target", "npu", "--precision-mode", "force_fp16",
                           "--overflow-mode", "inf_nan", *how, "--", str(script))
        assert again.returncode == 0, again.stderr
        fresh = Workspace(str(ws_dir)).runs("npu")[-1]
        assert "SoftmaxFusionPass" not in fresh.info["fusion_passes"]
        assert "GeluFusionPass" in fresh.info["fusion_passes"]
        assert (Workspace(str(ws_dir)).step_history(fresh).status == 0).all()


def test_fix_says_when_its_rerun_ends_before_the_step_it_repairs(tmp_path):
    """The planted script reading its step count from the environment, run for 4 steps and
    repaired at step 3 where the environment asks for 2: the rerun exits 0 without step 3.
    fix says how far it got beside the run it reran and what to check (exit 2), and leaves
    no rerun behind; before, it said only that the rerun had no dump of step 3."""
    script = tmp_path / "attn.py"
    script.write_text("import os\n" + PLANTED.replace(
        "range(4)", "range(int(os.environ['STEPS']))"))
    ws_dir = tmp_path / "ws"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRECISION_TOOL_")}
    done = subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir", str(ws_dir),
                           "torch-run", "--precision-mode", "force_fp16", "--overflow-mode",
                           "inf_nan", "--dump-step", "3", "--", str(script)],
                          capture_output=True, text=True, env=dict(env, STEPS="4"), timeout=600)
    assert done.returncode == 0, done.stderr
    fixed = subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir", str(ws_dir),
                            "fix", "-s", "3"], capture_output=True, text=True,
                           env=dict(env, STEPS="2"), timeout=600)
    assert fixed.returncode == 2, fixed.stdout + fixed.stderr
    said = fixed.stdout + fixed.stderr
    assert "the rerun ended after step 1, before step 3 (the run it reran went to step 3)" \
        in said and "from the environment" in said and "Traceback" not in said
    assert [r.label for r in Workspace(str(ws_dir)).runs("npu")] == ["npu/debug_0"]


def test_fix_says_why_it_cannot_rerun_a_script_it_did_not_start(tmp_path):
    """A run the debugger made inside a script (no torch-run) names no script to rerun:
    fix and fo say so and how, exit 2."""
    for target in ("golden", "npu"):
        _train(lambda: Attention(scaled=False), str(tmp_path), target, steps=1, scale=100.0,
               optimizer="sgd", precision_mode="force_fp16", overflow_mode="inf_nan")
    for command in ("fix", "fo"):
        out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), command])
        assert out.exit_code == 2, out.output
        assert "was not made by torch-run" in out.output and \
            "precision-tool torch-run" in out.output
        assert len(out.output.strip().splitlines()) <= 2 and "Traceback" not in out.output


NANOGPT = os.path.join(os.path.dirname(__file__), "..", "examples", "nanogpt.py")


def _nanogpt(root, mode, *plant, overflow="inf_nan", dump_mode="tensor"):
    """examples/nanogpt.py (a plain PyTorch nanoGPT on real text, GradScaler) under
    torch-run, every step dumped on both targets; ac -c's JSON and exit code."""
    done = _torch_run(root, "--precision-mode", mode, "--overflow-mode", overflow,
                      "--dump-step", "all", "--dump-mode", dump_mode, "--", NANOGPT, *plant)
    assert done.returncode == 0, done.stderr
    out = CliRunner().invoke(cli, ["--data-dir", str(root), "--json", "ac", "-c"])
    return json.loads(out.stdout), out.exit_code


@pytest.mark.parametrize("overflow,dump_mode", [("saturation", "tensor"), ("inf_nan", "tensor"),
                                                ("saturation", "statistics")])
def test_a_nanogpt_script_trained_healthy_is_called_sound(tmp_path, overflow, dump_mode):
    """The nanoGPT script as written, as the README runs it: four steps, every one dumped,
    ac -c says sound (exit 0). The attention mask's -inf (which the NPU holds as -inf, or
    saturating as -65504) is said to decide nothing, not blamed on the data: in a
    statistics dump too, where no element count says how many -65504s there are."""
    result, code = _nanogpt(tmp_path, "allow_mix_precision", overflow=overflow,
                            dump_mode=dump_mode)
    assert code == 0 and result["verdict"] == "sound", result["advice"]
    advice = " ".join(result["advice"])
    assert "a mask's -inf" in advice and "the data or the model" not in advice


@pytest.mark.parametrize("spread", [False, True])
def test_a_golden_inf_after_the_mask_is_named_not_the_mask(tmp_path, spread):
    """A healthy nanoGPT step (statistics, saturation), its golden index then given 3 +inf
    in the first GELU's output (and, spread, in what the next linear makes of it). The
    mask's -inf comes first in execution order, but the NPU holds it too and the softmax
    reading it comes out finite: no effect. The GELU's inf is the one the advice names."""
    import csv
    _nanogpt(tmp_path, "allow_mix_precision", "--steps", "1", overflow="saturation",
             dump_mode="statistics")
    index = tmp_path / "cpu" / "debug_0" / "dump" / "0" / "index.csv"
    with open(index, newline="") as f:
        rows = list(csv.reader(f))
    head = rows[0]
    edited = {"Functional.gelu.0.forward:0"} | ({"Functional.linear.3.forward:0"} if spread
                                                 else set())
    for row in rows[1:]:
        if row[head.index("tensor")] in edited:
            row[head.index("pos_inf_count")] = "3"
    with open(index, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c"])
    result = json.loads(out.stdout)
    assert result["golden_nonfinite"]["golden_tensor"] == "Functional.gelu.0.forward:0"
    advice = " ".join(result["advice"])
    assert "the first Functional.gelu.0.forward:0 (3 element(s))" in advice, advice
    assert "masked_fill" not in advice

def test_a_backward_overflow_under_a_huge_loss_scale_is_put_to_the_loss_scale(tmp_path):
    """A cause nobody planted: GradScaler started at 2**24 under saturation mode. The scaled
    backward overflows in fp16 (a linear's backward first); the advice for a script's
    backward call (named .backward, not under gradients/) leads with the loss scale. Steps
    0-6 are skipped while GradScaler halves the scale, step 7 runs clean at 2**17, and step
    8 overflows again: the advice starts the script's scaler at 2**16, where the run held
    from there on, a scale the run proved, not one guessed from a peak that saturation
    clipped (two steps, none clean: the guess is all there is). fix makes no rerun: the
    scaler is the script's, and calls kept in fp32 would only hide the overflow (it made
    two reruns that could not match, then "No fix found")."""
    result, code = _nanogpt(tmp_path, "allow_mix_precision", "--steps", "12", "--init-scale",
                            str(2.0 ** 24), overflow="saturation", dump_mode="statistics")
    assert code == 1
    assert result["first_overflow"]["op_name"].endswith(".backward")
    advice = " ".join(result["advice"])
    assert "It is in the backward pass, and the loss scale starts too high: step(s) 0-6 " \
        "overflowed and skipped their update while the dynamic manager brought the scale " \
        "down from 16777216 to 131072, where step 7 ran without overflow; step(s) 8 " \
        "overflowed again, and from there the scale is 65536, which the steps after held. " \
        "Start the script's scaler there and no step is lost " \
        "(torch.amp.GradScaler(init_scale=65536); not verified)." in advice, advice
    assert "precision-tool fix" not in advice and "--keep-fp32" not in advice
    fixed = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "fix"])
    assert fixed.exit_code == 1, fixed.output
    f = json.loads(fixed.stdout)
    assert f["trials"] == [] and not f["verified"]
    assert any("GradScaler(init_scale=65536)" in n and "it made no rerun" in n
               for n in f["notes"]), f["notes"]
    short, code = _nanogpt(tmp_path / "short", "allow_mix_precision", "--steps", "2",
                           "--init-scale", str(2.0 ** 24), overflow="saturation",
                           dump_mode="statistics")
    assert code == 1
    assert "It is in the backward pass under loss scaling: lower the loss scale to" in \
        " ".join(short["advice"])


SPIKE = """
import sys, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu", init_scale=float(sys.argv[2]))
g = torch.Generator().manual_seed(1)
x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
for step in range(int(sys.argv[1])):
    loss = F.cross_entropy(model(x), y) * (float(sys.argv[3]) if step == 2 else 1.0)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
"""


@pytest.mark.parametrize("steps,mirrored", [(3, False), (6, False), (6, True)])
def test_a_loss_scale_backing_off_once_is_no_finding(tmp_path, steps, mirrored):
    """A cause nobody planted as a fault: GradScaler at 2**12, and step 2's loss 1000 times
    larger (a spike in the data). Its backward overflows in fp16 (allow_mix_precision) and
    the scaler skips that update and halves the scale, between steps without overflow:
    the loss scale backing off as designed, which ac -c said was a finding ("lower the loss
    scale"). Now it says so and finds nothing in the step. The steps after it start from a
    state the golden's differs from by the skipped update (it took it): what diverges there
    are judged against the golden started from the NPU's state (a rerun of the script, as
    for drift): sound; with --no-verify they are said, with no clean verdict (exit 2), not
    blamed on an op, and the losses parting after it are not reported as drift. With
    --golden-skips-as-npu the golden skips that
    update too (run.json says so, the script's own run never did), the steps after it
    start from one state and are judged: sound, exit 0."""
    script = tmp_path / "spike.py"
    script.write_text(SPIKE)
    root = tmp_path / "ws"
    done = _torch_run(root, "--precision-mode", "allow_mix_precision", "--dump-step", "all",
                      *(["--golden-skips-as-npu"] if mirrored else []),
                      "--", str(script), str(steps), str(2.0 ** 12), "1000")
    assert done.returncode == 0, done.stderr
    golden = Workspace(str(root)).run("cpu")
    assert golden.info.get("skips_as_npu") == ([2] if mirrored else None)
    assert (Workspace(str(root)).step_history(golden).finite == 0).sum() == int(mirrored)
    out = CliRunner().invoke(cli, ["--data-dir", str(root), "--json", "ac", "-c"])
    result = json.loads(out.stdout)
    assert result["loss_scale"]["skipped_steps"] == [2]
    assert result["step"] == 2 and result["backoff"]["before"] == 1
    assert result["first_overflow"]["op_name"].endswith(".backward")
    advice = " ".join(result["advice"])
    assert "Step 2's backward overflowed at loss scale 4096" in advice and \
        "the loss scale backing off as designed (1 of " in advice, advice
    assert "lower the loss scale" not in advice and "keep" not in advice.lower()
    assert result["drift"] is None
    if steps == 3 or mirrored:
        assert out.exit_code == 0 and result["verdict"] == "sound", advice
        assert [x["step"] for x in result["steps"]] == list(range(steps))
        # where the step's divergence starts is shown, and not as a root cause
        shown = CliRunner().invoke(cli, ["--data-dir", str(root), "ac", "-c"]).output
        assert "Where the divergence starts (after the skipped step's overflow: no finding)" \
            in shown and "Root cause" not in shown and "[the loss scale backing off" in shown
    else:
        # judged against the golden started from the NPU's state (one rerun of the script)
        assert out.exit_code == 0 and result["verdict"] == "sound", advice
        assert result["after_skip_replayed"]["steps"] == [3, 4, 5] and not result["unseen_steps"]
        assert "Steps 3-5 come after the update(s) of step(s) 2, which the loss scale " \
            "skipped and the golden took. Judged against the golden started from the NPU's " \
            "own state" in advice, advice
        shown = CliRunner().invoke(cli, ["--data-dir", str(root), "ac", "-c"]).output
        replay = result["after_skip_replayed"]["replayed_by"]
        assert f"[after a skipped update: against {replay}, from the NPU's state: no finding]" \
            in shown
        # the steps box counts them against that replay, as they were judged
        looks = {look["step"]: look for look in result["steps"]}
        assert all(looks[x]["against"] == replay and looks[x]["diverging_ops"] == 0
                   for x in (3, 4, 5)), looks
        # without the replay they are not judged: no clean verdict
        out = CliRunner().invoke(cli, ["--data-dir", str(root), "--json", "ac", "-c",
                                       "--no-verify"])
        result = json.loads(out.stdout)
        advice = " ".join(result["advice"])
        assert out.exit_code == 2 and result["verdict"] == "incomplete", advice
        assert list(result["unseen_steps"].values()) == [[3, 4, 5]]
        assert "Steps 3-5 diverge after the update(s) of step(s) 2, which the loss scale " \
            "skipped and the golden took" in advice and "--golden-skips-as-npu" in advice
        # a file of step 4 deleted: step 4 fails the replay only by what it could not see
        ws = Workspace(str(root))
        npu = ws.run("npu")
        t = ws.index(npu, 4)
        gone = t[(t.op_name == "Functional.layer_norm.0.backward") & (t.io == "output")]
        os.remove(os.path.join(ws.step_path(npu, 4), gone.file.iloc[0]))
        out = CliRunner().invoke(cli, ["--data-dir", str(root), "--json", "ac", "-c"])
        result = json.loads(out.stdout)
        advice = " ".join(result["advice"])
        assert out.exit_code == 2 and result["after_skip_replayed"]["unseen_only"], advice
        assert "Step 4 could not be compared in full with that replay" in advice and \
            "file missing" in advice, advice
        # a script that cannot be rerun: not judged either, and why
        shutil.rmtree(Workspace(str(root)).resolve_run(
            json.loads(CliRunner().invoke(cli, ["--data-dir", str(root), "--json", "ac", "-c"])
                       .stdout)["after_skip_replayed"]["replayed_by"], None).path)
        script.rename(tmp_path / "moved.py")
        out = CliRunner().invoke(cli, ["--data-dir", str(root), "--json", "ac", "-c"])
        advice = " ".join(json.loads(out.stdout)["advice"])
        assert out.exit_code == 2 and "(not judged from the NPU's state: " in advice and \
            "spike.py" in advice, advice


@pytest.mark.parametrize("scale,settles", [(2.0 ** 17, True), (2.0 ** 20, False)])
def test_a_loss_scale_settling_from_its_start_is_no_finding_unless_it_costs(tmp_path, scale,
                                                                          settles):
    """GradScaler started above what the fp16 backward holds: at 2**17 step 0 overflows,
    is skipped, and step 1 runs at 2**16 (1 of 8 steps: the scale settling, as designed;
    with the golden skipping it too every step is judged, sound); at 2**20 steps 0-3 are
    skipped (half the steps: a finding, and the advice starts the scale where it settled)."""
    script = tmp_path / "calib.py"
    script.write_text(SPIKE)
    root = tmp_path / "ws"
    done = _torch_run(root, "--precision-mode", "allow_mix_precision", "--dump-step", "all",
                      "--golden-skips-as-npu", "--", str(script), "8", str(scale), "1")
    assert done.returncode == 0, done.stderr
    out = CliRunner().invoke(cli, ["--data-dir", str(root), "--json", "ac", "-c"])
    result = json.loads(out.stdout)
    advice = " ".join(result["advice"])
    if settles:
        assert result["loss_scale"]["skipped_steps"] == [0]
        assert out.exit_code == 0 and result["verdict"] == "sound", advice
        assert result["backoff"]["kind"] == "calibration"
        assert "step 1 ran without overflow at 65536. That is the loss scale settling" in advice
    else:
        assert result["loss_scale"]["skipped_steps"] == [0, 1, 2, 3]
        assert out.exit_code == 1 and result["backoff"] is None
        assert "the loss scale starts too high: step(s) 0-3 overflowed" in advice and \
            "Start the script's scaler there and no step is lost " \
            "(torch.amp.GradScaler(init_scale=65536)" in advice, advice


def test_steps_after_a_settling_loss_scale_are_judged_from_the_npus_state(tmp_path):
    """GradScaler at 2**17 with the golden as written: the NPU's step 0 overflows and is
    skipped (the scale settling), the golden's is taken. Every later step starts from
    state the golden's differs from by that update, and the NPU's Adam makes its moments
    and step count at step 1, its first update, where the golden's has had them since
    step 0 (their calls had no golden: the compare of step 1 was incomplete). ac -c judges
    those steps against the golden rerun from the NPU's state, which drops the optimizer
    state the NPU's step did not start with and takes the NPU's loss scale (2**16, the
    golden's still 2**17): they compute as it does, and the run is sound."""
    script = tmp_path / "calib.py"
    script.write_text(SPIKE)
    root = tmp_path / "ws"
    done = _torch_run(root, "--precision-mode", "allow_mix_precision", "--dump-step", "all",
                      "--", str(script), "4", str(2.0 ** 17), "1")
    assert done.returncode == 0, done.stderr
    out = CliRunner().invoke(cli, ["--data-dir", str(root), "--json", "ac", "-c"])
    result = json.loads(out.stdout)
    advice = " ".join(result["advice"])
    assert out.exit_code == 0 and result["verdict"] == "sound", advice
    assert result["loss_scale"]["skipped_steps"] == [0]
    assert result["backoff"]["kind"] == "calibration"
    assert result["after_skip_replayed"]["steps"] == [1, 2, 3]
    assert "Steps 1-3 come after the update(s) of step(s) 0" in advice
    replay = Workspace(str(root)).resolve_run(result["after_skip_replayed"]["replayed_by"], None)
    state = replay.info["state_from"]
    assert state["state_dropped"] == {"1": 6}                   # 3 layers' weights and biases
    assert state["loss_scale"] == {str(k): 2.0 ** 16 for k in (1, 2, 3)}


FLIPPED_AT_2 = textwrap.dedent("""
    import os, torch, torch.nn as nn, torch.nn.functional as F
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 17)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    npu = os.environ.get("PRECISION_TOOL_TORCH_TARGET") == "npu"
    for step in range(4):
        # what a kernel computing wrongly on the device does, at step 2 only
        logits = model(x) * (-1.0 if npu and step == 2 else 1.0)
        loss = F.cross_entropy(logits, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
""")


def test_a_step_after_a_skip_that_diverges_from_the_npus_state_too_is_its_own(tmp_path):
    """The loss scale settles at step 0 (skipped on the NPU, taken by the golden), and at
    step 2 the NPU's run computes its logits wrongly. Against the golden as written every
    tensor of step 2 differs by the skipped update; ac -c judges step 1 against the golden
    started from the NPU's state (it matches) and compares step 2 with that replay, where
    the NPU's own fault is the origin (its call and line), exit 1."""
    _, root = _dumped_script(tmp_path, FLIPPED_AT_2, "flipped.py")
    out = CliRunner().invoke(cli, ["--data-dir", str(root), "--json", "ac", "-c"])
    result = json.loads(out.stdout)
    advice = " ".join(result["advice"])
    assert out.exit_code == 1 and result["step"] == 2, advice
    replayed = result["after_skip_replayed"]
    assert replayed["steps"] == [1] and replayed["diverges"] == 2
    assert result["golden_run"] == replayed["replayed_by"] != "cpu/debug_0"
    assert result["origin"]["op_name"] == "Tensor.mul.0.forward"
    assert result["origin"]["call_site"].endswith("flipped.py:12 in <module>")
    assert "Step 2 diverges from that replay too" in advice
    assert "so the state differs" not in advice


def test_a_nanogpt_rmsnorm_whose_squares_flush_in_fp16_is_named_and_fixed(tmp_path):
    """A planted cause: an RMSNorm over activations of 1e-4, under force_fp16: the squares
    flush to zero and 1/sqrt(0 + eps) overflows (eps 1e-8 is zero in fp16 too). ac -c names
    the square (Tensor.pow) in blocks.0.norm1 and its source line; fix reruns the script
    and what it writes, applied to a fresh run, makes it match the golden."""
    result, code = _nanogpt(tmp_path, "force_fp16", "--plant", "rmsnorm-eps",
                            "--init-scale", "1024")
    assert code == 1
    assert result["origin"]["op_name"] == "Tensor.pow.0.forward"
    assert result["origin"]["module"] == "blocks.0.norm1"
    assert result["origin"]["call_site"].endswith("nanogpt.py:27 in forward")
    fixed = subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir", str(tmp_path),
                            "--json", "fix"], capture_output=True, text=True, timeout=900)
    assert fixed.returncode == 0, fixed.stderr
    keep = json.loads(fixed.stdout)["config"]["keep_fp32"]
    assert "Tensor.pow" in keep and "Torch.rsqrt" in keep, keep     # the square, and 1/sqrt
    again = _torch_run(tmp_path, "--target", "npu", "--fix", str(tmp_path / "config" / "fix.json"),
                       "--dump-step", "all", "--", NANOGPT, "--plant", "rmsnorm-eps",
                       "--init-scale", "1024")
    assert again.returncode == 0, again.stderr
    fresh = Workspace(str(tmp_path)).runs("npu")[-1].label
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "ac", "-c", "-lt", fresh])
    assert out.exit_code == 0, out.output


def test_nanogpt_attention_left_unscaled_is_named_in_its_module(tmp_path):
    """A planted cause: attention scores unscaled over unnormalised activations, under the
    default allow_mix_precision: the fp16 scores' grid is coarser than the softmax can take;
    ac -c names the softmax of blocks.0.attn (exit 1)."""
    result, code = _nanogpt(tmp_path, "allow_mix_precision", "--plant", "unscaled-attention")
    assert code == 1
    assert result["origin"]["module"] == "blocks.0.attn"
    assert result["origin"]["op_name"].startswith("Torch.softmax.")


RAW_INPUTS = textwrap.dedent("""
    import torch, torchvision, torch.nn.functional as F
    model = torchvision.models.resnet18(num_classes=4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = 32768 * torch.randn(8, 3, 64, 64), torch.randint(0, 4, (8,))   # not normalised
    for step in range(2):
        loss = F.cross_entropy(model(x), y)
        loss.backward(); opt.step(); opt.zero_grad()
""")


def test_resnet18_fed_unnormalised_inputs_is_named_and_fixed(tmp_path):
    """A planted cause in torchvision's ResNet-18: inputs of PCM range (±32768 and beyond),
    not normalised, under the default allow_mix_precision: the first convolution's fp16
    inputs and accumulation overflow. ac -c names Functional.conv2d.0.forward in conv1 and
    says first to scale what feeds it; fix finds the convolutions kept in fp32 over both steps,
    and a fresh run with its fix matches the golden."""
    pytest.importorskip("torchvision", reason="torchvision builds ResNet-18 (the onnx-export "
                                              "extra)")
    script = tmp_path / "train.py"
    script.write_text(RAW_INPUTS)
    done = _torch_run(tmp_path, "--dump-step", "all", "--", str(script))
    assert done.returncode == 0, done.stderr
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c"])
    assert out.exit_code == 1
    result = json.loads(out.stdout)
    assert result["first_overflow"]["op_name"] == "Functional.conv2d.0.forward"
    assert result["origin"]["op_name"] == "Functional.conv2d.0.forward"
    assert result["origin"]["module"] == "conv1"
    line = next(a for a in result["advice"] if a.startswith("The first overflow"))
    # its inputs are beyond fp16's range: what feeds it leads
    assert "beyond fp16's largest value (65504)" in line
    assert "fused kernel or not. Scale what feeds it down (not verified), or keep" in line
    fixed = subprocess.run([sys.executable, "-m", "precision_tool", "--data-dir", str(tmp_path),
                            "--json", "fix"], capture_output=True, text=True, timeout=900)
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads(fixed.stdout)["config"]["keep_fp32"] == ["Functional.conv2d"]
    again = _torch_run(tmp_path, "--target", "npu", "--fix", str(tmp_path / "config" / "fix.json"),
                       "--dump-step", "all", "--", str(script))
    assert again.returncode == 0, again.stderr
    fresh = Workspace(str(tmp_path)).runs("npu")[-1].label
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "ac", "-c", "-lt", fresh])
    assert out.exit_code == 0, out.output


def test_without_torch_the_front_end_says_which_extra(tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    from precision_tool.torch import PrecisionDebugger\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == ("the PyTorch front-end needs torch: "
                                  "pip install 'precision_tool[torch]'")


def _real(name):
    """Real models nobody here wrote, built from configs with random weights (no download):
    (model, inputs, labels, loss of model output)."""
    if name == "resnet18":
        tv = pytest.importorskip("torchvision", reason="torchvision builds ResNet-18 (the "
                                                       "onnx-export extra)")
        torch.manual_seed(0)
        return (tv.models.resnet18(num_classes=4), torch.randn(8, 3, 64, 64),
                torch.randint(0, 4, (8,)), lambda m, x, y: F.cross_entropy(m(x), y))
    transformers = pytest.importorskip("transformers", reason="transformers builds BERT and "
                                                              "GPT-2 (the onnx-export extra)")
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (8, 16))
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=64,
                                      max_position_embeddings=32, num_labels=4)
        return (transformers.BertForSequenceClassification(cfg), ids, torch.randint(0, 4, (8,)),
                lambda m, x, y: m(input_ids=x, labels=y).loss)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    return (transformers.GPT2LMHeadModel(cfg), ids, ids,
            lambda m, x, y: m(input_ids=x, labels=y).loss)


@pytest.mark.parametrize("name", ["resnet18", "bert", "gpt2"])
def test_real_models_golden_is_the_script_and_every_kernel_is_classified(tmp_path, name):
    """torchvision's ResNet-18, Hugging Face BERT and GPT-2, three AdamW steps as fp16
    training runs them (the transformers under torch.amp.GradScaler, at 2**15), every step
    dumped on both targets. The golden's losses are the script's without the tool, bit for
    bit; the NPU's run lists no kernel as not simulated; both runs name the same calls; and
    the healthy run is called healthy: ac -c over every step exits 0 (the attention key
    bias, whose gradient is zero up to rounding, random-walks under Adam on both sides and
    changes nothing: noise, in every step it is carried into)."""
    def run(target):
        model, x, y, loss_of = _real(name)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 15) if name != "resnet18" \
            else None
        d = PrecisionDebugger(str(tmp_path), target=target, dump_step="all") if target else None
        if d:
            d.start(model)
        losses = []
        for _ in range(3):
            loss = loss_of(model, x, y)
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if d:
                d.step()
        if d:
            d.stop()
        return losses
    plain = run(None)
    assert run("golden") == plain
    assert run("npu") != plain
    ws = Workspace(str(tmp_path))
    assert ws.run("npu").info.get("not_simulated") is None
    assert list(dict.fromkeys(ws.index(ws.run("npu"), 0).op_name)) == \
        list(dict.fromkeys(ws.index(ws.run("cpu"), 0).op_name))
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["verdict"] == "sound"
    # check finds nothing wrong with the data (the attention masks the models make in the
    # step are not data) and no error
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "check"])
    findings = json.loads(out.stdout)["findings"]
    assert out.exit_code == 0 and not [f for f in findings if f["check"].startswith("data.")], \
        out.output


FULL_DISK = textwrap.dedent("""
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    from precision_tool.torch import PrecisionDebugger

    def train(root, dump_step):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 4))
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        x, y = torch.randn(64, 64), torch.randint(0, 4, (64,))
        d = PrecisionDebugger(root, target="npu", dump_step=dump_step)
        d.start(m)
        for _ in range(30):
            loss = F.cross_entropy(m(x), y); loss.backward(); opt.step(); opt.zero_grad()
            d.step(loss)
        d.stop()
        return loss.item(), [p.detach().clone() for p in m.parameters()]

    dumped = train(sys.argv[1], "all")
    undumped = train(sys.argv[2], "1000")          # the same simulation, nothing written
    same = dumped[0] == undumped[0] and all(torch.equal(a, b) for a, b in zip(dumped[1], undumped[1]))
    print("trained 30 steps; same as undumped:", same)
""")


def test_a_full_disk_stops_the_dump_and_the_script_finishes(tmp_path):
    """A workspace on a 1 MB tmpfs: the first step that does not fit ends the dump with one
    warning (its step and cause), run.json records it, the steps before it read whole, and
    the script runs to its end."""
    from test_readonly import NO_NAMESPACES, _in_namespace
    if NO_NAMESPACES:
        pytest.skip(NO_NAMESPACES)
    script = tmp_path / "train.py"
    script.write_text(FULL_DISK)
    disk = tmp_path / "disk"
    disk.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRECISION_TOOL_")}
    listing = " ".join([sys.executable, "-m", "precision_tool", "--data-dir", str(disk / "ws"),
                        "--json", "ls"])
    train, ls = _in_namespace(tmp_path, f"mount -t tmpfs -o size=1024k tmpfs {disk}",
                              [f"{sys.executable} {script} {disk / 'ws'} {tmp_path / 'other'}",
                               listing], env=env)
    assert train[0] == 0, train[2]
    assert "trained 30 steps; same as undumped: True" in train[1]
    warnings = [line for line in train[2].splitlines() if "dumping stopped" in line]
    assert len(warnings) == 1, train[2]
    assert "No space left on device" in warnings[0] and "the script goes on" in warnings[0]
    assert "Traceback" not in train[2]
    assert ls[0] == 0, ls[2]
    (run,) = json.loads(ls[1])["runs"]            # what the full disk holds reads whole
    assert 0 < len(run["steps"]) < 30 and run["partial_steps"] == []
    assert run["dump_stopped"]["step"] == len(run["steps"])
    assert "No space left on device" in run["dump_stopped"]["error"]


# -- many ranks: torch-run under torchrun -------------------------------------------------------
def _torchrun(tmp_path, *args, script_args=()):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "precision_tool",
         "--data-dir", str(tmp_path), "torch-run", "--dump-step", "all", *args, "--",
         os.path.join(root, "examples", "ddp_train.py"), *script_args],
        capture_output=True, text=True, timeout=900, cwd=str(tmp_path),
        env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return Workspace(str(tmp_path))


def test_torchrun_dumps_a_run_per_rank_and_ac_names_the_rank_that_made_a_nan(tmp_path):
    ws = _torchrun(tmp_path, "--overflow-mode", "inf_nan",
                   script_args=("--plant", "nan-on-rank1"))
    for target in ("npu", "cpu"):
        runs = ws.runs(target)
        assert sorted(r.info["rank"] for r in runs) == ["rank0", "rank1"]
        assert len({r.info["rank_group"] for r in runs}) == 1
        assert all(r.complete_steps == [0, 1, 2] for r in runs)
    # the collectives are calls of the step, with what each rank got back
    rank0 = next(r for r in ws.runs("npu") if r.info["rank"] == "rank0")
    names = ws.index_table(rank0, 0)["op_name"].tolist()
    assert "Distributed.all_reduce.3.forward" in names
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c", "-lt",
                                   rank0.label])
    assert out.exit_code == 1, out.output
    result = json.loads(out.stdout)
    # compared with its own rank's golden run
    golden = ws.resolve_run(result["golden_run"], "cpu")
    assert golden.info["rank"] == "rank0" and golden.info["rank_group"] == rank0.info["rank_group"]
    ranks = result["ranks"]
    assert ranks["step"] == 1
    assert [(e["rank"], e["op_name"]) for e in ranks["origin"]] == [("rank1", "Tensor.log.0.forward")]
    assert [(e["rank"], e["op_name"]) for e in ranks["received"]] == \
        [("rank0", "Distributed.all_reduce.0.forward")]


def test_clean_torchrun_ranks_agree_and_hold_no_nan(tmp_path):
    """No nan, the replicas agree, and against the golden nothing is a finding: an element of
    a bias gradient cancels to exactly 0 in the NPU's float32 all_reduce where the golden
    sums to a few 1e-6, which is rounding, not underflow."""
    ws = _torchrun(tmp_path)
    for run in ws.runs("npu"):
        out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-lt",
                                       run.label])
        assert out.exit_code == 0, out.output
        # no nan, and the replicas' parameters and all-reduce results agree bit for bit
        assert json.loads(out.stdout)["ranks"] is None
        out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c",
                                       "-lt", run.label])
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)["origin"] is None


def test_a_divergence_spread_by_all_reduce_is_traced_to_its_rank(tmp_path):
    """Rank 1 fed unnormalised inputs in step 1: its first layer saturates in fp16, and the
    all_reduce hands rank 0 gradients that diverge. ac -c on rank 0 compares every rank
    with its own golden and names rank 1's call, not rank 0's collective."""
    ws = _torchrun(tmp_path, script_args=("--plant", "unnormalised-on-rank1"))
    rank0 = next(r for r in ws.runs("npu") if r.info["rank"] == "rank0")
    out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path), "--json", "ac", "-c", "-lt",
                                   rank0.label])
    assert out.exit_code == 1, out.output
    result = json.loads(out.stdout)
    spread = result["ranks_divergence"]
    assert spread["step"] == 1 and spread["compared"] == 2
    assert [(f["rank"], f["op_name"], f["received"]) for f in spread["first"]] == \
        [("rank1", "Functional.linear.0.forward", False)]
    mine = [f for f in spread["ranks"] if f["rank"] == "rank0"]
    assert mine and mine[0]["received"] and mine[0]["op_name"].startswith("Distributed.all_reduce")
    advice = " ".join(result["advice"])
    assert "the divergence first appears on rank1" in advice and "Look at that rank" in advice
    assert "keep-fp32 Distributed.all_reduce" not in advice    # not this rank's collective


# -- a float64 golden, on request ---------------------------------------------------------------
def test_a_float64_golden_computes_every_call_in_float64(tmp_path):
    """golden_dtype float64: the first step's loss is the model's in float64 (the same fp32
    initial weights, cast), to float64's precision, not float32's; the script's parameters
    and optimizer state keep float32; the dumped golden tensors are float64."""
    losses, params = _train(Attention, str(tmp_path), "golden", steps=2, golden_dtype="float64")
    plain, _ = _train(Attention, steps=2)
    torch.manual_seed(0)
    model = Attention()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 6, 16, generator=g), torch.randint(0, 4, (2,), generator=g)
    reference = F.cross_entropy(model.double()(x.double()), y).item()
    assert abs(losses[0] - reference) < 1e-12
    assert abs(plain[0] - reference) > abs(losses[0] - reference)    # float32's own rounding
    assert all(p.dtype == torch.float32 for p in params)
    ws = Workspace(str(tmp_path))
    run = ws.run("cpu")
    assert run.info["golden_dtype"] == "float64"
    table = ws.index_table(run, 0)
    dtypes = dict(zip(table["tensor"].tolist(), table["dtype"].tolist()))
    assert dtypes["Functional.linear.0.forward:0"] == "float64"
    # the Variables (the script's parameters, as read) keep their dtype
    assert {dtypes[t] for t in dtypes if t.startswith("q.weight")} == {"float32"}
    with pytest.raises(TorchFrontEndError, match="golden_dtype must be one of float32, float64"):
        PrecisionDebugger(str(tmp_path), target="golden", golden_dtype="float16")


HALF_SGD = textwrap.dedent("""
    import torch, torch.nn as nn, torch.nn.functional as F
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.uniform_(0.75, 1.0)
    model.half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    for step in range(2):
        loss = F.cross_entropy(model(x.half()).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
""")


def test_a_half_model_under_sgd_loses_its_updates_and_is_told_to_keep_fp32_weights(tmp_path):
    """A script that casts its model to fp16 (.half()), weights near 1 (an ulp of 2^-10),
    SGD at lr 1e-4: each step (1e-4 x gradients under 0.5) is under half an ulp and rounds
    away, so the NPU's weights never move while every value still matches the golden's
    (which holds them in float32 and moves them). ac -c names the lost update of the
    weight, and for a script says to keep the model in float32 under torch.autocast (exit
    1), not to "declare the variables float32"."""
    _, ws_dir = _dumped_script(tmp_path, HALF_SGD, "half.py")
    out = CliRunner().invoke(cli, ["--data-dir", str(ws_dir), "--json", "ac", "-c"])
    assert out.exit_code == 1, out.output
    r = json.loads(out.stdout)
    lost = {u["variable"]: u for u in r["lost_updates"]["lost"]}
    assert lost["0.weight:0"]["dtype"] == "float16" and lost["0.weight:0"]["share"] == 1.0
    advice = " ".join(r["advice"])
    assert "Updates are lost" in advice and "Keep fp32 master weights" in advice
    assert "the model in float32 (no .half() or .bfloat16() of it) and its compute cast down " \
        "by torch.autocast" in advice and "declare the variables" not in advice
    ws = Workspace(str(ws_dir))
    npu, t = ws.run("npu"), ws.index(ws.run("npu"), 1)
    row = t[(t.op_name == "0.weight") & (t.io == "output")].iloc[0]
    t0 = ws.index(npu, 0)
    row0 = t0[(t0.op_name == "0.weight") & (t0.io == "output")].iloc[0]
    # what the lost update means: the weight step 1 starts from is the one step 0 read
    assert np.array_equal(ws.load(npu, 1, row.file), ws.load(npu, 0, row0.file))
