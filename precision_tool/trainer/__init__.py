"""MindSpore-style training: Model.train with callbacks and data sink mode, over the same
Session, executors and dump hooks as a hand-written loop."""
from .callbacks import (Callback, CallbackParams, DumpCallback, EarlyStop, LossMonitor,
                        OverflowMonitor, RunContext, StepRecord, TimeMonitor, WatchpointCallback)
from .dataset import DatasetError, NumpySlicesDataset
from .model import Model, ModelError, Transfers

__all__ = ["Model", "ModelError", "Transfers", "NumpySlicesDataset", "DatasetError", "Callback",
           "CallbackParams", "RunContext", "StepRecord", "LossMonitor", "TimeMonitor",
           "EarlyStop", "DumpCallback", "OverflowMonitor", "WatchpointCallback"]
