"""The ``mpsboost`` command: doctor, plan, demo, bench, selftest."""

from __future__ import annotations

import argparse
import functools
import json
import platform
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main", "shipped_models"]

#: Every line the doctor's first screen and the plan of a shipped id print fits a terminal this wide.
WIDTH = 100


# ------------------------------------------------------------------------------------------ doctor


def _torch_build() -> dict[str, Any]:
    import torch

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "git": getattr(torch.version, "git_version", None),
        "debug": bool(getattr(torch.version, "debug", False)),
        "mps_built": torch.backends.mps.is_built(),
    }


def _devices() -> list[dict[str, Any]]:
    import torch

    devs: list[dict[str, Any]] = [{"type": "cpu", "name": platform.processor() or platform.machine()}]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            devs.append(
                {"type": "cuda", "index": i, "name": torch.cuda.get_device_name(i), "capability": f"{cap[0]}.{cap[1]}"}
            )
    if torch.backends.mps.is_available():
        devs.append({"type": "mps", "name": f"Apple MPS ({platform.machine()})"})
    return devs


def _env_from_args(args: argparse.Namespace):
    from .gate import Env

    if args.device is None and args.torch is None:
        return Env.detect()
    from .bench.harness import best_device

    return Env.simulate(args.device or best_device(), args.torch)


def _doctor_info(args: argparse.Namespace, env: Any) -> dict[str, Any]:
    """Everything the doctor says, as the dict ``--json`` prints."""
    from . import __version__
    from .gate import feature_info, matrix
    from .registry import all_recipes

    verdicts = matrix(env)
    infos = {k: feature_info(k, env.device_type) for k in verdicts}
    info = {
        "mpsboost": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_build": _torch_build(),
        "devices": _devices(),
        "env": env.to_dict(),
        "features": {
            k: {"available": v.ok, "reason": v.reason, "decided_by": v.decided_by, "rules": infos[k]["rules"]}
            for k, v in verdicts.items()
        },
        "recipes": [
            {
                "name": r.name,
                "summary": r.summary,
                "lossless": r.lossless,
                "reversible": r.reversible,
                "default": r.default,
            }
            for r in all_recipes()
        ],
        "applies": _applies(env),
    }
    info["hub_kernels"] = _hub_kernels(env)
    info["gguf_kernels"] = _gguf_kernels(env)
    info["torch_wheel"] = _wheel_facts(env)
    if getattr(args, "fp8_checkpoint", None):
        info["fp8_checkpoint"] = _describe_fp8(args.fp8_checkpoint, env)
    return info


def _doctor(args: argparse.Namespace) -> int:
    env = _env_from_args(args)
    info = _doctor_info(args, env)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    lines = _doctor_all(info, env) if args.all else _doctor_screen(info, env)
    print("\n".join(lines))
    if "fp8_checkpoint" in info:
        print(f"\nfp8 checkpoint {args.fp8_checkpoint}:")
        print("\n".join(_wrap(info["fp8_checkpoint"], "  ")))
    return 0


def _wrap(text: str, indent: str = "", hang: str | None = None, width: int = WIDTH) -> list[str]:
    """``text`` in lines of at most ``width`` characters (first line ``indent``, the rest ``hang``)."""
    return textwrap.wrap(
        text,
        width,
        initial_indent=indent,
        subsequent_indent=indent if hang is None else hang,
        break_long_words=True,
        break_on_hyphens=False,
    ) or [indent]


def _header_lines(info: dict[str, Any], env: Any) -> list[str]:
    tb = info["torch_build"]
    out = _wrap(f"mpsboost {info['mpsboost']}  python {info['python']}  {info['platform']}")
    out += _wrap(
        f"torch {tb['torch']}  cuda {tb['cuda'] or '-'}  git {str(tb['git'] or '-')[:12]}  mps built: {tb['mps_built']}"
    )
    out += _wrap("devices: " + _devices_text(info), hang="  ")
    return out


