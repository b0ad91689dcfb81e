"""patch / unpatch / patched / plan, and adopt.

Data flows one way: ``patch(obj)`` -> targets (pipeline components, or the module tree of an
``nn.Module``) -> each recipe's ``find`` -> ``decide`` (the gate is asked there) -> ``apply``, as one
transaction -> :class:`~mpsboost.report.PatchReport`. ``plan`` stops before ``apply``. :func:`adopt`
commits changes that were built outside a recipe's ``apply`` (``load_fp8``'s tensors and layers) through
the same transaction and the same records, so that reports and ``unpatch`` treat them like patch()'s.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from .errors import (
    GateError,
    IrreversiblePatchError,
    NotPatchedError,
    PatchedCopyError,
    PatchError,
    RecipeOptionError,
    RecipeSkippedError,
    UnsupportedTargetError,
)
from .gate import Env
from .registry import (
    Decision,
    Match,
    Recipe,
    accepted_options,
    all_recipes,
    make_options,
    get_recipe,
    matches_class,
)
from .patching import Patch, is_patched_by
from .report import ALREADY_PATCHED, APPLIED, NOT_APPLICABLE, SKIPPED, WOULD_APPLY, PatchReport, Row

__all__ = [
    "patch",
    "unpatch",
    "patched",
    "plan",
    "last_report",
    "adopt",
    "Adopted",
    "targets",
    "env_for",
    "device_env",
]

log = logging.getLogger("mpsboost")

_PIPELINE_CLASS = "diffusers.pipelines.pipeline_utils.DiffusionPipeline"
_ACCEPTED = "a diffusers DiffusionPipeline or a torch.nn.Module (transformers and diffusers models included)"

# Patching and unpatching are serialised process-wide: two threads patching the same (or different)
# objects never interleave their changes.
_LOCK = threading.RLock()


@dataclass
class _Applied:
    recipe: Recipe
    match: Match
    undo: Patch


# Each patch() call's record gets the next number: unpatch() of an object undoes the calls made on it and
# on the modules inside it (a nested model patched on its own) newest first, whichever object holds them.
_SEQUENCE = itertools.count()


@dataclass
class _Record:
    report: PatchReport
    applied: list[_Applied] = field(default_factory=list)
    seq: int = field(default_factory=lambda: next(_SEQUENCE))


# The records of a patched object live on the object itself (one attribute), so they are freed with it:
# a process-wide table keyed by the object would keep every patched model alive through its records,
# which hold the patched modules (the root module too, for a recipe that targets it).
_RECORDS_ATTR = "_mpsboost_records"


class _Records(list):
    """The patch records of one object. A copy of the object (``copy``, ``deepcopy``, pickle) gets none:
    every undo step belongs to the original (``unpatch`` of a copy says so, see :class:`PatchedCopyError`)."""

    def __copy__(self) -> "_Records":
        return _Records()

    def __deepcopy__(self, memo: dict) -> "_Records":
        return _Records()

    def __reduce__(self):
        return (_Records, ())


def _records(obj: Any) -> list[_Record] | None:
    recs = getattr(obj, "__dict__", {}).get(_RECORDS_ATTR)
    return recs if isinstance(recs, _Records) and recs else None


def _add_record(obj: Any, rec: _Record) -> None:
    d = obj.__dict__
    recs = d.get(_RECORDS_ATTR)
    if not isinstance(recs, _Records):
        recs = d[_RECORDS_ATTR] = _Records()
    recs.append(rec)


def _drop_records(obj: Any) -> None:
    obj.__dict__.pop(_RECORDS_ATTR, None)


# ------------------------------------------------------------------------------------------ targets


def _is_pipeline(obj: Any) -> bool:
    return matches_class(obj, (_PIPELINE_CLASS,))


def _targets(obj: Any, *, allow_mapping: bool = False, action: str = "patch") -> list[tuple[str, torch.nn.Module]]:
    """(prefix, root module) pairs: one for a module, one per module component of a pipeline.

    ``allow_mapping`` (plan only) also takes a plain {component name: module} mapping; ``action``
    names what the caller was asked to do, for the error message ("unpatch", "plan for", ...).
    """
    if isinstance(obj, torch.nn.Module):
        return [("", obj)]
    if _is_pipeline(obj) or (allow_mapping and isinstance(obj, Mapping)):
        comps = (obj if isinstance(obj, Mapping) else getattr(obj, "components", {})) or {}
        found, seen = [], set()
        for name, comp in comps.items():
            if isinstance(comp, torch.nn.Module) and id(comp) not in seen:
                seen.add(id(comp))
                found.append((name, comp))
        if not found:
            raise UnsupportedTargetError(
                f"{type(obj).__name__} has no torch.nn.Module among its components "
                f"({', '.join(comps) or 'none'}); load its models first, then {action.split()[0]}"
            )
        return found
    raise UnsupportedTargetError(
        f"mpsboost cannot {action} a {type(obj).__module__}.{type(obj).__qualname__}; it accepts {_ACCEPTED}"
    )


def targets(obj: Any, *, action: str = "patch") -> list[tuple[str, torch.nn.Module]]:
    """(component name, root module) pairs that patch() works on: ``[("", obj)]`` for a module, one pair
    per module component of a diffusers pipeline. ``action`` names what the caller was asked to do in
    the :class:`UnsupportedTargetError` for anything else (e.g. ``"save or load fp8 weights of"``)."""
    return _targets(obj, action=action)


def _components(targets: list[tuple[str, torch.nn.Module]]) -> tuple[str, ...]:
    """The pipeline component names of ``targets`` (empty for a model): the report counts per model."""
    return tuple(p for p, _ in targets if p)


def _first_param_device(targets: list[tuple[str, torch.nn.Module]]) -> torch.device | None:
    for _, root in targets:
        for t in _tensors(root):
            return t.device
    return None


def _tensors(root: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from root.parameters()
    yield from root.buffers()


def _execution_device(obj: Any, targets: list[tuple[str, torch.nn.Module]]) -> torch.device | None:
    """Where the model will compute: the pipeline's execution device under offloading, else its weights'."""
    for _, root in targets:
        hook = getattr(root, "_hf_hook", None)
        dev = getattr(hook, "execution_device", None)
        if dev is not None:
            return torch.device(dev) if not isinstance(dev, torch.device) else dev
    if _is_pipeline(obj):
        try:
            dev = obj._execution_device
            if dev is not None:
                return torch.device(dev)
        except Exception:  # diffusers raises on pipelines whose components have no device yet
            log.debug("pipeline has no _execution_device; using its weights' device")
    return _first_param_device(targets)


_KNOWN_DEVICES = "cpu, cuda, mps (cuda:N for one GPU)"


def _present(device_type: str) -> bool:
    if device_type == "mps":
        return torch.backends.mps.is_available()
    if device_type == "cuda":
        return torch.cuda.is_available()
    return True


def _device_type(device: Any) -> torch.device:
    """``device`` as a torch.device of a type mpsboost knows; mpsboost's own one-line error otherwise."""
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "mps"):
        raise GateError(f"device {str(device)!r} is not one mpsboost knows; accepted: {_KNOWN_DEVICES}")
    return dev


