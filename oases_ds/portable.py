"""Moved to :mod:`oases_ds.checkpoint.portable`; this name stays for code that imports
``oases_ds.portable`` (``from oases_ds import portable``).

Why an alias and not a copy of its names: ``oases_ds.portable`` *is* the module object of
``oases_ds.checkpoint.portable``, so its private helpers, a test's ``monkeypatch`` of one of
its functions and ``isinstance`` checks against its classes behave exactly as before.
"""
from __future__ import annotations

import sys

from oases_ds.checkpoint import portable as _portable

sys.modules[__name__] = _portable
