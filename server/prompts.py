"""Turn validated prompts into token ids. These functions run on the engine thread (through
`AsyncEngine.call`), the only thread that touches the engine and its tokenizer, and raise
ProtocolError before anything is queued."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.errors import ProtocolError, from_value_error
from server.protocol import GenerationSpec


@dataclass(slots=True)
class PromptInput:
    text: str | None  # the prompt as text (echo); None when the model has no tokenizer
    token_ids: list[int]


def context_length_error(max_model_len: int, num_tokens: int, param: str) -> ProtocolError:
    # vLLM's wording, which clients and load balancers look for.
    return ProtocolError(
        f"This model's maximum context length is {max_model_len} tokens. However, your request has {num_tokens} "
        f"input tokens, which leaves no room for output. Please reduce the length of the "
        f"{'messages' if param == 'messages' else 'prompt'}.", param=param)


def _tokenizer(engine: Any, param: str) -> Any:
    if engine.tokenizer is None:
        raise ProtocolError("this model has no tokenizer: pass prompts as token ids", param=param)
    return engine.tokenizer


def render_chat(engine: Any, messages: list[dict[str, str]], chat_template: str | None, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                kwargs: dict[str, Any] | None = None) -> str:
    tok = _tokenizer(engine, "messages")
    if not (chat_template or tok.chat_template):
        raise ProtocolError("this model has no chat template; start the server with --chat-template",
                            param="messages")
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, chat_template=chat_template,
                                       **(kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja raises many kinds; the template rejected these messages
        raise ProtocolError(f"the chat template could not render these messages: {e}", param="messages") from None
    return text if isinstance(text, str) else text[0]


def _check_length(ids: list[int], max_model_len: int, param: str) -> None:
    if not ids:
        raise ProtocolError("the prompt must contain at least one token", param=param)
    if len(ids) >= max_model_len:
        raise context_length_error(max_model_len, len(ids), param)


def render_prompts(engine: Any, spec: GenerationSpec, server_chat_template: str | None) -> list[PromptInput]:
    """Token ids for every prompt of the request (one for chat), all checked against max_model_len."""
    max_model_len = engine.max_model_len
    try:
        spec.params.check_vocab(engine.model_config.vocab_size)
    except ValueError as e:
        raise from_value_error(e) from None
    if spec.kind == "chat":
        text = render_chat(engine, spec.messages, spec.chat_template or server_chat_template,
                           add_generation_prompt=spec.add_generation_prompt,
                           continue_final_message=spec.continue_final_message, kwargs=spec.chat_template_kwargs)
        ids = list(engine.tokenizer.encode(text, add_special_tokens=False))
        _check_length(ids, max_model_len, "messages")
        return [PromptInput(text, ids)]
    inputs = []
    for prompt in spec.prompts:
        if isinstance(prompt, str):
            ids = list(_tokenizer(engine, "prompt").encode(prompt))
            inputs.append(PromptInput(prompt, ids))
        else:
            text = engine.tokenizer.decode(prompt) if engine.tokenizer is not None and spec.echo else None
            inputs.append(PromptInput(text, list(prompt)))
        _check_length(inputs[-1].token_ids, max_model_len, "prompt")
    return inputs