def _env_for(obj: Any, targets, device: Any) -> Env:
    if device is None:
        dev = _execution_device(obj, targets)
        if dev is None or dev.type == "meta":
            return Env.detect("cpu")
        return Env.detect(dev)
    return device_env(device, absent="simulate", stacklevel=4)


def device_env(device: Any, *, absent: str = "simulate", stacklevel: int = 2) -> Env:
    """The :class:`Env` for a ``device=`` argument: an Env as it is, or a device name or torch.device.

    The one place that reads ``device=`` for patch(), plan() and load_fp8(). A device type mpsboost does
    not know raises :class:`GateError` in one line. A known device that torch does not see here is
    ``absent="simulate"`` (patch, plan): the decisions are made for it, with a warning, and the model
    stays where it is; or ``absent="raise"`` (load_fp8, which must put tensors on it): the same sentence
    as a one-line :class:`GateError`.
    """
    if isinstance(device, Env):
        return device
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            "device must be None, an mpsboost.Env, a str such as 'mps', or a torch.device; "
            f"got {type(device).__name__}: {device!r}"
        )
    if absent not in ("simulate", "raise"):
        raise ValueError(f"absent must be 'simulate' or 'raise', got {absent!r}")
    dev = _device_type(device)
    if _present(dev.type):
        return Env.detect(dev)
    if absent == "raise":
        raise GateError(
            f"device={str(device)!r} but torch sees no {dev.type} device here; pass device="
            f"mpsboost.Env.simulate({dev.type!r}) to make the {dev.type} decisions with the tensors on the CPU"
        )
    # Tests and dry runs ask for a device that is not here: the decisions are made for it, marked
    # simulated in the report, and the user is told (the model itself stays where it is).
    warnings.warn(
        f"mpsboost: device={str(device)!r} but torch sees no {dev.type} device here; the decisions are "
        f"simulated for {dev.type} (the report says so) and the model computes where its weights are",
        stacklevel=stacklevel,
    )
    return Env.simulate(dev.type)


