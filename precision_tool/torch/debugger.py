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

import os
import sys
import time
from typing import Dict, List, Optional

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from ..dump import layout
from ..dump.runwriter import OpSpec, Record, RunWriter, TensorSpec, warn_stopped
from ..dump.writer import DumpWriteError, write_error
from ..runtime.config import SessionConfig
from .simulate import ByIdentity, tensors_in

TARGETS = ("npu", "golden")
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


# in-place fills: what the tensor held before (often uninitialised memory) is not an input
_OVERWRITES = frozenset({"uniform_", "normal_", "zero_", "fill_", "random_", "bernoulli_",
                         "exponential_", "geometric_", "log_normal_", "cauchy_", "copy_",
                         "set_", "resize_"})


class TorchFrontEndError(ValueError):
    """A debugger setting that cannot be used."""


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


def _copy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.to(torch.float32)
    return t.cpu().numpy().copy()


class _Recorder(TorchFunctionMode):
    """Every API call of the script while started: its inputs and outputs, as Records."""

    def __init__(self, debugger: "PrecisionDebugger"):
        super().__init__()
        self.d = debugger

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.d.touched = True
        api = _api_name(func) if self.d.recording else None
        if api is None:
            return func(*args, **kwargs)
        ins = tensors_in(args, kwargs)
        if api.rsplit(".", 1)[-1] in _OVERWRITES or \
                getattr(func, "__module__", None) == "torch.nn.init":
            ins = ins[1:]           # an initialiser fills its tensor: nothing read from it
        before = [(t, self.d._snapshot(t)) for t in ins]   # an in-place call changes them
        npu = self.d.npu
        held = npu.status if npu is not None else 0
        if npu is not None:
            npu.status = 0              # the call's own status word, then the step's again
        out = func(*args, **kwargs)
        status = npu.status if npu is not None else 0
        if npu is not None:
            npu.status = held | status
        outs = tensors_in(out)
        if outs:
            self.d._record(api, before, outs, status)
        return out


