"""The dump observers: attached to a Session, they write each dumped step into the workspace.

An NPU run writes, per dumped step, one .npy per kernel input/output (Ascend's names), an
Opdebug record per overflowing task, index.csv (one row per tensor, with statistics) and a
replay bundle; a golden (CPU) run writes every op's outputs under the golden names. The
index of a step is written last, after every file it names is in place.
"""
from __future__ import annotations

import io
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import pandas as pd

from .. import __version__, numerics
from ..graph import graph_to_json
from . import layout
from .writer import AsyncWriter, save_npy, save_text

NOT_DUMPED = frozenset({"NoOp"})
NOT_KERNELS = frozenset({"Placeholder", "Variable", "Const", "NoOp"})


def _to_disk(value: np.ndarray, dtype: str) -> np.ndarray:
    """The array as the dump stores it: fp16 in fp16; bf16 (which .npy cannot name) as its
    exact float32 values, the index recording 'bfloat16'."""
    if dtype == "float16":
        return value.astype(np.float16)
    if dtype == "bfloat16":
        return value.astype(np.float32)
    return value


def _json(data) -> str:
    return json.dumps(data, indent=1, sort_keys=False, default=str) + "\n"


@dataclass(frozen=True)
class DumpHook:
    """A SessionConfig observer factory: `attach(session)` starts a dump run."""
    settings: layout.DumpSettings

    def attach(self, session):
        return DumpObserver(session, self.settings)