def env_for(obj: Any, device: Any = None) -> Env:
    """The environment patch() decides for: ``device`` (an :class:`Env`, or a device name; a device that
    is not here is simulated, with a warning), or where ``obj`` computes (its execution device under
    offloading, else its weights'; the CPU for a model without data)."""
    return _env_for(obj, _targets(obj), device)


def _offloaded(module: torch.nn.Module) -> bool:
    """True when an accelerate hook on ``module`` keeps its weights elsewhere (sequential CPU offload,
    disk offload): its tensors sit on the meta device by design and the hook loads them for each call."""
    hook = module.__dict__.get("_hf_hook")
    hooks = getattr(hook, "hooks", None) or ((hook,) if hook is not None else ())
    return any(getattr(h, "offload", False) or getattr(h, "weights_map", None) is not None for h in hooks)


def _check_not_meta(targets) -> None:
    for prefix, root in targets:
        for mod_name, mod in root.named_modules():
            tensors = list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
            meta = [n for n, t in tensors if t.device.type == "meta"]
            if meta and not _offloaded(mod):
                where = ".".join(p for p in (prefix, mod_name, meta[0]) if p)
                raise UnsupportedTargetError(
                    f"{where} is on the meta device (no data) and no accelerate offload hook manages it: "
                    "patch() needs real weights. Load or materialise the model first; plan() works on meta models."
                )


# ------------------------------------------------------------------------------------------ selection


def _keyword_recipes(keywords: Mapping[str, Any]) -> list[Recipe]:
    """The recipes a public keyword selects (``fp8="rowwise"`` selects fp8_weights): declared by each
    recipe (``Recipe.keyword``), not known to this module. A value the recipe does not accept
    (``keyword_values``) raises ValueError before anything else."""
    chosen = []
    for r in all_recipes():
        value = keywords.get(r.keyword) if r.keyword is not None else None
        if value is None:
            continue
        accepted = tuple(r.keyword_values or ())
        if accepted and value not in accepted:
            names = ", ".join(repr(v) for v in accepted[:-1])
            names += (" or " if len(accepted) > 1 else "") + repr(accepted[-1])
            raise ValueError(f"{r.keyword} must be None, {names}; got {value!r}")
        chosen.append(r)
    return chosen


def _select(
    recipes: Sequence[str] | str | None, exclude: Sequence[str], keywords: Mapping[str, Any]
) -> tuple[list[Recipe], set[str]]:
    by_keyword = _keyword_recipes(keywords)
    if isinstance(exclude, str):
        exclude = (exclude,)
    if not isinstance(exclude, (list, tuple, set, frozenset)):
        raise TypeError(f"exclude must be a list of recipe names, got {type(exclude).__name__}")
    excluded = {get_recipe(n).name for n in exclude}
    if recipes is None:
        chosen = [r for r in all_recipes() if r.default and r.lossless]
        chosen += [r for r in by_keyword if r not in chosen]
        requested: set[str] = set()
    else:
        if isinstance(recipes, str):
            recipes = (recipes,)
        if not isinstance(recipes, (list, tuple, set, frozenset)):
            raise TypeError(f"recipes must be None or a list of recipe names, got {type(recipes).__name__}")
        chosen = [get_recipe(n) for n in recipes]
        chosen += [r for r in by_keyword if r not in chosen]
        requested = {r.name for r in chosen}
    chosen = [r for r in chosen if r.name not in excluded]
    chosen.sort(key=lambda r: (r.order, r.name))
    return chosen, requested


def _check_options(options: Mapping[str, Mapping[str, Any]] | None) -> None:
    """The shape of ``options`` and its recipe names, before anything is decided."""
    if options is None:
        return
    if not isinstance(options, Mapping):
        raise TypeError(f"options must map recipe names to dicts, got {type(options).__name__}")
    for name, given in options.items():
        recipe = get_recipe(name)  # unknown names raise with the registered list
        if not isinstance(given, Mapping):
            raise RecipeOptionError(
                f"options[{name!r}] must be a dict of option names to values, got {type(given).__name__}; "
                f"accepted options of {name}: {accepted_options(recipe)}",
                recipe=name,
            )
        make_options(recipe, given)  # unknown keys and wrong types, also for a recipe not selected


def _check_selected(options: Mapping[str, Mapping[str, Any]] | None, chosen: Sequence[Recipe]) -> None:
    """Options given for a recipe this call does not select would be ignored silently: refuse them."""
    if not options:
        return
    selected = {r.name for r in chosen}
    for name in options:
        recipe = get_recipe(name)
        if recipe.name in selected:
            continue
        if recipe.keyword is not None:
            how = f"select it with {recipe.keyword}=... (or recipes=[..., {recipe.name!r}])"
        else:
            how = "select it (name it in recipes=[...], leave it out of exclude)"
        raise RecipeOptionError(
            f"options name {recipe.name}, which this call does not select "
            f"(selected: {', '.join(sorted(selected)) or 'none'}); {how}, or drop its options",
            recipe=recipe.name,
        )


