"""Federated splits: of data that ships with packages (sklearn's digits; nothing is downloaded), and of a
person's own ``.npz`` (``fedge simulate --data``: one file split by ``--partition``, or a directory holding one
file per device and ``test.npz``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge.runtime.data import _config_error, check_xy, read_npz  # noqa: F401 (coordinator.datasets' callers)


@dataclass
class FederatedData:
    shards: list[tuple[np.ndarray, np.ndarray]]
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    x_val: np.ndarray | None = None  # a validation split beside the test split (None unless asked for)
    y_val: np.ndarray | None = None


DIGITS = Path(__file__).with_name("data") / "digits.csv.gz"


def load_digits_xy() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's digits (UCI's optical handwritten digits: 1,797 8x8 images, 0..16 per pixel), read from the copy
    of scikit-learn's ``digits.csv.gz`` in coordinator/data (BSD-3-Clause, as scikit-learn), exactly as
    ``sklearn.datasets.load_digits`` reads it: the demo and ``fedge simulate`` need no scikit-learn (and scipy)."""
    data = np.loadtxt(DIGITS, delimiter=",")
    return (data[:, :-1] / 16.0).astype(np.float32), data[:, -1].astype(np.int64)


def digits_sample(path: str | Path, n: int = 60, seed: int = 0) -> Path:
    """A device's data file (``.npz`` with ``x``, ``y``): ``n`` random rows of sklearn's digits, e.g. the data a
    conformance run gives a device and the driver."""
    from edge.runtime.data import save_npz
    x, y = load_digits_xy()
    idx = np.random.default_rng(seed).permutation(len(y))[:n]
    save_npz(path, x[idx], y[idx])
    return Path(path)


def dirichlet_split(y: np.ndarray, n: int, alpha: float, rng: np.random.Generator, min_size: int = 5) -> list[np.ndarray]:
    """Label skew of Hsu et al. 2019: each class is spread over devices by proportions ~ Dir(alpha).
    Redrawn until every device has at least ``min_size`` samples."""
    classes = np.unique(y)
    for _ in range(1000):
        parts: list[list[int]] = [[] for _ in range(n)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            cuts = (np.cumsum(rng.dirichlet([alpha] * n))[:-1] * len(idx)).astype(int)
            for i, chunk in enumerate(np.split(idx, cuts)):
                parts[i].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.array(sorted(p)) for p in parts]
    raise ValueError(f"could not split {len(y)} samples over {n} devices with at least {min_size} each")


def digits_federated(n_devices: int, alpha: float = 0.5, seed: int = 0, test_frac: float = 0.2,
                     val_frac: float = 0.0) -> FederatedData:
    """``val_frac`` > 0 keeps a validation split beside the test split (the next ``val_frac`` of the same
    permutation), taken from what would otherwise be training data; the test split does not change with it,
    and ``val_frac = 0`` gives exactly the split of before."""
    x, y = load_digits_xy()
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(y))
    n_test = int(round(test_frac * len(y)))
    n_val = int(round(val_frac * len(y)))
    test, val, train = perm[:n_test], perm[n_test:n_test + n_val], perm[n_test + n_val:]
    xt, yt = x[train], y[train]
    shards = [(xt[i], yt[i]) for i in dirichlet_split(yt, n_devices, alpha, rng)]
    if not n_val:
        return FederatedData(shards, x[test], y[test], 10)
    return FederatedData(shards, x[test], y[test], 10, x[val], y[val])


# ------------------------------------------------------------------------------------------- a person's data
def parse_partition(text: str) -> tuple[str, float]:
    """``iid``, ``dirichlet:ALPHA`` or ``shards:K``."""
    kind, _, arg = str(text).partition(":")
    try:
        if kind == "iid" and not arg:
            return "iid", 0.0
        if kind == "dirichlet" and float(arg) > 0:
            return "dirichlet", float(arg)
        if kind == "shards" and int(arg) >= 1 and str(int(arg)) == arg:
            return "shards", int(arg)
    except ValueError:
        pass
    raise _config_error(f"--partition = {text!r}: expected iid, dirichlet:ALPHA (ALPHA > 0) or shards:K (K >= 1)")


