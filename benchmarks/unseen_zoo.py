"""Models and data that no strategy's preset was tuned on (issue 27), for benchmarks/unseen_models.py and the
tests that hold the defaults to them. The factories are named by reference, as a person names theirs:
``benchmarks/unseen_zoo.py:cnn``.

Models (every one takes 1 x 28 x 28 images and has 10 classes):

- ``cnn``: the issue's own CNN: two 5x5 convolutions with 8 and 16 channels, each followed by ReLU and 2x2
  max-pooling, then Linear 256-64-10.
- ``resnet``: a 3x3 stem (12 channels), two residual blocks (conv-ReLU-conv plus the identity, then ReLU), with
  max-pooling before, between and after them, and a linear classifier on the 12 x 3 x 3 map. (A first version
  ended in global average pooling; FedAvg at these defaults stayed at chance on it for 30 rounds, so it said
  nothing about the other strategies.)
- ``bnnet``: normalisation layers: two 3x3 convolutions each followed by BatchNorm, ReLU and max-pooling, then a
  hidden Linear with LayerNorm, then the classifier.

Data (float32 images N x 1 x 28 x 28, integer labels 0..9), nothing downloaded:

- ``digits28``: sklearn's ``load_digits`` (1,797 8x8 images, values /16), each pixel repeated 3 x 3 (24 x 24)
  and zero-padded by 2 to 28 x 28.
- ``blobs28``: generated. Class c has a fixed prototype of three Gaussian bumps (sd 2.5 pixels) at positions
  drawn once from seed 1234 inside the central 20 x 20; an example is its class's prototype with each bump's
  amplitude scaled by U(0.6, 1.4), the whole image shifted by an integer in [-3, 3] on each axis, plus
  N(0, 0.35^2) pixel noise; 200 examples per class (2,000). Bumps of different classes overlap and the shifts
  mix positions, so a model has to learn the bumps' joint layout (not one pixel) to separate the classes.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

SIDE = 28


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 5), nn.ReLU(), nn.MaxPool2d(2),      # 28 -> 24 -> 12
                         nn.Conv2d(8, 16, 5), nn.ReLU(), nn.MaxPool2d(2),     # 12 -> 8 -> 4
                         nn.Flatten(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))


class ResNet(nn.Module):
    def __init__(self, c: int = 12):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        # each layer used once (fedge's rule), so one pooling module per place
        self.pool1, self.pool2, self.pool3 = nn.MaxPool2d(2), nn.MaxPool2d(2), nn.MaxPool2d(2)
        self.a1, self.a2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.b1, self.b2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.fc = nn.Linear(c * 3 * 3, 10)

    def forward(self, x):
        h = self.pool1(torch.relu(self.stem(x)))                    # 14 x 14
        h = torch.relu(h + self.a2(torch.relu(self.a1(h))))
        h = self.pool2(h)                                           # 7 x 7
        h = torch.relu(h + self.b2(torch.relu(self.b1(h))))
        return self.fc(self.pool3(h).flatten(1))                    # 3 x 3


def resnet() -> nn.Module:
    return ResNet()


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.n2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.pool1, self.pool2 = nn.MaxPool2d(2), nn.MaxPool2d(2)
        self.fc, self.ln = nn.Linear(16 * 7 * 7, 32), nn.LayerNorm(32)
        self.out = nn.Linear(32, 10)

    def forward(self, x):
        h = self.pool1(torch.relu(self.n1(self.c1(x))))             # 14 x 14
        h = self.pool2(torch.relu(self.n2(self.c2(h))))             # 7 x 7
        return self.out(torch.relu(self.ln(self.fc(h.flatten(1)))))


def bnnet() -> nn.Module:
    return BNNet()


MODELS = ("cnn", "resnet", "bnnet")


def digits28() -> tuple[np.ndarray, np.ndarray]:
    from coordinator.datasets import load_digits_xy
    x, y = load_digits_xy()
    img = np.kron(x.reshape(-1, 8, 8), np.ones((3, 3), np.float32))
    img = np.pad(img, ((0, 0), (2, 2), (2, 2)))
    return img[:, None].astype(np.float32), y


def blobs28(per_class: int = 200, seed: int = 1234) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.uniform(4, 24, size=(10, 3, 2))  # three bumps per class, inside the central 20 x 20
    yy, xx = np.mgrid[0:SIDE, 0:SIDE].astype(np.float64)
    bumps = np.exp(-((yy[None, None] - centres[..., 0, None, None]) ** 2
                     + (xx[None, None] - centres[..., 1, None, None]) ** 2) / (2 * 2.5 ** 2))  # [10, 3, 28, 28]
    y = np.repeat(np.arange(10), per_class)
    amp = rng.uniform(0.6, 1.4, size=(len(y), 3))
    img = np.einsum("nb,nbhw->nhw", amp, bumps[y])
    shifts = rng.integers(-3, 4, size=(len(y), 2))
    img = np.stack([np.roll(im, tuple(s), axis=(0, 1)) for im, s in zip(img, shifts)])
    img = img + rng.normal(0, 0.35, img.shape)
    perm = rng.permutation(len(y))
    return img[perm, None].astype(np.float32), y[perm].astype(np.int64)


DATASETS = {"digits28": digits28, "blobs28": blobs28}
