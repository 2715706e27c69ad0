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


class _Block(nn.Module):
    """What a big step spills: views of a spilled output (one its shape, one not), an
    activation a later call changes in place, a tensor two calls read (autograd sums its
    gradients), a parameter update."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.a(x)
        g = F.gelu(h.view(8, 2, 16).reshape(8, 32)) + torch.tanh(h)
        r = g.clone()
        r.relu_()
        return self.b(r * g)


def _dump(root, target="golden", steps=3):
    torch.manual_seed(0)
    model = _Block()
    opt = torch.optim.Adam(model.parameters(), lr=1e-1)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    d = PrecisionDebugger(str(root), target=target, dump_step="all")
    d.start(model)
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        d.step(loss)
    d.stop()
    return d


def _tensors(root, kind, step):
    """(op, io, index) -> (row's shape, dtype, statistics, the file's array)."""
    ws = Workspace(str(root))
    run = ws.run(kind)
    assert run.partials == []
    t = ws.index(run, step)
    stats = ["max", "min", "mean", "l2norm", "nan_count", "pos_inf_count", "neg_inf_count"]
    return {(r.op_name, r.io, r["index"]): (r["shape"], r.dtype, tuple(r[s] for s in stats),
                                             ws.load(run, step, r.file, r["shape"]))
            for _, r in t.iterrows()}


def _file_shapes(root, kind, step):
    """(op, io, index) -> (the shape its index line says, the shape in its file's header,
    the file's inode) of a step."""
    ws = Workspace(str(root))
    run = ws.run(kind)
    t = ws.index(run, step)
    out = {}
    for _, r in t.iterrows():
        path = os.path.join(ws.step_path(run, step), r.file)
        out[(r.op_name, r.io, r["index"])] = (r["shape"], " ".join(map(str, np.load(
            path, mmap_mode="r", allow_pickle=False).shape)), os.stat(path).st_ino)
    return out


@pytest.mark.parametrize("target,kind", [("golden", "cpu"), ("npu", "npu")])
def test_a_big_step_written_as_it_runs_holds_what_a_small_one_does(tmp_path, monkeypatch,
                                                                   target, kind):
    """A step past IN_PLACE_BYTES writes each value as it is made (spills it: no copy
    kept) and links the files in when the step ends: every line of its index, and every
    file read in its line's shape, is what the same step written from copies holds; a view
    of another shape is a link to the file of what it views, not a second copy; no spill is
    left behind."""
    import precision_tool.torch.debugger as debugger
    _dump(tmp_path / "copies", target)
    monkeypatch.setattr(debugger, "IN_PLACE_BYTES", 0)
    spilled = []
    real = debugger.RunWriter.spill
    monkeypatch.setattr(debugger.RunWriter, "spill",
                        lambda self, n, v: spilled.append(v.shape) or real(self, n, v))
    _dump(tmp_path / "spilled", target)
    assert len(spilled) > 30            # all but the first value of each step, fp16 aside
    for step in range(3):
        want, got = _tensors(tmp_path / "copies", kind, step), _tensors(tmp_path / "spilled",
                                                                        kind, step)
        assert want.keys() == got.keys()
        for key, (shape, dtype, stats, value) in want.items():
            g = got[key]
            assert (g[0], g[1]) == (shape, dtype), key
            assert np.array_equal(g[2], stats, equal_nan=True), key
            assert g[3].dtype == value.dtype and np.array_equal(g[3], value), key
    if target == "golden":      # (the NPU's fp16 values are copied: their dtype changes)
        files = _file_shapes(tmp_path / "spilled", kind, 1)
        views = [k for k in files if k[:2] == ("Tensor.view.0.forward", "output")]
        assert views
        for key in views:
            said, header, inode = files[key]
            shared = [k for k, f in files.items() if f[2] == inode and k[0] != key[0]]
            assert said != header and shared, (key, files[key])
            assert files[shared[0]][1] == header
    leftovers = [p for p, _, _ in os.walk(tmp_path / "spilled") if ".spilled" in p or
                 p.endswith(".partial")]
    assert leftovers == []


def test_every_reader_gives_a_linked_view_its_own_shape(tmp_path, monkeypatch):
    """A view written as a link to the file of what it views (a spilled step): pt by name
    and by file name, the msprobe export and ac read it in the shape of its index line, and
    they give what a step written from copies gives."""
    import json
    from click.testing import CliRunner
    from precision_tool.cli import cli
    import precision_tool.torch.debugger as debugger
    for target in ("golden", "npu"):
        _dump(tmp_path / "copies", target, steps=2)
    monkeypatch.setattr(debugger, "IN_PLACE_BYTES", 0)
    for target in ("golden", "npu"):
        _dump(tmp_path / "spilled", target, steps=2)

    def cli_json(root, *args, code=0):
        out = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / root), "--json", *args])
        assert code is None or out.exit_code == code, out.output
        return json.loads(out.stdout)
    view = "Tensor.view.0.forward:output:0"
    ws = Workspace(str(tmp_path / "spilled"))
    row = ws.index(ws.run("cpu"), 1)
    row = row[(row.op_name == "Tensor.view.0.forward") & (row.io == "output")].iloc[0]
    run = ["-r", "cpu/debug_0", "-s", "1"]
    by_file = cli_json("spilled", "pt", *run, row["file"])
    by_name = cli_json("spilled", "pt", *run, view)
    copied = cli_json("copies", "pt", *run, view)
    assert by_file["shape"] == by_name["shape"] == copied["shape"] == \
        [int(d) for d in row["shape"].split()]
    assert by_file["head"] == by_name["head"] == copied["head"]
    exported = {}
    for root in ("spilled", "copies"):
        cli_json(root, "export", "-r", "cpu/debug_0", "-o", str(tmp_path / f"ex-{root}"))
        with open(tmp_path / f"ex-{root}" / "step1" / "rank0" / "dump.json") as f:
            data = json.load(f)["data"]
        exported[root] = {k: [o["shape"] for o in v["output"]] for k, v in data.items()}
    assert exported["spilled"] == exported["copies"]
    assert exported["spilled"]["Tensor.view.0.forward"] == [[int(d) for d in
                                                             row["shape"].split()]]
    checked = [cli_json(root, "ac", "-c", code=None) for root in ("spilled", "copies")]
    for each in checked:     # (the divergence report's paths differ: their workspaces)
        each.pop("result_file")
    assert checked[0] == checked[1]


