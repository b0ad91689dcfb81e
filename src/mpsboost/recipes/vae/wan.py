"""Recipe ``wan_vae_pad``: the Wan2.1 / Wan2.2 VAE without a single ``F.pad`` call.

On MPS before torch 2.15 every ``F.pad`` in front of the VAE's causal 3-D convolutions built an
MPSGraph: a Wan2.2-TI2V-5B tiled decode (28 tiles, 8,764 pad calls) held 270 GiB of driver memory
(pytorch#195368), and constant time padding of rank-5 tensors with H*W >= 65536 came back wrong
(issue pytorch#194922). This recipe folds the spatial padding into each convolution, writes the
causal time padding as cached frames or a zero slab, replaces ``AvgDown3D``'s time pad and the
``ZeroPad2d((0, 1, 0, 1))`` of the downsampling blocks: zero pad calls in encode and decode, tiled or
not. On later builds and other devices it is kept for speed (one copy less per convolution, a
tile loop that blends as it goes; on CUDA also channels-last activations and a fused RMS norm).
"""

from __future__ import annotations

from ...registry import register
from .common import CausalVaeRecipe
from .families import rows_for

NAME = "wan_vae_pad"
#: Its rows of the family table (Wan2.1 / Wan2.2: one row, ``AutoencoderKLWan``).
ROWS = rows_for(NAME)


@register
class WanVaePad(CausalVaeRecipe):
    name = NAME
    summary = "Wan VAE: spatial padding folded into each causal Conv3d, time padding as cache or zero slab; no F.pad"
    targets = tuple(t for row in ROWS for t in (row.vae, row.conv, row.avg_down) if t)
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 100
    ROWS = ROWS