def partition(y: np.ndarray, n: int, how: str, rng: np.random.Generator) -> list[np.ndarray]:
    """Row indices per device: ``iid`` (a random equal split), ``dirichlet:ALPHA`` (label skew, Hsu et al. 2019)
    or ``shards:K`` (McMahan et al. 2017's pathological split: the rows sorted by label, cut into n*K shards,
    K at random per device)."""
    kind, arg = parse_partition(how)
    if len(y) < n:
        raise _config_error(f"{len(y)} training examples cannot be split over {n} devices")
    if kind == "iid":
        return [np.sort(p) for p in np.array_split(rng.permutation(len(y)), n)]
    if kind == "dirichlet":
        try:
            return dirichlet_split(y, n, arg, rng, min_size=max(1, min(5, len(y) // (2 * n))))
        except ValueError as e:
            raise _config_error(f"--partition dirichlet:{arg:g}: {e}") from None
    k = int(arg)
    if n * k > len(y):
        raise _config_error(f"--partition shards:{k}: {n} devices x {k} shards is more than {len(y)} examples")
    order = np.argsort(y, kind="stable")
    shards = np.array_split(order, n * k)
    pick = rng.permutation(n * k).reshape(n, k)
    return [np.sort(np.concatenate([shards[j] for j in row])) for row in pick]


def from_file(path: str | Path, n_devices: int, how: str, seed: int = 0, test_frac: float = 0.2) -> FederatedData:
    """A person's ``.npz`` (``x``, ``y``; ``x_test``/``y_test`` if present, else ``test_frac`` held out), split
    over ``n_devices`` as ``how`` says (:func:`partition`)."""
    d = read_npz(path)
    for k in ("x", "y"):
        if k not in d:
            raise _config_error(f"{path}: no array {k!r} (found {', '.join(sorted(d)) or 'none'})")
    x, y = check_xy(d["x"], d["y"], str(path))
    rng = np.random.default_rng(seed)
    if ("x_test" in d) != ("y_test" in d):
        raise _config_error(f"{path}: has one of x_test and y_test but not the other")
    if "x_test" in d:
        xt, yt = check_xy(d["x_test"], d["y_test"], f"{path} (x_test, y_test)")
        if xt.shape[1:] != x.shape[1:]:
            raise _config_error(f"{path}: x_test examples are {xt.shape[1:]}, x examples {x.shape[1:]}")
    else:
        if not 0.0 < test_frac < 1.0:
            raise _config_error(f"--test-frac = {test_frac}: must be between 0 and 1 (or put x_test, y_test in {path})")
        perm = rng.permutation(len(y))
        n_test = max(1, int(round(test_frac * len(y))))
        if n_test >= len(y):
            raise _config_error(f"{path}: too few examples to hold out a test split")
        test, train = perm[:n_test], perm[n_test:]
        x, y, xt, yt = x[train], y[train], x[test], y[test]
    shards = [(x[i], y[i]) for i in partition(y, n_devices, how, rng)]
    return FederatedData(shards, xt, yt, int(max(y.max(), yt.max())) + 1)


def from_dir(path: str | Path) -> tuple[list[str], FederatedData]:
    """A natural partition: ``<device id>.npz`` per device (x, y: what ``fedge device --data`` reads) and
    ``test.npz``; returns the device ids (file stems, sorted) and the data."""
    from edge.protocol.wire import ID_RE
    root = Path(path)
    if not root.is_dir():
        raise _config_error(f"--data {path}: no such directory")
    test = root / "test.npz"
    if not test.is_file():
        raise _config_error(f"--data {path}: no test.npz (the held-out split the coordinator evaluates on)")
    files = sorted(p for p in root.glob("*.npz") if p.name != "test.npz")
    if not files:
        raise _config_error(f"--data {path}: no <device id>.npz files besides test.npz")
    ids, shards = [], []
    for f in files:
        if not ID_RE.match(f.stem):
            raise _config_error(f"{f}: {f.stem!r} is not a device id (1-128 of A-Z a-z 0-9 _ . : -)")
        d = read_npz(f)
        if "x" not in d or "y" not in d:
            raise _config_error(f"{f}: needs arrays x and y")
        shards.append(check_xy(d["x"], d["y"], str(f)))
        ids.append(f.stem)
    t = read_npz(test)
    if "x" not in t or "y" not in t:
        raise _config_error(f"{test}: needs arrays x and y")
    xt, yt = check_xy(t["x"], t["y"], str(test))
    shape = shards[0][0].shape[1:]
    for i, (x, _y) in zip(ids, shards):
        if x.shape[1:] != shape:
            raise _config_error(f"{path}/{i}.npz: examples are {x.shape[1:]}, {ids[0]}.npz has {shape}")
    if xt.shape[1:] != shape:
        raise _config_error(f"{test}: examples are {xt.shape[1:]}, the devices' are {shape}")
    classes = int(max(max(int(y.max()) for _x, y in shards), yt.max())) + 1
    return ids, FederatedData(shards, xt, yt, classes)
