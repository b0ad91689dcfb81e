"""Recipe ``mps_streams``: the tiled VAE decode overlaps blending with the next tile on a side stream.

In diffusers' tiled decode the tiles are independent until they are blended: here tile i is
blended with its finished neighbours and written into the output on a side stream while tile i+1
decodes on the main stream. Written with device-generic stream APIs (``torch.Stream``,
``torch.accelerator``, ``Tensor.record_stream``), so the same code runs on CUDA now and on MPS once
a build orders work across streams. Streams alone are not enough: the loop makes each stream wait
for the other (``wait_stream``, an event recorded on one stream and awaited on the other). The
2.15.0 macOS wheel ships ``torch.mps.Stream`` and ``record_stream`` (gate feature ``device_streams``)
but its ``torch.mps.Event`` raises "Non-default streams are not yet supported." off the default
stream, so the recipe requires ``cross_stream_events`` (pytorch#194111; 2.16 nightlies at the
earliest, probed on a real Mac). The output is the stock one, value for value.

Opt-in everywhere (``default = False``: a plain ``patch()`` never selects it; name it, e.g.
``patch(vae, recipes=["wan_vae_pad", "mps_streams"])``). A recipe is on by default only where it was
measured harmless, and this one has no such record: on MPS it has never been measured (no MPS device
has run it; the first builds where it can run are those with events across streams), and on an H200
it bought nothing: the side stream left a stock tiled decode's time unchanged and, next to
``wan_vae_pad``, was slower in one series and no different in the next (the mps_streams records, on
the figures page). On CUDA, where it exists to
measure the code that MPS 2.16 will run, it also needs ``options={"mps_streams": {"on_cuda": True}}``.

Targets: the Wan and Qwen-Image VAEs (``tiled_decode``). With ``wan_vae_pad`` / ``qwen_image_vae``
applied as well, their convolutions are used inside the same tile loop.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ...gate import Env, check_all
from ...ops.streams import SideStream
from ...patching import Patch, set_instance_attr
from ...registry import Decision, Match, Recipe, register
from . import common
from . import tiles as vae_tiles
from .families import FAMILIES, family

#: The rows whose tiled decode it serves (``side_stream=True``: Wan, Qwen-Image 1.0).
ROWS = tuple(row for row in FAMILIES if row.side_stream)


@dataclass(frozen=True)
class StreamsPlan:
    """What ``decide`` settled for one VAE: its row, and whether it decodes tiled now (for the report)."""

    family: str
    use_tiling: bool

    def report_details(self) -> dict:
        return {"use_tiling": self.use_tiling}


@dataclass(frozen=True)
class MpsStreamsOptions:
    """``options={"mps_streams": {...}}``: ``on_cuda`` opts in on CUDA."""

    on_cuda: bool = False


@register
class MpsStreams(Recipe):
    name = "mps_streams"
    summary = "tiled VAE decode: tile i is blended and written out on a side stream while tile i+1 decodes"
    targets = tuple(row.vae for row in ROWS)
    lossless = True
    reversible = True
    requires = ("device_streams", "cross_stream_events")
    default = False  # opt-in: measured harmless nowhere yet (see the module docstring)
    order = 110  # after wan_vae_pad / qwen_image_vae, whose tile loop this one replaces
    Options = MpsStreamsOptions

    def find(self, root: torch.nn.Module, prefix: str = "") -> Iterator[Match]:
        return common.find_vaes(root, prefix, ROWS)

    def decide(self, match: Match, env: Env, options: MpsStreamsOptions) -> Decision:
        on_cuda = options.on_cuda
        v = check_all(self.requires, env)
        if not v.ok:
            return Decision.skip(v.reason)
        if env.device_type == "cuda" and not on_cuda:
            # The H200 series (the mps_streams records): no gain alone or next to wan_vae_pad.
            return Decision.skip(
                f"{v.reason}, but on CUDA the side stream bought nothing (H200, Wan2.2 480x832x21 tiled decode: "
                "0.99x-1.01x, once 0.80x next to wan_vae_pad); opt in with options={'mps_streams': {'on_cuda': True}}"
            )
        plan = StreamsPlan(match.data.family, bool(getattr(match.module, "use_tiling", False)))
        return Decision.apply(
            "side stream: blend and copy-out overlap the next tile",
            f"{v.reason}; applies when the VAE decodes tiled (vae.enable_tiling())",
            plan=plan,
        )

    def apply(self, match: Match, decision: Decision, env: Env, options: MpsStreamsOptions) -> Patch:
        import importlib

        from diffusers.models.autoencoders.vae import DecoderOutput

        row = family(decision.plan.family)
        mod = importlib.import_module(row.module)
        pf, upf = (getattr(mod, n, None) for n in row.patch_fns)
        spec = common.loop_spec(match.module, row, patchify=pf, unpatchify=upf)

        def tiled_decode(self: Any, z: torch.Tensor, return_dict: bool = True) -> Any:
            dec = vae_tiles.tiled_decode(self, z, spec, side=SideStream(z.device))
            return DecoderOutput(sample=dec) if return_dict else (dec,)

        return set_instance_attr(match.module, self.name, "tiled_decode", types.MethodType(tiled_decode, match.module))
