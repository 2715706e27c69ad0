"""PrecisionDebugger: a PyTorch script's API calls dumped into a workspace, on the golden (the
script as written, fp32 on CPU) or on the simulated NPU (simulate.SimulatedNPU).

    from precision_tool.torch import PrecisionDebugger
    debugger = PrecisionDebugger(data_dir="precision_data", target="npu")
    debugger.start(model)
    for x, y in data:
        loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()
        debugger.step()
    debugger.stop()

Names are msprobe's: an API call is `Functional.linear.0.forward` (Functional, Tensor, Torch
and their call index in the step), its backward `Functional.linear.0.backward` (the
gradients flowing in as its inputs, those flowing out to the call's inputs as its outputs).
Both targets of one script name the same calls the same: the runs map call for call. Each
dumped step is written through the workspace's run writer (dump.runwriter): a device run
(npu) or a reference run (cpu), with the step history (loss when the script hands it,
status word) and run.json saying what ran and what was not simulated.

Recording never changes what the script computes: values are copied out after each call
(inputs before it: an in-place call changes them), and the golden computes every kernel as
the script asks, in float32 where it asks for float16 or bfloat16 (golden.GoldenFP32). A
test holds its loss and parameters bit for bit to the script's without the tool."""
from __future__ import annotations

import gc
import os
import sys
import time
import weakref
from typing import Dict, List, Optional

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.autograd.graph import increment_version

from ..dump import layout
from ..dump.runwriter import OpSpec, Record, RunWriter, TensorSpec, warn_stopped
from ..dump.stepplan import Spilled, Summary, disk_dtype
from ..dump.writer import DumpWriteError, close_at_exit, make_writer, write_error
from ..errors import PrecisionToolError
from ..runtime.config import SessionConfig
from ..runtime.npu.fusion import enabled_passes, fusion_record, switch_for
from .backward import call_graph, next_node, where_from
from .collectives import CollectiveWatch, rank_info
from .scaler import ScalerWatch
from .simulate import ByIdentity, tensors_in
from .state import (StateError, StateReplayed, npu_loss_scale, npu_state, parse_state_from,
                    set_state)

