"""One engine over two processes on this machine (2 simulated CPU devices each, loopback, gloo):
JAX's multi-controller runtime with a 4-device mesh, rank 0 scheduling and rank 1 running its plan.
Its tokens are a single process's at tensor parallel 4 and transformers' (greedy rows), for a dense
Llama and a Mixtral MoE; with speculation on (n-gram, a draft model, an EAGLE-3 head) they stay the
plain run's, rank 1 replaying the drafter's passes too. Also the start-up rendezvous alone: a
missing, doubled or mismatched rank is named."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from paxserve import Engine
from paxserve.config import ClusterConfig
from paxserve.config import EngineConfig
from paxserve.distributed.cluster import Cluster
from paxserve.distributed.rendezvous import Rendezvous, RendezvousError, settings_digest
from tests.helpers import make_tiny_llama
from tests.models.family_checkpoints import make_family_checkpoint
from tests.paxserve.test_eagle3 import TorchHead, write_head
from tests.paxserve.multihost_args import (
    ENGINE_ARGS,
    GREEDY_ROWS,
    PROMPTS,
    STEPS,
    logprob_rows,
    sampling_params,
)

PROBE = Path(__file__).with_name("multihost_probe.py")
RUN_TIMEOUT_S = 300


def _free_port() -> int:
    """A free port whose successor is free too (JAX's coordination service takes it)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two free neighbouring ports")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    root = tmp_path_factory.mktemp("multihost")
    (root / "llama").mkdir()
    (root / "mixtral").mkdir()
    return {"llama": (make_tiny_llama(root / "llama", seed=3, num_key_value_heads=2), root / "llama"),
            "mixtral": (make_family_checkpoint("mixtral", root / "mixtral", seed=4), root / "mixtral")}


@pytest.fixture(scope="module")
def head(models: dict[str, tuple[Any, Path]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random EAGLE-3 head for the llama (the speculative runs' target), half its draft vocabulary
    on the llama's most frequent greedy token, so that some proposals are accepted."""
    hf, _ = models["llama"]
    with torch.no_grad():
        greedy = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
                  for p in PROMPTS]
    common = int(np.bincount(torch.cat(greedy).numpy()).argmax())
    return write_head(tmp_path_factory.mktemp("multihost-head"), 11, 96, common, vocab=hf.config.vocab_size)


@pytest.fixture(scope="module")
def loras(models: dict[str, tuple[Any, Path]], tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, Any]]:
    """Two PEFT adapters of the llama, of ranks 8 and 4 (with rsLoRA and patterns)."""
    from tests.models.test_lora import ADAPTERS, write_adapter

    root = tmp_path_factory.mktemp("multihost-loras")
    return [write_adapter(models["llama"][0], root / f"a{i}", seed=60 + i, **ADAPTERS[i]) for i in range(2)]


@pytest.fixture(scope="module")
def two_ranks(models: dict[str, tuple[Any, Path]], head: Path, loras: list[tuple[Path, Any]],
              tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both ranks' reports of the engines they ran, one after the other."""
    out = tmp_path_factory.mktemp("multihost-out") / "out"
    port = _free_port()
    command = [sys.executable, str(PROBE), "RANK", str(port), str(out), str(head), ",".join(str(p) for p, _ in loras),
               *(str(d) for _, d in models.values())]
    procs = [subprocess.Popen([*command[:2], str(rank), *command[3:]], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace") for rank in (0, 1)]
    logs = [""] * 2

    def drain(i: int) -> None:
        logs[i] = procs[i].stdout.read()  # type: ignore[union-attr]

    readers = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(2)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
    for reader in readers:
        reader.join(timeout=10)
    codes = [p.wait() for p in procs]
    assert codes == [0, 0], f"exit codes {codes}\n--- rank 0\n{logs[0][-6000:]}\n--- rank 1\n{logs[1][-4000:]}"
    return [json.loads(out.with_suffix(f".rank{rank}.json").read_text()) | {"log": logs[rank]} for rank in (0, 1)]


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_two_processes_give_a_single_process_tokens_at_tp_4_and_transformers(
        family: str, models: dict[str, tuple[Any, Path]], two_ranks: list[dict], report) -> None:
    hf, directory = models[family]
    rank0, rank1 = two_ranks
    assert rank0["devices"] == 4 and rank0["local"] == 2
    got = rank0["models"][str(directory)]
    # The mesh takes rank 0's two devices, then rank 1's: tensor parallelism inside a host first.
    assert [p for p, _ in got["mesh"]] == [0, 0, 1, 1]
    assert got["kv_blocks"] == ENGINE_ARGS["num_gpu_blocks_override"]
    assert got["blocks_free"] == got["kv_blocks"] - 1  # every block came back
    assert rank1["models"][str(directory)]["worker_steps"] >= STEPS

    single = Engine(str(directory), **ENGINE_ARGS)
    outs = single.generate(PROMPTS, sampling_params(), use_tqdm=False)
    assert got["tokens"] == [o.outputs[0].token_ids for o in outs]
    want_logprobs = logprob_rows(outs[1])
    assert len(got["logprobs"]) == STEPS + len(PROMPTS[1]) - 1
    assert np.allclose(np.concatenate(got["logprobs"]), np.concatenate(want_logprobs), atol=1e-4)
    assert sorted(map(list, single.runner.compiled)) == got["buckets"]
    for row in GREEDY_ROWS:
        prompt = PROMPTS[row]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got["tokens"][row] == ref[0, len(prompt):].tolist()
    report(f"{family}: 2 processes x 2 devices = a single process at TP 4 for {len(PROMPTS)} requests "
           f"(greedy, penalised, seeded; logprobs within 1e-4), = transformers on the greedy ones")


def test_two_processes_verify_ngram_proposals_and_give_plain_decodings_tokens(
        models: dict[str, tuple[Any, Path]], two_ranks: list[dict], report) -> None:
    """Speculation over two hosts with async scheduling: rank 0 proposes and plans, both ranks run
    the verifying steps; tokens and logprobs are the plain run's, and every block comes back."""
    rank0, rank1 = two_ranks
    plain, spec = rank0["models"][str(models["llama"][1])], rank0["models"]["spec"]
    assert spec["tokens"] == plain["tokens"]
    assert np.allclose(np.concatenate(spec["logprobs"]), np.concatenate(plain["logprobs"]), atol=1e-4)
    assert spec["drafts"] > 4 and 0 < spec["accepted"] < spec["draft_tokens"], spec
    assert spec["blocks_free"] == spec["kv_blocks"] - 1
    assert rank1["models"]["spec"]["worker_steps"] > 0
    report(f"n-gram speculation over 2 processes: {spec['accepted']} of {spec['draft_tokens']} proposed tokens "
           f"accepted in {spec['drafts']} drafts, tokens and logprobs the plain run's")


@pytest.mark.parametrize("drafter", ["draft", "eagle3"])
def test_two_processes_run_a_drafters_passes_and_give_plain_decodings_tokens(
        drafter: str, models: dict[str, tuple[Any, Path]], head: Path, two_ranks: list[dict], report) -> None:
    """A draft model (the llama as its own) and an EAGLE-3 head over two hosts: rank 0 publishes each
    drafter pass and rank 1 replays it between the steps (the draft's collectives meet; the head
    reads the target steps' hidden states on both). Tokens and logprobs are the plain run's, and
    every proposal is what the drafter proposes in one process: the target's own greedy tokens
    for the draft model, the torch reference head's for EAGLE-3."""
    rank0, rank1 = two_ranks
    hf, directory = models["llama"]
    plain, spec = rank0["models"][str(directory)], rank0["models"][drafter]
    assert spec["tokens"] == plain["tokens"]
    assert np.allclose(np.concatenate(spec["logprobs"]), np.concatenate(plain["logprobs"]), atol=1e-4)
    assert spec["blocks_free"] == spec["kv_blocks"] - 1
    assert rank1["models"][drafter]["worker_steps"] > 0
    # The worker ran the drafter's passes too (compiled the same programs for them).
    assert rank1["models"][drafter]["drafter_programs"] == spec["drafter_programs"] > 0
    proposals = spec["proposals"]
    assert len(proposals) >= 4
    if drafter == "draft":
        for tokens, proposal in proposals:
            with torch.no_grad():
                ref = hf.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                                  max_new_tokens=len(proposal), do_sample=False, eos_token_id=None, pad_token_id=0)
            assert proposal == ref[0, len(tokens):].tolist(), tokens
    else:
        assert spec["head_cache_devices"] == 4  # whole on each device of both hosts
        reference = TorchHead(head, hf)
        for tokens, proposal in proposals:
            assert proposal == reference.proposals(tokens, len(proposal)), tokens
    if drafter == "draft":
        assert spec["accepted"] > 0, spec
    else:
        # Each request drafts again after a rejected draft (the probe turns the back-off's pauses off;
        # the engine's acceptance rate of 0 then stops the plan): its later proposals follow a
        # catch-up over a verified step whose rejected positions were left out.
        assert spec["drafts"] >= 2 * len(PROMPTS), spec
    report(f"{drafter} over 2 processes: {spec['accepted']} of {spec['draft_tokens']} proposed tokens accepted in "
           f"{spec['drafts']} drafts; {len(proposals)} proposals equal one process's reference; tokens and logprobs "
           "the plain run's")


# ---- the start-up rendezvous (no JAX: plain sockets) ------------------------------------------------

def _meet_all(ranks: list[int], nnodes: int, digests: dict[int, str], timeout: float = 2.0) -> dict[int, str]:
    """Run the given ranks' rendezvous side by side; each rank's outcome ("ok" or the error)."""
    port = _free_port()
    outcomes: dict[int, str] = {}

    def run(rank: int) -> None:
        try:
            config = ClusterConfig(nnodes, rank, "127.0.0.1", port, init_timeout_s=timeout)
            Rendezvous(config).meet(digests.get(rank, digests[0]))
            outcomes[rank] = "ok"
        except RendezvousError as e:
            outcomes[rank] = str(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout + 40)
    return outcomes


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_two_processes_serve_lora_adapters_sharing_a_slot(models: dict[str, tuple[Any, Path]],
                                                           loras: list[tuple[Path, Any]], two_ranks: list[dict],
                                                           report) -> None:
    """Two adapters and the base model over two hosts with one device slot: rank 1 replays every
    slot write rank 0 makes (the slots split over all 4 devices), and each request's greedy tokens
    are transformers + PEFT's."""
    rank0, rank1 = (r["models"]["lora"] for r in two_ranks)
    assert rank0["lora_writes"] == 2 and rank1["lora_writes"] == 2  # A, then B once A's requests are done
    assert rank0["blocks_free"] == rank0["kv_blocks"] - 1
    base = models["llama"][0]
    for prompt, model, got in zip(PROMPTS, [loras[0][1], loras[1][1], base, loras[0][1]], rank0["tokens"]):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == ref[0, len(prompt):].tolist()
    report(f"LoRA over 2 hosts: 2 adapters + the base through 1 slot ({rank0['lora_writes']} writes, replayed by "
           "rank 1) = transformers + PEFT")


def test_rendezvous_names_the_rank_that_never_came() -> None:
    outcomes = _meet_all([0, 1], nnodes=3, digests={0: settings_digest({"block_size": 16})})
    assert "node rank(s) 2 of 3 did not join within 2s" in outcomes[0]
    assert "rank 0 refused to start" in outcomes[1] and "node rank(s) 2" in outcomes[1]


def test_rendezvous_names_a_rank_started_with_other_settings() -> None:
    ours, theirs = settings_digest({"block_size": 16, "dtype": "auto"}), settings_digest({"block_size": 32,
                                                                                          "dtype": "auto"})
    outcomes = _meet_all([0, 1], nnodes=2, digests={0: ours, 1: theirs})
    assert "node rank 1" in outcomes[0] and "block_size: 32 vs 16" in outcomes[0] and "dtype" not in outcomes[0]
    assert outcomes[1].startswith("rank 0 refused to start")


def test_rendezvous_without_rank_0_fails_in_time_naming_it() -> None:
    start = time.monotonic()
    outcomes = _meet_all([1], nnodes=2, digests={0: "x"}, timeout=1.0)
    assert "rank 0 did not answer at 127.0.0.1:" in outcomes[1] and time.monotonic() - start < 10


def test_multi_host_settings_are_checked_before_anything_starts() -> None:
    with pytest.raises(ValueError, match=r"node_rank must be in \[0, 1\] for nnodes=2, got 2"):
        EngineConfig(nnodes=2, node_rank=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size.*multiple of nnodes"):
        EngineConfig(nnodes=2, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="master_port"):
        ClusterConfig(nnodes=2, master_port=65535)
    assert EngineConfig(nnodes=2, tensor_parallel_size=4).shared_settings()["tensor_parallel_size"] == 4


# ---- liveness (the heartbeat watcher over a stand-in for the coordination service's store) ---------

class _Store:
    """The key-value calls the heartbeats make, in memory; `down` makes every call fail as an
    unreachable service does."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.down = False

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        self.values[key] = value

    def key_value_try_get(self, key: str) -> str:
        if self.down:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]


def _watch(rank: int, store: _Store, timeout: float = 1.0) -> tuple[Cluster, list[Exception], threading.Event]:
    lost: list[Exception] = []
    called = threading.Event()
    cluster = Cluster(ClusterConfig(nnodes=2, node_rank=rank, heartbeat_timeout_s=timeout), store,
                      on_lost=lambda e: (lost.append(e), called.set()))
    return cluster, lost, called


def test_rank_0_gives_up_on_a_worker_whose_heartbeat_stops_and_only_then() -> None:
    store = _Store()
    cluster, lost, called = _watch(0, store)
    for beat in range(12):  # the worker beats for 1.2 s, longer than the timeout: no alarm
        store.key_value_set("paxserve/alive/1", str(beat))
        time.sleep(0.1)
    assert not called.is_set()
    stopped = time.monotonic()
    assert called.wait(5.0)  # then it stops (a dead or SIGSTOPped process)
    assert 0.9 < time.monotonic() - stopped < 3.0
    assert "node rank 1 stopped answering: no heartbeat" in str(lost[0]) and cluster.lost and len(lost) == 1
    assert store.values["paxserve/alive/0"]  # rank 0 beats too, for its workers


def test_a_worker_gives_up_when_rank_0s_store_cannot_be_reached() -> None:
    store = _Store()
    cluster, lost, called = _watch(1, store)
    store.key_value_set("paxserve/alive/0", "0")
    store.down = True
    assert called.wait(5.0)
    assert "coordination service on node rank 0 cannot be reached" in str(lost[0])