_LIBRARY = (os.path.dirname(torch.__file__) + os.sep,
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


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

    def __init__(self, model=None):
        self.stack: List[str] = []
        self._names: Dict[int, str] = {}
        if model is not None:
            self._name_tree(model)
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)
        self._handles = [register_module_forward_pre_hook(self._enter),
                         register_module_forward_hook(self._leave, always_call=True)]

    def _name_tree(self, root) -> None:
        for name, m in root.named_modules():
            self._names.setdefault(id(m), name or type(root).__name__)

    def _enter(self, module, args):
        if id(module) not in self._names:      # a module outside any tree seen: a new root
            self._name_tree(module)
        self.stack.append(self._names[id(module)])

    def _leave(self, module, args, output):
        if self.stack:
            self.stack.pop()

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
    only the calls whose name holds one of these strings (every call still runs simulated)."""

    def __init__(self, data_dir: Optional[str] = None, target: str = "npu",
                 precision_mode: str = "allow_mix_precision", amp_level: Optional[str] = None,
                 overflow_mode: str = "saturation", modify_mixlist=None,
                 dump_step: str = "0", dump_mode: str = "tensor", scope=None):
        if target not in TARGETS:
            raise TorchFrontEndError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
        if dump_mode not in DUMP_MODES:
            raise TorchFrontEndError(f"dump_mode must be one of {', '.join(DUMP_MODES)}, "
                                     f"got {dump_mode!r}")
        self.root = layout.resolve_root(data_dir)
        self.target = target
        self.config = SessionConfig(precision_mode=precision_mode, amp_level=amp_level,
                                    overflow_mode=overflow_mode, modify_mixlist=modify_mixlist)
        self.steps = layout.parse_steps(dump_step)
        self.dump_mode = dump_mode
        self.scope = tuple(scope) if scope else ()
        self.step_number = 0
        self.run_dir: Optional[str] = None
        self.npu = None
        self.golden = None
        self._writer: Optional[RunWriter] = None
        self._modes: List = []
        self._records: List[Record] = []
        self._counts: Dict[str, int] = {}
        self._names = ByIdentity()          # tensor -> the call output it is (op:k)
        self._copies = ByIdentity()         # tensor -> (version, its copy) this step
        self._loss: Optional[float] = None
        self._modules: Optional[_Modules] = None
        self._calls: Dict[str, dict] = {}      # op name -> its module and source line
        self.recording = False
        self.stopped: Optional[tuple] = None    # (step, error) once a write failure stopped it
        self.touched = False       # an API call since the last step ended (a step ran)

    # -- the user's calls ------------------------------------------------------------------
    def start(self, model=None) -> None:
        """Begin (or resume) recording; the first start opens the run. model: accepted as
        msprobe's debugger takes it (the calls are recorded whatever module makes them)."""
        if self._writer is None:
            self._open()
        if self._modules is None:
            self._modules = _Modules(model)
        kernels = self.npu if self.target == "npu" else self.golden
        if kernels is not None and not any(m is kernels for m in self._modes):
            kernels.__enter__()
            self._modes.append(kernels)
        if not self._modes or not isinstance(self._modes[-1], _Recorder):
            rec = _Recorder(self)
            rec.__enter__()
            self._modes.append(rec)
        self.recording = self._wants(self.step_number)

    def stop(self, error: Optional[BaseException] = None) -> None:
        """Stop recording; the step in progress is written (with its history row). With the
        error that ended the script, the step in progress is not written (it is cut short)
        and run.json says which step and why."""
        if error is not None and self._writer is not None:
            self._records = []
            self._writer.record(script_failed={"step": self.step_number,
                                               "error": f"{type(error).__name__}: {error}"})
        self._end_step()
        while self._modes:
            self._modes.pop().__exit__(None, None, None)
        if self._modules is not None:
            self._modules.remove()
            self._modules = None
        if self._writer is not None:
            try:
                self._writer.finish()
            except OSError as e:
                self._stop(e)

    def step(self, loss=None) -> None:
        """The end of a training step (after the optimizer's): the step is written if it is
        dumped; loss (optional) goes into the step history."""
        if loss is not None:
            self._loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self._end_step()
        self.step_number += 1
        self.recording = self._wants(self.step_number)

    def _wants(self, step: int) -> bool:
        return self._writer is not None and (self.steps is None or step in self.steps)

    # -- inside ------------------------------------------------------------------------------
    def _open(self) -> None:
        info = {"graph": "torch", "front_end": "pytorch", "torch": torch.__version__,
                "actions": ["dump"], "dump_step": "all" if self.steps is None else sorted(self.steps),
                "dump_mode": "all", "dump_data": "stats" if self.dump_mode == "statistics" else "tensor",
                "replay_of": None, "values_from": None}
        if self.target == "npu":
            from .simulate import SimulatedNPU
            self.npu = SimulatedNPU(self.config)
            cfg = self.config
            info.update(precision_mode=cfg.precision_mode, amp_level=cfg.amp_level,
                        overflow_mode=cfg.overflow_mode, mode="pynative",
                        numerics="simulated at the kernel level: the policy's dtypes, fp32 "
                                 "accumulation, rounding per kernel")
            target = layout.NPU
        else:
            from .golden import GoldenFP32
            self.golden = GoldenFP32()
            info.update(golden_dtype="float32",
                        numerics="the script as written, every kernel in float32 (a cast to "
                                 "float16/bfloat16 or autocast computes in float32)")
            target = layout.GOLDEN
        try:
            self._writer = RunWriter(self.root, target, info)
        except DumpWriteError as e:         # no run directory: the script runs undumped
            self._stop(e)
            return
        self.run_dir = self._writer.run_dir

    def _snapshot(self, t: torch.Tensor) -> np.ndarray:
        """t's value now, copied once per version: an output read by the next call (and a
        parameter read by several) is one copy; torch's version counter says when an
        in-place call changed it since."""
        key = (int(t._version), t.dtype, tuple(t.shape))
        held = self._copies.get(t)
        if held is not None and held[0] == key:
            return held[1]
        value = _copy(t)
        self._copies[t] = (key, value)
        return value

    def _name_of(self, t: torch.Tensor) -> Optional[str]:
        return self._names.get(t)

    def _record(self, api: str, before, outs, status: int = 0) -> None:
        k = self._counts.get(api, 0)
        self._counts[api] = k + 1
        name = f"{api}.{k}.forward"
        if self.scope and not any(s in name for s in self.scope):
            return
        inputs, in_specs, in_values = [], [], []
        for i, (t, value) in enumerate(before):
            inputs.append(self._name_of(t) or f"{name}.input:{i}")
            in_specs.append(TensorSpec(self._dtype(t)))
            in_values.append(value)
        out_values, out_specs = [], []
        for i, t in enumerate(outs):
            out_values.append(self._snapshot(t))
            out_specs.append(TensorSpec(self._dtype(t)))
            self._names[t] = f"{name}:{i}"
        spec = OpSpec(api, name, tuple(inputs), tuple(in_specs), tuple(out_specs))
        site = {"module": self._modules.current if self._modules else "",
                "source": _call_site(sys._getframe(2))}
        self._calls[name] = site
        self._records.append(Record(spec, in_values, out_values,
                                    _Task(len(self._records), status)
                                    if self.target == "npu" else None,
                                    int(time.time() * 1e6)))
        if torch.is_grad_enabled():
            self._hook_backward(api, name, outs, site)

    def _hook_backward(self, api: str, name: str, outs, site: dict) -> None:
        """The call's backward, recorded when autograd runs it: its grad_fn's hook hands the
        gradients flowing in (grad_outputs) and out (grad_inputs)."""
        fns = {id(o.grad_fn): o.grad_fn for o in outs if o.grad_fn is not None}
        for fn in fns.values():
            def hook(grad_inputs, grad_outputs, fn_name=name.replace(".forward", ".backward")):
                if not self.recording:
                    return
                gin = [g for g in grad_outputs if isinstance(g, torch.Tensor)]
                gout = [g for g in grad_inputs if isinstance(g, torch.Tensor)]
                if not gout:
                    return
                self._calls[fn_name] = site
                spec = OpSpec(api, fn_name,
                              tuple(f"{fn_name}.input:{i}" for i in range(len(gin))),
                              tuple(TensorSpec(self._dtype(g)) for g in gin),
                              tuple(TensorSpec(self._dtype(g)) for g in gout))
                self._records.append(Record(spec, [_copy(g) for g in gin],
                                            [_copy(g) for g in gout],
                                            _Task(len(self._records)) if self.target == "npu"
                                            else None, int(time.time() * 1e6)))
            fn.register_hook(hook)

    def _dtype(self, t: torch.Tensor) -> str:
        if self.npu is not None:
            return self.npu.dtype_of(t) or "float32"
        return str(t.dtype).replace("torch.", "")

    def _stop(self, error: Exception) -> None:
        """A write failed (a full disk): the dump ends here with one warning, run.json says
        so, and the script goes on undumped."""
        error = error if isinstance(error, DumpWriteError) else write_error(error)
        self.stopped = (self.step_number, str(error))
        self.recording = False
        self._records = []
        writer, self._writer = self._writer, None
        warn_stopped(self.run_dir, self.step_number, error,
                     writer.dumped_steps if writer is not None else [],
                     "the script goes on")
        if writer is not None:
            try:
                writer.stopped(self.step_number, str(error))
            except OSError:
                pass

    def _end_step(self) -> None:
        if self._writer is None:
            return
        try:
            self._write_step()
        except (DumpWriteError, OSError) as e:
            self._stop(e)

    def _write_step(self) -> None:
        status = self.npu.status if self.npu is not None else 0
        if not (self.touched or self._records or self._loss is not None):
            return                     # stop() right after step(): no step ran since
        self._writer.observed(self.step_number, status, None, self._loss)
        if self._records and (self.steps is None or self.step_number in self.steps):
            self._writer.write_step(self.step_number, self._records,
                                    files=self.dump_mode == "tensor", calls=self._calls)
        if self.npu is not None:
            self.npu.status = 0
            if self.npu.unclassified:
                self._writer.record(not_simulated=sorted(self.npu.unclassified))
        if self.golden is not None and self.golden.lifted:
            self._writer.record(lifted_to_float32=sorted(self.golden.lifted))
        # names are the step's: a tensor made in an earlier step is an input from outside it
        # (its call's name would collide with this step's call of the same name and index)
        self._records, self._counts, self._loss, self.touched = [], {}, None, False
        self._calls = {}
        self._names, self._copies = ByIdentity(), ByIdentity()
        self._writer.finish()
