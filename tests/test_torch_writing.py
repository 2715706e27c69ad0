"""The PyTorch debugger's steps written by a writer thread while the training goes on (a
small step) or in place (a big one): every dumped step holds its own values, a script that
never stops the debugger finds its steps on disk at exit, a stopped debugger is let go."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch front-end is an extra "
                                            "(pip install 'precision_tool[torch]')")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from precision_tool.dump import Workspace  # noqa: E402
from precision_tool.torch import PrecisionDebugger  # noqa: E402


@pytest.mark.parametrize("in_place", [False, True], ids=["handed-over", "in-place"])
def test_every_dumped_step_holds_its_own_values(tmp_path, monkeypatch, in_place):
    """Six steps dumped in tensor mode, each written while the script goes on changing its
    tensors: each step's files hold what the script had at that step (its parameters as the
    step read them, its first activation, its loss), recorded by the script itself; small
    steps handed to the writer thread, big ones (here: every one) written in place."""
    import precision_tool.torch.debugger as debugger
    if in_place:
        monkeypatch.setattr(debugger, "IN_PLACE_BYTES", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-1)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    seen = []
    model[0].register_forward_hook(lambda m, i, out: seen[-1].update(act=out.detach().clone()))
    d = PrecisionDebugger(str(tmp_path), target="golden", dump_step="all")
    d.start(model)
    for _ in range(6):
        seen.append({"weight": model[0].weight.detach().clone(),
                     "bias": model[2].bias.detach().clone()})
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen[-1]["loss"] = loss.detach().clone()
        d.step(loss)
    d.stop()
    assert d._writer._handed == ([] if in_place else list(range(6)))     # the steps handed over
    ws = Workspace(str(tmp_path))
    run = ws.run("cpu")
    assert run.complete_steps == list(range(6))
    for step, want in enumerate(seen):
        t = ws.index(run, step)

        def value(op, io="output"):
            (file,) = set(t[(t.op_name == op) & (t.io == io)].file)
            return ws.load(run, step, file)
        assert np.array_equal(value("0.weight"), want["weight"].numpy()), step
        assert np.array_equal(value("2.bias"), want["bias"].numpy()), step
        assert np.array_equal(value("Functional.linear.0.forward"), want["act"].numpy()), step
        assert np.array_equal(value("Functional.cross_entropy.0.forward"),
                              want["loss"].numpy()), step
    # the weights changed from step to step: equal files would not be a coincidence
    assert not np.array_equal(seen[0]["weight"], seen[5]["weight"])


NEVER_STOPPED = textwrap.dedent("""
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    from precision_tool.torch import PrecisionDebugger
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    x, y = torch.randn(512, 64), torch.randint(0, 4, (512,))
    d = PrecisionDebugger(sys.argv[1], target="golden", dump_step="all")
    d.start(m)
    for _ in range(4):
        loss = F.cross_entropy(m(x), y); loss.backward(); opt.step(); opt.zero_grad()
        d.step(loss)
    # no d.stop(): the process ends with the last steps still queued
""")


def test_a_script_that_never_stops_the_debugger_finds_its_steps_on_disk(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(NEVER_STOPPED)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "ws")],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=root))
    assert done.returncode == 0, done.stderr[-2000:]
    run = Workspace(str(tmp_path / "ws")).run("cpu")
    assert run.complete_steps == [0, 1, 2, 3] and run.partials == []
    assert run.info["dumped_steps"] == [0, 1, 2, 3]


def test_a_stopped_debugger_goes_with_its_last_reference(tmp_path):
    """A model outlives its debugger (an in-process replay makes one per rerun): once
    stopped, nothing of the model holds the debugger (its hooks are removed), so it and
    what it holds do not stay alive."""
    import gc
    import weakref
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    d = PrecisionDebugger(str(tmp_path), target="golden", dump_step="all")
    d.start(model)
    for _ in range(3):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        d.step()
    d.stop()
    gone = weakref.ref(d)
    del d
    gc.collect()
    assert gone() is None
    # and the model trains on without it
    F.cross_entropy(model(x), y).backward()
    opt.step()
