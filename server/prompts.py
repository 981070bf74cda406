"""Turn validated prompts into token ids, on an input worker (`AsyncEngine.run_input`), never on
the step loop. Every check raises before anything is queued, with the HTTP field to blame."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paxserve.server.errors import ProtocolError, from_value_error
from paxserve.server.protocol import GenerationSpec


@dataclass(slots=True)
class PromptInput:
    text: str | None  # the prompt as text (echo); None when the model has no tokenizer
    token_ids: list[int]


def render_prompts(inputs: Any, spec: GenerationSpec, server_chat_template: str | None) -> list[PromptInput]:
    """Token ids for every prompt of the request (one for chat), each checked against the context:
    the prompt must leave room, and prompt + max_tokens must fit (vLLM's 400s). `inputs` is the
    engine's InputProcessor."""
    param = "messages" if spec.kind == "chat" else "prompt"
    renames = {"max_tokens": spec.max_tokens_param, "prompt": param}
    try:
        spec.params.check_vocab(inputs.vocab_size)
        if spec.params.structured_outputs is not None:  # compiled here (cached), so a bad schema is a 400
            inputs.compile_grammar(spec.params.structured_outputs, param=spec.structured_param or "structured_outputs")
        if spec.kind == "chat":
            text = inputs.render_chat(spec.messages, chat_template=spec.chat_template or server_chat_template,
                                      add_generation_prompt=spec.add_generation_prompt,
                                      continue_final_message=spec.continue_final_message,
                                      tools=spec.tools, template_kwargs=spec.chat_template_kwargs)
            prompts = [PromptInput(text, inputs.tokenize(text, add_special_tokens=False, param=param))]
        else:
            prompts = []
            for prompt in spec.prompts:
                if isinstance(prompt, str):
                    prompts.append(PromptInput(prompt, inputs.tokenize(prompt, param=param)))
                else:
                    text = inputs.tokenizer.decode(prompt) if inputs.tokenizer is not None and spec.echo else None
                    prompts.append(PromptInput(text, list(prompt)))
        for p in prompts:
            inputs.check_prompt_length(len(p.token_ids), param)
            inputs.resolve_max_tokens(len(p.token_ids), spec.params)
    except ProtocolError:
        raise
    except ValueError as e:
        raise from_value_error(e, param, renames) from None
    return prompts
