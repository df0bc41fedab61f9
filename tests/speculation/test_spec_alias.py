"""The old ``specdec_rt.spec`` paths still import, with a DeprecationWarning naming the new ones."""

from __future__ import annotations

import importlib
import sys
import warnings


def test_old_paths_warn_and_resolve_to_the_new_modules():
    for name in [m for m in sys.modules if m == "specdec_rt.spec" or m.startswith("specdec_rt.spec.")]:
        del sys.modules[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old_params = importlib.import_module("specdec_rt.spec.params")
        old_checks = importlib.import_module("specdec_rt.spec.request_checks")
        old_scheduler = importlib.import_module("specdec_rt.spec.scheduler")
    assert any(
        issubclass(w.category, DeprecationWarning) and "specdec_rt.speculation" in str(w.message) for w in caught
    ), [str(w.message) for w in caught]
    import specdec_rt.request.checks
    import specdec_rt.request.params
    import specdec_rt.speculation.scheduler

    assert old_params is specdec_rt.request.params
    assert old_checks is specdec_rt.request.checks
    assert old_scheduler.SpecDecScheduler is specdec_rt.speculation.scheduler.SpecDecScheduler