def _doctor_screen(info: dict[str, Any], env: Any) -> list[str]:
    """The first screen: what applies on this machine (or the simulated one), in lines a terminal shows."""
    from .gate import FEATURES

    tb = info["torch_build"]
    out = _wrap(
        f"mpsboost {info['mpsboost']}  torch {tb['torch']} (cuda {tb['cuda'] or '-'}, mps built: {tb['mps_built']})"
        f"  python {info['python']}  {platform.system()} {platform.machine()}"
    )
    out += _wrap("devices: " + _devices_text(info), hang="  ")
    out += _wrap(f"decisions for {env.describe()}" + ("" if env.simulated else " (this machine)"), hang="  ")
    out.append("")
    out += _applies_lines(info["applies"])
    # The features with a rule for this device type (the others are for other devices).
    feats = {k: v for k, v in info["features"].items() if k in FEATURES and env.device_type in FEATURES[k].rules}
    no = [k for k, v in feats.items() if not v["available"]]
    others = len(info["features"]) - len(feats)
    out.append("")
    head = f"gate: {len(feats) - len(no)} of {len(feats)} {env.device_type} features available"
    tail = f" ({others} more for other devices)" if others else ""
    out += _within(head + ("; not: " if no else ""), no, tail, " and {} more (doctor --all)", lines=1)
    hub, gguf = info["hub_kernels"], info["gguf_kernels"]
    whys = [d["why"].split("; ")[0].split(" (")[0] for d in (hub, gguf) if not d["would_load"]]
    if hub["would_load"] == gguf["would_load"]:
        verdict = "would load" if hub["would_load"] else f"would not load: {whys[0]}"
        out += _wrap(f"transformers' Hub kernels (Metal, GGUF): {verdict}", hang="  ")
    else:
        loads = {True: "would load", False: "would not"}
        out += _wrap(
            f"transformers' Hub kernels: Metal SDPA/RMSNorm {loads[hub['would_load']]}, GGUF-on-MPS "
            f"{loads[gguf['would_load']]}: {whys[0]}",
            hang="  ",
        )
    example = next(iter(info["applies"]["models"]), "HUB_ID")
    out.append(f"next: mpsboost plan {example}  (or mpsboost doctor --all: every feature and why)")
    if env.device_type != "mps":
        out.append("      a Mac's decisions: mpsboost doctor --device mps --torch 2.15.0")
    return out


def _within(head: str, names: list[str], tail: str, more: str, lines: int = 2) -> list[str]:
    """``head`` + as many of ``names`` as fit in ``lines`` lines, then how many more (``more``), then ``tail``."""
    for k in range(len(names), 0, -1):
        text = head + ", ".join(names[:k]) + (more.format(len(names) - k) if k < len(names) else tail)
        wrapped = _wrap(text, hang="  ")
        if len(wrapped) <= lines:
            return wrapped
    return _wrap(head + tail, hang="  ")


def _devices_text(info: dict[str, Any]) -> str:
    return "; ".join(
        f"{d['type']}{':' + str(d['index']) if 'index' in d else ''} {d['name']}"
        + (f" (sm {d['capability']})" if "capability" in d else "")
        for d in info["devices"]
    )


def _doctor_all(info: dict[str, Any], env: Any) -> list[str]:
    """``--all``: the whole gate matrix with each rule's facts, every recipe, the Hub kernels, the wheel."""
    out = _header_lines(info, env)
    out += ["", *_wrap(f"gate for {env.describe()}:")]
    feats = info["features"]
    width = max(len(k) for k in feats)
    lead = " " * (width + 9)
    for name, v in feats.items():
        head = f"  {name.ljust(width)}  {'yes' if v['available'] else 'no '}  [{v['decided_by']}]  {v['reason']}"
        out += _wrap(head, hang=lead)
        for r in v["rules"]:
            facts = [
                f"upstream {r['upstream']}" if r["upstream"] else "",
                f"merged {r['merged']}" if r["merged"] else "",
                f"first release {r['first_release']}",
                f"macOS >= {r['min_macos']}" if r["min_macos"] else "",
                f"sm >= {r['min_capability']}" if r["min_capability"] else "",
                r["conditions"],
                f"macOS wheels: {r['evidence_text']}" if r.get("evidence_text") else "",
            ]
            out += _wrap("rule: " + "; ".join(f for f in facts if f), lead)
    if info["recipes"]:
        out += ["", "recipes:"]
        w = max(len(r["name"]) for r in info["recipes"])
        for r in info["recipes"]:
            tags = [t for t in ("lossless", "reversible", "default") if r[t]]
            tag = ", ".join(tags) or "opt-in, lossy, irreversible"
            out += _wrap(f"  {r['name'].ljust(w)}  {r['summary']} [{tag}]", hang=" " * (w + 4))
    out.append("")
    out += _applies_lines(info["applies"])
    for label, k in (
        ("transformers hub kernels for Metal", "hub_kernels"),
        ("transformers GGUF-on-MPS kernels", "gguf_kernels"),
    ):
        d = info[k]
        out.append("")
        out += _wrap(f"{label} ({', '.join(d['repos'])}): {'would load' if d['would_load'] else 'would not load'}")
        out += _wrap(d["why"], "  ")
    if info["torch_wheel"]:
        out += ["", *_wrap(info["torch_wheel"])]
    return out


