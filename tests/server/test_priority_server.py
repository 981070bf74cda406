"""`--scheduling-policy priority` through a real server on the bundled SmolLM2 with one batch slot:
an urgent request (`priority` -1) sent while a background request (`priority` 5) streams takes the
slot at once and finishes first; the background request is preempted, resumes, and streams exactly
the tokens it gives alone."""

from __future__ import annotations

from paxserve.server.settings import DEFAULT_MODEL_NAME
from tests.server.conftest import SMALL_ARGS, start_server

PROMPT = "Write a long story about a lighthouse keeper."
GREEDY = dict(model=DEFAULT_MODEL_NAME, temperature=0, max_tokens=48)


def test_an_urgent_request_preempts_a_streaming_background_request_which_finishes_unchanged() -> None:
    srv = start_server([*SMALL_ARGS, "--max-num-seqs", "1", "--scheduling-policy", "priority"])
    try:
        client = srv.client()
        alone = client.completions.create(prompt=PROMPT, extra_body={"ignore_eos": True}, **GREEDY).choices[0].text
        stream = iter(client.completions.create(prompt=PROMPT, stream=True,
                                                extra_body={"ignore_eos": True, "priority": 5}, **GREEDY))
        background = next(stream).choices[0].text
        # The one batch slot is the background request's: the urgent one takes it (a preemption) and
        # is done while the background one still has most of its 48 tokens to go.
        urgent = client.completions.create(prompt="Say hi.", extra_body={"priority": -1}, **{**GREEDY, "max_tokens": 4})
        assert urgent.choices[0].finish_reason == "length"
        # As vLLM without --enable-prompt-tokens-details: no prompt_tokens_details in usage.
        assert urgent.usage.prompt_tokens_details is None and urgent.usage.prompt_tokens > 0
        assert srv.metric("paxserve:num_preemptions") == 1
        rest = [chunk.choices[0] for chunk in stream if chunk.choices]
        background += "".join(choice.text for choice in rest)
        assert rest[-1].finish_reason == "length" and background == alone
        srv.wait_idle()
    finally:
        srv.stop()
