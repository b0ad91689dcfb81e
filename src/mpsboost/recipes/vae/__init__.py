"""Video and image VAEs: one family table, the code that reads it, and four thin recipes.

* :mod:`.families`: ``FAMILIES``, one :class:`~.families.VaeFamily` row per model family (Wan 2.1 / 2.2,
  Qwen-Image 1.0 and 2.1, HunyuanVideo, Mochi, CogVideoX, Cosmos, ...), naming its diffusers classes by
  dotted path and the recipe that serves it;
* :mod:`.common`: what the recipes share: options, decisions (frozen plans), the causal treatment
  (:func:`~.common.patch_tree`) and the pad treatment (:func:`~.common.patch_pads`);
* :mod:`.tiles`: the frame and tile loops of the Wan-design VAEs (a mirror of diffusers' loops);
* the recipes select their rows: :mod:`.wan` (``wan_vae_pad``), :mod:`.qwen_image` (``qwen_image_vae``),
  :mod:`.video` (``video_vae_pad``), :mod:`.streams` (``mps_streams``, rows with ``side_stream=True``).

Adding a VAE family is adding a row to ``FAMILIES`` in ``families.py``:

* a VAE of the Wan design (causal convolutions that keep diffusers' ``_padding`` and ``F.pad`` in front
  of themselves): give ``conv``, ``norm``, ``resample``, ``blocks``, ``avg_down`` (or None) and the loop
  fields ``first_chunk``, ``clamp_tiled``, ``patchify``, ``patch_fns`` as the family's diffusers code has
  them; ``conv_kind="frame2d"`` where its convolutions are 2-D already; ``images=True`` for an image
  model; ``recipe`` the recipe that serves that model (``wan_vae_pad`` or ``qwen_image_vae``; a new
  model's VAE joins the recipe of its model family, or a new thin recipe module like :mod:`.wan`);
* any other VAE that pads 5-D tensors: ``recipe="video_vae_pad"`` and ``pads``, one
  :class:`~.families.PadSite` per module class that calls ``F.pad`` on a 5-D tensor (``how="route"``
  unless one of ``PAD_HOWS`` fits). Find the classes by counting pads (``mpsboost.bench.count_pad5d``)
  on a tiny config of the VAE and tracing them to their callers.

Tests to copy: ``tests/recipes/vae/test_qwen_image21_vae.py`` (a causal row: zero pads, numerics against
stock, decisions per simulated environment, unpatch) or, for a pad row, a tiny config as a row of
``mpsboost.bench.models`` named in its ``VIDEO_VAES`` (then ``tests/recipes/vae/test_video_vae_pad.py`` runs it).
"""

from . import qwen_image, streams, video, wan  # noqa: F401  (each registers its recipe)
