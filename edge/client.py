"""Client halves of the strategies: run a plan on local data and encode the update to send.

The coordinator owns the server halves; here is only what a device must compute itself.
"""
from __future__ import annotations

import numpy as np

from .training import local_train
from .trainers.base import Trainer
from .wire import Plan, Report, TensorUpdate

_VALUE_DTYPES = {"f4": np.float32, "f2": np.float16}


def _dense_update(weights: dict[str, np.ndarray], dtype: str) -> dict[str, TensorUpdate]:
    dt = _VALUE_DTYPES[dtype]
    return {k: TensorUpdate(shape=tuple(v.shape), values=np.asarray(v, dt)) for k, v in weights.items()}


def run_fedavg(plan: Plan, trainer: Trainer, x: np.ndarray, y: np.ndarray) -> Report:
    """FedAvg's client (E-step of hard-EM with lambda -> 0, paper 000 Eq. 7): local SGD from the server's w,
    then send the trained weights. Dense: every row is sent."""
    hp = plan.hparams
    trainer.set_weights(plan.weights)
    res = local_train(trainer, x, y, epochs=int(hp["epochs"]), batch_size=int(hp["batch_size"]),
                      lr=float(hp["lr"]), seed=plan.seed)
    tensors = _dense_update(trainer.get_weights(), str(plan.upload.get("dtype", "f4")))
    return Report(plan.task_id, plan.device_id, len(x), {"train_loss": res.loss, "steps": res.steps}, tensors)


CLIENTS = {"fedavg": run_fedavg}


def run_plan(plan: Plan, trainer: Trainer, x: np.ndarray, y: np.ndarray) -> Report:
    try:
        fn = CLIENTS[plan.strategy]
    except KeyError:
        raise ValueError(f"strategy {plan.strategy!r} has no client half on this device") from None
    return fn(plan, trainer, x, y)
