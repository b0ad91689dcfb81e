"""`import mpsboost` stays light: it imports neither diffusers nor transformers."""
from __future__ import annotations

import subprocess
import sys


def test_import_does_not_pull_in_diffusers_or_transformers():
    code = (
        "import sys, mpsboost\n"
        "mpsboost.recipe_names()\n"  # loads every built-in recipe module too
        "import mpsboost.gate, mpsboost.report, mpsboost.api, mpsboost.cli\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('diffusers', 'transformers', 'accelerate'))\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"import mpsboost imported: {proc.stdout.strip()}"


def test_public_api_is_exported():
    import mpsboost

    for name in ("patch", "unpatch", "patched", "plan", "last_report", "save_fp8", "load_fp8", "Env", "PatchReport"):
        assert callable(getattr(mpsboost, name)) or isinstance(getattr(mpsboost, name), type), name


def test_ops_hold_tensor_functions_only():
    """ops/ is the shared kernel layer: it imports no registry, recipe or API module (no patching from
    there) and names no diffusers or transformers module (the integrations live next to their recipes)."""
    import ast
    from pathlib import Path

    import mpsboost.ops

    forbidden_internal = {"registry", "recipes", "api", "fp8_io", "fp8_formats"}
    offenders = []
    for path in sorted(Path(mpsboost.ops.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                parts = (node.module or "").split(".")
                if node.level >= 2 and parts[0] in forbidden_internal:
                    offenders.append(f"{path.name}: from {'.' * node.level}{node.module} import ...")
                if node.level == 0 and parts[0] in ("diffusers", "transformers", "mpsboost"):
                    offenders.append(f"{path.name}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                offenders += [f"{path.name}: import {a.name}" for a in node.names if a.name.split(".")[0] in ("diffusers", "transformers")]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(("diffusers.", "transformers.")):
                offenders.append(f"{path.name}: names {node.value!r}")
    assert not offenders, offenders
