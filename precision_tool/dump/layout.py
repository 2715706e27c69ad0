"""The precision_data/ workspace layout and its names (Ascend's conventions).

    npu/debug_<k>/run.json, graph/<graph>.json, fusion_result.json,
        dump/<YYYYmmddHHMMSS>/<device_id>/<graph>/<graph_id>/<step>/
            <OpType>.<op_name>.<task_id>.<stream_id>.<timestamp>.<input|output>.<i>.npy
            Opdebug.Node_OpDebug.<task_id>.<stream_id>.<timestamp>.json, index.csv
        replay/<step>/
    cpu/debug_<k>/run.json, dump/<step>/<op_name>.<output_index>.<timestamp>.npy + index.csv
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import FrozenSet, Optional, Tuple

from ..errors import PrecisionToolError

DEFAULT_ROOT = "precision_data"
ENV_ROOT = "PRECISION_TOOL_DATA"
# where commands write what they make (compare results, replays, reports, fix configs) when
# not into the workspace: a shared dump, a read-only mount
ENV_RESULTS = "PRECISION_TOOL_RESULTS"
ENV_NPU_ACTION = "PRECISION_TOOL_NPU_ACTION"      # set by the script runner
ENV_CPU_ACTION = "PRECISION_TOOL_CPU_ACTION"
ENV_DUMP_STEP = "PRECISION_TOOL_DUMP_STEP"
ENV_DUMP_MODE = "PRECISION_TOOL_DUMP_MODE"
ENV_DUMP_DATA = "PRECISION_TOOL_DUMP_DATA"
ENV_ON_WRITE_ERROR = "PRECISION_TOOL_ON_WRITE_ERROR"
# the script runner's file in which each dump of the script names the run it writes: what the
# script dumped, whatever other processes write into the same workspace
ENV_RUNS_FILE = "PRECISION_TOOL_RUNS_FILE"
# set by `check -- SCRIPT`: the script stops (SystemExit 0) once its last dumped step is on
# disk, so that checking a long training script takes one step of it
ENV_STOP_AFTER_DUMP = "PRECISION_TOOL_STOP_AFTER_DUMP"
# the launch a rank's run belongs to (every rank of one torchrun shares it): its runs are the
# ranks of one data-parallel run to the analysis
ENV_RANK_GROUP = "PRECISION_TOOL_RANK_GROUP"


def launch_group() -> str:
    """What every rank of this process's distributed launch shares: the host, the launcher's
    process (torchrun's ranks are its agent's children) and the rendezvous port."""
    import socket
    return f"{socket.gethostname()}:{os.getppid()}:{os.environ.get('MASTER_PORT', '')}"

ACTIONS = ("dump", "overflow", "fusion_off", "fusion_switch")
DUMP_MODES = ("input", "output", "all")
DUMP_DATA = ("tensor", "stats")
# what a dump does when it cannot write (a full disk): stop dumping and let the training go
# on (stop), or raise out of the training step (raise)
ON_WRITE_ERROR = ("stop", "raise")
INDEX_FILE = "index.csv"
# a step's call sites, where a front-end knows them: op name -> module path, source line
CALLS_FILE = "calls.json"
HISTORY_FILE = "step_history.csv"        # per run: every observed step's status and loss scale
HISTORY_HEADER = "step,status,loss_scale,next_loss_scale,finite,loss"
# the header before the loss was recorded: read, with no loss
HISTORY_HEADER_V1 = "step,status,loss_scale,next_loss_scale,finite"
MAX_FILE_BYTES = 255         # a file name's limit on common file systems (ext4, xfs, tmpfs)
MAX_NAME_BYTES = 200          # a mangled op name on its own (a directory name, a golden file)
STAMP_DIGITS = 20             # what a name reserves for its timestamp (an int64's digits)


class DumpConfigError(PrecisionToolError, ValueError):
    """A dump setting that cannot be used (unknown action, bad dump_step...)."""


# what a run is to the analysis: the device under test (its steps in Ascend's device layout,
# dump/<time>/<device>/<graph>/<graph_id>/<step>, with its compiled graph) or a reference
# to compare it with (dump/<step>)
DEVICE, REFERENCE = "device", "reference"
KINDS = (DEVICE, REFERENCE)
TARGET_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# workspace directories that hold what commands make, never runs
NOT_TARGETS = frozenset({"config", "temp", "watch"})


@dataclass(frozen=True)
class Target:
    """Where a run goes (<workspace>/<name>/debug_<k>) and what it is (kind: DEVICE or
    REFERENCE). The simulated NPU writes NPU and the golden executor GOLDEN; another front-end
    or an imported dump names its own (a gpu reference, say), and commands take its runs by
    label (gpu/debug_0)."""
    name: str
    kind: str

    def __post_init__(self):
        if not TARGET_NAME.fullmatch(self.name) or self.name in NOT_TARGETS:
            raise DumpConfigError(f"a target is named by 1-32 lower-case letters, digits, '_' "
                                  f"or '-' (not {', '.join(sorted(NOT_TARGETS))}), got "
                                  f"{self.name!r}")
        if self.kind not in KINDS:
            raise DumpConfigError(f"a target's kind is one of {', '.join(KINDS)}, got "
                                  f"{self.kind!r}")


NPU = Target("npu", DEVICE)
GOLDEN = Target("cpu", REFERENCE)


def target_of(name: str, info: dict) -> Target:
    """A listed run's target: the kind its run.json records, else the one its directory
    implies (runs written before kinds were recorded, foreign dumps: npu is the device)."""
    kind = info.get("kind") if isinstance(info, dict) else None
    if kind not in KINDS:
        kind = DEVICE if name == NPU.name else REFERENCE
    return Target(name, kind)


def resolve_root(data_dir: Optional[str] = None) -> str:
    return os.path.abspath(data_dir or os.environ.get(ENV_ROOT) or DEFAULT_ROOT)


def writable(path: str) -> bool:
    """Whether files can be made in the directory at path (or, while it does not exist yet,
    in its nearest existing parent): a read-only mount refuses even root."""
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def resolve_results(root: str, results: Optional[str] = None) -> Tuple[str, str]:
    """Where commands write what they make, and why there: (path, "given") for the directory
    named (--results-dir, else $PRECISION_TOOL_RESULTS); (root, "workspace") when the
    workspace can be written; else (a directory of the user's cache named after the
    workspace, "read-only"), the same one every time for the same workspace, so that a
    later command finds what an earlier one wrote."""
    given = results or os.environ.get(ENV_RESULTS)
    if given:
        return os.path.abspath(given), "given"
    if writable(root):
        return root, "workspace"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    real = os.path.realpath(root)
    tag = hashlib.sha1(real.encode("utf-8", "surrogateescape")).hexdigest()[:10]
    name = mangle(os.path.basename(real) or "root", 64)
    return os.path.join(cache, "precision_tool", "results", f"{name}-{tag}"), "read-only"


_UNSAFE = re.compile(r"[/\\. \x00-\x1f\x7f]")


def mangle(op_name: str, budget: int = MAX_NAME_BYTES) -> str:
    """An op name as it appears in a file name: '/', '\\', '.', spaces and control characters
    become '_' (Ascend's rule, which also makes '..' harmless); a name over `budget` bytes is
    cut (never inside a UTF-8 character) and given a hash of the whole name, so that two long
    names stay apart. The index keeps the real name."""
    name = _UNSAFE.sub("_", op_name) or "_"
    if len(name.encode("utf-8")) > budget:
        digest = hashlib.sha1(op_name.encode("utf-8")).hexdigest()[:12]
        cut = name.encode("utf-8")[:max(budget - 13, 1)].decode("utf-8", "ignore")
        name = f"{cut}_{digest}"
    return name


def fit_file_name(stem: str, suffix: str) -> str:
    """stem + suffix within MAX_FILE_BYTES: a derived file (pt -c's text copy, dc's
    conversion, a subgraph) of a dump file whose name is already near the limit."""
    room = MAX_FILE_BYTES - len(suffix.encode("utf-8"))
    if len(stem.encode("utf-8")) > room:
        digest = hashlib.sha1(stem.encode("utf-8")).hexdigest()[:12]
        stem = stem.encode("utf-8")[:room - 13].decode("utf-8", "ignore") + "_" + digest
    return stem + suffix


def _room(tail: str, timestamp) -> int:
    """The bytes left for names beside `tail`, its timestamp counted at STAMP_DIGITS."""
    return MAX_FILE_BYTES - len(tail.encode("utf-8")) + len(str(timestamp)) - STAMP_DIGITS


def npu_file_name(op_type, op_name, task_id, stream_id, timestamp, io, index) -> str:
    """Ascend's NPU dump name from the real op type and name, mangled here so that the whole
    name stays within MAX_FILE_BYTES whatever the timestamp's digits."""
    tail = f".{task_id}.{stream_id}.{timestamp}.{io}.{index}.npy"
    kind = mangle(op_type, 64)
    return f"{kind}.{mangle(op_name, _room(tail, timestamp) - len(kind.encode('utf-8')) - 1)}{tail}"


def cpu_file_name(op_name, output_index, timestamp) -> str:
    """The golden dump name from the real op name, within MAX_FILE_BYTES likewise."""
    tail = f".{output_index}.{timestamp}.npy"
    return f"{mangle(op_name, min(MAX_NAME_BYTES, _room(tail, timestamp)))}{tail}"


def opdebug_file_name(task_id, stream_id, timestamp) -> str:
    return f"Opdebug.Node_OpDebug.{task_id}.{stream_id}.{timestamp}.json"


def format_steps(steps) -> str:
    """Steps in dump_step's own syntax, runs as ranges: [0, 1, 2, 5] -> "0-2|5" (what
    parse_steps reads back); "" for none."""
    parts, run = [], []
    for step in sorted(set(steps)):
        if run and step == run[-1] + 1:
            run.append(step)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [step]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return "|".join(parts)


def parse_steps(spec) -> Optional[FrozenSet[int]]:
    """Ascend's dump_step: "0|5|10", ranges "0|3-5|10"; None or "all" means every step."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "all"):
        return None
    if isinstance(spec, int):
        spec = str(spec)
    if not isinstance(spec, str):
        raise DumpConfigError(f"dump_step must be a string like \"0|3-5|10\", got {spec!r}")
    steps = set()
    for part in spec.split("|"):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not m:
            raise DumpConfigError(f"dump_step {spec!r}: {part!r} is not a step or a range a-b")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise DumpConfigError(f"dump_step {spec!r}: range {part!r} runs backwards")
        if hi - lo > 1_000_000:
            raise DumpConfigError(f"dump_step {spec!r}: range {part!r} is too long")
        steps.update(range(lo, hi + 1))
    return frozenset(steps)


def parse_action(action) -> FrozenSet[str]:
    """'dump', 'overflow', 'fusion_off', 'fusion_switch', joined with '|' (spaces allowed)."""
    if action is None:
        return frozenset()
    if not isinstance(action, str):
        raise DumpConfigError(f"action must be a string like \"dump|fusion_off\", got {action!r}")
    parts = [p.strip() for p in action.split("|") if p.strip()]
    unknown = [p for p in parts if p not in ACTIONS]
    if unknown:
        raise DumpConfigError(f"unknown action {unknown[0]!r}; actions: {', '.join(ACTIONS)}, "
                              f"joined with '|'")
    if "fusion_off" in parts and "fusion_switch" in parts:
        raise DumpConfigError("fusion_off and fusion_switch exclude each other")
    return frozenset(parts)


@dataclass(frozen=True)
class DumpSettings:
    """What a dumping session writes, and where."""
    root: str
    actions: FrozenSet[str]
    steps: Optional[FrozenSet[int]]     # None: every step
    mode: str = "all"                   # input, output or all
    data: str = "tensor"                # tensor or stats
    debug_dir: Optional[str] = None     # a named debug_<k> (default: the next free one)
    # the least k a new debug_<k> takes: replays written beside a read-only workspace are
    # numbered after its runs, so that the two listed together never share a name
    first_free: int = 0
    replay_of: Optional[str] = None     # a replay of this run (npu/debug_0): not a default run
    # the values were computed elsewhere (onnxruntime) and handed to this executor's ops: a
    # second reference, never a default run
    values_from: Optional[str] = None
    on_write_error: str = "stop"        # ON_WRITE_ERROR

    def __post_init__(self):
        if self.mode not in DUMP_MODES:
            raise DumpConfigError(f"dump_mode must be one of {', '.join(DUMP_MODES)}, got {self.mode!r}")
        if self.data not in DUMP_DATA:
            raise DumpConfigError(f"dump_data must be one of {', '.join(DUMP_DATA)}, got {self.data!r}")
        if self.on_write_error not in ON_WRITE_ERROR:
            raise DumpConfigError(f"on_write_error must be one of {', '.join(ON_WRITE_ERROR)}, "
                                  f"got {self.on_write_error!r}")

    def wants_step(self, step: int) -> bool:
        return self.steps is None or step in self.steps


def next_debug_dir(parent: str, name: Optional[str] = None, first_free: int = 0) -> str:
    """Create and return <parent>/debug_<k> for the next free k, at least first_free (or the
    named one). Creating the directory claims it, so two runs starting together get
    different ones."""
    os.makedirs(parent, exist_ok=True)
    if name is not None:
        if not re.fullmatch(r"debug_\d+", name):
            raise DumpConfigError(f"a debug directory is named debug_<k>, got {name!r}")
        path = os.path.join(parent, name)
        os.makedirs(path, exist_ok=True)
        return path
    taken = [int(m.group(1)) for d in os.listdir(parent) if (m := re.fullmatch(r"debug_(\d+)", d))]
    k = max(max(taken, default=-1) + 1, first_free)
    while True:
        path = os.path.join(parent, f"debug_{k}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            k += 1