# ------------------------------------------------------------------------------------------ what applies


# Status marks of the doctor's table: what patch() (or the opt-in keyword) does to each shipped model.
_MARKS = {"would apply": "yes", "skipped": "no", "not applicable": "-"}


def _applies(env: Any) -> dict[str, Any]:
    """For each shipped model (its real widths, one layer of each kind, on the meta device): the recipes that
    would apply, those that keep stock here, and the extras a missing library would bring."""
    from .registry import all_recipes

    default = [r.name for r in all_recipes() if r.default and r.lossless]
    opt_in = [r for r in all_recipes() if r.name not in default]
    models: dict[str, Any] = {}
    for hub_id, spec in shipped_models().items():
        missing = _missing_library(spec)
        if missing:
            models[hub_id] = {"label": spec["label"], "missing": missing}
            continue
        cls_name, comps = _few_layer_model(hub_id)
        target = comps[""] if "" in comps else comps
        status: dict[str, str] = {}
        reasons: dict[str, str] = {}
        for report in _plans(target, env, opt_in):
            for row in report.rows:
                # one model, many rows per recipe: it applies where any row applies; else the first skip says why
                old = status.get(row.recipe)
                if old == "would apply" or (old == "skipped" and row.status == "not applicable"):
                    continue
                status[row.recipe] = row.status
                if row.status == "skipped":
                    reasons.setdefault(row.recipe, row.reason)
        models[hub_id] = {"label": spec["label"], "class": cls_name, "status": status, "skipped_because": reasons}
    return {"default": default, "opt_in": {r.name: _opt_in_hint(r) for r in opt_in}, "models": models}


@functools.lru_cache(maxsize=None)
def _few_layer_model(hub_id: str) -> tuple[str, dict[str, Any]]:
    """A shipped model with one layer of each kind on the meta device, built once per process (plan changes
    nothing; these are mpsboost's own modules, holding no weights)."""
    return _build_shipped(hub_id, layers="few")


def _plans(target: Any, env: Any, opt_in: list) -> list:
    from .api import plan

    out = [plan(target, env=env)]
    for r in opt_in:
        kw = {r.keyword: r.keyword_values[0]} if r.keyword and r.keyword_values else {}
        out.append(plan(target, env=env, recipes=[] if kw else [r.name], **kw))
    return out


def _opt_in_hint(recipe: Any) -> str:
    if recipe.keyword and recipe.keyword_values:
        return f"{recipe.keyword}={recipe.keyword_values[0]!r}"
    return f"recipes=[{recipe.name!r}]"


def _applies_lines(applies: dict[str, Any]) -> list[str]:
    """The recipes x shipped models table (rows: recipes with a target in some shipped model)."""
    models = applies["models"]
    built = {k: m for k, m in models.items() if "status" in m}
    out = ["recipes on the shipped models (yes: applies here; no: stock kept; -: no target; *: opt-in)"]
    for hub_id, m in models.items():
        if "missing" in m:
            out += _wrap(f"  {hub_id}: {m['missing']}", hang="    ")
    if not built:
        return out
    names = applies["default"] + list(applies["opt_in"])
    rows = [n for n in names if any(m["status"].get(n, "not applicable") != "not applicable" for m in built.values())]
    labels = [m["label"] for m in built.values()]
    w = max([len(n) + 1 for n in rows] + [6]) + 2
    out.append(("  " + "".ljust(w) + "  ".join(labels)).rstrip())
    nowhere = []
    for n in rows:
        marks = [_MARKS.get(m["status"].get(n, "not applicable"), "?") for m in built.values()]
        star = "*" if n in applies["opt_in"] else ""
        if "yes" not in marks:
            nowhere.append(n + star)
            continue
        cells = "  ".join(mark.center(len(lab)) for mark, lab in zip(marks, labels))
        out.append(f"  {(n + star).ljust(w)}{cells}".rstrip())
    if nowhere:
        out += _wrap(f"  stock kept on every shipped model here: {', '.join(nowhere)}", hang="    ")
    if applies["opt_in"]:
        out += _wrap(f"  *: patch(model, {' or '.join(applies['opt_in'].values())})", hang="    ")
    return out


# ------------------------------------------------------------------------------------------ shipped configs

