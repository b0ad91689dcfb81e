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
