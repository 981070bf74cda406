"""`python dying_server.py CHECKPOINT PORT`: serve CHECKPOINT with `server.serve.serve`, as
`paxserve serve` does, with an engine core whose step raises outside its own failure isolation (a
scheduler bug, say): the first request kills the step loop. The watchdog test runs it."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from paxserve import AsyncEngine, Engine  # noqa: E402
from paxserve.server.serve import serve  # noqa: E402
from paxserve.server.settings import ServerSettings  # noqa: E402


def broken_step() -> list:
    raise RuntimeError("scheduler invariant broken at 0xdeadbeef")


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    engine = Engine(sys.argv[1], warmup=False, log_stats_interval=0, compilation_cache_dir="", max_model_len=256,
                    kv_cache_memory_bytes=64 * 2**20)
    engine.core.step = broken_step
    async_engine = AsyncEngine(engine.parts)
    try:
        return asyncio.run(serve(async_engine, ServerSettings(served_model_names=["tiny"]), "127.0.0.1",
                                 int(sys.argv[2])))
    finally:
        async_engine.shutdown(timeout=0.5)


if __name__ == "__main__":
    sys.exit(main())
