"""The PyTorch front-end's cost (python bench/torch_frontend.py, torch installed): a training
step of a real PyTorch model with the debugger against the same step without it, measured
side by side in one process, blocks interleaved. A block measures the steady state: its
first step runs untimed (what a run pays once, its hooks and the first dumped step's plan
of the index, is printed apart as "its first step"), then its steps and the stop() that
writes the last one are timed. Each ratio is a round's (a variant's block ÷ the plain block
of the same round), printed as the median over the rounds with the lowest and highest.

- installed: PrecisionDebugger made but not started (what a script pays for the import and
  the object);
- golden, statistics dump / tensor dump (workspace on tmpfs where there is one): every step
  dumped;
- NPU simulated, nothing dumped (dump_step past the run): the simulated kernels alone;
- NPU simulated, statistics dump;
- the plain step followed by writing as many bytes as the tensor dump's step left on disk:
  what those bytes alone cost on this machine at that moment (tmpfs pages cost what the
  kernel, or a virtual machine's host, takes to hand them out), and the tensor dump ÷ it;
- msprobe's own debugger (mindstudio-probe; `--install` puts it in bench/.msprobe-venv), L1
  statistics of every step, in a child process against its own plain step: our statistics
  dump's overhead against its.

Models, in two sizes (`--size small|realistic|all`, all by default):
- small: an attention block in plain PyTorch, Hugging Face GPT-2 and BERT of 2 layers 64
  wide: steps of a few milliseconds, where what each call costs the tool shows most;
- realistic: torchvision's ResNet-18 on 8 images of 224x224, GPT-2 and BERT of 6 layers
  384 wide and the examples' nanoGPT at that size, on 8 sequences of 128 tokens: steps of
  a second or more, where what each tensor's bytes cost shows.
Hugging Face models are built from configs (random weights, no download) when
transformers is installed, ResNet-18 when torchvision is.
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

# (blocks, steps per block) by size: a realistic step takes seconds
REPEATS = {"small": (7, 6), "realistic": (3, 2)}
SIZES = ("small", "realistic")


class Attention(nn.Module):
    def __init__(self, d=64, classes=8):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        q, k, v = self.q(x) / 8.0, self.k(x), self.v(x)
        h = self.norm(F.gelu(torch.softmax(q @ k.transpose(-1, -2), -1) @ v) + x)
        return self.out(h).mean(1)


def _transformers(width, layers, tokens):
    """Hugging Face GPT-2 and BERT of that size: name -> (model, step function)."""
    try:
        from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel
    except ImportError:
        return {}
    heads = max(4, width // 64)
    ids = torch.randint(0, 1000, (8, tokens))
    gpt = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_embd=width, n_layer=layers,
                                     n_head=heads, n_positions=max(64, tokens)))
    bert = BertForSequenceClassification(BertConfig(
        vocab_size=1000, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=2 * width if width < 128 else 4 * width,
        max_position_embeddings=max(64, tokens), num_labels=4))
    labels = torch.randint(0, 4, (8,))
    return {f"GPT-2 ({layers} layers, {width} wide)":
            (gpt, lambda m=gpt: m(input_ids=ids, labels=ids).loss),
            f"BERT ({layers} layers, {width} wide)":
            (bert, lambda m=bert: m(input_ids=ids, labels=labels).loss)}


def _nanogpt(width, layers, tokens):
    """The examples' nanoGPT (plain PyTorch) at that size, on random tokens."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "nanogpt.py")
    spec = importlib.util.spec_from_file_location("nanogpt_example", path)
    nanogpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nanogpt)
    model = nanogpt.GPT(1000, tokens, d=width, heads=width // 64, layers=layers)
    x, y = torch.randint(0, 1000, (8, tokens)), torch.randint(0, 1000, (8, tokens))
    return {f"nanoGPT ({layers} layers, {width} wide)": (model, lambda m=model: m(x, y))}


def models(size: str = "small"):
    """name -> (model, step function) of a size (see the module)."""
    torch.manual_seed(0)
    if size == "small":
        m = Attention()
        x, y = torch.randn(16, 32, 64), torch.randint(0, 8, (16,))
        return {"attention block (plain PyTorch)": (m, lambda m=m: F.cross_entropy(m(x), y)),
                **_transformers(64, 2, 32)}
    out = {}
    try:
        import torchvision
        resnet = torchvision.models.resnet18(num_classes=10)
        images, classes = torch.randn(8, 3, 224, 224), torch.randint(0, 10, (8,))
        out["ResNet-18 (8 images of 224x224)"] = (
            resnet, lambda m=resnet: F.cross_entropy(m(images), classes))
    except ImportError:
        pass
    return {**out, **_transformers(384, 6, 128), **_nanogpt(384, 6, 128)}


def _step(model, loss_fn, opt, debugger):
    loss = loss_fn()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if debugger is not None:
        debugger.step()


def _block(model, loss_fn, opt, debugger, steps, first=None):
    """Seconds a step, steady state: one step run first, untimed (what a run pays once:
    its hooks, the first dumped step's plan of the index; its seconds, without its files'
    writing, go to `first`, a list, when given) and its files written, then `steps` timed,
    and stop() (the last step's files are on disk only then)."""
    if debugger is not None:
        debugger.start(model)
    start = time.perf_counter()
    _step(model, loss_fn, opt, debugger)
    if first is not None:
        first.append(time.perf_counter() - start)
    if debugger is not None:
        # the first step's files written untimed: a step is written while the next one
        # runs, and the timed steps pay for their own writes only (stop() writes the last)
        debugger.close()
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, loss_fn, opt, debugger)
    if debugger is not None:
        debugger.stop()
    return (time.perf_counter() - start) / steps


