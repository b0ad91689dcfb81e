"""``python -m mpsboost.selftest``: the same as ``mpsboost selftest`` (and the fresh processes it starts)."""

from __future__ import annotations

import sys

from .run import main

if __name__ == "__main__":
    sys.exit(main())