def _options(recipe: Recipe, keywords: Mapping[str, Any], options: Mapping[str, Mapping[str, Any]] | None) -> Any:
    """``recipe``'s typed options: the user's dict for it checked against ``recipe.Options``, with the
    public keyword it declares (``Recipe.keyword``) filled in as its option field (``Recipe.keyword_field``)."""
    given = dict((options or {}).get(recipe.name, {}))
    keyword_value = keywords.get(recipe.keyword) if recipe.keyword else None
    if keyword_value is not None and recipe.keyword_field:
        if given.get(recipe.keyword_field, keyword_value) != keyword_value:
            raise RecipeOptionError(
                f"{recipe.keyword}={keyword_value!r} and options={{{recipe.name!r}: {{{recipe.keyword_field!r}: "
                f"{given[recipe.keyword_field]!r}}}}} disagree; pass one of them",
                recipe=recipe.name,
            )
        given[recipe.keyword_field] = keyword_value
    return make_options(recipe, given)


# ------------------------------------------------------------------------------------------ planning


def _plan_rows(
    chosen, targets, env, keywords, options, *, mode: str
) -> tuple[list[Row], list[tuple[Recipe, Match, Decision, Any]]]:
    rows: list[Row] = []
    actions: list[tuple[Recipe, Match, Decision, Any]] = []
    _check_options(options)
    _check_selected(options, chosen)
    for recipe in chosen:
        opts = _options(recipe, keywords, options)
        seen: set[int] = set()
        matches: list[Match] = []
        for prefix, root in targets:
            for match in recipe.find(root, prefix):
                if id(match.module) not in seen:
                    seen.add(id(match.module))
                    matches.append(match)
        found = bool(matches)
        for match in matches:
            if is_patched_by(match.module, recipe.name):
                # A recipe may refuse a repeat that asks for something else (fp8_weights: another granularity).
                repeat = getattr(recipe, "repeat_request", None)
                why = repeat(match, opts) if repeat is not None else None
                rows.append(Row(recipe.name, match.path, ALREADY_PATCHED, reason=why or "patched by an earlier call"))
                continue
            inside = _patched_inside(match.module, recipe.name, seen)
            if inside:
                # An earlier patch() of a model nested in this one (or of a model this one is nested in)
                # changed modules this match covers: applying again would change them twice. They stay
                # as that call left them; unpatch() of the outer object undoes both calls.
                more = f" and {len(inside) - 1} more" if len(inside) > 1 else ""
                rows.append(
                    Row(
                        recipe.name,
                        match.path,
                        ALREADY_PATCHED,
                        reason=(
                            "patched by an earlier patch() of a nested or enclosing model "
                            f"({_full_path(match.path, inside[0])}{more})"
                        ),
                        details={"patched_modules": len(inside)},
                    )
                )
                continue
            try:
                # The declared requirements first (Recipe.requires): a recipe never decides on a build
                # that lacks a feature every one of its paths needs.
                decision = recipe.gate(env) or recipe.decide(match, env, opts)
            except Exception as exc:
                raise PatchError(
                    f"recipe {recipe.name} could not decide for {match.path}: {exc}",
                    recipe=recipe.name,
                    target=match.path,
                ) from exc
            if decision.applicable:
                rows.append(
                    Row(
                        recipe.name,
                        match.path,
                        APPLIED if mode == "patch" else WOULD_APPLY,
                        decision.backing,
                        decision.reason,
                        dict(decision.details),
                    )
                )
                actions.append((recipe, match, decision, opts))
            else:
                rows.append(
                    Row(recipe.name, match.path, SKIPPED, reason=decision.reason, details=dict(decision.details))
                )
        if not found:
            # At most two class names in the text; every one in the row's details (to_json()).
            names = [t.rsplit(".", 1)[-1] for t in recipe.targets]
            if not names:
                what = "no target of this recipe in this object"
            elif len(names) <= 2:
                what = f"no {' or '.join(names)} in this object"
            else:
                what = f"no target in this object ({len(names)} classes; see to_json())"
            rows.append(
                Row(recipe.name, "-", NOT_APPLICABLE, reason=what, details={"target_classes": list(recipe.targets)})
            )
    return rows, actions