VARIANTS = {
    "installed, not started": lambda root: "installed",
    "golden, statistics dump": lambda root: dict(target="golden", dump_mode="statistics"),
    "golden, tensor dump": lambda root: dict(target="golden", dump_mode="tensor"),
    "NPU simulated, nothing dumped": lambda root: dict(target="npu", dump_step="100000"),
    "NPU simulated, statistics dump": lambda root: dict(target="npu", dump_mode="statistics"),
}
# the plain step, then as many bytes as the tensor dump's step put on disk written to one
# file there: what the machine asks for a tensor dump's bytes alone (fresh tmpfs pages cost
# what the kernel, or a virtual machine's host, takes to hand them out, which varies)
WRITE_FLOOR = "plain step + writing a tensor dump's bytes"


def _disk_bytes(root) -> int:
    """The bytes of the files under root, a file linked under several names once."""
    sizes = {}
    for d, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(d, f))
            sizes[st.st_ino] = st.st_size
    return sum(sizes.values())


def _write_block(model, loss_fn, opt, steps, root, step_bytes, chunk) -> float:
    """As _block's steady state, with no debugger: each step followed by step_bytes written
    to a new file under root (chunk, a buffer, written over and over)."""
    def one(k):
        _step(model, loss_fn, opt, None)
        with open(os.path.join(root, f"step{k}.bin"), "wb") as f:
            for at in range(0, step_bytes, chunk.nbytes):
                f.write(chunk[:step_bytes - at])
    one(0)
    start = time.perf_counter()
    for k in range(steps):
        one(k + 1)
    return (time.perf_counter() - start) / steps


