"""A multi-host worker's loop: run rank 0's device calls, in its order, on this host's devices.

Rank 0's model runner publishes each call that reaches the devices (`write_state`: sampler-state
rows of requests that start running; `write_lora`: a LoRA adapter's weights into a device slot;
`dispatch`: one step's padded batch, sampling rows and prompt scoring inputs) before making it, and so does its drafter for each of its passes (a draft model's
or an EAGLE-3 head's, between the steps). A worker makes the same calls with the same plain data,
so every rank launches the same compiled programs with the same inputs, and their collectives meet.
The worker never reads results: the sampled ids and proposals come back to rank 0 alone.
"""

from __future__ import annotations

import logging
import time

import jax

from paxserve.distributed.cluster import PlanChannel
from paxserve.spec_decode.draft_model import DRAFT_PASS, DraftModel
from paxserve.spec_decode.eagle3 import EAGLE_PASS, Eagle3Proposer
from paxserve.worker.model_runner import DISPATCH, STOP, WRITE_LORA, WRITE_STATE, DeviceStep, ModelRunner

logger = logging.getLogger(__name__)


def run_worker(runner: ModelRunner, channel: PlanChannel, drafter: DraftModel | Eagle3Proposer | None = None) -> int:
    """Apply rank 0's plan until it stops the engine; returns the number of steps run. A failed step
    raises (the engine cannot go on without this rank). `drafter`: this rank's part of the engine's
    speculative drafter, if it has one."""
    rank = channel.cluster.rank
    logger.info("node rank %d: ready; running rank 0's steps%s", rank,
                "" if drafter is None else f" and its {type(drafter).__name__} passes")
    eagle = drafter if isinstance(drafter, Eagle3Proposer) else None
    passes = {DRAFT_PASS: DraftModel, EAGLE_PASS: Eagle3Proposer}
    previous: DeviceStep | None = None
    steps = drafts = 0
    start = time.perf_counter()
    while True:
        message = channel.receive()
        kind = message[0]
        if kind == STOP:
            break
        if kind == WRITE_STATE:
            runner.write_sampler_state(message[1])
        elif kind == WRITE_LORA:
            runner.write_lora(message[1], message[2])
        elif kind == DISPATCH:
            step = runner.dispatch(*message[1:])
            if eagle is not None and step.aux is not None:
                eagle.keep_aux(step.index, step.aux)
            # Wait for the step before this one: errors surface here, and the queue stays one deep.
            if previous is not None:
                jax.block_until_ready(previous.packed)
            previous = step
            steps += 1
        elif kind in passes and isinstance(drafter, passes[kind]):
            drafter.replay(message)
            drafts += 1
        else:
            raise ValueError(f"node rank {rank}: unexpected plan message {kind!r} from rank 0 (are all ranks running "
                             "the same paxserve version and speculative config?)")
    if previous is not None:
        jax.block_until_ready(previous.packed)
    logger.info("node rank %d: rank 0 stopped the engine after %d steps and %d drafter passes (%.0fs)", rank, steps,
                drafts, time.perf_counter() - start)
    return steps
