"""The PyTorch front-end's cost (python bench/torch_frontend.py; bench/run.py runs it when
torch is installed): a training step of a real PyTorch model with the debugger against the
same step without it, measured side by side in one process, blocks interleaved, medians.

- installed: PrecisionDebugger made but not started (what a script pays for the import and
  the object);
- golden, statistics dump / tensor dump (workspace on tmpfs where there is one): every step
  dumped;
- NPU simulated, nothing dumped (dump_step past the run): the simulated kernels alone;
- NPU simulated, statistics dump;
- msprobe's own debugger (mindstudio-probe; `--install` puts it in bench/.msprobe-venv), L1
  statistics of every step, in a child process against its own plain step: our statistics
  dump's overhead against its.

Models: Hugging Face GPT-2 and BERT built from small configs (random weights, no download)
when transformers is installed, and an attention block in plain PyTorch.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from precision_tool.torch import PrecisionDebugger

BLOCKS, STEPS = 7, 6


class Attention(nn.Module):
    def __init__(self, d=64, classes=8):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        q, k, v = self.q(x) / 8.0, self.k(x), self.v(x)
        h = self.norm(F.gelu(torch.softmax(q @ k.transpose(-1, -2), -1) @ v) + x)
        return self.out(h).mean(1)


def models():
    """name -> (model, step function)."""
    out = {}
    torch.manual_seed(0)
    m = Attention()
    x, y = torch.randn(16, 32, 64), torch.randint(0, 8, (16,))
    out["attention block (plain PyTorch)"] = (m, lambda m=m: F.cross_entropy(m(x), y))
    try:
        from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel
    except ImportError:
        return out
    ids = torch.randint(0, 1000, (8, 32))
    gpt = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4,
                                     n_positions=64))
    out["GPT-2 (2 layers, 64 wide)"] = (gpt, lambda m=gpt: m(input_ids=ids, labels=ids).loss)
    bert = BertForSequenceClassification(BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, num_labels=4))
    labels = torch.randint(0, 4, (8,))
    out["BERT (2 layers, 64 wide)"] = (bert, lambda m=bert: m(input_ids=ids, labels=labels).loss)
    return out


def _block(model, loss_fn, opt, debugger, steps):
    if debugger is not None:
        debugger.start(model)
    start = time.perf_counter()
    for _ in range(steps):
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if debugger is not None:
            debugger.step()
    elapsed = time.perf_counter() - start
    if debugger is not None:
        debugger.stop()
    return elapsed / steps


VARIANTS = {
    "installed, not started": lambda root: "installed",
    "golden, statistics dump": lambda root: dict(target="golden", dump_mode="statistics"),
    "golden, tensor dump": lambda root: dict(target="golden", dump_mode="tensor"),
    "NPU simulated, nothing dumped": lambda root: dict(target="npu", dump_step="100000"),
    "NPU simulated, statistics dump": lambda root: dict(target="npu", dump_mode="statistics"),
}


def measure(model, loss_fn, where):
    """variant -> median step time ÷ the plain step's, blocks interleaved."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = {name: [] for name in ["plain", *VARIANTS]}
    root = tempfile.mkdtemp(prefix="bench-torch-", dir=where)
    try:
        _block(model, loss_fn, opt, None, 2)            # warm up
        for _ in range(BLOCKS):
            for name in times:
                if name == "plain":
                    times[name].append(_block(model, loss_fn, opt, None, STEPS))
                    continue
                made = VARIANTS[name](root)
                if made == "installed":
                    PrecisionDebugger(root)
                    times[name].append(_block(model, loss_fn, opt, None, STEPS))
                    continue
                dump_step = made.pop("dump_step", "all")
                d = PrecisionDebugger(root, dump_step=dump_step, **made)
                times[name].append(_block(model, loss_fn, opt, d, STEPS))
                shutil.rmtree(root, ignore_errors=True)
                os.makedirs(root, exist_ok=True)
        plain = statistics.median(times["plain"])
        return {name: statistics.median(v) / plain for name, v in times.items() if name != "plain"}, plain
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _msprobe_block(model, loss_fn, opt, debugger, steps):
    """Steps under msprobe's debugger as its guide has them: start, the step, stop, step."""
    start = time.perf_counter()
    for _ in range(steps):
        debugger.start(model)
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad()
        debugger.stop()
        debugger.step()
    return (time.perf_counter() - start) / steps


