"""Import a paxserve checkout as it is installed, without installing it.

    PYTHONPATH="$(python3 benchmarks/checkout.py [TREE])" python3 ...

Installed, the top-level folders `models`, `server` and `pallas_kernels` are the subpackages
`paxserve.models`, `paxserve.server` and `paxserve.kernels` (pyproject's package-dir mapping). A plain
checkout has no such package: this makes, once per tree, a folder holding a `paxserve` of links (to
the tree's own `paxserve` entries and to each mapped folder) and prints it. Put it first on
PYTHONPATH, and run `python -m` from it (cwd), so that no other copy of paxserve shadows it. Used
where nothing can be installed (the GPU image reaches no registry: `gpu_check.sh`) and where another
tree's code must run beside this one's (`startup.py --baseline-tree`, `ab_serving.sh`). A tree from
before the mapping is returned as it is (its packages import from its root). Standard library only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path


def package_dirs(tree: Path) -> dict[str, str]:
    """pyproject's package-dir mapping of `tree` (empty for a tree from before it)."""
    pyproject = tree / "pyproject.toml"
    if not pyproject.exists():
        return {}
    return tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {}).get("package-dir", {})


def import_root(tree: Path) -> Path:
    """The folder to put first on PYTHONPATH (and to start `python -m` in) for `tree`'s code."""
    tree = tree.resolve()
    mapping = package_dirs(tree)
    if not mapping:
        return tree
    links = {entry.name: entry for entry in (tree / "paxserve").iterdir() if entry.name != "__pycache__"}
    for name, folder in mapping.items():
        parent, _, leaf = name.partition(".")
        assert parent == "paxserve" and "." not in leaf, f"unexpected package-dir entry {name}"
        links[leaf] = tree / folder
    root = Path(tempfile.gettempdir()) / f"paxserve-checkout-{hashlib.sha256(str(tree).encode()).hexdigest()[:12]}"
    if _links(root / "paxserve") == links:
        return root  # as made before (a server may be running from it)
    building = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    (building / "paxserve").mkdir()
    for name, target in links.items():
        (building / "paxserve" / name).symlink_to(target)
    # Replace an out-of-date folder in one step: a reader never sees half of one.
    old = root.with_name(root.name + ".old")
    if root.exists():
        os.replace(root, old)
    os.replace(building, root)
    shutil.rmtree(old, ignore_errors=True)
    return root


def _links(folder: Path) -> dict[str, Path] | None:
    if not folder.is_dir():
        return None
    return {entry.name: Path(os.readlink(entry)) for entry in folder.iterdir() if entry.is_symlink()}


def main() -> None:
    tree = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
    print(import_root(tree))


if __name__ == "__main__":
    main()
