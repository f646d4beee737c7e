"""Package re-exports resolved on first access, so importing one module of a package does not load
the others (and a lower layer can import a module of the package without a cycle through its
`__init__`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, public: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `public[name]` and returns its `name`."""

    def __getattr__(name: str) -> Any:
        if name in public:
            return getattr(importlib.import_module(public[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
