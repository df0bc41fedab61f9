"""Deprecated alias: ``specdec_rt.spec`` was renamed ``specdec_rt.speculation`` (the loop) and
``specdec_rt.request`` (``params``, and ``request_checks`` as ``request.checks``). Importing it
warns once; the old module paths keep working until 0.3."""

from __future__ import annotations

import sys
import warnings

from ..request import checks as request_checks
from ..request import params
from ..speculation import adapters, context, protocols, scheduler

warnings.warn(
    "specdec_rt.spec is deprecated: import from specdec_rt.speculation, or specdec_rt.request for "
    "params and request checks (or from specdec_rt itself)",
    DeprecationWarning,
    stacklevel=2,
)

for _name, _module in {
    "adapters": adapters,
    "context": context,
    "protocols": protocols,
    "scheduler": scheduler,
    "params": params,
    "request_checks": request_checks,
}.items():
    sys.modules[f"{__name__}.{_name}"] = _module

__all__ = ["adapters", "context", "protocols", "scheduler", "params", "request_checks"]
