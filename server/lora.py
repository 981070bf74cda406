"""LoRA adapters in the server, with vLLM's names: `--enable-lora`, `--lora-modules name=path` (or
its JSON form), `--max-loras`, `--max-lora-rank`, `--max-cpu-loras`; a request's `model` naming an
adapter runs it; `/v1/models` lists adapters with their base model as `parent`; and, only when
started with `--allow-runtime-lora-updating` (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, read
when the flags are parsed), `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Adapters are read by an input worker (never the step loop); one that cannot serve this model is a
400 naming why (at start, for `--lora-modules`: the server does not start).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from dataclasses import dataclass, field

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictStr
from typing_extensions import Annotated

from paxserve.lora_request import LoRARequest
from paxserve.server.errors import ProtocolError
from paxserve.server.protocol import parse_body

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One `--lora-modules` entry: a served name and the adapter's directory."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """`name=path`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r} is not valid JSON: {e}") from None
        unknown = set(value) - {"name", "path", "base_model_name"} if isinstance(value, dict) else set()
        if not isinstance(value, dict) or unknown or not all(isinstance(value.get(k), str) and value.get(k)
                                                             for k in ("name", "path")):
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: the JSON form is {{\"name\": NAME, "
                                             "\"path\": DIR, \"base_model_name\": BASE (optional)}")
        return LoraModule(value["name"], value["path"], value.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: expected NAME=DIR or a JSON object")
    return LoraModule(name.strip(), path.strip())


def add_lora_flags(group: argparse._ActionsContainer) -> None:
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (PEFT format) of the model: a request's `model` names one; "
                            "requests for different adapters and the base model share each step")
    group.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None, metavar="NAME=DIR",
                       help="adapters served by name (NAME=DIR, or JSON {\"name\", \"path\", \"base_model_name\"}); "
                            "each is read and checked at start")
    group.add_argument("--max-loras", type=int, default=1,
                       help="adapters the device holds at once (its slots); a request whose adapter finds no free "
                            "slot waits while others run")
    group.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank served")
    group.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept read in host memory (default: --max-loras)")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       default=os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true"),
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (default: vLLM's "
                            f"{RUNTIME_UPDATING_ENV})")


@dataclass(slots=True)
class LoraModules:
    """The adapters a server serves, by name (changed only on the event loop's thread)."""

    base_model_name: str
    runtime_updating: bool = False
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    parents: dict[str, str] = field(default_factory=dict)  # `base_model_name` given with --lora-modules
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def new(self, name: str, path: str) -> LoRARequest:
        """An adapter under `name` with an id never used before on this server (an unloaded adapter's
        id is never reused, so no device slot can hold a stale one); not served until `serve`."""
        return LoRARequest(name, next(self._ids), path)

    def serve(self, lora: LoRARequest, parent: str | None = None) -> LoRARequest | None:
        """Serve `lora` under its name; the adapter it replaces, if any."""
        held = self.adapters.get(lora.lora_name)
        self.adapters[lora.lora_name] = lora
        if parent is None:
            self.parents.pop(lora.lora_name, None)
        else:
            self.parents[lora.lora_name] = parent
        return held

    def remove(self, name: str) -> None:
        del self.adapters[name]
        self.parents.pop(name, None)

    def parent(self, name: str) -> str:
        """What /v1/models shows as an adapter's `parent`: its stated base, else the served model."""
        return self.parents.get(name, self.base_model_name)

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.adapters.get(name)


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: Annotated[StrictStr, Field(min_length=1)]
    lora_path: Annotated[StrictStr, Field(min_length=1)]
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: Annotated[StrictStr, Field(min_length=1)]
    lora_int_id: int | None = None


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's: read and check the adapter now (on an input worker), then serve it under its name."""
    from paxserve.server.request_body import read_json
    from paxserve.server.state import STATE

    state = request.app[STATE]
    body = parse_body(LoadLoraAdapterRequest, await read_json(request, state))
    modules = state.settings.lora_modules
    if body.lora_name in state.settings.served_model_names:
        raise ProtocolError(f"`{body.lora_name}` is the base model's name", param="lora_name")
    held = modules.adapters.get(body.lora_name)
    if held is not None and not body.load_inplace:
        raise ProtocolError(f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
    candidate = modules.new(body.lora_name, body.lora_path)
    await _read(state, candidate)
    held = modules.serve(candidate)  # another load in place may have finished meanwhile
    if held is not None:
        state.async_engine.input_processor.lora.forget(held.lora_int_id)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's: stop serving an adapter by name (requests already running with it finish)."""
    from paxserve.server.request_body import read_json
    from paxserve.server.state import STATE

    state = request.app[STATE]
    body = parse_body(UnloadLoraAdapterRequest, await read_json(request, state))
    modules = state.settings.lora_modules
    held = modules.adapters.get(body.lora_name)
    if held is None or (body.lora_int_id is not None and body.lora_int_id != held.lora_int_id):
        raise ProtocolError(f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name", status=404)
    modules.remove(body.lora_name)
    state.async_engine.input_processor.lora.forget(held.lora_int_id)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _read(state: object, lora: LoRARequest) -> None:
    from paxserve.sampling_params import RequestError
    from paxserve.server.errors import from_value_error

    state.check_serving()
    try:
        await state.async_engine.run_input(state.async_engine.input_processor.load_lora, lora)
    except RequestError as e:
        e.param = "lora_path"
        raise from_value_error(e) from None


def add_routes(app: web.Application, modules: LoraModules | None) -> None:
    if modules is not None and modules.runtime_updating:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
