"""Frozen dataclasses registered as JAX pytrees (every field a child), with `.replace(**changes)`.

JAX's own `register_dataclass` instead of `flax.struct`, so the kernels and their tests import with
JAX alone (the Python 3.12 interpret-mode lane installs nothing else).
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import jax

T = TypeVar("T")


def static_field(default: object = None) -> object:
    """A field that is part of the pytree's structure (hashable, compared by jit), not a leaf."""
    return dataclasses.field(default=default, metadata={"static": True})


def pytree_dataclass(cls: type[T]) -> type[T]:
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.replace = lambda self, **changes: dataclasses.replace(self, **changes)  # type: ignore[attr-defined]
    fields = dataclasses.fields(cls)
    data = [f.name for f in fields if not f.metadata.get("static")]
    meta = [f.name for f in fields if f.metadata.get("static")]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


__all__ = ["pytree_dataclass", "static_field"]
