"""The training layer: autodiff with TF-style gradient names and optimizers as graph ops."""
from . import amp
from .amp import DynamicLossScaler, StaticLossScaler, all_finite
from .autodiff import gradients
from .loss_scale import (DynamicLossScaleManager, ExponentialUpdateLossScaleManager,
                         FixedLossScaleManager, LossScaleOptimizer)
from .optimizers import SGD, Adam, Momentum, Optimizer, trainable_variables

GradientDescent = SGD

__all__ = ["gradients", "SGD", "GradientDescent", "Momentum", "Adam", "Optimizer",
           "trainable_variables", "LossScaleOptimizer", "FixedLossScaleManager",
           "DynamicLossScaleManager", "ExponentialUpdateLossScaleManager", "amp", "all_finite",
           "DynamicLossScaler", "StaticLossScaler"]
