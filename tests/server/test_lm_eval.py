"""lm-evaluation-harness itself (`lm_eval.simple_evaluate` with its `local-completions` model) run
against the shared server on two tiny local tasks, offline: a multiple-choice task (loglikelihood,
scored from `echo` + `logprobs`) and a generate_until task (stop at a newline). lm-eval finds the
server's tokenizer through /tokenizer_info and /tokenize, so it needs no local tokenizer files. Every
loglikelihood it reports is checked against transformers' log-softmax on the same model, and every
generation against transformers' greedy answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import API_KEY, MODEL_NAME

QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " a banana"], 0),
    ("Two plus two equals", [" four", " seven", " the moon"], 0),
    ("The opposite of hot is", [" purple", " cold", " seventeen"], 1),
    ("Water freezes at zero degrees", [" Celsius", " Tuesday", " inches"], 0),
]
COMPLETIONS = [("Question: What is the capital of Italy?\nAnswer:", " Rome"),
               ("Question: What colour is the sky on a clear day?\nAnswer:", " Blue"),
               ("Question: How many legs does a cat have?\nAnswer:", " Four")]
MAX_GEN_TOKS = 8


def _write_tasks(root: Path) -> None:
    """Two lm-eval task configs over local JSONL files (datasets' `json` builder; its cache in `root`)."""
    mc, gen = root / "mc.jsonl", root / "gen.jsonl"
    mc.write_text("".join(json.dumps({"q": q, "choices": c, "label": a}) + "\n" for q, c, a in QUESTIONS))
    gen.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in COMPLETIONS))
    cache = root / "datasets_cache"
    common = "dataset_path: json\ntest_split: train\n"
    (root / "paxserve_mc.yaml").write_text(
        f"task: paxserve_mc\n{common}dataset_kwargs:\n  data_files: {{train: {mc}}}\n  cache_dir: {cache}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
        "target_delimiter: ''\nmetric_list:\n  - metric: acc\n")
    (root / "paxserve_gen.yaml").write_text(
        f"task: paxserve_gen\n{common}dataset_kwargs:\n  data_files: {{train: {gen}}}\n  cache_dir: {cache}\n"
        "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\ntarget_delimiter: ''\n"
        f"generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def lm_eval_results(server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lm_eval")
    _write_tasks(root)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(name, "1")
        mp.setenv("HF_HOME", str(root / "hf_home"))
        mp.setenv("OPENAI_API_KEY", API_KEY)  # local-completions sends it as the bearer token
        import lm_eval
        from lm_eval.tasks import TaskManager

        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model={MODEL_NAME},base_url={server.url}/v1/completions,num_concurrent=1,max_retries=1",
            tasks=["paxserve_mc", "paxserve_gen"], task_manager=TaskManager(include_path=str(root)),
            log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    return results


def _token_ids(server, text: str) -> list[int]:
    return server.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_lm_eval_loglikelihoods_equal_transformers(lm_eval_results, hf_smollm2, server, report) -> None:
    import torch

    model, _ = hf_smollm2
    samples = sorted(lm_eval_results["samples"]["paxserve_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(QUESTIONS)
    worst, correct = 0.0, 0
    for sample, (question, choices, label) in zip(samples, QUESTIONS):
        got = [tuple(r) for r in sample["filtered_resps"]]  # (loglikelihood, is_greedy) per choice
        assert len(got) == len(choices)
        for (loglik, is_greedy), choice in zip(got, choices):
            context, whole = _token_ids(server, question), _token_ids(server, question + choice)
            assert whole[:len(context)] == context, "the continuation starts a new token here"
            with torch.no_grad():
                logits = model(torch.tensor([whole]), attention_mask=torch.ones(1, len(whole), dtype=torch.long)).logits[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            continuation = range(len(context), len(whole))
            expected = sum(float(logprobs[j - 1, whole[j]]) for j in continuation)
            greedy = all(int(logprobs[j - 1].argmax()) == whole[j] for j in continuation)
            assert loglik == pytest.approx(expected, abs=2e-3 * len(continuation)), (question, choice)
            assert is_greedy == greedy, (question, choice)
            worst = max(worst, abs(loglik - expected))
        correct += int(np.argmax([g[0] for g in got]) == label)
    assert lm_eval_results["results"]["paxserve_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))
    report(f"lm-eval local-completions: {len(QUESTIONS) * 3} loglikelihoods within {worst:.1e} of transformers, "
           f"acc {correct}/{len(QUESTIONS)}")


def test_lm_eval_generations_equal_transformers_greedy(lm_eval_results, hf_smollm2, server) -> None:
    import torch

    model, _ = hf_smollm2
    samples = sorted(lm_eval_results["samples"]["paxserve_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == len(COMPLETIONS)
    matches = 0
    for sample, (question, answer) in zip(samples, COMPLETIONS):
        ids = _token_ids(server, question)
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_GEN_TOKS, do_sample=False, eos_token_id=None, pad_token_id=0)
        new = ref[0, len(ids):].tolist()
        new = new[:new.index(model.config.eos_token_id)] if model.config.eos_token_id in new else new
        # lm-eval stops at "\n" (and the end-of-sequence token); the server leaves the stop string out.
        expected = server.post("/detokenize", {"tokens": new}).json()["prompt"].split("\n")[0]
        (got,) = sample["resps"][0]
        assert got == expected and "\n" not in got, question
        matches += int(got.strip() == answer.strip())
    assert lm_eval_results["results"]["paxserve_gen"]["exact_match,none"] == pytest.approx(matches / len(COMPLETIONS))


def test_tokenizer_info_names_the_special_tokens_and_template(server) -> None:
    resp = server.get("/tokenizer_info", auth=False)
    assert resp.status == 200, resp
    info = resp.json()
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    assert info["model_max_length"] == 512 and info["tokenizer_class"]