def test_a_step_cut_short_leaves_no_spilled_values(tmp_path, monkeypatch):
    """A script that raises in the middle of a big step: the steps before it are on disk,
    the values the cut step had spilled are not (no hidden directory is left)."""
    import precision_tool.torch.debugger as debugger
    monkeypatch.setattr(debugger, "IN_PLACE_BYTES", 0)
    torch.manual_seed(0)
    model = _Block()
    x = torch.randn(8, 16)
    d = PrecisionDebugger(str(tmp_path), target="golden", dump_step="all")
    d.start(model)
    model(x).sum().backward()
    d.step()
    model(x)            # the second step's forward, then the script fails
    assert any(".spilled" in p for p, _, _ in os.walk(tmp_path))
    d.stop(RuntimeError("the script failed"))
    run = Workspace(str(tmp_path)).run("cpu")
    assert run.complete_steps == [0]
    assert [p for p, _, _ in os.walk(tmp_path) if "partial" in p or ".spilled" in p] == []


def test_a_spill_that_fails_ends_the_dump_and_the_training_goes_on(tmp_path, monkeypatch,
                                                                  capsys):
    """A full disk met while spilling: the dump stops at that step with one warning and
    nothing of the step left on disk; the steps before it stay; the script trains on."""
    import errno
    import precision_tool.torch.debugger as debugger
    monkeypatch.setattr(debugger, "IN_PLACE_BYTES", 0)
    real, calls = debugger.RunWriter.spill, []

    def spill(self, number, value):
        calls.append(number)
        if number == 1 and calls.count(1) == 3:
            raise debugger.write_error(OSError(errno.ENOSPC, "No space left on device",
                                               self.partial_dir(number)))
        return real(self, number, value)
    monkeypatch.setattr(debugger.RunWriter, "spill", spill)
    d = _dump(tmp_path, steps=3)
    assert d.stopped is not None and d.stopped[0] == 1
    assert "No space left" in capsys.readouterr().err
    run = Workspace(str(tmp_path)).run("cpu")
    assert run.complete_steps == [0] and run.partials == []
    assert [p for p, _, _ in os.walk(tmp_path) if "partial" in p or ".spilled" in p] == []
    assert max(calls) == 1          # nothing spilled after the failure


def _bench():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    try:
        import torch_frontend
    finally:
        sys.path.pop(0)
    return torch_frontend


def test_the_bench_warns_of_workspaces_an_earlier_bench_left(tmp_path, capsys):
    """A bench killed before its cleanup leaves its workspace on the tmpfs, and every tensor
    dump measured after it then pays for the memory it holds: the next bench says so."""
    torch_frontend = _bench()
    torch_frontend._warn_left_behind(str(tmp_path))
    assert capsys.readouterr().err == ""
    left = tmp_path / "bench-torch-abc" / "cpu"
    left.mkdir(parents=True)
    (left / "x.npy").write_bytes(b"\0" * 3_000_000)
    torch_frontend._warn_left_behind(str(tmp_path))
    err = capsys.readouterr().err
    assert "1 workspace(s) of an earlier bench" in err and "(3 MB: " in err
    assert str(tmp_path / "bench-torch-abc") in err


def test_the_bench_writes_a_tensor_dumps_bytes_beside_it_and_cleans_up(tmp_path):
    """The write floor writes, after each plain step, as many bytes as the tensor dump's step
    put on disk (the number measure reports), and measure leaves nothing behind; each ratio
    is a round's (its median within its lowest and highest)."""
    bench = _bench()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))

    def loss_fn():
        return F.cross_entropy(model(x), y)
    got = bench.measure(model, loss_fn, str(tmp_path), repeats=(2, 1))
    assert os.listdir(tmp_path) == []
    assert set(got["ratios"]) == {*bench.VARIANTS, bench.WRITE_FLOOR}
    for low_mid_high in [*got["ratios"].values(), got["over_floor"]]:
        assert low_mid_high[1] <= low_mid_high[0] <= low_mid_high[2]
    # a block's dump (its first step and one more, the optimizer's state made before), by
    # itself: what the bench says a step writes (to a few bytes: the index's timestamps
    # and the run's record differ in length)
    root = tmp_path / "two"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    bench._step(model, loss_fn, opt, None)
    d = PrecisionDebugger(str(root), target="golden", dump_mode="tensor", dump_step="all")
    d.start(model)
    for _ in range(2):
        bench._step(model, loss_fn, opt, d)
    d.stop()
    assert got["step_bytes"] == pytest.approx(bench._disk_bytes(str(root)) / 2, rel=1e-3)
    floor = tmp_path / "floor"
    floor.mkdir()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    bench._write_block(model, loss_fn, opt, 2, str(floor), 1000, np.ones(300, np.uint8))
    assert sorted(os.listdir(floor)) == ["step0.bin", "step1.bin", "step2.bin"]
    assert {(floor / f).stat().st_size for f in os.listdir(floor)} == {1000}
