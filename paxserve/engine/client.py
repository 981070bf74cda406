"""What a front end (the HTTP server, or any other) may ask of a serving engine: the typed seam
between `server/` and `paxserve.engine`, so the server never reaches into an engine's parts.

`AsyncEngine` implements it. The module imports nothing heavy: a front end can type against it
without pulling in JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping, Protocol, TypeVar

if TYPE_CHECKING:
    from paxserve.core.interface import EngineCoreRequest, EngineSnapshot
    from paxserve.engine.input_processor import InputProcessor, Prompt
    from paxserve.outputs import RequestOutput
    from paxserve.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServingLimits:
    """The engine's facts a front end reports and enforces (decided at start, fixed after)."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    # The model's default sampling settings (--generation-config), SamplingParams' names.
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)


class EngineClient(Protocol):
    """A running engine as a front end sees it. Every method is safe to call from the front end's
    event loop at any moment; cancelling a caller costs only its own request."""

    @property
    def input_processor(self) -> InputProcessor:
        """Chat templates, tokenization and request checks (call through `run_input`)."""

    @property
    def limits(self) -> ServingLimits: ...

    @property
    def snapshot(self) -> EngineSnapshot:
        """The latest gauges and counters, published after every step (never waits on the loop)."""

    @property
    def is_alive(self) -> bool: ...

    def on_death(self, callback: Callable[[BaseException], None]) -> None: ...

    async def run_input(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run request-specific work (render, tokenize, validate) on an input worker."""

    def generate(self, request_id: str, prompt: Prompt | EngineCoreRequest, params: SamplingParams | None = None, *,
                 cache_salt: str | None = None, arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; an `EngineCoreRequest` (from `InputProcessor.process`)
        is taken as already checked."""

    def abort(self, request_id: str) -> None: ...

    def shutdown(self, timeout: float = 30.0) -> None: ...
