"""A multi-host worker's loop: run rank 0's device calls, in its order, on this host's devices.

Rank 0's model runner publishes each call that reaches the devices (`write_state`: sampler-state
rows of requests that start running; `dispatch`: one step's padded batch, sampling rows and prompt
scoring inputs) before making it. A worker's runner makes the same call with the same plain data,
so every rank launches the same compiled program with the same inputs, and the programs'
collectives meet. The worker never reads results: the sampled ids come back to rank 0 alone.
"""

from __future__ import annotations

import logging
import time

import jax

from paxserve.distributed.cluster import PlanChannel
from paxserve.worker.model_runner import DISPATCH, STOP, WRITE_STATE, DeviceStep, ModelRunner

logger = logging.getLogger(__name__)


def run_worker(runner: ModelRunner, channel: PlanChannel) -> int:
    """Apply rank 0's plan until it stops the engine; returns the number of steps run. A failed step
    raises (the engine cannot go on without this rank)."""
    rank = channel.cluster.rank
    logger.info("node rank %d: ready; running rank 0's steps", rank)
    previous: DeviceStep | None = None
    steps = 0
    start = time.perf_counter()
    while True:
        message = channel.receive()
        kind = message[0]
        if kind == STOP:
            break
        if kind == WRITE_STATE:
            runner.write_sampler_state(message[1])
        elif kind == DISPATCH:
            step = runner.dispatch(*message[1:])
            # Wait for the step before this one: errors surface here, and the queue stays one deep.
            if previous is not None:
                jax.block_until_ready(previous.packed)
            previous = step
            steps += 1
        else:
            raise ValueError(f"node rank {rank}: unknown plan message {kind!r} from rank 0 (are all ranks running "
                             "the same paxserve version?)")
    if previous is not None:
        jax.block_until_ready(previous.packed)
    logger.info("node rank %d: rank 0 stopped the engine after %d steps (%.0fs)", rank, steps,
                time.perf_counter() - start)
    return steps
