"""Model folders shared by the backend tests."""

from __future__ import annotations

from typing import Any

from tests.reference import TINY_CLASS_CONDITIONAL

# The smallest UNet2DModel that still has every part (class embedding, resnets, skip connections):
# one level, no attention. Inductor / AOTInductor compile C++ per kernel, so fewer blocks = faster tests.
MICRO: dict[str, Any] = dict(TINY_CLASS_CONDITIONAL, block_out_channels=(8,), down_block_types=("DownBlock2D",),
                             up_block_types=("UpBlock2D",), add_attention=False)
