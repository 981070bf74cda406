"""A generation request's prompts -> engine requests, on an input worker (`AsyncEngine.run_input`),
never on the step loop: the chat template, then one `InputProcessor.process` per prompt, which is
the request's only check against the tokenizer and the engine's limits. What it returns the engine
trusts."""

from __future__ import annotations

from dataclasses import dataclass, replace

from paxserve.core.interface import EngineCoreRequest
from paxserve.engine.input_processor import InputProcessor
from paxserve.sampling_params import RequestError, RequestOutputKind
from paxserve.server.errors import from_value_error
from paxserve.server.generation_spec import GenerationSpec


@dataclass(slots=True)
class PromptInput:
    text: str | None  # the prompt as text (echo); None when the model has no tokenizer
    request: EngineCoreRequest

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_token_ids


def process_prompts(inputs: InputProcessor, spec: GenerationSpec, server_chat_template: str | None,
                    run_id: str, arrival: float) -> list[PromptInput]:
    """One engine request per prompt of `spec` (one for chat), ids `{run_id}-{i}`, streaming deltas.
    Raises ProtocolError naming the client's field."""
    params = replace(spec.params, output_kind=RequestOutputKind.DELTA)
    try:
        if spec.kind == "chat":
            text = inputs.render_chat(spec.messages, chat_template=spec.chat_template or server_chat_template,
                                      add_generation_prompt=spec.add_generation_prompt,
                                      continue_final_message=spec.continue_final_message,
                                      tools=spec.tools, template_kwargs=spec.chat_template_kwargs)
            prompts: list[str | list[int]] = [text]
        else:
            prompts = spec.prompts
        out = []
        for i, prompt in enumerate(prompts):
            request = inputs.process(f"{run_id}-{i}", prompt, params, cache_salt=spec.cache_salt, arrival_time=arrival,
                                     add_special_tokens=spec.add_special_tokens, prompt_param=spec.prompt_param,
                                     lora_request=spec.lora_request, priority=spec.priority)
            text = request.prompt
            if text is None and spec.echo and inputs.tokenizer is not None:
                text = inputs.tokenizer.decode(request.prompt_token_ids)
            out.append(PromptInput(text, request))
        return out
    except RequestError as e:
        raise from_value_error(e, spec.prompt_param, spec.renames()) from None
