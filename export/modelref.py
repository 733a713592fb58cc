"""``--model`` (and fleet.toml's ``[model] name``, and ``fedge export --model``): which network a run trains.

- a zoo name: ``mlp`` (hidden sizes from ``--hidden``/the config, inputs and classes from the data) or ``cnn``
  (the zoo's LeNet-family CNN; images C x H x W, or 64 flat features as 1 x 8 x 8);
- ``spec.json``: a spec written before (a zoo spec, or a module spec from ``fedge export --spec-out``);
- ``path/to/file.py:factory`` or ``package.module:factory``: a person's own ``torch.nn.Module`` from a factory;
  its inputs are the data's example shape, its classes its last layer's outputs (checked against the labels).

Every mistake is one :class:`edge.runtime.config.ConfigError` line.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from edge import model as M
from edge.runtime.config import ConfigError

ZOO_NAMES = ("mlp", "cnn")


def is_factory_ref(ref: str) -> bool:
    where, sep, name = str(ref).rpartition(":")
    return bool(sep and where and name.isidentifier() and (where.endswith(".py") or "." in where or where.isidentifier()))


def resolve(ref: str, example_shape: tuple[int, ...] | list[int], classes: int | None = None, *,
            hidden: tuple[int, ...] = (200, 200)) -> dict[str, Any]:
    """The spec for ``ref`` and examples of ``example_shape``; ``classes`` (from the labels) sizes a zoo
    network's last layer and is checked against any other model's."""
    shape = tuple(int(d) for d in example_shape)
    feats = int(math.prod(shape))
    if ref == "mlp":
        return M.mlp([feats, *[int(h) for h in hidden], int(classes or 10)])
    if ref == "cnn":
        if len(shape) == 1 and shape[0] == 64:
            shape = (1, 8, 8)
        if len(shape) != 3:
            raise ConfigError(f"--model cnn needs image examples C x H x W, the data's are {list(shape)}")
        try:
            return M.lenet(shape, int(classes or 10))
        except ValueError as e:
            raise ConfigError(f"--model cnn: {e}") from None
    if ref.endswith(".json"):
        p = Path(ref)
        if not p.is_file():
            raise ConfigError(f"--model {ref}: no such file")
        try:
            spec = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"--model {ref}: not valid JSON: {e}") from None
        return check(spec, shape, classes, ref)
    if is_factory_ref(ref):
        from edge.trainers.torch_objectives.usermodel import describe
        return check(describe(ref, shape), shape, classes, ref)
    raise ConfigError(f"--model {ref!r}: expected {' or '.join(ZOO_NAMES)}, a spec .json, path/to/file.py:factory "
                      f"or package.module:factory")


def check(spec: dict[str, Any], shape: tuple[int, ...], classes: int | None, what: str) -> dict[str, Any]:
    """The spec, if it takes examples of ``shape`` and has at least ``classes`` outputs."""
    if not isinstance(spec, dict) or spec.get("arch") not in ("mlp", "cnn", "module"):
        raise ConfigError(f"--model {what}: not a model spec (arch mlp, cnn or module)")
    try:
        n_in, n_out = M.input_size(spec), M.num_classes(spec)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"--model {what}: malformed spec ({type(e).__name__}: {e})") from None
    if M.is_module(spec) and tuple(spec["input"]) != tuple(shape) and n_in != math.prod(shape):
        raise ConfigError(f"--model {what}: takes examples {spec['input']}, the data's are {list(shape)}")
    if n_in != math.prod(shape):
        raise ConfigError(f"--model {what}: takes {n_in} input features, the data's examples have {math.prod(shape)}")
    if classes is not None and classes > n_out:
        raise ConfigError(f"--model {what}: its last layer has {n_out} outputs, the labels go up to {classes - 1}")
    return spec


def label_classes(*ys: np.ndarray) -> int:
    return int(max(int(np.max(y)) for y in ys if len(y))) + 1
