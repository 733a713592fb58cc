"""Data as a person brings it: an .npz with ``x`` (examples first, any shape: here 1 x 8 x 8 images) and ``y``
(integer labels). sklearn's 8x8 digits (the copy fedge ships: no scikit-learn needed) stand in for your own data.

    python examples/your_model/make_data.py --out runs/your-model/digits.npz
        one file: x, y (fedge simulate holds out --test-frac of it, or put x_test, y_test in it)
    python examples/your_model/make_data.py --devices pi-0,pi-1,pi-2 --out runs/your-model/fleet
        a directory: <device id>.npz per device (what `fedge device --data` reads) and test.npz
    python examples/your_model/make_data.py --flat --devices pi-kitchen,phone-1 --out .
        the same with 64 flat features per example: the data of the README's fleet.toml (the zoo MLP 64-200-200-10)
"""
import argparse
from pathlib import Path

import numpy as np

from coordinator.datasets import load_digits_xy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--devices", help="comma-separated device ids: write one file per device and test.npz")
    ap.add_argument("--seed", type=int, default=0, help="seeds the split (default: 0)")
    ap.add_argument("--flat", action="store_true", help="64 features per example (the zoo MLP), not 1 x 8 x 8 images")
    a = ap.parse_args()
    x, y = load_digits_xy()
    x = x if a.flat else x.reshape(-1, 1, 8, 8)  # N x 64, or N x 1 x 8 x 8
    rng = np.random.default_rng(a.seed)
    perm = rng.permutation(len(y))
    if not a.devices:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        np.savez(a.out, x=x, y=y)
        print(f"wrote {a.out}: x {x.shape}, y {y.shape}")
        return
    ids = [s.strip() for s in a.devices.split(",") if s.strip()]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n_test = len(y) // 5
    np.savez(out / "test.npz", x=x[perm[:n_test]], y=y[perm[:n_test]])
    for i, part in zip(ids, np.array_split(perm[n_test:], len(ids))):
        np.savez(out / f"{i}.npz", x=x[part], y=y[part])
    print(f"wrote {len(ids)} device files and test.npz to {out}")


if __name__ == "__main__":
    main()
