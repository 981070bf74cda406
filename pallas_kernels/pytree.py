"""Frozen dataclasses registered as JAX pytrees (every field a child), with `.replace(**changes)`.

JAX's own `register_dataclass` instead of `flax.struct`, so the kernels and their tests import with
JAX alone (the Python 3.12 interpret-mode lane installs nothing else).
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import jax

T = TypeVar("T")


def pytree_dataclass(cls: type[T]) -> type[T]:
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.replace = lambda self, **changes: dataclasses.replace(self, **changes)  # type: ignore[attr-defined]
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


__all__ = ["pytree_dataclass"]