TARGETS = ("npu", "golden")
GOLDEN_DTYPES = ("float32", "float64")
DUMP_MODES = ("tensor", "statistics")
# calls that are not computations: attribute access, shape queries, bookkeeping
_SKIP = frozenset({"__get__", "__set__", "size", "dim", "numel", "is_floating_point",
                   "__len__", "__iter__", "__bool__", "__format__", "__repr__", "__hash__",
                   "item", "tolist", "numpy", "cpu", "to", "detach", "requires_grad_",
                   "_set_grad_enabled", "backward", "_record_function_enter_new",
                   "register_hook", "retain_grad", "data_ptr", "stride", "storage_offset",
                   "is_contiguous", "element_size", "get_device", "type", "__reduce_ex__",
                   "__setstate__", "__deepcopy__", "grad", "_version", "is_leaf", "grad_fn",
                   "shape", "dtype", "device", "requires_grad", "data", "T", "__index__",
                   "__int__", "__float__", "__contains__", "__eq__", "__ne__", "__array__",
                   # memory with no defined contents: nothing to compare
                   "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


# A tensor dump's step that has copied more bytes than this writes each value it meets
# after as it is made (RunWriter.spill: no copy) and is written on the training thread, not
# handed to the writer thread: the copying and writing of hundreds of megabytes is memory
# work that, beside torch's own threads (which take every core, and cannot be given fewer:
# the golden's sums depend on their count), slows the step more than the overlap saves
# (measured in docs/design-notes.md, "A small step is written while the next one runs").
IN_PLACE_BYTES = 64 << 20


# the unrecorded calls whose output holds its input's values: in another dtype or on another
# device (`x.to(w.dtype)`), or the same memory apart from autograd (SGD's first momentum
# buffer is `grad.detach().clone()`)
_CONVERSIONS = frozenset({"to", "type", "cpu", "detach"})


# in-place fills: what the tensor held before (often uninitialised memory) is not an input
_OVERWRITES = frozenset({"uniform_", "normal_", "zero_", "fill_", "random_", "bernoulli_",
                         "exponential_", "geometric_", "log_normal_", "cauchy_", "copy_",
                         "set_", "resize_"})


def _written_list(api: str, args) -> list:
    """The tensors an in-place call on a list writes (its first argument: a `_foreach_*_`
    op's, GradScaler's unscale), else []. Torch's kernels for them leave the version
    counters as they were (the unscale always; `_foreach_mul_`, which clip_grad_norm_
    scales gradients with, under the simulated NPU's dispatch mode): what keys copies and
    names by version would take the old value for the new. The unscale returns nothing:
    what it writes are its outputs."""
    if not api.endswith("_") or api.endswith("__") or not args or \
            not isinstance(args[0], (list, tuple)):
        return []
    return [t for t in args[0] if isinstance(t, torch.Tensor)]


def _step_list(steps) -> frozenset:
    """Step numbers from "3,7" (the runner's environment) or an iterable of ints."""
    if not steps:
        return frozenset()
    items = steps.split(",") if isinstance(steps, str) else steps
    try:
        return frozenset(int(x) for x in items)
    except (TypeError, ValueError):
        raise TorchFrontEndError(f"skip_steps must be step numbers, got {steps!r}") from None


class TorchFrontEndError(ValueError):
    """A debugger setting that cannot be used."""


def _switch_text(text: str) -> dict:
    """A fusion switch given as its JSON text."""
    import json
    try:
        return json.loads(text)
    except ValueError as e:
        raise TorchFrontEndError(f"fusion switch: not JSON: {e}") from None


def _keep_list(keep) -> tuple:
    """keep_fp32 as a tuple of names: a list, or one text of names split by commas."""
    if not keep:
        return ()
    names = keep.split(",") if isinstance(keep, str) else list(keep)
    if not all(isinstance(n, str) and n.strip() for n in names):
        raise TorchFrontEndError(f"keep_fp32 must be API names (Torch.matmul) or module "
                                 f"paths, got {keep!r}")
    return tuple(n.strip() for n in names)


class _Task:
    """A call's task on the simulated device: its id, stream and the status word its
    kernels set (an Opdebug record when not 0)."""
    __slots__ = ("task_id", "stream_id", "status")

    def __init__(self, task_id: int, status: int = 0):
        self.task_id, self.stream_id, self.status = task_id, 0, status


def _api_name(func) -> Optional[str]:
    """Functional.linear, Tensor.add, Torch.matmul; None for what is not an API call."""
    name = getattr(func, "__name__", None)
    if not name or name in _SKIP:
        return None
    module = getattr(func, "__module__", "") or ""
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    if module.startswith("torch.nn.functional") or \
            getattr(torch.nn.functional, name, None) is func:
        return f"Functional.{name}"
    if owner is torch.Tensor or getattr(func, "__qualname__", "").startswith("Tensor.") or \
            getattr(func, "__qualname__", "").startswith("TensorBase."):
        return f"Tensor.{name}"
    return f"Torch.{name}"


def _view(t: torch.Tensor) -> np.ndarray:
    """t's values as numpy sees them: its own memory where it can (bfloat16, which numpy
    cannot hold, as a float32 copy)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.to(torch.float32)
    return t.cpu().numpy()


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory t views (t itself when it is no view)."""
    return t._base if t._base is not None else t


def _values(v) -> np.ndarray:
    """A value held as an array, or as autograd's tensor (numpy's view of it)."""
    return _view(v) if isinstance(v, torch.Tensor) else v


def _key(t: torch.Tensor) -> tuple:
    """What a value kept of t holds for: t's version, dtype and shape."""
    return int(t._version), t.dtype, tuple(t.shape)


def _reshaped(value, shape: tuple):
    """A kept value (a copy, a Summary, a Spilled) as a view of it in that shape."""
    return value.reshape(shape) if isinstance(value, np.ndarray) else value.reshaped(shape)


def _copy(t: torch.Tensor) -> np.ndarray:
    # (a bfloat16 tensor's view is a float32 copy already)
    return _view(t) if t.dtype == torch.bfloat16 else _view(t).copy()


class _Recorder(TorchFunctionMode):
    """Every API call of the script while started: its inputs and outputs, as Records."""

    def __init__(self, debugger: "PrecisionDebugger"):
        super().__init__()
        self.d = debugger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        d = self.d
        d.touched = True
        if getattr(func, "__name__", None) == "backward":
            d.backward_from(args)
            return d.run(func, args, kwargs)
        # (a fused call computing in a dtype of its own does so whether dumped or not)
        inside = d.npu.inside_dtype(func, args) if d.npu is not None else None
        api = _api_name(func) if d.recording or d.keep_fp32 or inside else None
        # the dtype the call's kernels compute in, where it sets one: keep_fp32 first
        kept = "float32" if api is not None and d.npu is not None and d.kept(api) else inside
        if api is None or not (d.recording or kept):
            out = d.run(func, args, kwargs)
            if d.recording and getattr(func, "__name__", None) in _CONVERSIONS and \
                    isinstance(out, torch.Tensor) and args and out is not args[0]:
                d.converted(args[0], out)
            return out
        ins = tensors_in(args, kwargs)
        grads = torch.is_grad_enabled()
        origins = [where_from(t) for t in ins] if grads else None
        first = next_node() if grads else 0
        # the names of what it read (every tensor, initialiser's too): whose gradients its
        # backward hands on
        read = [d._name_of(t) for t in ins] if grads and d.recording else None
        if api.rsplit(".", 1)[-1] in _OVERWRITES or \
                getattr(func, "__module__", None) == "torch.nn.init":
            ins = ins[1:]           # an initialiser fills its tensor: nothing read from it
        before = d._before(ins) if d.recording else []
        written = _written_list(api, args)
        versions = [t._version for t in written]
        npu = d.npu
        held = npu.status if npu is not None else 0
        if npu is not None:
            npu.status = 0              # the call's own status word, then the step's again
            npu.inside += [kept] if kept else []
            npu.fired.clear()
        try:
            out = d.run(func, args, kwargs)
        finally:
            if npu is not None and kept:
                npu.inside.pop()
        status = npu.status if npu is not None else 0
        if npu is not None:
            npu.status = held | status
        for t, version in zip(written, versions):
            if t._version == version:
                increment_version(t)
        outs = tensors_in(out) or written
        if outs and d.recording:
            d._record(api, before, outs, status, sorted(npu.fired) if npu is not None else ())
        if grads and outs:
            d.watch_backward(api, origins, first, read, outs, kept)
        return out


_LIBRARY = (os.path.dirname(torch.__file__) + os.sep,
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def _freeze_heap() -> bool:
    """Leave the objects alive now out of Python's cyclic collector until stop() (gc.freeze):
    a dump makes thousands of objects a step, enough to set off full collections, and each
    scans the whole heap (with a Hugging Face model's imports: 0.1 to 0.2 s, beside a 0.8 s
    step). What the script makes from here on is collected as before; cyclic garbage made
    before start() waits for stop(). A heap the script froze itself, or a collector it
    turned off, is left as it is. Whether it froze."""
    if not gc.isenabled() or gc.get_freeze_count():
        return False
    gc.freeze()
    return True


def _call_site(frame) -> str:
    """The script's line that made a call: the first frame outside torch and this package
    (a model library's line, transformers' for a Hugging Face model, counts as the
    script's)."""
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(_LIBRARY):
            return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return ""


class _Modules:
    """The module path the script is in while it runs (global forward hooks): the dotted
    path named_modules gives from the outermost module called (its own class name when the
    call is the outermost module's own)."""

    def __init__(self, model=None, on_root=None):
        self.stack: List[str] = []
        # on_root(starting): the outermost module's forward starts (True) or ends (False)
        self.on_root = on_root
        self._names: Dict[int, str] = {}
        # parameters and buffers (and, named by the optimizer hook, optimizer state) -> their
        # names: the state a step reads from the steps before it
        self.variables = ByIdentity()
        self._optimizers: list = []     # weak references to the optimizers seen stepping
        if model is not None:
            self._name_tree(model)
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        self._handles = [register_module_forward_pre_hook(self._enter),
                         register_module_forward_hook(self._leave, always_call=True),
                         register_optimizer_step_pre_hook(self.name_state)]

    def _name_tree(self, root) -> None:
        for name, m in root.named_modules():
            self._names.setdefault(id(m), name or type(root).__name__)
        for name, t in [*root.named_parameters(), *root.named_buffers()]:
            if self.variables.get(t) is None:
                self.variables[t] = name

    def name_state(self, optimizer, args=None, kwargs=None) -> None:
        """An optimizer's state tensors, named by their parameter (`<param>.exp_avg`)."""
        if not any(ref() is optimizer for ref in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = self.variables.get(p)
                for key, t in optimizer.state.get(p, {}).items():
                    if name and isinstance(t, torch.Tensor) and self.variables.get(t) is None:
                        self.variables[t] = f"{name}.{key}"

    def drop_state_not_in(self, values) -> int:
        """The optimizer state a step from the NPU's state did not start with, dropped: a
        parameter the NPU's step read (it is in `values`) with none of its state there had
        none on the NPU (its loss scale skipped every update so far, and Adam makes its
        moments and step at its first), so the golden's step makes it afresh too, with the
        same calls. How many parameters' state was dropped."""
        dropped = 0
        for ref in self._optimizers:
            optimizer = ref()
            for group in optimizer.param_groups if optimizer is not None else ():
                for p in group["params"]:
                    name, state = self.variables.get(p), optimizer.state.get(p)
                    if name and state and name in values and \
                            not any(f"{name}.{key}" in values for key in state):
                        del optimizer.state[p]
                        dropped += 1
        return dropped

    def name_state_of_optimizers(self) -> None:
        """The state of every optimizer seen stepping named again: what its last step made
        (a momentum buffer made at the first) before the next step reads it."""
        for ref in self._optimizers:
            if ref() is not None:
                self.name_state(ref())

    def _enter(self, module, args):
        if id(module) not in self._names:      # a module outside any tree seen: a new root
            self._name_tree(module)
        if not self.stack and self.on_root is not None:
            self.on_root(True)
        self.stack.append(self._names[id(module)])

    def _leave(self, module, args, output):
        if self.stack:
            self.stack.pop()
            if not self.stack and self.on_root is not None:
                self.on_root(False)

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class PrecisionDebugger:
    """Dump a PyTorch script's API calls (see the module). target: "golden" (cpu/debug_<k>,
    the script as written) or "npu" (npu/debug_<k>, the simulated NPU under precision_mode,
    amp_level, modify_mixlist and overflow_mode). dump_step: "0|5|10" or "0|3-5" or "all"
    (default "0"); dump_mode: tensor (files) or statistics (index rows only); scope: dump
    only the calls whose name holds one of these strings (every call still runs simulated).
    golden_dtype: float32 (the script as written) or float64 (every call computed in it).
    fusion_switch: the NPU's fused kernels (simulate.FUSED): "on" (default), "off", or a
    fusion_switch.cfg (its path or dict) naming the passes on and off. replay_of: the run
    this one reruns (fix's and fo's reruns of the script say so, as a graph's replays do).
    skip_steps (the golden's): the steps whose update the golden skips as the NPU run's loss
    scale did ("3,7" or a list): GradScaler's unscale finds an overflow there, so that the
    steps after start from the same state as the NPU's; run.json says which. state_from (the
    golden's): "<NPU run directory>:<step>[,<step>...]": each of those steps starts from the
    NPU run's state and the last is the run's last (torch.state), a replay of the NPU run
    (replay_of) that decides drift."""

    def __init__(self, data_dir: Optional[str] = None, target: str = "npu",
                 precision_mode: str = "allow_mix_precision", amp_level: Optional[str] = None,
                 overflow_mode: str = "saturation", modify_mixlist=None,
                 dump_step: str = "0", dump_mode: str = "tensor", scope=None,
                 keep_fp32=None, golden_dtype: str = "float32", fusion_switch=None,
                 replay_of: Optional[str] = None, skip_steps=None,
                 state_from: Optional[str] = None):
        if target not in TARGETS:
            raise TorchFrontEndError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
        if dump_mode not in DUMP_MODES:
            raise TorchFrontEndError(f"dump_mode must be one of {', '.join(DUMP_MODES)}, "
                                     f"got {dump_mode!r}")
        self.root = layout.resolve_root(data_dir)
        self.target = target
        if fusion_switch not in (None, "on") and target != "npu":
            raise TorchFrontEndError("fusion_switch is a setting of the simulated NPU (target "
                                     "npu): the golden runs no fused kernel")
        if isinstance(fusion_switch, str) and fusion_switch.lstrip().startswith("{"):
            fusion_switch = _switch_text(fusion_switch)      # from the runner's environment
        try:
            passes = enabled_passes(fusion_switch)
        except PrecisionToolError as e:
            raise TorchFrontEndError(str(e)) from None
        self.config = SessionConfig(precision_mode=precision_mode, amp_level=amp_level,
                                    overflow_mode=overflow_mode, modify_mixlist=modify_mixlist,
                                    fusion_switch=switch_for(passes))
        self.steps = layout.parse_steps(dump_step)
        self.dump_mode = dump_mode
        self.summaries = dump_mode == "statistics"     # records keep statistics, not copies
        self.scope = tuple(scope) if scope else ()
        self.keep_fp32 = _keep_list(keep_fp32)
        if golden_dtype not in GOLDEN_DTYPES:
            raise TorchFrontEndError(f"golden_dtype must be one of {', '.join(GOLDEN_DTYPES)}, "
                                     f"got {golden_dtype!r}")
        self.golden_dtype = golden_dtype
        self.replay_of = replay_of
        self.skip_steps = _step_list(skip_steps)
        if self.skip_steps and target != "golden":
            raise TorchFrontEndError("skip_steps is a setting of the golden (target golden): "
                                     "the NPU's loss scale decides its own skips")
        self.state_from = parse_state_from(state_from) if state_from else None
        # what run.json says of it: the steps, and by step what was set and what was not
        self._state_set = {"run": self.state_from[0], "steps": list(self.state_from[1]),
                           "variables": {}, "not_set": {}} if self.state_from else None
        if self.state_from and target != "golden":
            raise TorchFrontEndError("state_from is a setting of the golden (target golden): "
                                     "it starts a step of the golden from the NPU's state")
        if self.keep_fp32 and target != "npu":
            raise TorchFrontEndError("keep_fp32 is a setting of the simulated NPU (target "
                                     "npu): the golden computes everything in fp32")
        self.step_number = 0
        self.run_dir: Optional[str] = None
        self.npu = None
        self.golden = None
        self._writer: Optional[RunWriter] = None
        self._queue = None                  # its writer thread (dump.writer)
        self._modes: List = []
        self._records: List[Record] = []
        self._counts: Dict[str, int] = {}
        self._names = ByIdentity()          # tensor -> (the call output it is (op:k), version)
        self._copies = ByIdentity()         # tensor -> (version, its copy) this step
        self._held = 0                      # the bytes of this step's copies (tensor dump)
        self._spill_error: Optional[DumpWriteError] = None    # a spill that failed
        # (address, size, dtype) of a contiguous tensor -> (it, its version, its copy)
        self._memory: Dict[tuple, tuple] = {}
        self._loss: Optional[float] = None
        self._modules: Optional[_Modules] = None
        self._scaler: Optional[ScalerWatch] = None
        self._autocast_off = None    # the golden's: autocast entered disabled while started
        self._collectives: Optional[CollectiveWatch] = None
        self._optimizer_hooks: list = []
        self._scale_row: Optional[tuple] = None    # GradScaler's (scale, next, finite)
        self.scaling = False        # a GradScaler scales the loss: its update ends a step
        self.auto_steps = False     # the runner's: steps end by themselves (see run.py)
        self.optimizer_seen = False
        self._forwards, self._backward_since = 0, False   # since the step began
        self._calls: Dict[str, dict] = {}      # op name -> its module and source line
        self._fused: Dict[str, set] = {}       # pass -> the dumped calls its kernels made
        self._fusion_changed = False           # ... with calls fusion_result.json lacks
        self._last: Optional[tuple] = None     # the call just recorded: (name, call site)
        # a forward tensor's name -> the backward outputs that are its gradient this step
        self._grad_of: Dict[str, List[str]] = {}
        self._grad_values: Dict[str, tuple] = {}   # a backward output's (copy, dtype), this step
        self._leaf_made = ByIdentity()      # a parameter -> its gradient's name, "" if several
        self._vars_read = ByIdentity()      # the state read so far this step
        # the parameters whose accumulation is watched: id -> the hook's handle (removed by
        # stop(): a hook holds the debugger, and with it what it keeps)
        self._leaf_hooked: Dict[int, object] = {}
        self.recording = False
        self.stopped: Optional[tuple] = None    # (step, error) once a write failure stopped it
        self.touched = False       # an API call since the last step ended (a step ran)
        self._froze_heap = False   # start() left the heap before it to the collector

    # -- the user's calls ------------------------------------------------------------------
    def start(self, model=None) -> None:
        """Begin (or resume) recording; the first start opens the run. model: accepted as
        msprobe's debugger takes it (the calls are recorded whatever module makes them)."""
        if self._writer is None:
            self._open()
        if self._modules is None:
            self._modules = _Modules(model, self._root_forward)
        if self._scaler is None:
            self._scaler = ScalerWatch(
                self._scaled, self._scaler_updated,
                self._overflowed if self.npu is not None else
                self._skipped_as_npu if self.skip_steps else None, self._raise_flag)
        if self.golden is not None and self._autocast_off is None:
            from .golden import AutocastOff
            self._autocast_off = AutocastOff(self.golden.lifted)
        if self._collectives is None and torch.distributed.is_available():
            self._collectives = CollectiveWatch(self._collective)
        if not self._optimizer_hooks:
            # an optimizer's step is one update on the device (a fused Adam kernel, as the
            # graph's ApplyAdam): every kernel of it computes in its variables' dtype
            from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                               register_optimizer_step_pre_hook)
            self._optimizer_hooks = [register_optimizer_step_pre_hook(self._updating),
                                     register_optimizer_step_post_hook(self._updated)]
        if self.npu is not None and not any(m is self.npu for m in self._modes):
            self.npu.__enter__()
            self._modes.append(self.npu)
        if not self._modes or not isinstance(self._modes[-1], _Recorder):
            rec = _Recorder(self)
            rec.__enter__()
            self._modes.append(rec)
        self.recording = self._wants(self.step_number)
        if not self._froze_heap:
            self._froze_heap = _freeze_heap()

    def stop(self, error: Optional[BaseException] = None) -> None:
        """Stop recording; the step in progress is written (with its history row). With the
        error that ended the script, the step in progress is not written (it is cut short)
        and run.json says which step and why."""
        if error is not None and self._writer is not None:
            self._records = []
            self._writer.record(script_failed={"step": self.step_number,
                                               "error": f"{type(error).__name__}: {error}"})
        self._end_step(tail=True)
        while self._modes:
            self._modes.pop().__exit__(None, None, None)
        if self._modules is not None:
            self._modules.remove()
            self._modules = None
        if self._scaler is not None:
            self._scaler.remove()
            self._scaler = None
        if self._autocast_off is not None:
            self._autocast_off.remove()
            self._autocast_off = None
        if self._collectives is not None:
            self._collectives.remove()
            self._collectives = None
        for handle in [*self._optimizer_hooks, *self._leaf_hooked.values()]:
            handle.remove()
        self._optimizer_hooks, self._leaf_hooked = [], {}
        if self._froze_heap:
            gc.unfreeze()
            self._froze_heap = False
        self.close()

    def close(self) -> None:
        """Wait until every dumped step is on disk, run.json listing them (stop() does;
        so does the process's exit, for a script that never stops the debugger)."""
        if self._writer is not None:
            try:
                self._queue.flush()
                self._writer.finish()
            except OSError as e:
                self._stop(e)

    def step(self, loss=None) -> None:
        """The end of a training step (after the optimizer's): the step is written if it is
        dumped; loss (optional) goes into the step history."""
        if loss is not None:
            self._loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self._forwards, self._backward_since = 0, False
        self._end_step()
        if self.state_from and self.step_number == self.state_from[1][-1]:
            raise StateReplayed()           # the steps from the NPU's state are written
        self.step_number += 1
        if self.state_from and self.step_number in self.state_from[1]:
            self._start_from_npu_state()
        self.recording = self._wants(self.step_number)

    def _start_from_npu_state(self) -> None:
        """The variables the NPU run's dump of this step read, set to the NPU's values
        (torch.state); run.json says how many, by step, and which it could not set."""
        path, step = self.state_from[0], self.step_number
        try:
            values = npu_state(path, step)
        except StateError as e:
            raise TorchFrontEndError(str(e)) from None
        if self._modules is not None:
            self._modules.name_state_of_optimizers()
        variables = self._modules.variables.items() if self._modules is not None else ()
        loaded, missing = set_state(variables, values)
        if self._modules is not None:
            dropped = self._modules.drop_state_not_in(values)
            if dropped:
                self._state_set.setdefault("state_dropped", {})[str(step)] = dropped
        scale = npu_loss_scale(path, step)
        if scale is not None and self._scaler is not None:
            self._scaler.scale_to = scale
            self._state_set.setdefault("loss_scale", {})[str(step)] = scale
        self._state_set["variables"][str(step)] = loaded
        if missing:
            self._state_set["not_set"][str(step)] = missing
        self.note(state_from=self._state_set)

    # -- calls kept in fp32, the loss --------------------------------------------------------
    def kept(self, api: str) -> bool:
        """Whether a call of `api` made now computes in fp32: keep_fp32 names its API
        (Torch.matmul) or a module path it is made in (encoder.layer.0.attention)."""
        if api in self.keep_fp32:
            return True
        module = self._modules.current if self._modules is not None else ""
        return bool(module) and any(module == k or module.startswith(k + ".")
                                    for k in self.keep_fp32)

    def backward_from(self, args) -> None:
        """backward() on a scalar: the step's loss, unless the script hands one to step()
        or a GradScaler scaled it (its scale() saw the loss before it was scaled)."""
        self._backward_since = True
        if self._loss is None and args and isinstance(args[0], torch.Tensor) and \
                args[0].numel() == 1:
            self._loss = float(args[0].detach())

    def _updating(self, *args) -> None:
        self.optimizer_seen = True
        if self.npu is not None:
            self.npu.updating = True

    def _updated(self, *args) -> None:
        if self.npu is not None:
            self.npu.updating = False

    def _root_forward(self, starting: bool) -> None:
        """The outermost module's forward starts or ends. Under the runner, a script that
        neither steps an optimizer nor calls backward (inference) has a step per forward:
        one ends when the next forward starts."""
        if not starting:
            self._forwards += 1
        elif self.auto_steps and self._forwards and not self._backward_since and \
                not self.optimizer_seen and not self.scaling:
            self.step()

    def _collective(self, api: str, ins, call):
        """A collective of torch.distributed (collectives.CollectiveWatch): run, and
        recorded as a call of the step, what the rank handed in and what it got back."""
        if not self.recording:
            return call()[0]
        before = self._before(ins)
        result, outs = call()
        for t in outs:
            # the process group writes its result without bumping the tensor's version:
            # the copy taken before the call is not its value now, nor that of any view of
            # its memory (a bucket's slices)
            self._copies[t] = None
        if outs:
            self._memory.clear()
            self._record(api, before, outs)
        return result

    def _scaled(self, loss) -> None:
        self.scaling = True
        if self._loss is None:
            self._loss = float(loss.detach())

    def _overflowed(self) -> bool:
        """Whether a kernel of this step set the simulated device's status word, in
        saturation mode: there torch_npu's scaler reads the device's flag (a saturated
        overflow leaves no inf in the gradients to find). In inf_nan mode it checks the
        gradients' values, as torch's own does: an inf the script makes and masks (T5's
        log of a zero distance) sets the flag, never the gradients."""
        return self.npu.saturation and bool(self.npu.status)

    def _raise_flag(self, found_inf: torch.Tensor) -> None:
        """GradScaler's found_inf set, as the device's check sets it from its status word:
        the value is the check's output, whose name it keeps (a write no call records
        would end it, and what reads the flag would have no golden to compare with)."""
        named = self._name_of(found_inf)
        with torch._C.DisableTorchFunction():      # the tool's write: no API call
            found_inf.fill_(1.0)
        if named is not None:
            self._name(found_inf, named)

    def _skipped_as_npu(self) -> bool:
        """Whether the golden skips this step's update, as the NPU run's loss scale did."""
        return self.step_number in self.skip_steps

    def _scaler_updated(self, scale: float, after: float, finite: bool) -> None:
        """GradScaler.update: the step's loss scale decision; under the runner it ends the
        step (the optimizer's step is skipped when the gradients were not finite)."""
        self._scale_row = (scale, after, finite)
        if self.auto_steps:
            self.step()

    def run(self, func, args, kwargs):
        """An API call as this target makes it: the golden's in float32 whatever it asks, the
        NPU's with the device's fused kernels."""
        if self.golden is not None:
            return self.golden.call(func, args, kwargs)
        if self.npu is not None:
            return self.npu.call(func, args, kwargs)
        return func(*args, **kwargs)

    def note(self, **facts) -> None:
        """More for run.json (the runner's: the script and how it was run)."""
        if self._writer is not None:
            self._writer.record(**facts)

    def _wants(self, step: int) -> bool:
        return self._writer is not None and (self.steps is None or step in self.steps)

    # -- inside ------------------------------------------------------------------------------
    def _open(self) -> None:
        info = {"graph": "torch", "front_end": "pytorch", "torch": torch.__version__,
                **rank_info(),
                "actions": ["dump"], "dump_step": "all" if self.steps is None else sorted(self.steps),
                "dump_mode": "all", "dump_data": "stats" if self.dump_mode == "statistics" else "tensor",
                "replay_of": self.replay_of, "values_from": None}
        if self.target == "npu":
            from .simulate import SimulatedNPU
            self.npu = SimulatedNPU(self.config)
            cfg = self.config
            info.update(precision_mode=cfg.precision_mode, amp_level=cfg.amp_level,
                        overflow_mode=cfg.overflow_mode, mode="pynative",
                        keep_fp32=list(self.keep_fp32),
                        fusion_passes=sorted(self.npu.passes),
                        numerics="simulated at the kernel level: the policy's dtypes, fp32 "
                                 "accumulation, rounding per kernel")
            target = layout.NPU
        elif self.golden_dtype == "float64":
            from .golden import GoldenFP64
            self.golden = GoldenFP64()
            info.update(golden_dtype="float64",
                        numerics="every call computed in float64 (its float arguments "
                                 "widened; what the script creates, and its parameters, "
                                 "keep their dtype)")
            target = layout.GOLDEN
        else:
            from .golden import GoldenFP32
            self.golden = GoldenFP32()
            info.update(golden_dtype="float32",
                        numerics="the script as written, every kernel in float32 (a cast to "
                                 "float16/bfloat16 or autocast computes in float32)")
            target = layout.GOLDEN
        if self.skip_steps:
            # not the script as written at these steps: their updates skipped as the NPU's
            info.update(skips_as_npu=sorted(self.skip_steps))
        try:
            self._writer = RunWriter(self.root, target, info, fusion_result=None if
                                     self.npu is None else fusion_record("torch", {}))
        except DumpWriteError as e:         # no run directory: the script runs undumped
            self._stop(e)
            return
        self.run_dir = self._writer.run_dir
        # one step written while the next runs (a small one: IN_PLACE_BYTES); a tensor dump
        # holds two steps' copies at most
        self._queue = make_writer(max_pending=1)
        close_at_exit(self)

    def _snapshot(self, t: torch.Tensor) -> np.ndarray:
        """t's value now, copied once per version: an output read by the next call (and a
        parameter read by several) is one copy; torch's version counter says when an
        in-place call changed it since."""
        key = _key(t)
        held = self._copies.get(t)
        if held is not None and held[0] == key:
            return held[1]
        # a contiguous tensor's memory, in order: what a view of it shares
        memory = (t.data_ptr(), t.numel(), t.dtype) if t.numel() and t.is_contiguous() \
            else None
        value = self._same_memory(t, memory) if memory is not None else None
        if value is None:
            # a statistics dump keeps the statistics, not a copy (a step's every activation
            # twice over, for big models)
            value = Summary(_view(t)) if self.summaries else self._tensor_value(t)
            if memory is not None:
                self._memory[memory] = (weakref.ref(t), t._version, value)
        self._copies[t] = (key, value)
        return value

    def _same_memory(self, t: torch.Tensor, memory: tuple):
        """The value kept of a live tensor whose memory (address, size, dtype) t is, element
        for element in the same order and unchanged since (a view, reshape or flatten of a
        contiguous tensor: one copy for both), in t's shape; None where there is none."""
        held = self._memory.get(memory)
        other = held[0]() if held is not None else None
        # a live tensor's memory is its own: at the same address only a view of it, which
        # shares its version counter, is (two tensors made from one buffer are not)
        if other is None or held[1] != t._version or _root(other) is not _root(t):
            return None
        return _reshaped(held[2], tuple(t.shape))

    def _tensor_value(self, t: torch.Tensor):
        """What a tensor dump keeps of t's value: a copy, or once the step has copied
        IN_PLACE_BYTES, t written to the step's files now (Spilled: no copy). A value that
        is not written as it is (bfloat16, fp16 on the NPU) is copied all the same."""
        value = _view(t)
        if t.dtype != torch.bfloat16:       # (a bfloat16 tensor's view is a float32 copy)
            if self._held > IN_PLACE_BYTES and self._spill_error is None and \
                    disk_dtype(value, self._dtype(t)) == value.dtype:
                try:
                    return self._writer.spill(self.step_number, value)
                except DumpWriteError as e:     # the step ends the dump (_write_step)
                    self._spill_error = e
            value = value.copy()
        self._held += value.nbytes
        return value

    def _before(self, ins) -> list:
        """What a call reads, as it is before the call (an in-place call changes it): each
        input with its copy, its name and its version."""
        return [(t, self._snapshot(t), self._name_of(t), t._version) for t in ins]

    def _name_of(self, t: torch.Tensor) -> Optional[str]:
        """The call output t is, while its value is that output's: a write no call records
        (`x[3] = nan`, a kernel writing an input) bumps its version and ends the name (what
        reads it then reads an input from outside, dumped as it is)."""
        held = self._names.get(t)
        return held[0] if held is not None and held[1] == t._version else None

    def converted(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """out is t in another dtype or on another device (`.to`, no API call of its own), or
        t detached: it stands for the call output t is. (Detached, SGD's momentum buffer's
        first copy of a gradient read "an input from outside": a bias gradient crossing
        the threshold gradually then read as a divergence with no op to start it, a
        finding in a healthy ResNet-18 run.) A cast a script makes on one target only (T5's
        `hidden.to(wo.weight.dtype)`, taken where autocast made hidden fp16, not in the
        golden) then leaves both runs' names alike, forward and backward (the gradient its
        reader hands back is named by what that reader read), as a cast the compiler
        inserts does; the values are the cast's own."""
        named = self._name_of(t)
        if named is not None:
            self._name(out, named)

    def _name(self, t: torch.Tensor, name: str) -> None:
        self._names[t] = (name, t._version)

    def _record(self, api: str, before, outs, status: int = 0, fused=()) -> None:
        k = self._counts.get(api, 0)
        self._counts[api] = k + 1
        name = f"{api}.{k}.forward"
        if self.scope and not any(s in name for s in self.scope):
            return
        inputs, in_specs, in_values = [], [], []
        for i, (t, value, named, version) in enumerate(before):
            known = None
            var = self._modules.variables.get(t) if self._modules is not None else None
            if var is not None and self._vars_read.get(t) is None:
                # state, read the first time this step: a Variable (whatever made it earlier
                # in the step: an initialiser whose value a .data write has changed since)
                self._vars_read[t] = True
                known = self._variable(var, t, value, version)
            known = known or named
            inputs.append(known or f"{name}.input:{i}")
            in_specs.append(TensorSpec(self._dtype(t)))
            in_values.append(value)
        out_values, out_specs = [], []
        for i, t in enumerate(outs):
            out_values.append(self._snapshot(t))
            out_specs.append(TensorSpec(self._dtype(t)))
            self._name(t, f"{name}:{i}")
        # the fusion pass(es) whose fused kernel the call ran, as a graph's fused node names
        # its pass
        spec = OpSpec(api, name, tuple(inputs), tuple(in_specs), tuple(out_specs),
                      "+".join(fused))
        for p in fused:
            calls = self._fused.setdefault(p, set())
            self._fusion_changed |= name not in calls
            calls.add(name)
        site = {"module": self._modules.current if self._modules else "",
                "source": _call_site(sys._getframe(2))}
        self._calls[name] = dict(site, **self._kernels(outs))
        self._append(spec, in_values, out_values, status)
        self._last = (name, site)

    def watch_backward(self, api: str, origins, first: int, read, outs,
                       kept: Optional[str]) -> None:
        """The call's backward (backward.call_graph: every node it made from `first` on):
        its kernels in the dtype the call computes in (kept: "float32" for a call kept in
        fp32), the status word they set, and, when the call was recorded, its record
        (`<call>.backward`: the gradients its outputs receive as inputs, those it hands to
        each of its inputs as outputs, in input order) written when the last of its nodes
        that hand a gradient on has run."""
        recorded = self._last is not None and self.recording
        name, site = self._last if recorded else (None, None)
        self._last = None
        if not (recorded or kept):
            return
        graph = call_graph(origins, outs, first)
        if not graph.nodes:
            return
        npu = self.npu
        back = name.replace(".forward", ".backward") if recorded else None
        state = {"held": [], "status": 0, "in": [], "out": {}, "left": set()}
        waiting = {id(n) for n, _, _ in graph.edges}
        heads = {id(n) for n in graph.heads}
        outputs = {(id(o.grad_fn), o.output_nr): j for j, o in enumerate(outs)
                   if o.grad_fn is not None}
        edges = {}
        reached = sorted({k for _, _, k in graph.edges})   # the inputs given a gradient
        for node, i, k in graph.edges:
            edges.setdefault(id(node), []).append((i, k))
        state["left"] = set(waiting)

        def enter(grad_outputs):
            if npu is not None:
                state["held"].append(npu.status)
                npu.status = 0
                npu.inside += [kept] if kept else []

        def leave(grad_inputs, grad_outputs, node_id):
            if npu is not None:
                status = npu.status
                npu.status = state["held"].pop() | status
                if kept:
                    npu.inside.pop()
                state["status"] |= status
            if back is None or not self.recording:
                return
            if node_id in heads:
                state["in"] += [(outputs.get((node_id, r), r), g)
                                for r, g in enumerate(grad_outputs) if isinstance(g, torch.Tensor)]
            for i, k in edges.get(node_id, ()):
                g = grad_inputs[i]
                if isinstance(g, torch.Tensor):
                    held = state["out"].get(k)
                    if held is None:
                        # kept now, while it is in the cache (autograd may sum into it
                        # later): one copy, or statistics, per tensor and version
                        state["out"][k] = (g, self._snapshot(g), False)
                    else:                   # the call read the input twice: their sum
                        so_far = _values(held[0]) if isinstance(held[1], Summary) else \
                            held[1].load() if isinstance(held[1], Spilled) else held[1]
                        state["out"][k] = (g, so_far + _copy(g), True)
                    leaf = origins[k][2]
                    if leaf is not None:    # now: autograd accumulates it before the rest runs
                        self._leaf_grad(leaf, f"{back}:{reached.index(k)}",
                                        state["out"][k][1])
            state["left"].discard(node_id)
            if not state["left"] and state["out"]:
                self._record_backward(api, back, site, state, name, read)
                state.update({"in": [], "out": {}, "left": set(waiting), "status": 0})

        # on the NPU every node's kernels count (status word, dtype); on the golden only the
        # nodes the gradients enter and leave by
        hooked = graph.nodes if npu is not None else \
            [n for n in graph.nodes if id(n) in heads or id(n) in edges]
        for node in hooked:
            if npu is not None:
                node.register_prehook(enter)
            node.register_hook(lambda gi, go, node_id=id(node): leave(gi, go, node_id))

    def _record_backward(self, api: str, back: str, site: dict, state: dict, forward: str,
                         read) -> None:
        """The record of a call's backward. Its inputs are the gradients of the call's
        outputs, each named as the one backward output that made it (the call's output read
        by one call), or as an input from outside where autograd summed several: names
        from the forward's, the same on both targets (which tensor autograd hands on, and
        whether it sums in place, is not)."""
        gin = sorted(state["in"], key=lambda jg: jg[0])
        outs = [(k, *state["out"][k][:2]) for k in sorted(state["out"])]
        # a gradient is read twice a step (one call's backward output, the next one's
        # input): where autograd hands on that very tensor unchanged, the value kept of it
        inputs, values = [], [self._snapshot(g) for _, g in gin]
        for i, (j, g) in enumerate(gin):
            made = self._grad_of.get(f"{forward}:{j}", ())
            if len(made) > 1:               # autograd summed them: that sum is an op too
                inputs.append(self._record_sum(f"{back}.grad_sum.{i}", made, g, values[i],
                                               site))
            else:
                inputs.append(made[0] if made else f"{back}.input:{i}")
        for m, (k, _, _) in enumerate(outs):
            if read is not None and k < len(read) and read[k] is not None:
                self._grad_of.setdefault(read[k], []).append(f"{back}:{m}")
        self._calls[back] = dict(site, **self._kernels([g for _, g, _ in outs]))
        spec = OpSpec(api, back, tuple(inputs),
                      tuple(TensorSpec(self._dtype(g)) for _, g in gin),
                      tuple(TensorSpec(self._dtype(g)) for _, g, _ in outs))
        outs = [(k, g, self._kept(v)) for k, g, v in outs]
        for m, (k, g, v) in enumerate(outs):
            self._grad_values[f"{back}:{m}"] = (v, self._dtype(g))
        self._append(spec, values, [v for _, _, v in outs], state["status"])

    def _record_sum(self, name: str, made, g, value, site) -> str:
        """Autograd's sum of the gradients several calls handed one tensor, as its own op
        (`Autograd.accumulate`, a sum, as AddN in a graph): what each term changes is then
        judged by what the sum does with it. Returns its output's name."""
        held = [self._grad_values.get(n) for n in made]
        if any(t is None for t in held):     # a term not recorded: the sum is from outside
            return f"{name}.input:0"
        terms = [value for value, _ in held]
        self._calls[name] = dict(site, **({"kernels": "AddN"} if self.npu is not None else {}))
        spec = OpSpec("Autograd.accumulate", name, tuple(made),
                      tuple(TensorSpec(dtype) for _, dtype in held),
                      (TensorSpec(self._dtype(g)),))
        self._append(spec, terms, [value])
        return f"{name}:0"

    def _append(self, spec: OpSpec, inputs, outputs, status: int = 0) -> None:
        """One record of the step: on the NPU with its task (the status word its kernels
        set: an Opdebug record when not 0)."""
        if self.summaries:
            inputs, outputs = [self._kept(v) for v in inputs], [self._kept(v) for v in outputs]
        self._records.append(Record(spec, inputs, outputs,
                                    _Task(len(self._records), status)
                                    if self.target == "npu" else None,
                                    int(time.time() * 1e6)))

    def _kept(self, value):
        """What a record keeps of a value: the value, or (a statistics dump) its Summary (of
        a gradient held as autograd's tensor: its values)."""
        if self.summaries and isinstance(value, (np.ndarray, torch.Tensor)):
            return Summary(_values(value))
        return value

    def _variable(self, var: str, t, value, version: int) -> str:
        """A parameter, buffer or optimizer state as the step first reads it: a `Variable`
        op of its own (its name the parameter's: the same in every step and on both
        targets), as a graph run's state is; what reads it reads `<name>:0` until an
        in-place call changes it."""
        spec = OpSpec("Variable", var, (), (), (TensorSpec(self._dtype(t)),))
        self._append(spec, [], [value])
        self._names[t] = (f"{var}:0", version)
        return f"{var}:0"

    def _leaf_grad(self, leaf, name: str, value) -> None:
        """A leaf's gradient is the backward output `name` (its value kept: value) when it
        is the only one that reaches it this step (one call's edges count once) and its
        .grad was empty (zeroed): the update that reads .grad then reads that output, and
        that value (autograd took the tensor or copied it). Named when autograd has
        accumulated it (a hook per leaf)."""
        fresh = leaf.grad is None
        made = self._leaf_made.get(leaf)
        if fresh and made is None:
            self._leaf_made[leaf] = (name, value)
        elif made and made[0] == name:
            # the same call's output again (an unfused LSTM's every time step reads the
            # bias): autograd summed its edges into .grad in the leaf's dtype, and that sum,
            # not the record's, is the value the update reads
            self._leaf_made[leaf] = (name, None)
        else:
            self._leaf_made[leaf] = ""
        if id(leaf) in self._leaf_hooked:
            return

        def accumulated(param):
            made = self._leaf_made.get(param)
            if made and param.grad is not None:
                self._name(param.grad, made[0])
                if made[1] is not None:
                    self._copies[param.grad] = (_key(param.grad), made[1])
        self._leaf_hooked[id(leaf)] = leaf.register_post_accumulate_grad_hook(accumulated)

    def _kernels(self, outs) -> dict:
        """{"kernels": "MatMul,MatMul,ReduceSum"}: the op type of the kernel that made each
        output, on the NPU (the compare's sum kinds: a bias gradient is a sum); {} else."""
        if self.npu is None:
            return {}
        return {"kernels": ",".join(self.npu.kernel_of(t) for t in outs)}

    def _dtype(self, t: torch.Tensor) -> str:
        if self.npu is not None:
            return self.npu.dtype_of(t) or "float32"
        return str(t.dtype).replace("torch.", "")

    def _stop(self, error: Exception) -> None:
        """A write failed (a full disk): the dump ends here with one warning, run.json says
        so, and the script goes on undumped."""
        error = error if isinstance(error, DumpWriteError) else write_error(error)
        self.recording = False
        self._records = []
        writer, self._writer = self._writer, None
        step = self.step_number
        if writer is not None:
            step = writer.abandon(self._queue, step)
        self.stopped = (step, str(error))
        warn_stopped(self.run_dir, step, error,
                     writer.dumped_steps if writer is not None else [],
                     "the script goes on")
        if writer is not None:
            try:
                writer.stopped(step, str(error))
            except OSError:
                pass

    def _end_step(self, tail: bool = False) -> None:
        try:
            if self._writer is not None:
                self._write_step(tail)
        except (DumpWriteError, OSError) as e:
            self._stop(e)
        if self._writer is not None:    # values spilled by a step not written (cut short)
            self._writer.drop_spilled()
        self._held, self._spill_error = 0, None
        if self.npu is not None:        # the status word is the step's, dumped or not
            self.npu.status = 0

    def _write_step(self, tail: bool = False) -> None:
        status = self.npu.status if self.npu is not None else 0
        # stop() after the last step: what ran since is a step only if it dumped a call or
        # computed a loss (a final loss.item() is no step)
        if not ((self.touched and not tail) or self._records or self._loss is not None):
            return
        self._writer.observed(self.step_number, status, self._scale_row, self._loss)
        if self._spill_error is not None:
            raise self._spill_error
        if self._records and (self.steps is None or self.step_number in self.steps):
            files = self.dump_mode == "tensor"
            if files and self._held > IN_PLACE_BYTES:
                self._queue.flush()             # the steps before it first
                self._writer.write_step(self.step_number, self._records, files=files,
                                        calls=self._calls)
            else:
                self._writer.put_step(self._queue, self.step_number, self._records,
                                      files=files, calls=self._calls)
            if self._fusion_changed:       # a step's calls are the last step's, mostly
                self._writer.fusion(fusion_record("torch", self._fused))
                self._fusion_changed = False
        if self.npu is not None and self.npu.unclassified:
            self._writer.record(not_simulated=sorted(self.npu.unclassified))
        if self.golden is not None and self.golden.lifted:
            self._writer.record(lifted_to_float32=sorted(self.golden.lifted))
        # names are the step's: a tensor made in an earlier step is an input from outside it
        # (its call's name would collide with this step's call of the same name and index)
        self._records, self._counts, self._loss, self.touched = [], {}, None, False
        self._calls, self._scale_row, self._grad_of, self._grad_values = {}, None, {}, {}
        self._leaf_made, self._vars_read = ByIdentity(), ByIdentity()
        self._names, self._copies, self._memory = ByIdentity(), ByIdentity(), {}
        self._writer.finish()
