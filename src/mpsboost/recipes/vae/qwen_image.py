"""Recipe ``qwen_image_vae``: the Qwen-Image 1.0 and 2.1 VAEs without ``F.pad``, and 2-D for single images.

Same treatment as ``wan_vae_pad`` (the Qwen-Image VAE is the Wan2.1 design): spatial padding folded
into each causal convolution, time padding as cached frames or a zero slab, the downsampling
``ZeroPad2d`` as a buffer copy. On MPS before torch 2.15 this avoids pytorch#195368 (MPSGraph pad
memory) and pytorch#194922 (wrong time padding of rank-5 tensors once H*W >= 65536: roundtrips far
from the CPU result, ComfyUI#16433). For an image (one frame) every 3x3x3 causal convolution sees
``[0, 0, x]`` in time, which is exactly a 2-D convolution with the last time slice of the weight:
about a third of the FLOPs, and no cache copies since nothing follows the frame.

The Qwen-Image-2.1 VAE (``AutoencoderKLQwenImage21``) is a row of the same family table
(``qwen21`` in :data:`~mpsboost.recipes.vae.families.FAMILIES`): its causal convolutions are 2-D already (``nn.Conv2d``
subclasses that squeeze the frame and ``F.pad`` the 4-D tensor), its encoder's ``AvgDown3D`` blocks
pad 5-D in time. A 256x256 roundtrip issues 74 4-D and 5 5-D ``constant_pad_nd`` at the aten level;
patched, none. The 5-D time pads are the ones pytorch#194922 corrupts on MPS before 2.15
(QwenLM/Qwen-Image-2.1#6: encoder latents far from the CPU ones once H*W >= 65536).
"""

from __future__ import annotations

from ...registry import register
from .common import CausalVaeRecipe
from .families import rows_for

NAME = "qwen_image_vae"
#: Its rows of the family table: Qwen-Image 1.0 (``qwen``) and Qwen-Image-2.1 (``qwen21``).
ROWS = rows_for(NAME)


@register
class QwenImageVae(CausalVaeRecipe):
    name = NAME
    summary = "Qwen-Image 1.0 / 2.1 VAEs: no F.pad (padding fold, zero slab); single frames as 2-D convolutions"
    targets = tuple(t for row in ROWS for t in (row.vae, row.conv))
    lossless = True
    reversible = True
    requires = ()
    default = True
    order = 100
    # The rows say the rest: the 2.1 row's convolutions are 2-D already ("conv2d padding fold") and its
    # rank5_note names its AvgDown3D pads; the 1.0 row (images=True) names the single-frame 2-D path.
    ROWS = ROWS
