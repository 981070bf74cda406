"""POST /v1/completions and /v1/chat/completions: validate, admit, render and tokenize on an input
worker, run, and answer as one JSON response or as an SSE stream."""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from paxserve.outputs import CompletionOutput, RequestOutput
from paxserve.server import responses as R
from paxserve.server.errors import ProtocolError, internal_error
from paxserve.server.generation import GenerationRun, ServerShutdown, engine_failure, new_run_id
from paxserve.server.generation_spec import GenerationSpec, parse_chat_request, parse_completion_request
from paxserve.server.prompts import PromptInput, process_prompts
from paxserve.server.request_body import read_json
from paxserve.server.state import STATE, ServerState
from paxserve.server.streaming import send_done, send_error, send_event, start_stream

logger = logging.getLogger("paxserve.server")


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    spec = parse_completion_request(await read_json(request, state), state.settings)
    return await serve_generation(request, state, spec, arrival)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    spec = parse_chat_request(await read_json(request, state), state.settings)
    return await serve_generation(request, state, spec, arrival)


async def _process(state: ServerState, spec: GenerationSpec, run_id: str, arrival: float) -> list[PromptInput]:
    """Render, tokenize and check on an input worker (never on the step loop): the one call."""
    try:
        return await state.async_engine.run_input(process_prompts, state.async_engine.input_processor, spec,
                                                  state.settings.chat_template, run_id, arrival)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - the engine died, or something unexpected
        raise engine_failure(state.async_engine, e) from None


Responder = Callable[[GenerationRun, tuple[int, RequestOutput]], Awaitable[web.StreamResponse]]


async def serve_generation(request: web.Request, state: ServerState, spec: GenerationSpec, arrival: float,
                           respond: Responder | None = None, run_id: str | None = None,
                           rename: Callable[[ProtocolError], ProtocolError] | None = None) -> web.StreamResponse:
    """Admit, process and run `spec`; answer as a chat completion or completion, or through `respond`
    (the Responses and Messages APIs), which gets the run and its first output. `rename` maps errors
    raised before the first output to the endpoint's own field names."""
    state.check_serving()
    state.admit(spec.num_seqs)
    run: GenerationRun | None = None
    try:
        run_id = run_id or new_run_id("chatcmpl" if spec.kind == "chat" else "cmpl")
        try:
            prompts = await _process(state, spec, run_id, arrival)
        except ProtocolError as e:
            raise rename(e) if rename is not None else e from None
        run = GenerationRun(state.async_engine, state.metrics, run_id, prompts, spec.params, arrival)
        if state.settings.log_requests:
            logger.info("request %s: %s prompt tokens, %s", run.id, [len(p.token_ids) for p in prompts], spec.params)
        state.runs.add(run)
        run.start()
        try:
            first = await run.next()  # errors before the first output still get their own HTTP status
        except ServerShutdown as e:
            raise ProtocolError(str(e), status=503) from None
        except ProtocolError as e:
            raise rename(e) if rename is not None else e from None
        if respond is not None:
            return await respond(run, first)
        if spec.stream:
            return await _stream(request, state, spec, run, first)
        return await _collect(state, spec, run, first)
    finally:
        state.release(spec.num_seqs)
        if run is not None:
            run.close()
            state.runs.discard(run)


def _usage(run: GenerationRun, completion_tokens: int, cached_tokens: int, details: bool) -> dict[str, Any]:
    return R.usage(sum(len(p.token_ids) for p in run.prompts), completion_tokens, cached_tokens, details)


# ---- one JSON response ------------------------------------------------------------------------

