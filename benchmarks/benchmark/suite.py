"""Helper modules of the test suite that the benchmarks reuse (a server subprocess, the tiny models, the
engine tests' prompts), loaded from their files.

tests/ is not a package: pytest imports these files under their bare names (its `prepend` import mode), and
a `tests` package in site-packages (smdebug_rulesconfig ships one) would shadow a `tests.server_process`
import anyway. So `helper(name)` loads the file under that same bare name, once per process: inside a pytest
run, a benchmark module and the tests share one copy of the helper.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from .common import ROOT

FILES = {
    "server_process": ROOT / "tests" / "server_process.py",
    "tiny_vlm": ROOT / "tests" / "tiny_vlm.py",
    "tp_model": ROOT / "tests" / "tp_model.py",
    "engine_prompts": ROOT / "tests" / "unit" / "engine" / "engine_prompts.py",
    "otlp_receiver": ROOT / "tests" / "otlp_receiver.py",
    "device_models": ROOT / "tests" / "gpu" / "device_models.py",
}


def helper(name: str) -> ModuleType:
    """The module of tests/ named `name` (a key of FILES), imported once."""
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(FILES[name]):
        return loaded
    spec = importlib.util.spec_from_file_location(name, FILES[name])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
