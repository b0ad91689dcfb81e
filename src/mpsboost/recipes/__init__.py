"""The built-in recipes. Every module in this package registers its recipe on import.

Modules are discovered, not listed, so adding a recipe is adding a file. None of them may import
diffusers or transformers at module level: they match targets by class path and import lazily.
"""

from __future__ import annotations

import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
