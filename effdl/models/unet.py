"""The small segmentation UNet of the course's loss-scaling pipeline (Conv-BN-ReLU blocks).

Shapes for a 256x256 input (batch N)::

    down    3 -> 16 -> 32 (stride 2)        N x 32 x 128 x 128   (skip 1)
    pool                                     N x 32 x 64 x 64
    block   32 -> 64 -> 128                  N x 128 x 64 x 64    (skip 2)
    pool                                     N x 128 x 32 x 32
    middle  1x1 128 -> 128                   N x 128 x 32 x 32
    up x2, concat skip 2, 256 -> 128 -> 32   N x 32 x 64 x 64
    up x2, concat skip 1, 64 -> 64 -> 32     N x 32 x 128 x 128
    up x2, 32 -> 16, 1x1 16 -> 1             N x 1 x 256 x 256    (logits)

Input sides must be multiples of 8. The output is raw logits (pair it with BCEWithLogitsLoss).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def conv_bn_relu(c_in: int, c_out: int, kernel: int = 3, stride: int = 1) -> nn.Sequential:
    """Conv (no bias: BatchNorm follows) -> BatchNorm -> ReLU, 'same' padding."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """``forward(x: N x 3 x H x W) -> N x 1 x H x W`` logits, H and W divisible by 8."""

    def __init__(self, in_channels: int = 3, out_channels: int = 1) -> None:
        super().__init__()
        self.down1 = nn.Sequential(conv_bn_relu(in_channels, 16), conv_bn_relu(16, 32, stride=2))
        self.down2 = nn.Sequential(conv_bn_relu(32, 64), conv_bn_relu(64, 128))
        self.pool = nn.MaxPool2d(2)
        self.middle = conv_bn_relu(128, 128, kernel=1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.up2 = nn.Sequential(conv_bn_relu(256, 128), conv_bn_relu(128, 32))
        self.up1 = nn.Sequential(conv_bn_relu(64, 64), conv_bn_relu(64, 32))
        self.out = nn.Sequential(conv_bn_relu(32, 16), nn.Conv2d(16, out_channels, 1))

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] % 8 or x.shape[-2] % 8:
            raise ValueError(f"UNet needs height and width divisible by 8, got {tuple(x.shape)}")
        skip1 = self.down1(x)
        skip2 = self.down2(self.pool(skip1))
        h = self.middle(self.pool(skip2))
        h = self.up2(torch.cat([self.up(h), skip2], dim=1))
        h = self.up1(torch.cat([self.up(h), skip1], dim=1))
        return self.out(self.up(h))
