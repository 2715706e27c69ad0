"""Model: MindSpore's high-level training API over the same Session and executors.

    model = Model(net, loss_fn, optimizer, amp_level="O2", target="npu")
    model.train(epochs, dataset, callbacks=[LossMonitor()], dataset_sink_mode=True, sink_size=10)
    model.eval(test_dataset)          # {"loss": ..., "accuracy": ...}
    model.predict(x)                  # logits

The graph is built on first use from the network (a callable such as
`pt.models.cnn_network()`), the loss function and the optimizer, with placeholders shaped
after the data. The same graph on target "cpu" is the golden run of target "npu", so the dump
hooks and every analysis command work on a Model's runs as on a hand-written loop.

Data sink mode, as on Ascend: the host hands the device a whole sink of batches and gets the
outputs back once; the step callbacks see only those boundaries. `transfers` counts the
host→device and device→host interactions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import PrecisionToolError
from ..graph import Graph
from ..ops import placeholder
from ..runtime import Session, SessionConfig
from ..runtime.config import MODES
from ..runtime.npu.policy import AMP_LEVELS
from ..train import DynamicLossScaleManager, LossScaleOptimizer
from .callbacks import CallbackList, CallbackParams, RunContext, StepRecord
from .dataset import NumpySlicesDataset

TARGETS = ("npu", "cpu")


class ModelError(PrecisionToolError, ValueError):
    """A Model or a train/eval call that cannot run as configured."""


@dataclass
class Transfers:
    """Host↔device interactions: a batch (or a sink of batches) sent, outputs returned."""
    to_device: int = 0
    to_host: int = 0


class Model:
    """network(x, training, reuse) -> logits; loss_fn(logits, labels) -> scalar loss;
    optimizer: a pt.train optimizer. amp_level: O0 (default, fp32), O1 (white list in
    fp16), O2 (all but the norm family in fp16; dynamic loss scaling unless
    loss_scale_manager says otherwise), O3 (all fp16, no loss scaling), or None to keep
    the config's precision_mode. loss_scale_manager: pt.train.FixedLossScaleManager or
    DynamicLossScaleManager. target: "npu" (simulated) or "cpu" (golden). mode: "graph"
    (compiled: fusion, 5HD formats) or "pynative" (op by op). config: a SessionConfig for
    everything else (overflow_mode, fusion switch, the dump hooks' observers)."""

    def __init__(self, network, loss_fn=None, optimizer=None, amp_level: Optional[str] = "O0",
                 loss_scale_manager=None, target: str = "npu", mode: str = "graph",
                 config: Optional[SessionConfig] = None, seed: int = 0):
        if not callable(network):
            raise ModelError(f"network must be callable as network(x, training, reuse) -> "
                             f"logits, got {type(network).__name__}")
        if target not in TARGETS:
            raise ModelError(f"target must be one of {TARGETS}, got {target!r}")
        if mode not in MODES:
            raise ModelError(f"mode must be 'graph' or 'pynative', got {mode!r}")
        if amp_level is not None and amp_level not in AMP_LEVELS:
            raise ModelError(f"amp_level must be one of {', '.join(AMP_LEVELS)} (or None for the "
                             f"config's precision_mode), got {amp_level!r}")
        self.network, self.loss_fn, self.optimizer = network, loss_fn, optimizer
        self.amp_level, self.target, self.mode, self.seed = amp_level, target, mode, seed
        if loss_scale_manager is None and amp_level == "O2":
            loss_scale_manager = DynamicLossScaleManager()
        self.loss_scale_manager = loss_scale_manager
        # mode and amp_level go through SessionConfig's own checks (e.g. a fusion switch in
        # pynative mode is refused there, with the fix)
        self.config = dataclasses.replace(config or SessionConfig(), mode=mode,
                                          **({"amp_level": amp_level} if amp_level else {}))
        self.transfers = Transfers()
        self.graph: Optional[Graph] = None
        self._train_session: Optional[Session] = None
        self._eval_session: Optional[Session] = None
        self._scaler = None
        self._steps_done = 0

    # -- the graph ----------------------------------------------------------------------------
    def _build(self, x_sample: np.ndarray, y_sample: Optional[np.ndarray]):
        if self.graph is not None:
            return
        name = getattr(self.network, "name", None) or "model"
        g = Graph(name, seed=self.seed)
        with g.as_default():
            self.x = placeholder("x", [None] + list(x_sample.shape[1:]),
                                 _float_name(x_sample.dtype))
            label = np.dtype(y_sample.dtype).name if y_sample is not None else "int32"
            self.y = placeholder("y", [None] + list(y_sample.shape[1:] if y_sample is not None
                                                    else []), label)
            self.logits = self.network(self.x, training=True, reuse=False)
            differs = getattr(self.network, "inference_differs", True)
            self.eval_logits = (self.network(self.x, training=False, reuse=True)
                                if differs else self.logits)
            self.loss = self.eval_loss = self.train_op = None
            if self.loss_fn is not None:
                self.loss = self.loss_fn(self.logits, self.y)
                self.eval_loss = (self.loss_fn(self.eval_logits, self.y)
                                  if differs else self.loss)
            if self.loss is not None and self.optimizer is not None:
                if self.loss_scale_manager is not None:
                    self._scaler = LossScaleOptimizer(self.optimizer, self.loss_scale_manager)
                    self.train_op = self._scaler.minimize(self.loss)
                else:
                    self.train_op = self.optimizer.minimize(self.loss)
        self.graph = g

    def _session(self, training: bool) -> Session:
        if training:
            if self._train_session is None:
                self._train_session = Session(self.graph, self.target, self.config)
            return self._train_session
        if self._eval_session is None:      # no observers: evaluation is not a training step
            self._eval_session = Session(self.graph, self.target,
                                         dataclasses.replace(self.config, observers=()))
        if self._train_session is not None:
            self._eval_session.load_variables(self._train_session.variables(copy=False),
                                              exact=True)
        return self._eval_session

    @property
    def train_session(self) -> Optional[Session]:
        return self._train_session

    # -- training -----------------------------------------------------------------------------
    def train(self, epoch: int, train_dataset: NumpySlicesDataset, callbacks=None,
              dataset_sink_mode: bool = False, sink_size: int = -1) -> None:
        """Train for `epoch` epochs. Without sink mode an epoch is one pass over the data and
        the step callbacks fire every step. With dataset_sink_mode=True (graph mode only)
        the device runs a whole sink per host interaction: an epoch is one pass
        (sink_size=-1) or sink_size steps, with the data re-iterated endlessly from where it
        stopped; the step callbacks fire once per sink; epoch × sink_size steps in all."""
        if self.loss_fn is None or self.optimizer is None:
            raise ModelError("train needs a loss_fn and an optimizer: Model(network, loss_fn, "
                             "optimizer)")
        _check_dataset(train_dataset, "train", labels=True)
        if not isinstance(epoch, (int, np.integer)) or epoch < 1:
            raise ModelError(f"epoch must be a positive integer, got {epoch!r}")
        if not isinstance(sink_size, (int, np.integer)) or sink_size == 0 or sink_size < -1:
            raise ModelError(f"sink_size must be -1 (one pass per epoch) or a positive number "
                             f"of steps, got {sink_size!r}")
        if dataset_sink_mode and self.mode == "pynative":
            raise ModelError("dataset_sink_mode=True needs mode='graph' (pynative runs op by op "
                             "from the host, so there is nothing to sink): use "
                             "dataset_sink_mode=False or Model(..., mode='graph')")
        if sink_size != -1 and not dataset_sink_mode:
            raise ModelError("sink_size only means something with dataset_sink_mode=True: pass "
                             "dataset_sink_mode=True or drop sink_size")
        xs, ys = next(train_dataset.epoch(0))[:2]
        self._build(xs, ys)
        sess = self._session(training=True)
        batch_num = sink_size if dataset_sink_mode and sink_size > 0 else len(train_dataset)
        params = CallbackParams(self, sess, epoch, batch_num, dataset_sink_mode,
                                cur_step_num=self._steps_done, loss_scale=self._current_scale())
        ctx = RunContext(params)
        cbs = CallbackList(callbacks)
        endless = train_dataset.endless() if dataset_sink_mode and sink_size > 0 else None
        cbs.begin(ctx)
        for e in range(epoch):
            params.cur_epoch_num = e + 1
            cbs.epoch_begin(ctx)
            if dataset_sink_mode:
                batches = (train_dataset.epoch(e) if endless is None else
                           (next(endless) for _ in range(sink_size)))
                cbs.step_begin(ctx)
                self.transfers.to_device += 1            # the sink's batches, queued at once
                records = [self._step(sess, b) for b in batches]
                self.transfers.to_host += 1              # the outputs, at the sink's end
                self._step_end(cbs, ctx, records)
            else:
                for b in train_dataset.epoch(e):
                    cbs.step_begin(ctx)
                    self.transfers.to_device += 1
                    record = self._step(sess, b)
                    self.transfers.to_host += 1
                    self._step_end(cbs, ctx, [record])
                    if ctx.get_stop_requested():
                        break
            cbs.epoch_end(ctx)
            if ctx.get_stop_requested():
                break
        cbs.end(ctx)

    def _step(self, sess: Session, batch) -> StepRecord:
        loss, _ = sess.run([self.loss, self.train_op], {self.x: batch[0], self.y: batch[1]})
        self._steps_done += 1
        scale = finite = None
        if self._scaler is not None:
            state = sess.variables(copy=False)
            scale = float(state[self._scaler.loss_scale.node.name])
            finite = bool(state[self._scaler.last_step_finite.node.name])
        return StepRecord(self._steps_done, float(loss), sess.float_status(), scale, finite)

    def _step_end(self, cbs, ctx, records):
        p = ctx.original_args()
        p.step_records = records
        p.cur_step_num = records[-1].step
        p.net_outputs = records[-1].loss
        p.loss_scale = records[-1].loss_scale
        cbs.step_end(ctx)

    def _current_scale(self) -> Optional[float]:
        if self._scaler is None or self._train_session is None:
            return None if self.loss_scale_manager is None else \
                float(self.loss_scale_manager.initial_scale)
        return float(self._train_session.variables(copy=False)[self._scaler.loss_scale.node.name])

    # -- inference ----------------------------------------------------------------------------
    def eval(self, valid_dataset: NumpySlicesDataset) -> dict:
        """One pass in inference mode: the mean loss (if there is a loss_fn) and the share of
        samples whose arg-max logit is the label."""
        _check_dataset(valid_dataset, "eval", labels=True)
        xs, ys = next(valid_dataset.epoch(0))[:2]
        self._build(xs, ys)
        sess = self._session(training=False)
        total = correct = 0
        loss_sum = 0.0
        for batch in valid_dataset.epoch(0):
            xb, yb = batch[0], batch[1]
            if self.eval_loss is not None:
                loss, logits = sess.run([self.eval_loss, self.eval_logits],
                                        {self.x: xb, self.y: yb})
                loss_sum += float(loss) * len(xb)
            else:
                logits = sess.run(self.eval_logits, {self.x: xb})
            correct += int(np.sum(np.argmax(logits, axis=-1) == yb))
            total += len(xb)
        out = {"accuracy": correct / total}
        if self.eval_loss is not None:
            out["loss"] = loss_sum / total
        return out

    def predict(self, x) -> np.ndarray:
        """Inference-mode logits for a batch."""
        x = np.asarray(x)
        if x.ndim < 1 or x.dtype.kind != "f":
            raise ModelError(f"predict needs a float batch [batch, ...], got {x.dtype}{list(x.shape)}")
        self._build(x, None)
        return self._session(training=False).run(self.eval_logits, {self.x: x})


def _float_name(dtype) -> str:
    name = np.dtype(dtype).name
    return name if name in ("float16", "float32", "float64") else "float32"


def _check_dataset(dataset, what: str, labels: bool):
    if not isinstance(dataset, NumpySlicesDataset):
        raise ModelError(f"{what} needs a NumpySlicesDataset, got {type(dataset).__name__}")
    if dataset.batch_size is None:
        raise ModelError(f"{what} needs a batched dataset: call .batch(n) on it first")
    if labels and len(dataset.columns) < 2:
        raise ModelError(f"{what} needs (data, labels) columns, the dataset has "
                         f"{len(dataset.columns)}")
    if len(dataset) == 0:
        raise ModelError(f"{what}: the dataset yields no batch ({dataset.num_samples} samples, "
                         f"batch_size {dataset.batch_size}, drop_remainder="
                         f"{dataset.drop_remainder})")
