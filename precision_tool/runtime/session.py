"""Session: runs a graph on a target, keeping variable state across steps."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional

import numpy as np

from ..errors import FeedError, FetchError, PrecisionToolError
from ..graph import Graph, Tensor, dtypes, format_shape
from ..graph.ir import Node
from .config import SessionConfig
from .cpu import CpuExecutor
from .npu.executor import NpuExecutor
from .plan import STATS_ONLY, RunTrace

_EXECUTORS = {"cpu": CpuExecutor, "npu": NpuExecutor}


class Session:
    """`Session(graph, target="cpu", config=SessionConfig())`; `run(fetches, feed_dict)`.

    Fetches may be a Tensor, an op (Node), a name ("op:0" is a tensor; a bare op name is the
    op's first output, or the op itself when it has none), or a list/tuple/dict of these; the
    result has the same structure, with None for ops. Runs are deterministic: the same graph,
    seed and sequence of runs give bit-identical results.
    """

    def __init__(self, graph: Graph, target: str = "cpu", config: Optional[SessionConfig] = None):
        if not isinstance(graph, Graph):
            raise PrecisionToolError(f"Session needs a Graph, got {type(graph).__name__}")
        if target not in _EXECUTORS:
            raise PrecisionToolError(f"unknown target {target!r}; available: {', '.join(_EXECUTORS)}")
        self.graph = graph
        self.target = target
        self.config = config or SessionConfig()
        self._executor = _EXECUTORS[target](graph, self.config)
        self._variables = self._executor.initial_variables()
        self._plans: Dict[Any, Any] = {}
        self.step = 0           # number of completed run() calls
        self.fetched: Dict[str, np.ndarray] = {}    # the last run's fetched tensors, by name
        self._observers = []
        for factory in self.config.observers:
            self.add_observer(factory.attach(self))

    def add_observer(self, observer) -> None:
        """Watch runs: `begin_run(session, feeds, fetch_tensors, fetch_nodes) -> bool` (whether
        to watch this one), then `end_run(session, trace)` with the run's RunTrace (every op's
        outputs, the feeds, the NPU's tasks) before run() returns, or `abort_run(session,
        error)` if it fails. Watching costs the run one list append per op. An observer
        that needs only each value's statistics returns STATS_ONLY from begin_run: when every
        watching observer does, the run keeps no values and its trace holds their
        statistics instead (RunTrace.stats), computed as the values are made. An observer
        that defines `unwatched_run(session)` is told of each run it chose not to watch, after
        it (no trace: what the session itself holds, as its status word and variables)."""
        self._observers.append(observer)

    @property
    def observers(self) -> tuple:
        """The observers watching this session's runs (a dump's, among others)."""
        return tuple(self._observers)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        """Finish what observers still do in the background (a dump's last steps)."""
        for o in self._observers:
            close = getattr(o, "close", None)
            if close is not None:
                close()

    # -- running ------------------------------------------------------------------------------
    def run(self, fetches, feed_dict=None, substitute=None):
        """Run the fetches' ops once (one step). substitute: {op name: {output: value}}, the
        what-if of an analysis: those ops do not compute (no status word either) and hand on
        the given values instead (logical layout, rounded to the output's dtype), so that
        what follows is computed from them."""
        flat = []
        structure = self._flatten(fetches, flat)
        feeds = self._feeds(feed_dict or {})
        fetch_tensors = sorted({f.name for f in flat if isinstance(f, Tensor)})
        fetch_nodes = sorted({f.name for f in flat if isinstance(f, Node)})
        key = (tuple(fetch_tensors), tuple(fetch_nodes), frozenset(feeds))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._executor.plan(fetch_tensors, fetch_nodes,
                                                          frozenset(feeds))
        wants = [(o, o.begin_run(self, feeds, fetch_tensors, fetch_nodes)) for o in self._observers]
        watching = [o for o, want in wants if want]
        stats = bool(watching) and all(want == STATS_ONLY for _, want in wants if want)
        trace = [] if watching and not stats else None
        try:
            values = self._executor.run(plan, dict(feeds), self._variables, self.step, trace,
                                        stats, substitute)
        except BaseException as e:
            for o in watching:
                o.abort_run(self, e)
            raise
        # copies: a fetched array must never alias session state or a feed
        results = [None if isinstance(f, Node) else np.array(self._executor.fetch(values, f.name))
                   for f in flat]
        # what this run fetched, in the caller's order (observers read the loss from it)
        self.fetched = {f.name: r for f, r in zip(flat, results) if r is not None}
        if watching:
            run = RunTrace(plan, trace, feeds, getattr(self._executor, "tasks", None),
                           self._executor.stats if stats else None, self.float_status())
            for o in watching:
                o.end_run(self, run)
        for o, want in wants:
            if not want:
                unwatched = getattr(o, "unwatched_run", None)
                if unwatched is not None:
                    unwatched(self)
        self.step += 1
        return _unflatten(structure, iter(results))

    def _resolve(self, item):
        if isinstance(item, (Tensor, Node)):
            if item.graph is not self.graph:
                raise FetchError(f"{item.name!r} belongs to graph {item.graph.name!r}, "
                                 f"not to this session's graph {self.graph.name!r}")
            return item
        if isinstance(item, str):
            node_name, sep, index = item.rpartition(":")
            try:
                if sep and index.isdigit():
                    return self.graph.node(node_name).output(int(index))
                node = self.graph.node(item)
            except PrecisionToolError:
                raise FetchError(f"graph {self.graph.name!r} has no tensor or op named {item!r}") from None
            return node.output(0) if node.outputs else node
        raise FetchError(f"cannot fetch {item!r}: expected a tensor, an op or a name")

    def _flatten(self, fetches, flat):
        if isinstance(fetches, (list, tuple)):
            return type(fetches), [self._flatten(f, flat) for f in fetches]
        if isinstance(fetches, dict):
            return dict, {k: self._flatten(v, flat) for k, v in fetches.items()}
        flat.append(self._resolve(fetches))
        return None

    def _feeds(self, feed_dict) -> Dict[str, np.ndarray]:
        out = {}
        for key, value in feed_dict.items():
            try:
                tensor = self._resolve(key)
            except FetchError as e:
                raise FeedError(f"cannot feed {key!r}: {e}") from None
            if isinstance(tensor, Node) or tensor.node.type != "Placeholder":
                raise FeedError(f"cannot feed {getattr(tensor, 'name', key)!r}: only placeholders are fed")
            out[tensor.name] = self._check_feed(tensor, value)
        return out

    def _check_feed(self, tensor: Tensor, value) -> np.ndarray:
        spec = tensor.spec
        name = tensor.node.name
        try:
            arr = np.asarray(value)
        except Exception as e:  # ragged lists and the like
            raise FeedError(f"placeholder {name!r}: value is not an array: {e}") from None
        want = self._executor.run_dtype(spec.dtype)
        if dtypes.category(arr.dtype) != dtypes.category(spec.dtype):
            raise FeedError(f"placeholder {name!r} expects {spec.dtype}, was fed {arr.dtype}")
        if arr.ndim != len(spec.shape) or any(d is not None and d != s
                                              for d, s in zip(spec.shape, arr.shape)):
            raise FeedError(f"placeholder {name!r} expects shape {format_shape(spec.shape)}, "
                            f"was fed shape {list(arr.shape)}")
        if arr.dtype.kind in "iu" and arr.size and np.dtype(want) != arr.dtype:
            info = np.iinfo(want)
            if arr.min() < info.min or arr.max() > info.max:
                raise FeedError(f"placeholder {name!r} expects {spec.dtype}; fed values do not fit")
        value = self._executor.cast_in(arr, spec.dtype)
        return value if value.flags.c_contiguous else value.copy(order="C")

    # -- the NPU's view -------------------------------------------------------------------
    def tasks(self):
        """The kernels the last run executed, in order (simulated NPU; empty on the CPU)."""
        return list(getattr(self._executor, "tasks", []))

    def float_status(self) -> int:
        """The OR of the AI Core status words of the last run (0 on the CPU)."""
        return getattr(self._executor, "status", 0)

    @property
    def compiled(self):
        """The compiled NPU graph and its compile records (None on the CPU)."""
        return getattr(self._executor, "compiled", None)

    def fusion_result(self) -> dict:
        """Per fusion pass that ran, its match and effect counts and the fused nodes, in the
        shape of Ascend's fusion_result.json."""
        compiled = self.compiled
        if compiled is None:
            return {}
        from .npu.fusion import fusion_record
        return fusion_record(self.graph.name, compiled.fusion)

    # -- state --------------------------------------------------------------------------------
    def variables(self, copy: bool = True) -> Mapping[str, np.ndarray]:
        """Every variable's current value, by name: copies, or (copy=False, for readers that
        keep them or write them out) a read-only view of the session's own arrays, which a
        step replaces but never modifies (the view follows the session: take the values you
        keep out of it)."""
        if not copy:
            return MappingProxyType(self._variables)
        return {k: v.copy() for k, v in self._variables.items()}

    def load_variables(self, values: Dict[str, np.ndarray], exact: bool = False) -> None:
        """Overwrite variables by name; shapes must match; values are rounded to the variable's
        declared dtype, then held as the run dtype — or, with exact=True (state saved from a
        session of the same target and config), taken as they are."""
        staged = {}
        for name, value in values.items():
            if name not in self._variables:
                raise FeedError(f"graph {self.graph.name!r} has no variable named {name!r}")
            current = self._variables[name]
            arr = np.asarray(value)
            if arr.shape != current.shape:
                raise FeedError(f"variable {name!r} has shape {list(current.shape)}, "
                                f"was given {list(arr.shape)}")
            staged[name] = (arr.astype(current.dtype) if exact else
                            self._executor.cast_in(arr, self.graph.node(name).outputs[0].dtype))
        self._variables.update(staged)


def _unflatten(structure, it):
    if structure is None:
        return next(it)
    kind, children = structure
    if kind is dict:
        return {k: _unflatten(v, it) for k, v in children.items()}
    items = [_unflatten(c, it) for c in children]
    return kind(items) if kind in (list, tuple) else kind(*items)
