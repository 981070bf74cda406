"""Make this interpreter see only the GPU image's Python packages (plus paxserve itself).

Put this folder first on PYTHONPATH (`PYTHONPATH=tests/support/gpu_image`): Python imports this file
at start, and every top-level module of an installed distribution that `packages.txt` does not list
then fails to import with ModuleNotFoundError ("import of gguf halted; None in sys.modules"), as it would on the image, which reaches no package
registry. Subprocesses inherit PYTHONPATH, so a script's children see the same set. Modules of no
distribution (the standard library, the checkout's own folders) are left alone, and so are the
run-time requirements of listed packages: this environment's versions of them may need other
packages than the image's versions do (huggingface_hub here needs httpx2), which the image then
has in its own form.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: str) -> list[str]:
    """The distributions `dist` needs at run time (no extras), as installed here."""
    from packaging.requirements import Requirement

    try:
        lines = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    needed = []
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            needed.append(_normalize(req.name))
    return needed


def _blocked_modules() -> set[str]:
    listed = Path(__file__).with_name("packages.txt").read_text().splitlines()
    absent = {_normalize(line[1:]) for line in listed if line.startswith("!")}
    allowed = {_normalize(line) for line in listed if line.strip() and line[0] not in "#!"}
    todo = list(allowed)
    while todo:  # the listed packages' own requirements, transitively
        for dist in _requirements(todo.pop()):
            if dist not in allowed and dist not in absent:
                allowed.add(dist)
                todo.append(dist)
    allowed.add("paxserve")  # what runs from the checkout (its requirements are what is checked)
    owners = importlib.metadata.packages_distributions()
    return {module for module, dists in owners.items() if not any(_normalize(d) in allowed for d in dists)}


BLOCKED = _blocked_modules()
# A None entry in sys.modules makes `import name` raise ModuleNotFoundError and makes
# `importlib.util.find_spec(name)` answer None, as for a package that is not installed (libraries
# probe for optional packages that way: yarl looks for pydantic_core).
for _module in BLOCKED:
    sys.modules.setdefault(_module, None)