async def _collect(state: ServerState, spec: GenerationSpec, run: GenerationRun,
                   first: tuple[int, RequestOutput]) -> web.Response:
    """Fold the deltas of every choice into one answer."""
    n = spec.params.n
    choices: dict[int, CompletionOutput] = {}
    cached = [0] * len(run.prompts)
    prompt_logprobs: list[list | None] = [None] * len(run.prompts)
    done: set[int] = set()
    item = first
    while True:
        i, out = item
        cached[i] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            prompt_logprobs[i] = out.prompt_logprobs
        if out.finished:
            done.add(i)
        for o in out.outputs:
            idx = i * n + o.index
            if idx in choices:
                choices[idx].extend(o)
            else:
                choices[idx] = o
        if len(done) == len(run.prompts):
            break
        try:
            item = await run.next()
        except ServerShutdown as e:
            raise ProtocolError(str(e), status=503) from None
    decode = _decoder(state)
    body = [_final_choice(spec, idx, run.prompts[idx // n], choices[idx], prompt_logprobs[idx // n], decode)
            for idx in sorted(choices)]
    completion_tokens = sum(len(o.token_ids) for o in choices.values())
    model = state.settings.response_model(spec.model)
    response = R.response(spec.kind, run.id, run.created, model, body,
                          _usage(run, completion_tokens, sum(cached), state.settings.enable_prompt_tokens_details))
    if spec.kind == "chat":  # vLLM puts chat's at the top, null when not asked for
        response["prompt_logprobs"] = None if spec.params.prompt_logprobs is None else \
            R.vllm_prompt_logprobs(prompt_logprobs[0])
        if spec.return_token_ids:
            response["prompt_token_ids"] = list(run.prompts[0].token_ids)
    return web.json_response(response)


def _decoder(state: ServerState) -> Callable[[int], str]:
    tokenizer = state.async_engine.input_processor.tokenizer
    return (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: f"token_id:{t}")


def _echo_logprobs(spec: GenerationSpec, prompt: PromptInput, prompt_logprobs: list | None, o: CompletionOutput,
                   decode: Callable[[int], str]) -> dict[str, Any]:
    """Echo with logprobs: the prompt's tokens (the first with null logprobs) and then the answer's."""
    entries = list(prompt_logprobs or [None] * len(prompt.token_ids)) + list(o.logprobs or [])
    return R.completion_logprobs(entries, prompt.token_ids + o.token_ids, 0, decode, spec.tokens_as_ids)


def _final_choice(spec: GenerationSpec, index: int, prompt: PromptInput, o: CompletionOutput,
                  prompt_logprobs: list | None, decode: Callable[[int], str]) -> dict[str, Any]:
    want_logprobs = spec.logprobs is not None and o.logprobs is not None
    if spec.kind == "chat":
        logprobs = R.chat_logprobs(o.logprobs, o.token_ids, spec.logprobs, spec.tokens_as_ids,
                                   spec.logprob_token_ids) if want_logprobs \
            else None
        choice = R.chat_choice(index, spec.output.message(o.text), logprobs, o.finish_reason, o.stop_reason)
        if spec.return_token_ids:
            choice["token_ids"] = list(o.token_ids)
        return choice
    if want_logprobs:
        logprobs = _echo_logprobs(spec, prompt, prompt_logprobs, o, decode) if spec.echo else \
            R.completion_logprobs(o.logprobs, o.token_ids, 0, as_ids=spec.tokens_as_ids)
    else:
        logprobs = None
    text = (prompt.text or "") + o.text if spec.echo else o.text
    vllm_prompt = R.vllm_prompt_logprobs(prompt_logprobs) if spec.params.prompt_logprobs is not None else None
    choice = R.completion_choice(index, text, logprobs, o.finish_reason, o.stop_reason, vllm_prompt)
    choice.setdefault("prompt_logprobs", None)  # vLLM sends the field whether or not it was asked for
    if spec.return_token_ids:
        choice["prompt_token_ids"], choice["token_ids"] = list(prompt.token_ids), list(o.token_ids)
    return choice


# ---- an SSE stream ----------------------------------------------------------------------------

class _StreamState:
    """What each choice has been sent so far."""

    def __init__(self, spec: GenerationSpec, run: GenerationRun) -> None:
        num = len(run.prompts) * spec.params.n
        self.text_sent = [0] * num
        self.tokens = [0] * num
        self.finished = [False] * num
        self.echo_pending = [spec.echo] * num
        self.prompt_logprobs_sent = [False] * num
        self.prompt_ids_sent = [False] * num  # return_token_ids: a completion choice's first chunk has them
        self.decode: Callable[[int], str] = lambda t: f"token_id:{t}"  # the server's tokenizer, set by _stream
        self.cached = [0] * len(run.prompts)
        # Chat with a reasoning or tool-call parser: each choice's text goes through its own stream.
        self.parsed = [spec.output.stream() for _ in range(num)] if spec.kind == "chat" and spec.output.active \
            else None


def _chunks(spec: GenerationSpec, run: GenerationRun, st: _StreamState, i: int,
            out: RequestOutput) -> list[tuple[int, dict[str, Any]]]:
    """The SSE choices of one delta output (it carries only what is new)."""
    chunks = []
    n = spec.params.n
    st.cached[i] = out.num_cached_tokens
    for o in out.outputs:
        idx = i * n + o.index
        if st.finished[idx]:
            continue
        st.tokens[idx] += len(o.token_ids)
        text = o.text
        echoed = st.echo_pending[idx]
        if echoed:
            text = (run.prompts[i].text or "") + text
            st.echo_pending[idx] = False
        logprobs = None
        if spec.logprobs is not None and (o.logprobs or echoed):
            if spec.kind == "chat":
                logprobs = R.chat_logprobs(o.logprobs, o.token_ids, spec.logprobs, spec.tokens_as_ids,
                                           spec.logprob_token_ids)
            elif echoed:
                logprobs = _echo_logprobs(spec, run.prompts[i], out.prompt_logprobs, o, st.decode)
            else:
                logprobs = R.completion_logprobs(o.logprobs, o.token_ids, st.text_sent[idx],
                                                 as_ids=spec.tokens_as_ids)
        if not text and logprobs is None and o.finish_reason is None and not (spec.return_token_ids and o.token_ids):
            continue
        st.text_sent[idx] += len(text)
        st.finished[idx] = o.finish_reason is not None
        if spec.kind == "chat":
            finish_reason = o.finish_reason
            if st.parsed is not None:
                parsed = st.parsed[idx]
                delta = parsed.feed(text, final=o.finish_reason is not None)
                if parsed.made_calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
                if not delta and logprobs is None and finish_reason is None and not spec.return_token_ids:
                    continue  # held back: it may be the start of a tool call or a tag
            else:
                delta = {"content": text} if text else {}
            choice = R.chat_chunk_choice(idx, delta, logprobs, finish_reason, o.stop_reason)
        else:
            vllm_prompt = None
            if spec.params.prompt_logprobs is not None and not st.prompt_logprobs_sent[idx] and out.prompt_logprobs:
                vllm_prompt = R.vllm_prompt_logprobs(out.prompt_logprobs)
                st.prompt_logprobs_sent[idx] = True
            choice = R.completion_choice(idx, text, logprobs, o.finish_reason, o.stop_reason, vllm_prompt)
            if spec.return_token_ids and not st.prompt_ids_sent[idx]:
                choice["prompt_token_ids"] = list(run.prompts[i].token_ids)
                st.prompt_ids_sent[idx] = True
        if spec.return_token_ids:
            choice["token_ids"] = list(o.token_ids)
        chunks.append((idx, choice))
    return chunks


async def _stream(request: web.Request, state: ServerState, spec: GenerationSpec, run: GenerationRun,
                  first: tuple[int, RequestOutput]) -> web.StreamResponse:
    model = state.settings.response_model(spec.model)
    st = _StreamState(spec, run)
    st.decode = _decoder(state)
    prompt_tokens = sum(len(p.token_ids) for p in run.prompts)
    details = state.settings.enable_prompt_tokens_details

    def usage() -> dict[str, Any]:
        return R.usage(prompt_tokens, sum(st.tokens), sum(st.cached), details)

    def chunk(choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        return R.response(spec.kind, run.id, run.created, model, choices, usage, chunk=True,
                          with_usage=spec.include_usage)

    resp = await start_stream(request)
    try:
        if spec.kind == "chat":  # the first delta of each choice carries the role
            for idx in range(len(st.finished)):
                # With continuous usage stats every chunk carries usage, this one too (vLLM's).
                role = R.chat_chunk_choice(idx, {"role": "assistant", "content": ""}, None, None)
                opening = chunk([role], usage() if spec.continuous_usage else None)
                if spec.return_token_ids and idx == 0:  # vLLM's: the prompt's ids on the first chunk
                    opening["prompt_token_ids"] = list(run.prompts[0].token_ids)
                await send_event(resp, opening)
        item = first
        while True:
            for _, choice in _chunks(spec, run, st, *item):
                await send_event(resp, chunk([choice], usage() if spec.continuous_usage else None))
            if all(st.finished):
                break
            item = await run.next()
        if spec.include_usage:
            await send_event(resp, chunk([], usage()))
        await send_done(resp)
    except ConnectionError:  # the client went away mid-stream; run.close() aborts the request
        logger.debug("client disconnected from %s", run.id)
    except Exception as e:  # noqa: BLE001 - the 200 status line is already sent: report the error in-band
        if isinstance(e, ServerShutdown):
            err = ProtocolError(str(e), status=503)
        elif isinstance(e, ProtocolError):
            err = e
        else:
            logger.exception("error while streaming %s", run.id)
            err = internal_error()
        try:
            await send_error(resp, err)
        except ConnectionError:
            pass
    return resp
