"""How to install mpsboost and its extras: the one place every hint (demo, plan, errors) takes it from.

The package index's project named ``mpsboost`` is another project (gradient boosting); this one is
installed from its repository: a checkout (a clone), or a wheel built from it. ``pip install
mpsboost[...]`` would fetch the other project, so no message here ever suggests it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["NOT_ON_INDEX", "INSTALL", "EXTRAS", "checkout", "extra_hint"]

NOT_ON_INDEX = "the package index's 'mpsboost' is another project; install this one from its repository"

INSTALL = (
    "from a checkout (git clone the repository, cd into it): pip install -e '.[diffusers,transformers]'; "
    "from a wheel built there: pip install 'mpsboost[diffusers] @ file:///path/to/mpsboost-0.1.0-py3-none-any.whl'"
)

# extra -> the packages it adds (kept in step with pyproject.toml by tests/core/test_packaging.py)
EXTRAS: dict[str, tuple[str, ...]] = {
    "diffusers": ("diffusers>=0.35", "accelerate>=1.0"),
    "transformers": ("transformers>=5.0", "accelerate>=1.0"),
    "bench": ("matplotlib>=3.7", "tqdm>=4.60", "nvidia-ml-py>=12; sys_platform != 'darwin'"),
}


def checkout() -> Path | None:
    """The source checkout this mpsboost runs from (an editable install), or None (a wheel install)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "src" / "mpsboost").is_dir() else None


def extra_hint(extra: str) -> str:
    """One sentence: how to add ``extra`` to this installation, never through the index's 'mpsboost'."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; mpsboost's extras are: {', '.join(EXTRAS)}")
    packages = " ".join(f"'{p.split(';')[0]}'" for p in EXTRAS[extra])
    root = checkout()
    where = f"pip install -e '{root}[{extra}]'" if root is not None else f"pip install {packages}"
    also = f" (or just its packages: pip install {packages})" if root is not None else ""
    return f"install the {extra} extra: {where}{also}. Not 'pip install mpsboost[{extra}]': {NOT_ON_INDEX}"