def measure(model, loss_fn, where, repeats=REPEATS["small"]):
    """A dict: ratios, variant -> (median, lowest, highest) over the rounds of a block's step
    time ÷ the plain block's of the same round, blocks interleaved; over_floor, the tensor
    dump's ÷ WRITE_FLOOR's, the same way; plain, the plain step in seconds (median); firsts,
    variant -> its first step ÷ the plain step; step_bytes, a tensor dump's step on disk. A
    ratio within a round: what the machine's load does to both halves of it cancels, a
    drift over the run does not reach it."""
    import numpy as np
    blocks, steps = repeats
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = {name: [] for name in ["plain", *VARIANTS, WRITE_FLOOR]}
    firsts = {name: [] for name in VARIANTS}
    root = tempfile.mkdtemp(prefix="bench-torch-", dir=where)
    chunk = np.ones(1 << 26, np.uint8)
    step_bytes = 0              # the tensor dump's, this round

    def fresh():
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root, exist_ok=True)
    try:
        _block(model, loss_fn, opt, None, 2)            # warm up
        for _ in range(blocks):
            for name in times:
                if name == "plain":
                    times[name].append(_block(model, loss_fn, opt, None, steps))
                    continue
                if name == WRITE_FLOOR:
                    times[name].append(_write_block(model, loss_fn, opt, steps, root,
                                                    step_bytes, chunk))
                    fresh()
                    continue
                made = VARIANTS[name](root)
                if made == "installed":
                    PrecisionDebugger(root)
                    times[name].append(_block(model, loss_fn, opt, None, steps, firsts[name]))
                    continue
                dump_step = made.pop("dump_step", "all")
                d = PrecisionDebugger(root, dump_step=dump_step, **made)
                times[name].append(_block(model, loss_fn, opt, d, steps, firsts[name]))
                if made.get("dump_mode") == "tensor":
                    step_bytes = _disk_bytes(root) // (steps + 1)
                fresh()
        plain = statistics.median(times["plain"])
        return dict(ratios={name: _spread([t / p for t, p in zip(v, times["plain"])])
                            for name, v in times.items() if name != "plain"},
                    over_floor=_spread([t / w for t, w in zip(times["golden, tensor dump"],
                                                              times[WRITE_FLOOR])]),
                    plain=plain, step_bytes=step_bytes,
                    firsts={name: statistics.median(v) / plain for name, v in firsts.items()})
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _spread(ratios) -> tuple:
    """(median, lowest, highest) of a variant's ratios, one a round."""
    return statistics.median(ratios), min(ratios), max(ratios)


def _msprobe_block(model, loss_fn, opt, debugger, steps):
    """Steps under msprobe's debugger as its guide has them (start, the step, stop, step),
    steady state as _block's: one untimed first."""
    def one():
        debugger.start(model)
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad()
        debugger.stop()
        debugger.step()
    one()
    start = time.perf_counter()
    for _ in range(steps):
        one()
    return (time.perf_counter() - start) / steps


def measure_msprobe(name, size, where, repeats) -> tuple:
    """msprobe's L1 statistics dump of every step ÷ the plain step (as measure's ratios: a
    round's, then their (median, lowest, highest)), blocks interleaved, in
    this process (msprobe wraps torch's APIs for good once its debugger is made: a child
    of its own, so that nothing else is measured under its wrappers)."""
    import json
    from msprobe.pytorch import PrecisionDebugger as MsprobeDebugger
    model, loss_fn = models(size)[name]
    blocks, steps = repeats
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
        ratios = []
        for _ in range(blocks):
            plain = _block(model, loss_fn, opt, None, steps)
            ratios.append(_msprobe_block(model, loss_fn, opt, debugger, steps) / plain)
            shutil.rmtree(os.path.join(root, "dump"), ignore_errors=True)
        return _spread(ratios)
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


