"""The host's bookkeeping of LoRA adapters: what a request names, which adapters are read into host
memory, and which the device's slots hold.

The device keeps `max_loras` adapters at once (models/lora.py's slots); an adapter takes a slot when
a request that uses it is scheduled and keeps it while any running request uses it. A slot no
running request uses is given to the next adapter that needs one, least recently used first, so a
workload that cycles through a few adapters rewrites no slot. Host memory keeps `max_cpu_loras`
read adapters the same way, so bringing one back into a slot reads no file. Neither ever touches
the device: the engine writes a slot's weights when `acquire` says the slot changed hands.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, TypeVar

from paxserve.lora_request import LoRARequest

Adapter = TypeVar("Adapter")


class LoraSlots:
    """Which adapter (by id) each of `max_loras` device slots holds."""

    def __init__(self, max_loras: int) -> None:
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"max_loras must be an integer >= 1, got {max_loras!r}")
        self.max_loras = max_loras
        self._held: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._free = list(range(max_loras))

    def slot(self, lora_id: int) -> int | None:
        """The slot holding `lora_id`, if one does."""
        return self._held.get(lora_id)

    @property
    def resident(self) -> dict[int, int]:
        return dict(self._held)

    def can_acquire(self, lora_id: int, in_use: set[int]) -> bool:
        """Whether `acquire` would give `lora_id` a slot now (changing nothing)."""
        return lora_id in self._held or bool(self._free) or any(held not in in_use for held in self._held)

    def acquire(self, lora_id: int, in_use: set[int]) -> tuple[int, bool] | None:
        """A slot for `lora_id`: (slot, whether its weights must be written there), or None when
        every slot holds an adapter a running request uses (`in_use`: their ids)."""
        slot = self._held.get(lora_id)
        if slot is not None:
            self._held.move_to_end(lora_id)
            return slot, False
        if self._free:
            slot = self._free.pop(0)
        else:
            victim = next((held for held in self._held if held not in in_use), None)
            if victim is None:
                return None
            slot = self._held.pop(victim)
        self._held[lora_id] = slot
        return slot, True

    def release(self, lora_id: int) -> int | None:
        """Forget `lora_id` (an adapter unloaded at run time); its slot, now free, if it had one."""
        slot = self._held.pop(lora_id, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort()
        return slot


class LoraCache(Generic[Adapter]):
    """Up to `max_cpu_loras` adapters read into host memory, least recently used dropped first;
    `read(request)` reads one (and raises ValueError naming why it cannot serve)."""

    def __init__(self, max_cpu_loras: int, read: Callable[[LoRARequest], Adapter]) -> None:
        if isinstance(max_cpu_loras, bool) or not isinstance(max_cpu_loras, int) or max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be an integer >= 1, got {max_cpu_loras!r}")
        self.max_cpu_loras = max_cpu_loras
        self._read = read
        self._adapters: OrderedDict[int, tuple[LoRARequest, Adapter]] = OrderedDict()
        self.num_reads = 0

    def get(self, request: LoRARequest) -> Adapter:
        """The adapter `request` names, read now unless held. The same id with another path is an
        error: ids name adapters."""
        held = self._adapters.get(request.lora_int_id)
        if held is not None:
            if held[0].lora_path != request.lora_path:
                raise ValueError(f"LoRA id {request.lora_int_id} is {held[0].lora_name!r} at {held[0].lora_path}, "
                                 f"not {request.lora_path}: one id per adapter")
            self._adapters.move_to_end(request.lora_int_id)
            return held[1]
        adapter = self._read(request)
        self.num_reads += 1
        self._adapters[request.lora_int_id] = (request, adapter)
        while len(self._adapters) > self.max_cpu_loras:
            self._adapters.popitem(last=False)
        return adapter

    def drop(self, lora_id: int) -> None:
        self._adapters.pop(lora_id, None)

    def __contains__(self, lora_id: int) -> bool:
        return lora_id in self._adapters

    def ids(self) -> set[int]:
        return set(self._adapters)