def _patched_inside(module: torch.nn.Module, recipe: str, matches: set[int]) -> list[str]:
    """Paths (below ``module``) of the modules ``recipe`` changed that are not matches of this call: what an
    earlier patch() of a nested or enclosing model changed through a match this call does not see (e.g.
    ``patch(lm.model)`` then ``patch(lm)``: attention_split's match is the outer model, the earlier one
    was the inner model, and both would change the same attention modules)."""
    return [
        name
        for name, sub in module.named_modules()
        if sub is not module and id(sub) not in matches and is_patched_by(sub, recipe)
    ]


def _full_path(match_path: str, name: str) -> str:
    return ".".join(p for p in (match_path if match_path != "<root>" else "", name) if p)


def plan(
    obj: Any,
    *,
    device: str | torch.device | Env | None = None,
    torch_version: str | None = None,
    capability: tuple[int, int] | None = None,
    env: Env | None = None,
    recipes: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    fp8: str | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> PatchReport:
    """What :func:`patch` would do, for this environment or a simulated one; changes nothing.

    ``obj`` is what patch() takes, or a {component name: module} mapping (e.g. models built on the
    meta device from a pipeline folder's configs).

    ``plan(pipe, device="mps", torch_version="2.14.1")`` simulates an Apple machine on torch 2.14.1;
    ``device="cuda:8.0"`` (or ``capability=(8, 0)``) a CUDA GPU of that compute capability. ``device``
    also takes an :class:`Env` (``device=Env.simulate("mps", "2.15.0")``), as patch() does. Works on
    models on the meta device.
    """
    targets = _targets(obj, allow_mapping=True, action="plan for")
    if isinstance(device, Env):  # what patch(device=Env) takes, plan takes too
        if env is not None or torch_version is not None or capability is not None:
            raise TypeError(
                "device is an mpsboost.Env already: pass torch_version, capability and env only with a device "
                "name, or put them in the Env (Env.simulate(device, torch_version, capability=...))"
            )
        env, device = device, None
    elif isinstance(device, torch.device):
        device = str(device)
    if env is None:
        if device is not None or torch_version is not None or capability is not None:
            if device is None:
                device = _env_for(obj, targets, None).device_type
            if not isinstance(device, str):
                raise TypeError(f"device must be a str such as 'mps' or 'cuda:9.0', got {type(device).__name__}")
            if device.partition(":")[0] not in ("cpu", "cuda", "mps"):
                raise GateError(
                    f"device {device!r} is not one mpsboost knows; accepted: cpu, cuda, mps "
                    "(cuda:MAJOR.MINOR for a GPU generation)"
                )
            env = Env.simulate(device, torch_version, capability=capability)
        else:
            env = _env_for(obj, targets, None)
    elif not isinstance(env, Env):
        raise TypeError(f"env must be an mpsboost.Env, got {type(env).__name__}")
    keywords = {"fp8": fp8}  # the public keywords of plan() and patch(): each selects the recipe that declares it
    chosen, _ = _select(recipes, exclude, keywords)
    with _LOCK:
        rows, _ = _plan_rows(chosen, targets, env, keywords, options, mode="plan")
    return PatchReport.from_rows("plan", env, rows, target_type=type(obj).__name__, components=_components(targets))


# ------------------------------------------------------------------------------------------ patching


def _check_same_env(obj: Any, targets, env: Env) -> None:
    """An error when ``obj`` (or a model inside it) carries patches made for another environment than ``env``.

    An error, not a warning: after a second patch() under other decisions the model's layers would follow two
    environments at once (e.g. a Mac on torch 2.14.1 and one on 2.15.0), a model no real machine runs, and every
    plan, report or measurement of it would describe neither. Nothing has changed when it is raised."""
    for holder, rec in [(obj, r) for r in _records(obj) or ()] + _nested_records(obj, targets):
        if rec.applied and rec.report.env != env:
            name = type(obj).__name__
            what = f"this {name}" if holder is obj else f"a {type(holder).__name__} inside this {name}"
            raise PatchError(
                f"patch() for {env.describe()}, but {what} is already patched for {rec.report.env.describe()}: its "
                "layers would follow the decisions of two environments at once, which no real machine runs. Nothing "
                "was changed. Call mpsboost.unpatch(model) first, then patch for the new environment (or pass the "
                "same device= as the earlier call)."
            )


def _strict_message(skipped: Sequence[Row], env: Env) -> str:
    """strict=True's error: one line per selected recipe that would skip (how many targets, the first one, the
    headline of its reason), that nothing changed, and what to pass instead."""

    def short(reason: str) -> str:  # long asides (upstream lists, figures) dropped, then at most 150 characters
        text = re.sub(r"\s*\([^()]{25,}\)", "", reason)
        return text if len(text) <= 150 else text[:149].rsplit(" ", 1)[0].rstrip(",;:") + "…"

    by: dict[str, list[Row]] = {}
    for r in skipped:
        by.setdefault(r.recipe, []).append(r)
    lines = []
    for name, rs in by.items():
        reasons = list(dict.fromkeys(short(r.reason) for r in rs))
        where = rs[0].target if len(rs) == 1 else f"{len(rs)} targets, first {rs[0].target}"
        more = f" (+{len(reasons) - 1} other reasons)" if len(reasons) > 1 else ""
        lines.append(f"  {name} on {where}: {reasons[0]}{more}")
    n = len(by)
    return (
        f"strict=True: {n} selected recipe{'s' if n > 1 else ''} would be skipped on {env.device_type}; nothing "
        "was changed:\n"
        + "\n".join(lines)
        + f"\nPass exclude={sorted(by)!r}, or drop strict=True (mpsboost.plan(obj) gives every reason)."
    )


def patch(
    obj: Any,
    *,
    recipes: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    fp8: str | None = None,
    strict: bool = False,
    device: str | torch.device | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> PatchReport:
    """Patch ``obj`` (a diffusers pipeline or any ``nn.Module``) with every recipe that fits.

    By default every registered lossless recipe whose gate passes on the device ``obj`` computes on;
    ``recipes=[...]`` picks by name, ``exclude=[...]`` drops some, ``fp8="rowwise"|"tensorwise"`` opts
    in to FP8 weight storage (lossy, irreversible). ``strict=True`` turns any skip of a selected recipe
    into :class:`RecipeSkippedError` before anything changes. ``options={"recipe": {...}}`` passes
    recipe-specific settings, checked against the recipe's ``Options`` dataclass: an unknown key or a
    value of the wrong type raises :class:`~mpsboost.errors.RecipeOptionError` (a ``TypeError``) naming
    the recipe, the key and the accepted keys with their types. ``fp8=`` is the fp8_weights recipe's
    ``fp8`` option (its granularity).

    One transaction: if any recipe fails while applying, every change made by this call is undone and
    :class:`PatchError` names the recipe and module. Patching again is a no-op (rows say "already patched").
    """
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    targets = _targets(obj)
    keywords = {"fp8": fp8}
    chosen, requested = _select(recipes, exclude, keywords)
    with _LOCK:
        _check_not_meta(targets)
        env = _env_for(obj, targets, device)
        _check_same_env(obj, targets, env)
        rows, actions = _plan_rows(chosen, targets, env, keywords, options, mode="patch")
        skipped = [r for r in rows if r.status == SKIPPED or (r.status == NOT_APPLICABLE and r.recipe in requested)]
        if skipped:
            if strict:
                raise RecipeSkippedError(_strict_message(skipped, env))
            names = sorted({r.recipe for r in skipped if r.recipe in requested})
            if names:  # one warning per call, naming each requested recipe that skipped and why
                why = "; ".join(
                    f"requested recipe {n} was skipped: {next(r.reason for r in skipped if r.recipe == n)}"
                    for n in names
                )
                warnings.warn(f"mpsboost: {why}", stacklevel=2)
        rec = _Record(
            report=PatchReport.from_rows(
                "patch", env, rows, target_type=type(obj).__name__, components=_components(targets)
            )
        )
        _apply_actions(actions, env, rec.applied)
        for a in rec.applied:
            a.undo.commit()
        _add_record(obj, rec)  # also for a no-op, so that last_report() gives this call's report
        note = "nothing changed: already patched" if rec.report.noop and rec.report.by_status(ALREADY_PATCHED) else ""
        if note:
            rec.report = PatchReport.from_rows(
                "patch", env, rows, target_type=type(obj).__name__, note=note, components=_components(targets)
            )
        return rec.report


def _apply_actions(actions, env: Env, applied: list[_Applied]) -> None:
    """Each recipe's ``apply`` in turn, its Patch appended to ``applied``; on any exception every Patch in
    ``applied`` is undone (in reverse) and :class:`PatchError` names the recipe and module."""
    try:
        for recipe, match, decision, opts in actions:
            undo = recipe.apply(match, decision, env, opts)
            if not isinstance(undo, Patch):
                raise TypeError(
                    f"{recipe.name}.apply must return an mpsboost.patching.Patch, got {type(undo).__name__}"
                )
            if not recipe.reversible:
                undo.reversible = False
            applied.append(_Applied(recipe, match, undo))
            log.debug("applied %s to %s via %s", recipe.name, match.path, decision.backing)
    except BaseException as exc:
        failed_recipe, failed_path = recipe.name, match.path
        rollback_errors = _rollback(applied)
        extra = f" Rolling back also failed: {rollback_errors}" if rollback_errors else ""
        raise PatchError(
            f"recipe {failed_recipe} failed on {failed_path}: {type(exc).__name__}: {exc}. "
            f"Every change made by this patch() call was undone.{extra}",
            recipe=failed_recipe,
            target=failed_path,
        ) from exc


# ------------------------------------------------------------------------------------------ adopting


@dataclass(frozen=True)
class Adopted:
    """One change that :func:`adopt` makes and commits: ``make()`` makes it (through the helpers of
    :mod:`mpsboost.patching`) and returns its :class:`~mpsboost.patching.Patch`.

    With a ``decision`` it is recipe ``recipe``'s change of ``module`` at ``path`` (e.g. a layer the
    fp8_weights recipe built on codes read from a file): it gets the decision's report row and a
    record, so that ``unpatch`` undoes it, or refuses with the recipe's hint where it cannot be undone.
    Without one it is a step of the transaction only (a tensor read into place): undone if the
    transaction fails, committed with it, and then nothing is left of it to undo."""

    recipe: str
    path: str
    make: Callable[[], Patch]
    module: torch.nn.Module | None = None
    decision: Decision | None = None


def adopt(
    obj: Any,
    changes: Iterable[Adopted],
    *,
    device: Any = None,
    recipes: Sequence[str] | None = (),
    exclude: Sequence[str] = (),
) -> PatchReport:
    """Commit ``changes`` made outside a recipe's ``apply`` through :func:`patch`'s transaction and records.

    ``mpsboost.load_fp8`` commits through it: tensors read from a file and the fp8 layers the
    fp8_weights recipe builds on them. Each change is made in turn (``Adopted.make``); then the recipes
    ``recipes`` (names; ``None``: the default lossless ones, as in ``patch()``), less ``exclude``, are
    planned on the changed model and applied in the same transaction. On any exception every change made
    so far is undone in reverse and the exception propagates (a recipe's failure as :class:`PatchError`),
    so ``obj`` is exactly as it was. Otherwise everything commits, and one record holds what ``unpatch``
    needs. ``device`` is what patch() takes (an :class:`Env` included). Returns the report: one row per
    change with a decision, then the recipes' rows.
    """
    tgts = _targets(obj, action="adopt changes into")
    chosen, _ = _select(recipes, exclude, {})
    with _LOCK:
        env = _env_for(obj, tgts, device)
        rec = _Record(report=PatchReport.from_rows("patch", env, [], target_type=type(obj).__name__))
        rows: list[Row] = []
        steps: list[Patch] = []
        applied: list[_Applied] = []  # the recipes' patches
        try:
            for change in changes:
                if not isinstance(change, Adopted):
                    raise TypeError(f"adopt takes mpsboost.api.Adopted changes, got {type(change).__name__}")
                recipe = get_recipe(change.recipe)
                undo = change.make()
                if not isinstance(undo, Patch):
                    raise TypeError(f"Adopted.make must return an mpsboost.patching.Patch, got {type(undo).__name__}")
                if not recipe.reversible:
                    undo.reversible = False
                steps.append(undo)
                d = change.decision
                if d is not None:
                    rows.append(Row(recipe.name, change.path, APPLIED, d.backing, d.reason, dict(d.details)))
                    rec.applied.append(_Applied(recipe, Match(change.module, change.path, {}), undo))
            if chosen:
                _check_not_meta(tgts)
                more, actions = _plan_rows(chosen, tgts, env, {}, None, mode="patch")
                rows += more
                _apply_actions(actions, env, applied)  # undoes its own patches if one fails
        except BaseException:
            rec.applied.clear()
            for undo in reversed(steps):
                undo()
            raise
        for undo in steps:
            undo.commit()
        for a in applied:
            a.undo.commit()
        rec.applied += applied
        rec.report = PatchReport.from_rows("patch", env, rows, target_type=type(obj).__name__)
        _add_record(obj, rec)
        return rec.report


def _rollback(applied: list[_Applied]) -> list[str]:
    errors = []
    for a in reversed(applied):
        try:
            a.undo()
        except Exception as e:  # keep undoing the rest; report every failure
            errors.append(f"{a.recipe.name} on {a.match.path}: {type(e).__name__}: {e}")
    applied.clear()
    return errors


def unpatch(obj: Any) -> None:
    """Undo every patch mpsboost applied to ``obj``; the original forwards are the very same objects again.

    That is every ``patch()`` call made on ``obj`` and on any model inside it (``patch(lm.model)`` then
    ``patch(lm)``: ``unpatch(lm)`` undoes both, newest first). Patches that a ``patch()`` of an enclosing
    object made stay until that object is unpatched: ``unpatch(lm.model)`` after ``patch(lm)`` says so.

    After a ``patch()`` that applied nothing (every recipe skipped here, or already patched) it is a quiet
    no-op. Raises :class:`NotPatchedError` if ``obj`` was never passed to ``patch()`` (or was unpatched
    already), and :class:`IrreversiblePatchError` (changing nothing) if a recipe that converted weights in
    place was applied.
    """
    targets = _targets(obj, action="unpatch")
    with _LOCK:
        recs = _records(obj)
        nested = _nested_records(obj, targets)
        if recs and not any(r.applied for r in recs) and not nested:
            # patch() was called and changed nothing (every row skipped, not applicable or already
            # patched by a call that was undone since, or by a call on an enclosing object): there is
            # nothing to undo here, and saying "not patched" would be untrue; `try: patch(m) ...
            # finally: unpatch(m)` must work anywhere.
            _drop_records(obj)
            return
        if not recs and not nested:
            copied = _patched_modules(targets)
            if copied:
                raise PatchedCopyError(
                    f"this {type(obj).__name__} carries mpsboost patches "
                    f"({copied[0]} and {len(copied) - 1} more module(s)) "
                    "that no patch() of it made. Either a patch() of an enclosing model or pipeline made them "
                    "(unpatch that object), or it is a copy (copy.deepcopy) of a patched object, and the undo of "
                    "each patch belongs to the original. Nothing was changed. For a copy: unpatch the original "
                    "and copy it again (or reload the model); to copy a patched model and keep both, "
                    "copy it before patching and patch each."
                )
            raise NotPatchedError(
                f"this {type(obj).__name__} was not patched by mpsboost (or was already unpatched); nothing to undo"
            )
        _unpatch_records(obj, [(obj, r) for r in recs or ()] + nested)


def _nested_records(obj: Any, targets) -> list[tuple[Any, _Record]]:
    """(holder, record) of every patch() call made on a module inside ``obj`` (a pipeline's components
    included), other than on ``obj`` itself."""
    found = []
    for _, root in targets:
        for mod in root.modules():
            if mod is not obj:
                found += [(mod, r) for r in _records(mod) or ()]
    return found


def _patched_modules(targets) -> list[str]:
    """Paths of the modules that carry mpsboost's patch marker (the copy of a patched model has them)."""
    from .patching import ATTR

    return [
        ".".join(p for p in (prefix, name) if p) or "(root)"
        for prefix, root in targets
        for name, mod in root.named_modules()
        if mod.__dict__.get(ATTR)
    ]


def _unpatch_records(obj: Any, held: list[tuple[Any, _Record]]) -> None:
    """Undo the records ``held`` ((holder, record) pairs), newest call first, and drop them from their holders."""
    held = sorted(held, key=lambda hr: hr[1].seq, reverse=True)
    irreversible = [a for _, r in held for a in r.applied if not a.undo.reversible]
    if irreversible:
        names = sorted({a.recipe.name for a in irreversible})
        paths = [a.match.path for a in irreversible]
        shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        hints = "; ".join(sorted({a.undo.explanation or a.recipe.unpatch_hint() for a in irreversible}))
        raise IrreversiblePatchError(
            f"cannot unpatch this {type(obj).__name__}: {', '.join(names)} converted weights in place "
            f"({shown}); the original values are gone. Nothing was changed. To get the original model: {hints}."
        )
    errors = []
    for _, rec in held:
        errors += _rollback(rec.applied)
    for holder, rec in held:
        all_recs = _records(holder)
        if all_recs is not None:
            if rec in all_recs:
                all_recs.remove(rec)
            if not all_recs:
                _drop_records(holder)
    if errors:
        raise PatchError("unpatch could not restore everything: " + "; ".join(errors))


@contextlib.contextmanager
def patched(obj: Any, **kw: Any) -> Iterator[PatchReport]:
    """``with mpsboost.patched(model) as report: ...``: patched inside, unpatched on exit (even on error).

    Only what this block applied is undone; patches made before the block stay.
    """
    report = patch(obj, **kw)
    recs = _records(obj) or []
    mine = [r for r in recs if r.report is report]
    try:
        yield report
    finally:
        with _LOCK:
            if mine and mine[0].applied:
                _unpatch_records(obj, [(obj, r) for r in mine])
            elif mine:
                recs.remove(mine[0])


def last_report(obj: Any) -> PatchReport:
    """The report of the latest patch() of ``obj``."""
    recs = _records(obj)
    if not recs:
        raise NotPatchedError(f"this {type(obj).__name__} was not patched by mpsboost")
    return recs[-1].report


def is_patched(obj: Any) -> bool:
    recs = _records(obj)
    return bool(recs) and any(r.applied for r in recs)