def _msprobe_ratio(name, size, repeats) -> Optional[tuple]:
    """msprobe's ratios for a model (measure_msprobe's), from a child process in its
    environment; None where it is not installed or fails."""
    import subprocess
    python = os.path.join(MSPROBE_VENV, "bin", "python")
    if not os.path.exists(python):
        return None
    done = subprocess.run([python, os.path.abspath(__file__), "--msprobe", name, size,
                           *map(str, repeats)], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ratio ")]
    return tuple(map(float, lines[-1].split()[1:])) if done.returncode == 0 and lines \
        else None


def _warn_left_behind(where) -> None:
    """Workspaces an earlier bench left (killed before its cleanup) take the memory a tmpfs
    gives the dumps: on a small machine they slow every tensor dump measured after."""
    import glob
    left = glob.glob(os.path.join(where or tempfile.gettempdir(), "bench-torch-*"))
    if left:
        size = sum(os.path.getsize(os.path.join(d, f)) for top in left
                   for d, _, files in os.walk(top) for f in files)
        print(f"warning: {len(left)} workspace(s) of an earlier bench are still there "
              f"({size / 1e6:,.0f} MB: {', '.join(left)}); they take memory from the dumps "
              f"measured now: remove them unless a bench is running", file=sys.stderr)


def _arguments(argv):
    import argparse
    parser = argparse.ArgumentParser(
        prog="bench/torch_frontend.py", description="The PyTorch front-end's cost: a step "
        "with the debugger ÷ the plain step, measured side by side (see the module).")
    parser.add_argument("--size", choices=(*SIZES, "all"), default="all",
                        help="which models (default: all)")
    parser.add_argument("--model", action="append", default=[], metavar="TEXT",
                        help="only the models whose name holds TEXT (repeatable)")
    parser.add_argument("--blocks", type=int, metavar="N",
                        help="rounds of blocks (default: 7 small, 3 realistic); more rounds "
                             "narrow the spread on a loaded machine")
    parser.add_argument("--install", action="store_true",
                        help="put mindstudio-probe into bench/.msprobe-venv, once")
    args = parser.parse_args(argv)
    if args.blocks is not None and args.blocks < 1:
        parser.error("--blocks: at least 1")
    return args


def _memory() -> str:
    """The machine's free memory and page cache now (Linux's /proc/meminfo), "" elsewhere:
    a tensor dump's fresh tmpfs pages come from free memory, or from the page cache that the
    kernel must first reclaim; with 14 GB of it cached here, writing its bytes alone cost
    3.1 / 4.6x a ResNet-18 / GPT-2 step, and 1.4 / 1.6x once those files were gone."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f}
        return (f"memory: {info['MemFree'] / 2 ** 20:.1f} GiB free, "
                f"{info['Cached'] / 2 ** 20:.1f} GiB page cache")
    except (OSError, KeyError, ValueError, IndexError):
        return ""


def _ratio(r: tuple) -> str:
    """A variant's ratios: the median, and the spread over the rounds."""
    return f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(1)         # one core for the step: the comparison, not the machine
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if argv[:1] == ["--msprobe"]:    # the child _msprobe_ratio starts: name size blocks steps
        repeats = (int(argv[3]), int(argv[4]))
        print("ratio", *measure_msprobe(argv[1], argv[2], where, repeats))
        return 0
    args = _arguments(argv)
    if args.install:
        return install()
    _warn_left_behind(where)
    print("each ratio: the median over the rounds (lowest-highest), a round's ÷ that round's "
          "plain step", flush=True)
    if _memory():
        print(_memory(), flush=True)
    for each in SIZES if args.size == "all" else (args.size,):
        blocks, steps = REPEATS[each]
        repeats = (args.blocks or blocks, steps)
        for name, (model, loss_fn) in models(each).items():
            if args.model and not any(m in name for m in args.model):
                continue
            got = measure(model, loss_fn, where, repeats)
            ratios, firsts = got["ratios"], got["firsts"]
            print(f"{name}: plain step {got['plain'] * 1e3:.1f} ms, {repeats[0]} rounds, a "
                  f"tensor dump writes {got['step_bytes'] / 1e6:,.0f} MB a step", flush=True)
            for variant, r in ratios.items():
                first = f" (its first step {firsts[variant]:.2f})" if variant in firsts else ""
                print(f"  {variant} ÷ plain: {_ratio(r)}{first}")
            print(f"  tensor dump ÷ (plain step + writing its bytes): "
                  f"{_ratio(got['over_floor'])}")
            peer = _msprobe_ratio(name, each, repeats)
            if peer is None:
                print(f"  msprobe L1 statistics dump: not measured (python {sys.argv[0]} "
                      f"--install, once)")
                continue
            ours = ratios["golden, statistics dump"][0]
            print(f"  msprobe L1 statistics dump ÷ plain: {_ratio(peer)}")
            print(f"  our statistics dump's overhead ÷ msprobe's: "
                  f"{(ours - 1) / (peer[0] - 1):.2f} (ratio of ratios {ours / peer[0]:.2f})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