class DumpObserver:
    def __init__(self, session, settings: layout.DumpSettings):
        self.settings = settings
        self.target = session.target
        self.npu = session.target == "npu"
        self.run_dir = layout.next_debug_dir(os.path.join(settings.root, session.target),
                                             settings.debug_dir)
        self.started = time.strftime("%Y%m%d%H%M%S")
        self.graph = session.compiled.graph if self.npu else session.graph
        self.source = session.graph
        self.dumped_steps: List[int] = []
        self.writer = AsyncWriter()
        self._step = None
        self._write_run_files(session)

    # -- run-level files --------------------------------------------------------------------
    def _run_info(self, session) -> dict:
        cfg = session.config
        info = {
            "writer": "precision_tool", "version": __version__, "target": self.target,
            "graph": self.source.name, "seed": self.source.seed, "started": self.started,
            "device_id": 0, "actions": sorted(self.settings.actions),
            "dump_step": "all" if self.settings.steps is None else sorted(self.settings.steps),
            "dump_mode": self.settings.mode, "dump_data": self.settings.data,
            "dumped_steps": list(self.dumped_steps),
            "versions": {"python": platform.python_version(), "numpy": np.__version__},
        }
        if self.npu:
            info.update(precision_mode=cfg.precision_mode, amp_level=cfg.amp_level,
                        overflow_mode=cfg.overflow_mode, mode=cfg.mode,
                        fusion_passes=sorted(session.compiled.fusion),
                        numerics="simulated: cube ops accumulate in fp32, vector ops compute "
                                 "in fp32 and round per op; see DESIGN.md section 4")
        else:
            info.update(golden_dtype=cfg.golden_dtype)
        return info

    def _write_run_files(self, session):
        save_text(os.path.join(self.run_dir, "run.json"), _json(self._run_info(session)))
        if self.npu:
            os.makedirs(os.path.join(self.run_dir, "graph"), exist_ok=True)
            save_text(os.path.join(self.run_dir, "graph", f"{layout.mangle(self.graph.name)}.json"),
                      graph_to_json(self.graph) + "\n")
            save_text(os.path.join(self.run_dir, "fusion_result.json"), _json(session.fusion_result()))
        self._session = session

    # -- the observer protocol --------------------------------------------------------------
    def begin_run(self, session, feeds, fetch_tensors, fetch_nodes) -> bool:
        acts = self.settings.actions
        step = session.step
        dump = "dump" in acts and self.settings.wants_step(step)
        overflow = "overflow" in acts and (self.settings.steps is None or step in self.settings.steps)
        if not (dump or overflow):
            self._step = None
            return False
        if self.npu:
            step_dir = os.path.join(self.run_dir, "dump", self.started, "0",
                                    layout.mangle(self.graph.name), "0", str(step))
        else:
            step_dir = os.path.join(self.run_dir, "dump", str(step))
        os.makedirs(step_dir, exist_ok=True)
        self._step = _StepState(step, step_dir, dump, overflow)
        if dump:
            self._write_replay(session, feeds, fetch_tensors, fetch_nodes)
            if not self.npu:      # fed placeholders do not run, but the golden holds their values
                stamp = int(time.time() * 1e6)
                for tensor, value in feeds.items():
                    node = self.graph.tensor(tensor).node
                    self._tensor(node, "output", 0, tensor, value, node.outputs[0], stamp, (None, None))
        return True

    def on_node(self, node, inputs, outputs, task):
        st = self._step
        if node.type in NOT_DUMPED or (self.npu and node.type in NOT_KERNELS):
            return
        if self.npu:
            if task is None:
                return
            if not st.dump and task.status == 0:
                return        # overflow only: the overflowing kernels' tensors
            stamp = task.timestamp
            if task.status:
                self._opdebug(node, task)
            ids = (task.task_id, task.stream_id)
        else:
            stamp, ids = int(time.time() * 1e6), (None, None)
        mode = self.settings.mode if st.dump else "all"
        if mode in ("input", "all") and self.npu:
            for k, (name, value) in enumerate(zip(node.inputs, inputs)):
                self._tensor(node, "input", k, name, value, self.graph.tensor(name).spec, stamp, ids)
        if mode in ("output", "all") or not self.npu:
            for k, value in enumerate(outputs):
                self._tensor(node, "output", k, f"{node.name}:{k}", value, node.outputs[k], stamp, ids)

    def end_run(self, session):
        st, self._step = self._step, None
        self.writer.flush()
        columns = _NPU_COLUMNS if self.npu else _CPU_COLUMNS
        table = pd.DataFrame(st.rows, columns=columns)
        buf = io.StringIO()
        table.to_csv(buf, index=False)
        save_text(os.path.join(st.dir, layout.INDEX_FILE), buf.getvalue())
        self.dumped_steps.append(st.step)
        save_text(os.path.join(self.run_dir, "run.json"), _json(self._run_info(session)))

    def abort_run(self, session, error):
        self._step = None
        try:
            self.writer.flush()      # the files written so far are whole; the step has no index
        except Exception:            # the run's own error is the one to report
            pass

    # -- writing ----------------------------------------------------------------------------
    def _tensor(self, node, io_kind, k, tensor, value, spec, stamp, ids):
        st = self._step
        stats_only = self.settings.data == "stats"
        if self.npu:
            fname = layout.npu_file_name(node.type, node.name, ids[0], ids[1], stamp, io_kind, k)
        else:
            fname = layout.cpu_file_name(node.name, k, stamp)
        row = {"op_type": node.type, "op_name": node.name, "io": io_kind, "index": k,
               "tensor": tensor, "dtype": spec.dtype, "shape": _shape(value.shape, spec),
               "file": "" if stats_only else fname, "timestamp": stamp}
        if self.npu:
            row.update(task_id=ids[0], stream_id=ids[1], format=spec.format,
                       original_shape=" ".join(map(str, spec.original_shape or ())) if spec.original_shape else "",
                       pass_name=node.attrs.get("pass_name", ""))
        st.rows.append(row)
        path = os.path.join(st.dir, fname)
        known = st.files.get(tensor)
        if known is not None:              # the same tensor again (an op's input is another's output)
            src_path, src_row = known

            def job(row=row, src_row=src_row, src_path=src_path, path=path):
                row.update({f: src_row[f] for f in numerics.STAT_FIELDS})
                if not stats_only:
                    _link_or_copy(src_path, path)
        else:
            st.files[tensor] = (path, row)

            def job(row=row, value=value, dtype=spec.dtype, path=path):
                row.update(numerics.tensor_stats(value))
                if not stats_only:
                    save_npy(path, _to_disk(value, dtype))
        self.writer.put(job)

    def _opdebug(self, node, task):
        record = {"op_name": node.name, "op_type": node.type, "task_id": task.task_id,
                  "stream_id": task.stream_id, "timestamp": task.timestamp,
                  "status": task.status, "status_hex": f"0x{task.status:x}",
                  "status_bits": numerics.decode_status(task.status), "step": self._step.step}
        path = os.path.join(self._step.dir, layout.opdebug_file_name(task.task_id, task.stream_id,
                                                                      task.timestamp))
        self.writer.put(lambda: save_text(path, _json(record), durable=False))

    def _write_replay(self, session, feeds, fetch_tensors, fetch_nodes):
        from .replay import write_bundle
        path = os.path.join(self.run_dir, "replay", str(session.step))
        write_bundle(path, session, feeds, fetch_tensors, fetch_nodes)


class _StepState:
    def __init__(self, step, directory, dump, overflow):
        self.step, self.dir, self.dump, self.overflow = step, directory, dump, overflow
        self.rows: List[Dict] = []
        self.files: Dict[str, tuple] = {}


def _shape(actual, spec) -> str:
    return " ".join(str(d) for d in actual)


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        import shutil
        tmp = dst + ".part"
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)


_STATS = list(numerics.STAT_FIELDS)
_NPU_COLUMNS = ["op_type", "op_name", "task_id", "stream_id", "timestamp", "io", "index",
                "tensor", "dtype", "format", "shape", "original_shape", "pass_name", "file"] + _STATS
_CPU_COLUMNS = ["op_type", "op_name", "timestamp", "io", "index", "tensor", "dtype", "shape",
                "file"] + _STATS
