"""LoRA adapters through a real `paxserve serve` on the bundled SmolLM2, spoken to by the openai
client as vLLM's users do: adapters are models (listed with their base as `parent`), a request's
`model` runs its adapter (PEFT's greedy tokens), adapters load and unload at run time, and unknown
or unusable adapters get vLLM's 404 and 400s while everything else goes on."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.helpers import SMOLLM2_LORA_SHAPES, load_hf_smollm2, write_random_lora
from tests.server.conftest import SMALL_ARGS, ServerProcess, assert_error, start_server

# transformers' own notice while PEFT wraps its model (not paxserve's concern).
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
BASE = "smol"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # served as this too: adapters trained on another base are refused
PROMPT = "The capital of France is"
ATTENTION = {k: SMOLLM2_LORA_SHAPES[k] for k in ("q_proj", "v_proj")}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smol-loras")
    return {"every": write_random_lora(root / "every", 30, SMOLLM2_LORA_SHAPES, 8, seed=1, scale=0.5, base_model=HUB_ID),
            "attn": write_random_lora(root / "attn", 30, ATTENTION, 4, seed=2),
            "wide": write_random_lora(root / "wide", 30, ATTENTION, 16, seed=3),
            "other-base": write_random_lora(root / "other", 30, ATTENTION, 4, seed=4, base_model="org/other-model")}


@pytest.fixture(scope="module")
def server(adapters: dict[str, Path]) -> ServerProcess:
    srv = start_server([*SMALL_ARGS, "--served-model-name", BASE, HUB_ID, "--enable-lora", "--max-loras", "2",
                        "--max-lora-rank", "8", "--lora-modules", f"every={adapters['every']}",
                        json.dumps({"name": "attn", "path": str(adapters["attn"]), "base_model_name": HUB_ID}),
                        "--allow-runtime-lora-updating"])
    yield srv
    srv.stop()


def peft_tokens(path: Path | None, n: int) -> list[int]:
    import torch
    from peft import PeftModel

    hf, tok = load_hf_smollm2()
    model = hf if path is None else PeftModel.from_pretrained(hf, str(path))
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    finally:
        if path is not None:
            model.unload()  # the shared transformers model back as it was
    return out[0, ids.shape[1]:].tolist()


def test_adapters_are_models_and_each_runs_its_own_weights(server: ServerProcess, adapters: dict[str, Path]) -> None:
    client = server.client()
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [BASE, HUB_ID, "every", "attn"]
    # The served model's first name, or the base the JSON form names.
    assert cards["every"].model_extra["parent"] == BASE and cards["attn"].model_extra["parent"] == HUB_ID
    assert cards[BASE].model_extra["parent"] is None
    assert client.models.retrieve("attn").id == "attn"
    outs = {model: client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
            for model in (BASE, "every", "attn")}
    _, tok = load_hf_smollm2()
    assert tok.decode(peft_tokens(adapters["every"], 8)) == outs["every"]  # every projection adapted
    assert len(set(outs.values())) == 3
    chat = client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "attn" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    info = [s for s in server.metrics() if s[0] == "paxserve:lora_requests_info"]
    assert len(info) == 1 and 'max_lora="2"' in info[0][1]


def test_adapters_load_and_unload_at_run_time(server: ServerProcess, adapters: dict[str, Path]) -> None:
    client = server.client()
    before = client.completions.create(model="every", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    resp = server.post("/v1/load_lora_adapter", {"lora_name": "again", "lora_path": str(adapters["every"])})
    assert resp.status == 200 and "again" in resp.text
    assert [m.id for m in client.models.list().data][-1] == "again"
    assert client.completions.create(model="again", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text \
        == before
    assert_error(server.post("/v1/load_lora_adapter", {"lora_name": "again", "lora_path": str(adapters["attn"])}),
                 400, mentions="already been loaded")
    # The refusals below arrive while a request streams with an adapter: it runs on untouched.
    stream = client.completions.create(model="every", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    chunks = iter(stream)
    streamed = next(chunks).choices[0].text
    for name, path, words in (("wide", adapters["wide"], "rank 16"), ("gone", adapters["every"].parent / "missing",
                                                                      "adapter_config.json"),
                              ("other", adapters["other-base"], "org/other-model"), (BASE, adapters["attn"], "base")):
        assert_error(server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}), 400,
                     mentions=words)
    assert_error(server.post("/v1/load_lora_adapter", {"lora_name": "x"}), 400, param="lora_path")
    streamed += "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == client.completions.create(model="every", prompt=PROMPT, max_tokens=24,
                                                 temperature=0).choices[0].text
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "again"}).status == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="again", prompt=PROMPT, max_tokens=2)
    assert_error(server.post("/v1/unload_lora_adapter", {"lora_name": "again"}), 404, mentions="cannot be found")
    # Nothing else was disturbed: the adapters served from the start still run, and every block came back.
    assert client.completions.create(model="every", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text \
        == before
    server.wait_idle()
