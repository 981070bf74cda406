"""What the HTTP layer needs to know besides the engine: names, limits and policies from the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MiB = 2**20


@dataclass(slots=True)
class ServerSettings:
    served_model_names: list[str] = field(default_factory=lambda: [DEFAULT_MODEL_NAME])
    model_root: str | None = None  # the checkpoint path, shown as `root` in /v1/models
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on /v1/* when set
    max_logprobs: int = 20
    # 429 once more than this many sequences would wait for a batch slot (None: no limit).
    max_num_queued_reqs: int | None = None
    chat_template: str | None = None  # overrides the model's own template
    # A request's own `chat_template` runs arbitrary Jinja on the server: refused unless trusted.
    trust_request_chat_template: bool = False
    max_stop_strings: int = 32  # more stop strings in one request is a 400
    body_timeout_s: float = 30.0  # a request body must arrive within this once its headers have
    log_requests: bool = False
    # Filled from the engine by create_app when left None.
    max_model_len: int | None = None
    vocab_size: int | None = None
    max_num_seqs: int | None = None
    # The model's default sampling settings (--generation-config), SamplingParams' names: a request
    # that leaves temperature, top_p, top_k, min_p or repetition_penalty out of its body gets these.
    sampling_defaults: dict[str, Any] | None = None
    # Tool calling with tool_choice "auto": the model's own call format is parsed (vLLM's flags).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # splits <think> text into the message's `reasoning`
    # GET /tokenizer_info (vLLM's, opt-in there too since it shows the chat template): lets
    # lm-evaluation-harness' local-completions tokenize through the server, with no local files.
    enable_tokenizer_info_endpoint: bool = False
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details (cached prompt tokens).
    enable_prompt_tokens_details: bool = False
    # vLLM's --return-tokens-as-token-ids: logprobs name tokens "token_id:{id}" unless a request says not.
    return_tokens_as_token_ids: bool = False
    # The Responses API's store (previous_response_id, GET /v1/responses/{id}): off unless asked.
    enable_response_store: bool = False
    response_store_size: int = 1000
    # LoRA adapters served by name (paxserve.server.lora.LoraModules), with --enable-lora.
    lora_modules: Any = None

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("ServerSettings.served_model_names must name at least one model")
        if self.max_logprobs < -1:
            raise ValueError(f"ServerSettings.max_logprobs={self.max_logprobs} must be >= 0, or -1 for no limit")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 0:
            raise ValueError(f"ServerSettings.max_num_queued_reqs={self.max_num_queued_reqs} must be >= 0")
        if self.max_stop_strings < 0:
            raise ValueError(f"ServerSettings.max_stop_strings={self.max_stop_strings} must be >= 0")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral)")
        if self.response_store_size < 1:
            raise ValueError(f"ServerSettings.response_store_size={self.response_store_size} must be >= 1")
        if not self.body_timeout_s > 0:
            raise ValueError(f"ServerSettings.body_timeout_s={self.body_timeout_s} must be > 0 seconds")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def response_model(self, requested: str | None) -> str:
        """The name echoed in responses: the one the client asked for when it is one of ours."""
        return requested if requested is not None and (requested in self.served_model_names or self.lora(requested)) \
            else self.model_name

    def lora(self, name: str | None) -> Any:
        """The LoRARequest of the adapter served as `name`, if any."""
        return None if self.lora_modules is None else self.lora_modules.get(name)

    @property
    def client_max_size(self) -> int:
        """Body limit: a full max_model_len of token ids (up to ~16 bytes each in JSON) must fit."""
        return max(MiB, (self.max_model_len or 0) * 16 + 64 * 1024)
