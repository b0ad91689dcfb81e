"""Video and image VAEs: the family table and the shared patching code (:mod:`.common`),
the tile loop (:mod:`.tiles`) and the recipes that use them (wan_vae_pad, qwen_image_vae, video_vae_pad,
mps_streams). How to add a VAE: ``src/mpsboost/recipes/README.md``."""
from . import qwen_image, streams, video, wan  # noqa: F401  (each registers its recipe)
