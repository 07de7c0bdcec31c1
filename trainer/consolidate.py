"""``python -m taskfit.consolidate SRC [DST]``: kept at its documented path; the code is
checkpoint/consolidate.py."""
from __future__ import annotations

import sys

from .checkpoint.consolidate import consolidate_checkpoint, main

__all__ = ["consolidate_checkpoint", "main"]

if __name__ == "__main__":
    sys.exit(main())