# A hub id is written OWNER/NAME; a path that does not exist but looks like one is looked up among the shipped.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@functools.lru_cache(maxsize=1)
def shipped_models() -> dict[str, dict[str, Any]]:
    """The hub ids whose published configs ship with mpsboost (``mpsboost/bench/configs/*/real``), read from
    each file's ``_source`` note: {hub id: {"label", "library", "files": {component: path}}}."""
    from .bench.models import CONFIGS

    out: dict[str, dict[str, Any]] = {}
    for path in sorted(CONFIGS.glob("*/real/*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        source = str(data.get("_source", "")).split()
        if not source or not _HUB_ID.match(source[0]):
            continue  # run settings (run.json), not a model's config
        hub_id = source[0]
        entry = out.setdefault(
            hub_id,
            {"label": hub_id.split("/", 1)[1].removesuffix("-Diffusers"), "library": None, "files": {}},
        )
        entry["library"] = "diffusers" if "_class_name" in data else "transformers"
        component = "" if path.name == "config.json" else path.stem
        entry["files"][component] = path
    return out


def _missing_library(spec: dict[str, Any]) -> str:
    """'' when the library the shipped model needs is installed, else what to install."""
    import importlib.util

    from .install import extra_hint

    lib = spec["library"]
    return "" if importlib.util.find_spec(lib) is not None else f"needs {lib}; {extra_hint(lib)}"


def _unknown_hub_id(text: str) -> str:
    ids = ", ".join(shipped_models())
    return (
        f"{text} is neither a local folder nor a hub id whose config ships with mpsboost "
        f"(shipped: {ids}); give a local diffusers pipeline or model folder"
    )


def _few_layers(data: dict[str, Any]) -> dict[str, Any]:
    """The config with its layer count cut to one layer of each kind (the widths, which decide, unchanged)."""
    out = dict(data)
    if "num_hidden_layers" in out:  # transformers: a full-attention layer every N (Qwen3.6: 3 DeltaNet + 1)
        keep = max(int(out.get("full_attention_interval") or 1), 2)
        out["num_hidden_layers"] = min(out["num_hidden_layers"], keep)
        if isinstance(out.get("layer_types"), list):
            out["layer_types"] = out["layer_types"][: out["num_hidden_layers"]]
    if "num_layers" in out:  # diffusers transformers
        out["num_layers"] = min(out["num_layers"], 1)
    return out


def _build_shipped(hub_id: str, *, layers: str = "all") -> tuple[str, dict[str, Any]]:
    """The modules of a shipped model on the meta device: (class or pipeline name, {component: module}).

    ``layers="few"``: one layer of each kind (what the doctor plans on; every layer of a kind is the same)."""
    from .errors import UserInputError

    spec = shipped_models().get(hub_id)
    if spec is None:
        raise UserInputError(_unknown_hub_id(hub_id))
    missing = _missing_library(spec)
    if missing:
        raise UserInputError(f"{hub_id} {missing}")
    comps: dict[str, Any] = {}
    for component, path in spec["files"].items():
        raw = json.loads(path.read_text(encoding="utf-8"))
        data = {k: v for k, v in raw.items() if not k.startswith("_")}
        comps[component] = _meta_module(spec["library"], raw, _few_layers(data) if layers == "few" else data)
    if "" in comps:
        return type(comps[""]).__name__, comps
    return hub_id, comps


def _meta_module(library: str, raw: dict[str, Any], data: dict[str, Any]) -> Any:
    import importlib

    lib = importlib.import_module(library)
    with _empty_weights():
        if library == "diffusers":
            return getattr(lib, raw["_class_name"]).from_config(data)
        data = dict(data)
        arch = data.pop("architectures")[0]
        cfg = lib.AutoConfig.for_model(data.pop("model_type"), **data)
        return getattr(lib, arch)._from_config(cfg)


def _empty_weights():
    try:
        from accelerate import init_empty_weights
    except ImportError:  # accelerate is in both extras; without it, torch's meta device context
        import torch

        return torch.device("meta")
    return init_empty_weights()


def _installed(dist: str) -> str | None:
    """The installed version of a distribution, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _fits(have: str, lo: str, hi: str) -> bool:
    """lo <= have < hi, as transformers compares the `kernels` package's version."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(lo) <= Version(have) < Version(hi)
    except InvalidVersion:
        return False


# transformers' hub kernels for Metal: transformers 5.24's integrations/hub_kernels.py maps RMSNorm on "mps" to
# kernels-community/mlx-rmsnorm; gpt_oss and openai_privacy_filter ask for kernels-community/metal-flash-sdpa.
# They load only when transformers.utils.import_utils.is_kernels_available() holds: the `kernels` package
# installed with KERNELS_MIN_VERSION <= version < KERNELS_MAX_VERSION (0.18.2 and 0.19.0 in transformers 5.24;
# 0.19.1 and 0.20.0 in 5.25), and USE_HUB_KERNELS not set to a false value. Otherwise transformers falls back silently.
# Which of them the installed transformers names is read from its source (5.25 maps RMSNorm for cuda, rocm and
# xpu only: mlx-rmsnorm left hub_kernels.py): each repository and the files that would name it.
_HUB_REPOS = {
    "kernels-community/metal-flash-sdpa": (
        "models/gpt_oss/modeling_gpt_oss.py",
        "models/openai_privacy_filter/modeling_openai_privacy_filter.py",
    ),
    "kernels-community/mlx-rmsnorm": ("integrations/hub_kernels.py",),
}


def _hub_repos(root: str | None = None) -> list[str]:
    """The Metal hub kernels the transformers at ``root`` (default: the installed one, found without importing it)
    names in its source, in :data:`_HUB_REPOS` order."""
    import importlib.util
    import os

    if root is None:
        spec = importlib.util.find_spec("transformers")
        if spec is None or not spec.submodule_search_locations:
            return []
        root = list(spec.submodule_search_locations)[0]
    found = []
    for repo, files in _HUB_REPOS.items():
        for rel in files:
            try:
                with open(os.path.join(root, rel), encoding="utf-8") as f:
                    named = repo in f.read()
            except OSError:
                continue
            if named:
                found.append(repo)
                break
    return found


def _hub_kernels(env: Any) -> dict[str, Any]:
    """Would transformers' hub kernels for Metal load here, and why not."""
    import importlib.util
    import os

    transformers = _installed("transformers")
    out: dict[str, Any] = {
        "repos": _hub_repos() if transformers is not None else [],
        "kernels": _installed("kernels"),
        "transformers": transformers,
        "needs": None,
        "would_load": False,
    }
    lo = hi = None
    if out["transformers"] is not None and importlib.util.find_spec("transformers") is not None:
        try:  # the bounds transformers itself checks, read from the installed version
            from transformers.utils import import_utils

            lo, hi = (
                getattr(import_utils, "KERNELS_MIN_VERSION", None),
                getattr(import_utils, "KERNELS_MAX_VERSION", None),
            )
        except ImportError:
            lo = hi = None
    if lo and hi:
        out["needs"] = f"kernels>={lo},<{hi}"
    flag = os.environ.get("USE_HUB_KERNELS", "YES").upper()
    why = []
    if out["transformers"] is None:
        why.append("transformers is not installed")
    elif not (lo and hi):
        why.append(f"transformers {out['transformers']} has no hub-kernel version check (KERNELS_MIN_VERSION)")
    if out["kernels"] is None:
        why.append(f"the `kernels` package is not installed (transformers needs {out['needs'] or 'it'})")
    elif lo and hi:
        if not _fits(out["kernels"], lo, hi):
            why.append(
                f"kernels {out['kernels']} is installed; transformers {out['transformers']} "
                f"needs {out['needs']} and skips them silently"
            )
    if out["transformers"] is not None and not out["repos"]:
        why.append(f"transformers {out['transformers']} names none of {', '.join(_HUB_REPOS)}")
    if flag not in ("1", "ON", "YES", "TRUE"):
        why.append(f"USE_HUB_KERNELS={os.environ.get('USE_HUB_KERNELS')} turns them off")
    if env.device_type != "mps":
        why.append(f"they are Metal kernels and this is {env.device_type}")
    out["would_load"] = not why
    out["why"] = (
        "; ".join(why)
        if why
        else f"kernels {out['kernels']} fits {out['needs']} (the first use downloads them from the Hub)"
    )
    return out


# transformers' GGUF-on-MPS path (transformers/integrations/gguf/, 5.24+): a .gguf checkpoint of an architecture in
# integrations/gguf/utils.GGUF_ARCHS (qwen35, qwen35moe, lfm2 in 5.24) stays packed on the Mac and runs on ggml's
# Metal kernels, fetched from the Hub through the `kernels` package: get_gguf_kernel() calls
# hub_kernels.get_kernel("ggml-org/ggml-quantization"), which raises unless is_kernels_available()
# (KERNELS_MIN_VERSION <= kernels < KERNELS_MAX_VERSION), and kernelize_ggml_layers() returns without grafting
# the layer kernels (ggml-norm, ggml-gated-delta-net, topk) on the same check. Without it every forward unpacks
# the weights (slower, same memory). Reading a .gguf file at all needs the `gguf` package (GGUF_MIN_VERSION).
_GGUF_REPOS = (
    "ggml-org/ggml-quantization",
    "ggml-org/ggml-norm",
    "ggml-org/ggml-gated-delta-net",
    "transformers-community/topk",
)


def _gguf_kernels(env: Any) -> dict[str, Any]:
    """Would transformers' GGUF-on-MPS kernels load here, and why not (never downloads anything)."""
    import importlib.util

    from packaging.version import InvalidVersion, Version

    out: dict[str, Any] = {
        "repos": list(_GGUF_REPOS),
        "transformers": _installed("transformers"),
        "kernels": _installed("kernels"),
        "gguf": _installed("gguf"),
        "needs": None,
        "architectures": [],
        "would_load": False,
    }
    why = []
    lo = hi = gguf_min = None
    path = False
    if out["transformers"] is None:
        why.append("transformers is not installed")
    else:
        try:
            path = importlib.util.find_spec("transformers.integrations.gguf.kernels") is not None
        except (ImportError, ValueError):
            path = False
        if not path:
            why.append(
                f"transformers {out['transformers']} has no GGUF-on-MPS path "
                "(transformers/integrations/gguf/kernels.py, transformers 5.24+)"
            )
        else:
            from transformers.utils import import_utils

            lo = getattr(import_utils, "KERNELS_MIN_VERSION", None)
            hi = getattr(import_utils, "KERNELS_MAX_VERSION", None)
            gguf_min = getattr(import_utils, "GGUF_MIN_VERSION", None)
            try:
                from transformers.integrations.gguf.utils import GGUF_ARCHS

                out["architectures"] = sorted(GGUF_ARCHS)
            except ImportError:
                pass
    if lo and hi:
        out["needs"] = f"kernels>={lo},<{hi}" + (f", gguf>={gguf_min}" if gguf_min else "")
    if path:
        if out["kernels"] is None:
            why.append(f"the `kernels` package is not installed (transformers needs kernels>={lo},<{hi})")
        elif lo and hi:
            if not _fits(out["kernels"], lo, hi):
                why.append(
                    f"kernels {out['kernels']} is installed, needs >={lo},<{hi}: transformers "
                    f"{out['transformers']} unpacks the GGUF weights on every forward instead"
                )
        if out["gguf"] is None:
            why.append(f"the `gguf` package (to read .gguf files) is not installed (needs gguf>={gguf_min})")
        elif gguf_min:
            try:
                if Version(out["gguf"]) < Version(gguf_min):
                    why.append(f"gguf {out['gguf']} is installed, needs >={gguf_min}")
            except InvalidVersion:
                why.append(f"gguf {out['gguf']}: not a version transformers can compare")
    if env.device_type != "mps":
        why.append(f"they are Metal kernels and this is {env.device_type}")
    out["would_load"] = not why
    archs = ", ".join(out["architectures"]) or "none listed"
    out["why"] = (
        "; ".join(why)
        if why
        else f"kernels {out['kernels']} and gguf {out['gguf']} fit {out['needs']}; architectures: {archs} "
        "(the first load downloads the kernels from the Hub)"
    )
    return out


def _wheel_facts(env: Any) -> str:
    """What the released macOS wheel of this torch release says (data/mps_wheels.json), for MPS."""
    if env.device_type != "mps":
        return ""
    from .gate import wheel_evidence

    rel = ".".join(map(str, env.torch_version.release))
    for w in wheel_evidence()["wheels"]:
        if w["version"] == rel:
            return (
                f"torch {rel} macOS wheel: {w['file']} (macOS {w['min_macos']} or later), sha256 {w['sha256'][:16]}..."
                f"; the gate's MPS column is checked against it (data/mps_wheels.json)"
            )
    return f"torch {rel}: no released macOS wheel read into data/mps_wheels.json (a nightly, or newer than the file)"


def _describe_fp8(path: str, env: Any) -> str:
    """Which format a fp8 checkpoint file or folder is in, and the path its layers take in ``env``."""
    from .errors import UserInputError
    from .quant.fp8_plan import describe_checkpoint

    try:
        return describe_checkpoint(path, env)
    except OSError as exc:  # missing or unreadable: one line naming the file, like every other user error
        raise UserInputError(str(exc) if str(path) in str(exc) else f"{path}: {exc}") from None


# ------------------------------------------------------------------------------------------ plan


def _read_json(file: Path) -> dict[str, Any]:
    """A config file as a dict, or one line naming the file and what is wrong with it."""
    from .errors import UserInputError

    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserInputError(
            f"{file}: cannot be read ({type(exc).__name__}: {getattr(exc, 'strerror', None) or exc})"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{file}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise UserInputError(f"{file}: holds a JSON {type(data).__name__}, not an object of settings")
    return data


def _build_meta_components(path: Path) -> tuple[str, dict[str, Any]]:
    """Build the modules of a local diffusers pipeline folder or model folder on the meta device."""
    from .errors import UserInputError

    init_empty_weights = _empty_weights
    if not path.is_dir():
        raise UserInputError(f"{path} is not a folder (give a local diffusers pipeline or model folder)")
    index = path / "model_index.json"
    if index.is_file():
        spec = _read_json(index)
        comps: dict[str, Any] = {}
        wanted = []
        for name, value in spec.items():
            if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[0] is None:
                continue
            sub = path / name
            if (sub / "config.json").is_file():  # tokenizers, schedulers, processors: nothing to patch
                wanted.append((name, value[0], value[1], sub))
        _check_libraries({library for _, library, _, _ in wanted}, path)
        for name, library, cls_name, sub in wanted:
            with init_empty_weights():
                comps[name] = _build_one(library, cls_name, sub)
        if not comps:
            raise UserInputError(f"no model component with a config.json under {path}")
        return spec.get("_class_name", "pipeline"), comps
    config = path / "config.json"
    if not config.is_file():
        raise UserInputError(f"{path} has neither model_index.json (pipeline) nor config.json (model)")
    data = _read_json(config)
    if "_class_name" in data:
        library, cls_name = "diffusers", data["_class_name"]
    elif data.get("architectures"):
        library, cls_name = "transformers", data["architectures"][0]
    else:
        raise UserInputError(f"{config} names no class ('_class_name' or 'architectures')")
    _check_libraries({library}, path)
    with init_empty_weights():
        return cls_name, {"": _build_one(library, cls_name, path)}


def _check_libraries(libraries: set, folder: Path) -> None:
    """Every library the folder's classes come from is installed; checked before any model is built."""
    import importlib.util

    from .errors import UserInputError
    from .install import EXTRAS, extra_hint

    for library in sorted(libraries):
        if not isinstance(library, str) or not library:
            raise UserInputError(
                f"{folder}: a component names library {library!r}; expected 'diffusers' or 'transformers'"
            )
        if importlib.util.find_spec(library) is None:
            hint = extra_hint(library) if library in EXTRAS else f"install {library}"
            raise UserInputError(f"{folder} needs {library}, which is not installed; {hint}")


def _build_one(library: str, cls_name: str, folder: Path):
    import importlib

    from .errors import UserInputError

    lib = importlib.import_module(library)
    cls = getattr(lib, cls_name, None) if isinstance(cls_name, str) else None
    if cls is None:
        raise UserInputError(f"{folder}: {library} {getattr(lib, '__version__', '')} has no class {cls_name!r}")
    config = folder / "config.json"
    try:
        if library == "transformers":
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(folder)
            return cls._from_config(cfg) if hasattr(cls, "_from_config") else cls(cfg)
        if hasattr(cls, "load_config") and hasattr(cls, "from_config"):
            return cls.from_config(cls.load_config(folder))
    except Exception as exc:  # a bad value in the config: the library's own error, as one line naming the file
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise UserInputError(
            f"{config}: {library}.{cls_name} cannot be built from it ({type(exc).__name__}: {first})"
        ) from None
    raise UserInputError(f"{config}: {library}.{cls_name} cannot be built from a config")


def _plan(args: argparse.Namespace) -> int:
    from .api import plan

    shipped = not Path(args.path).exists() and _HUB_ID.match(args.path) is not None
    if shipped:
        if args.path not in shipped_models():
            from .errors import UserInputError

            raise UserInputError(_unknown_hub_id(args.path))
        name, comps = _build_shipped(args.path)
        title = f"{args.path} ({name})" if "" in comps else args.path
    else:
        name, comps = _build_meta_components(Path(args.path))
        title = name
    kw: dict[str, Any] = {"recipes": args.recipes or None, "exclude": tuple(args.exclude or ()), "fp8": args.fp8}
    if args.device is not None or args.torch is not None:
        kw["env"] = _env_from_args(args)
    else:
        from .gate import Env

        kw["env"] = Env.detect()
    target = comps[""] if "" in comps else comps
    report = plan(target, **kw)
    fp8_line = _describe_fp8(args.fp8_checkpoint, kw["env"]) if args.fp8_checkpoint else None
    if args.json:
        d = report.to_dict()
        d["target_type"] = name
        if shipped:
            d["hub_id"] = args.path
            d["shipped_config"] = [str(f) for f in shipped_models()[args.path]["files"].values()]
        if fp8_line is not None:
            d["fp8_checkpoint"] = fp8_line
        print(json.dumps(d, indent=2, default=str))
    else:
        import dataclasses

        print(dataclasses.replace(report, target_type=title).format(WIDTH))
        if shipped:
            from .bench.models import CONFIGS

            files = ", ".join(f.relative_to(CONFIGS).as_posix() for f in shipped_models()[args.path]["files"].values())
            said = f"built on the meta device from the real config shipped with mpsboost ({files}); nothing downloaded"
            print("\n".join(_wrap(said, hang="  ")))
        if fp8_line is not None:
            print(f"\nfp8 checkpoint {args.fp8_checkpoint}:")
            print("\n".join(_wrap(fp8_line, "  ")))
    return 0


# ------------------------------------------------------------------------------------------ main


def _build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(
        prog="mpsboost", description="Fast, lean, correct diffusers/transformers pipelines on PyTorch MPS."
    )
    p.add_argument("--version", action="version", version=f"mpsboost {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser(
        "doctor",
        help="what applies on this machine: recipes per shipped model, the gate's features (--all: every one, and why)",
    )
    d.add_argument("--device", help="simulate this device: mps, cpu, cuda or cuda:MAJOR.MINOR")
    d.add_argument("--torch", help="simulate this torch version string, e.g. 2.14.1 or 2.16.0.dev20261101")
    d.add_argument(
        "--fp8-checkpoint",
        metavar="FILE_OR_FOLDER",
        help="say which format this fp8 checkpoint is in and which path its layers take here",
    )
    d.add_argument(
        "--all", action="store_true", help="the whole gate matrix with each rule's facts, every recipe, the Hub kernels"
    )
    d.add_argument("--json", action="store_true", help="machine-readable output (everything --all shows)")
    d.set_defaults(func=_doctor)

    pl = sub.add_parser(
        "plan",
        help="what patch() would do to a local pipeline or model folder (built on the meta device; no weights read)",
    )
    pl.add_argument(
        "path",
        help="a local diffusers pipeline folder (model_index.json) or model folder (config.json), or the hub id of a "
        "config shipped with mpsboost (offline): " + ", ".join(shipped_models()),
    )
    pl.add_argument("--device", help="simulate this device: mps, cpu, cuda or cuda:MAJOR.MINOR")
    pl.add_argument("--torch", help="simulate this torch version string")
    pl.add_argument("--recipes", nargs="*", help="only these recipes")
    pl.add_argument("--exclude", nargs="*", help="leave these recipes out")
    pl.add_argument("--fp8", choices=("rowwise", "tensorwise"), help="include FP8 weight storage")
    pl.add_argument(
        "--fp8-checkpoint",
        metavar="FILE_OR_FOLDER",
        help="also say which format this fp8 checkpoint is in and which path its layers take",
    )
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=_plan)

    sub.add_parser(
        "demo",
        help="the main job: real architectures with random weights, stock vs patched, four records",
        add_help=False,
    )
    sub.add_parser("bench", help="run a recipe's benchmark (stock vs mpsboost vs peers)", add_help=False)
    sub.add_parser(
        "selftest",
        help="evidence from this machine: known MPS bugs probed, workloads stock vs patched across fresh "
        "processes; JSONL + markdown report to send (--quick, --full, --validate FILE)",
        add_help=False,
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # demo, bench and selftest own their arguments.
    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        return int(demo_main(argv[1:]) or 0)
    if argv and argv[0] == "bench":
        from .bench.cli import main as bench_main

        return int(bench_main(argv[1:]) or 0)
    if argv and argv[0] == "selftest":
        from .errors import MpsboostError
        from .selftest import main as selftest_main

        try:
            return int(selftest_main(argv[1:]) or 0)
        except (MpsboostError, ValueError) as e:
            print(f"mpsboost selftest: {e}", file=sys.stderr)
            return 2
    parser = _build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .errors import MpsboostError

    try:
        return int(args.func(args) or 0)
    except MpsboostError as e:  # every user error: one line, exit status 2 (README: "Exit status")
        print(f"mpsboost {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
