"""Packages only some features need, imported where those features run.

The GPU image paxserve is checked on (and a lean server install) lacks some of them: `gguf` reads
GGUF files, `llguidance` compiles structured-output grammars. Importing them at module level made
the whole engine fail to import without them; here a feature that needs one fails, when used, with
an error naming the package and the feature.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingPackageError(ImportError):
    """A feature was used whose package is not installed."""


def import_for(module: str, feature: str, package: str | None = None) -> ModuleType:
    """`importlib.import_module(module)`, or a MissingPackageError that says `feature` needs
    `package` (the distribution to install; default: the module's top-level name)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        name = package or module.split(".")[0]
        raise MissingPackageError(f"{feature} needs the Python package `{name}`, which is not installed "
                                  f"(pip install {name}): {e}") from None
