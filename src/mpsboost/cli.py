"""The ``mpsboost`` command: doctor, plan, demo, bench, selftest."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main"]


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


def _doctor(args: argparse.Namespace) -> int:
    from . import __version__
    from .gate import feature_info, matrix
    from .registry import all_recipes

    env = _env_from_args(args)
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
    }
    info["hub_kernels"] = _hub_kernels(env)
    info["gguf_kernels"] = _gguf_kernels(env)
    info["torch_wheel"] = _wheel_facts(env)
    if getattr(args, "fp8_checkpoint", None):
        info["fp8_checkpoint"] = _describe_fp8(args.fp8_checkpoint, env)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    tb = info["torch_build"]
    print(f"mpsboost {__version__}  python {info['python']}  {info['platform']}")
    print(
        f"torch {tb['torch']}  cuda {tb['cuda'] or '-'}  git {str(tb['git'] or '-')[:12]}  mps built: {tb['mps_built']}"
    )
    print(
        "devices: "
        + "; ".join(
            f"{d['type']}{':' + str(d['index']) if 'index' in d else ''} {d['name']}"
            + (f" (sm {d['capability']})" if "capability" in d else "")
            for d in info["devices"]
        )
    )
    print(f"\ngate for {env.describe()}:")
    width = max(len(k) for k in verdicts)
    for name, v in verdicts.items():
        print(f"  {name.ljust(width)}  {'yes' if v.ok else 'no '}  [{v.decided_by}]  {v.reason}")
        for r in infos[name]["rules"]:
            facts = [
                f"upstream {r['upstream']}" if r["upstream"] else "",
                f"merged {r['merged']}" if r["merged"] else "",
                f"first release {r['first_release']}",
                f"macOS >= {r['min_macos']}" if r["min_macos"] else "",
                f"sm >= {r['min_capability']}" if r["min_capability"] else "",
                r["conditions"],
                f"macOS wheels: {r['evidence_text']}" if r.get("evidence_text") else "",
            ]
            print(f"  {''.ljust(width)}       " + "; ".join(f for f in facts if f))
    if info["recipes"]:
        print("\nrecipes:")
        w = max(len(r["name"]) for r in info["recipes"])
        for r in info["recipes"]:
            tags = (
                ", ".join(
                    t
                    for t, on in (
                        ("lossless", r["lossless"]),
                        ("reversible", r["reversible"]),
                        ("default", r["default"]),
                    )
                    if on
                )
                or "opt-in, lossy, irreversible"
            )
            print(f"  {r['name'].ljust(w)}  {r['summary']} [{tags}]")
    hk = info["hub_kernels"]
    print(
        f"\ntransformers hub kernels for Metal ({', '.join(hk['repos'])}): "
        f"{'would load' if hk['would_load'] else 'would not load'}"
        f"\n  {hk['why']}"
    )
    gk = info["gguf_kernels"]
    print(
        f"\ntransformers GGUF-on-MPS kernels ({', '.join(gk['repos'])}): "
        f"{'would load' if gk['would_load'] else 'would not load'}"
        f"\n  {gk['why']}"
    )
    if info["torch_wheel"]:
        print(f"\n{info['torch_wheel']}")
    if "fp8_checkpoint" in info:
        print(f"\nfp8 checkpoint {args.fp8_checkpoint}:\n  {info['fp8_checkpoint']}")
    return 0


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


# transformers' hub kernels for Metal: transformers/integrations/hub_kernels.py maps RMSNorm on "mps" to
# kernels-community/mlx-rmsnorm; gpt_oss and openai_privacy_filter ask for kernels-community/metal-flash-sdpa.
# They load only when transformers.utils.import_utils.is_kernels_available() holds: the `kernels` package
# installed with KERNELS_MIN_VERSION <= version < KERNELS_MAX_VERSION (0.18.2 and 0.19.0 in transformers 5.24),
# and USE_HUB_KERNELS not set to a false value. Otherwise transformers falls back silently.
_HUB_REPOS = ("kernels-community/metal-flash-sdpa", "kernels-community/mlx-rmsnorm")


def _hub_kernels(env: Any) -> dict[str, Any]:
    """Would transformers' hub kernels for Metal load here, and why not."""
    import importlib.util
    import os

    out: dict[str, Any] = {
        "repos": list(_HUB_REPOS),
        "kernels": _installed("kernels"),
        "transformers": _installed("transformers"),
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
    from .recipes.fp8.formats import describe_checkpoint

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

    try:
        from accelerate import init_empty_weights
    except ImportError:  # accelerate is in both extras; without it, torch's meta device context
        import torch

        def init_empty_weights():
            return torch.device("meta")

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

    name, comps = _build_meta_components(Path(args.path))
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
        if fp8_line is not None:
            d["fp8_checkpoint"] = fp8_line
        print(json.dumps(d, indent=2, default=str))
    else:
        print(str(report).replace(f"for {report.target_type}:", f"for {name}:", 1))
        if fp8_line is not None:
            print(f"\nfp8 checkpoint {args.fp8_checkpoint}:\n  {fp8_line}")
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
        "doctor", help="torch build, devices, and the gate matrix (every feature, available or not, and why)"
    )
    d.add_argument("--device", help="simulate this device: mps, cpu, cuda or cuda:MAJOR.MINOR")
    d.add_argument("--torch", help="simulate this torch version string, e.g. 2.14.1 or 2.16.0.dev20261101")
    d.add_argument(
        "--fp8-checkpoint",
        metavar="FILE_OR_FOLDER",
        help="say which format this fp8 checkpoint is in and which path its layers take here",
    )
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=_doctor)

    pl = sub.add_parser(
        "plan",
        help="what patch() would do to a local pipeline or model folder (built on the meta device; no weights read)",
    )
    pl.add_argument("path", help="a local diffusers pipeline folder (model_index.json) or model folder (config.json)")
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
