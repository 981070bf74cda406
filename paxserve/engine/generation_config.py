"""A checkpoint's `generation_config.json` as default sampling settings, with vLLM's rules.

vLLM (`--generation-config`, `ModelConfig.get_diff_sampling_param`) takes these fields of the file
as the defaults of requests that do not set them, and nothing else:

    temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens (-> max_tokens)

`do_sample` is not among them: vLLM ignores it, so a file with `do_sample: false` and
`temperature: 0.6` samples at 0.6 (send temperature=0 for greedy). Fields set to null are skipped.
Modes: "auto" (the model's own file), "vllm" (no file: paxserve's defaults) or a directory that
holds a `generation_config.json` (a path to the .json file itself is accepted too).

Host-side and JAX-free. Invalid files raise ValueError naming the file, the field and the range.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from paxserve.sampling_params import SamplingParams

GENERATION_CONFIG_MODES = ("auto", "vllm")  # anything else is a directory
FILE_NAME = "generation_config.json"
# (file field, SamplingParams field, kind) in vLLM's order.
_FIELDS = (
    ("repetition_penalty", "repetition_penalty", float),
    ("temperature", "temperature", float),
    ("top_k", "top_k", int),
    ("top_p", "top_p", float),
    ("min_p", "min_p", float),
    ("max_new_tokens", "max_tokens", int),
)
IGNORE_HINT = "fix the file, or start with --generation-config vllm to ignore it"


def generation_config_file(directory: str | Path) -> Path:
    """`<directory>/generation_config.json` (or `directory` itself when it is a .json file)."""
    path = Path(directory).expanduser()
    if path.is_file() and path.suffix == ".json":
        return path
    if not path.is_dir():
        raise ValueError(f"--generation-config {str(directory)!r} is not 'auto', 'vllm' or a local directory "
                         f"holding {FILE_NAME} (paxserve has no model hub access)")
    file = path / FILE_NAME
    if not file.is_file():
        raise ValueError(f"--generation-config {str(directory)!r}: the directory has no {FILE_NAME}")
    return file


def read_generation_config(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, not a JSON {type(data).__name__}")
    return data


def sampling_defaults(generation_config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The file's sampling fields under SamplingParams' names (max_new_tokens -> max_tokens),
    each checked against SamplingParams' ranges. `source` names the file in errors."""
    defaults: dict[str, Any] = {}
    for file_name, name, kind in _FIELDS:
        value = original = generation_config.get(file_name)
        if value is None:
            continue
        if isinstance(value, float) and kind is int and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                kind is int and not isinstance(value, int)) or not math.isfinite(value):
            raise ValueError(f"{source}: {file_name}={json.dumps(value)} is invalid: must be "
                             f"{'an integer' if kind is int else 'a number'} ({IGNORE_HINT})")
        value = kind(value)
        if name == "max_tokens":
            if value < 1:
                raise ValueError(f"{source}: max_new_tokens={value} is invalid: must be an integer >= 1 "
                                 f"({IGNORE_HINT})")
        else:
            try:
                SamplingParams(**{name: value})
            except ValueError as e:  # "SamplingParams.top_p=2.0 is invalid: must be in (0, 1]"
                allowed = str(e).split(" is invalid: ", 1)[-1]
                raise ValueError(f"{source}: {file_name}={json.dumps(original)} is invalid: {allowed} "
                                 f"({IGNORE_HINT})") from None
        defaults[name] = value
    return defaults


def resolve_sampling_defaults(mode: str, model_generation_config: Mapping[str, Any],
                              model_source: str) -> tuple[dict[str, Any], str | None]:
    """(defaults, the start-up log line or None when there are none) for a --generation-config
    mode. "auto" uses the model's generation config (`model_source` is its checkpoint path)."""
    if mode == "vllm":
        return {}, None
    if mode == "auto":
        source = str(Path(model_source) / FILE_NAME) if Path(model_source).is_dir() else model_source
        config: Mapping[str, Any] = model_generation_config
    else:
        file = generation_config_file(mode)
        source, config = str(file), read_generation_config(file)
    defaults = sampling_defaults(config, source)
    return defaults, (describe_defaults(defaults, source, config) if defaults else None)


def describe_defaults(defaults: Mapping[str, Any], source: str, generation_config: Mapping[str, Any]) -> str:
    """The start-up log line, in plain words."""
    parts = [f"{k}={v}" + (" (from max_new_tokens)" if k == "max_tokens" else "") for k, v in defaults.items()]
    note = ""
    if generation_config.get("do_sample") is False and defaults.get("temperature", 1.0) != 0:
        note = "; its do_sample=false is ignored, as in vLLM: requests sample unless they send temperature=0"
    return (f"sampling defaults from {source}: {', '.join(parts)} (requests override them; "
            f"--generation-config vllm ignores the file{note})")


def default_sampling_params(defaults: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams for a request that brings none (vLLM's LLM.get_default_sampling_params).
    A file's max_new_tokens becomes max_tokens=None: the input processor then takes the smaller of
    it and the room left in the context (see InputProcessor.resolve_max_tokens)."""
    fields = {k: v for k, v in defaults.items() if k != "max_tokens"}
    if "max_tokens" in defaults:
        fields["max_tokens"] = None
    return SamplingParams(**fields)