def measure_msprobe(name, where) -> float:
    """msprobe's L1 statistics dump of every step ÷ the plain step, blocks interleaved, in
    this process (msprobe wraps torch's APIs for good once its debugger is made: a child
    of its own, so that nothing else is measured under its wrappers)."""
    import json
    from msprobe.pytorch import PrecisionDebugger as MsprobeDebugger
    model, loss_fn = models()[name]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    root = tempfile.mkdtemp(prefix="bench-msprobe-", dir=where)
    try:
        config = os.path.join(root, "config.json")
        with open(config, "w") as f:
            json.dump({"task": "statistics", "dump_path": os.path.join(root, "dump"), "rank": [],
                       "step": [], "level": "L1", "statistics": {
                           "scope": [], "list": [], "data_mode": ["all"],
                           "summary_mode": "statistics"}}, f)
        debugger = MsprobeDebugger(config_path=config)
        _block(model, loss_fn, opt, None, 2)
        plain, probed = [], []
        for _ in range(BLOCKS):
            plain.append(_block(model, loss_fn, opt, None, STEPS))
            probed.append(_msprobe_block(model, loss_fn, opt, debugger, STEPS))
            shutil.rmtree(os.path.join(root, "dump"), ignore_errors=True)
        return statistics.median(probed) / statistics.median(plain)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# msprobe (mindstudio-probe) and what it pulls in go into a virtual environment of their own
# that sees this one's packages (torch, transformers, precision_tool): --install makes it
MSPROBE_VENV = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".msprobe-venv")


def install() -> int:
    import subprocess
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", MSPROBE_VENV],
                   check=True)
    subprocess.run([os.path.join(MSPROBE_VENV, "bin", "python"), "-m", "pip", "install",
                    "--quiet", "mindstudio-probe"], check=True)
    print(f"installed mindstudio-probe into {MSPROBE_VENV}")
    return 0


def _msprobe_ratio(name) -> Optional[float]:
    """msprobe's ratio for a model, from a child process in its environment; None where
    it is not installed or fails."""
    import subprocess
    python = os.path.join(MSPROBE_VENV, "bin", "python")
    if not os.path.exists(python):
        return None
    done = subprocess.run([python, os.path.abspath(__file__), "--msprobe", name],
                          capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ratio ")]
    return float(lines[-1].split()[1]) if done.returncode == 0 and lines else None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(1)         # one core for the step: the comparison, not the machine
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if argv[:1] == ["--install"]:
        return install()
    if argv[:1] == ["--msprobe"]:
        print(f"ratio {measure_msprobe(argv[1], where)}")
        return 0
    for name, (model, loss_fn) in models().items():
        ratios, plain = measure(model, loss_fn, where)
        print(f"{name}: plain step {plain * 1e3:.1f} ms")
        for variant, r in ratios.items():
            print(f"  {variant} ÷ plain: {r:.2f}")
        peer = _msprobe_ratio(name)
        if peer is None:
            print(f"  msprobe L1 statistics dump: not measured (python {sys.argv[0]} "
                  f"--install, once)")
            continue
        ours = ratios["golden, statistics dump"]
        print(f"  msprobe L1 statistics dump ÷ plain: {peer:.2f}")
        print(f"  our statistics dump's overhead ÷ msprobe's: {(ours - 1) / (peer - 1):.2f} "
              f"(ratio of ratios {ours / peer:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
