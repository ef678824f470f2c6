"""Package namespaces whose names load on first use (PEP 562).

A package whose modules import torch lists its public names here instead of importing them in
its __init__, so its torch-free parts (the `config` modules, which the Prefect flow process
loads) import without torch, while `from posttrain.core.model import Transformer` still works:

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"Transformer": "posttrain.core.model.model", ...})
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """(__getattr__, __dir__, __all__) for `package`: name -> the module defining it. An exported
    name may not also be a submodule's (importing the submodule would bind the package attribute
    to the module instead)."""
    clash = [n for n in exports if importlib.util.find_spec(f"{package}.{n}") is not None]
    if clash:
        raise ImportError(f"{package}: exported names {clash} are also submodules; rename one")

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__, sorted(exports)
