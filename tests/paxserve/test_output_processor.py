"""OutputProcessor driven by hand-made engine-core outputs and the real bundled tokenizer (SmolLM2).

Each test encodes a sentence and feeds its ids to the processor as the engine core would: one
`SampleOutput` per sample per step. What is checked is what a client would see in the
`RequestOutput`s (text, token ids, logprobs, finish reasons) and what the core is told to do
(`samples_to_finish`, `requests_to_abort`).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from paxserve.core.interface import EngineCoreRequest, RequestOutputKind, SampledLogprobs, SampleOutput
from paxserve.engine.output_processor import OutputProcessor
from paxserve.outputs import RequestOutput
from paxserve.sampling_params import SamplingParams

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
# Plain words, a repeated "!", and an emoji that is split over three byte tokens (the first two
# render as nothing on their own).
SENTENCE = "Hello, world! The quick brown fox! Bye 👍 now."
OTHER = "Café au lait, 中文 ok."
EOS = 2


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def ids(tok):
    return tok.encode(SENTENCE, add_special_tokens=False)


@pytest.fixture(scope="module")
def other_ids(tok):
    return tok.encode(OTHER, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompt_ids(tok):
    return tok.encode("User said:", add_special_tokens=False)


def make_request(prompt_ids, request_id="r", **params) -> EngineCoreRequest:
    sp = SamplingParams(**{"max_tokens": 64, **params})
    return EngineCoreRequest(request_id=request_id, prompt="User said:", prompt_token_ids=list(prompt_ids),
                             sampling_params=sp, max_tokens=sp.max_tokens, eos_token_ids=(EOS,),
                             seeds=list(range(sp.n)))


def single_stream(token_ids, request_id="r", index=0, last_reason="length"):
    """Steps feeding one token each; the last step finishes the sample with `last_reason`."""
    return [[SampleOutput(request_id, index, [t], finish_reason=last_reason if i == len(token_ids) - 1 else None)]
            for i, t in enumerate(token_ids)]


def fake_logprobs(token: int, step: int, k: int, in_top: bool = True) -> SampledLogprobs:
    """Top-k rows with `token` at rank 2 (or absent), and distinct values per step."""
    lp = -0.25 - 0.01 * step
    alternatives = [100 + step, 200 + step, 300 + step, 400 + step]
    top = [alternatives[0], token, *alternatives[1:]] if in_top else alternatives
    values = [-0.1 - 0.01 * step, lp, -1.5, -2.0, -2.5] if in_top else [-0.1, -0.2, -0.3, -0.4]
    return SampledLogprobs(logprob=lp, top_token_ids=np.array(top[:max(k, 2)]),
                           top_logprobs=np.array(values[:max(k, 2)], dtype=np.float32))


def run(tok, request, steps):
    """Feeds `steps` (lists of SampleOutputs); returns (RequestOutputs, ProcessedOutputs per step)."""
    op = OutputProcessor(tok)
    op.add_request(request)
    outputs, processed = [], []
    for step in steps:
        result = op.process(step)
        processed.append(result)
        outputs.extend(result.request_outputs)
    return outputs, processed, op


def by_index(output: RequestOutput):
    return {c.index: c for c in output.outputs}


# ---- output kinds ----------------------------------------------------------------------------------------


def test_cumulative_outputs_are_snapshots_of_everything_so_far(tok, ids, prompt_ids):
    request = make_request(prompt_ids, output_kind=CUMULATIVE)
    op = OutputProcessor(tok)
    op.add_request(request)
    received: list[RequestOutput] = []
    copies: list[RequestOutput] = []
    for step in single_stream(ids):
        (out,) = op.process(step).request_outputs
        received.append(out)
        copies.append(copy.deepcopy(out))
    assert len(received) == len(ids)
    for i, out in enumerate(received):
        (c,) = out.outputs
        assert c.token_ids == ids[:i + 1]
        # A character split over tokens shows up only once complete; never a replacement char.
        full = tok.decode(ids[:i + 1])
        if "\ufffd" in full:
            assert full.startswith(c.text) and "\ufffd" not in c.text
        else:
            assert c.text == full
        assert out.finished == (i == len(ids) - 1)
        assert c.finish_reason == ("length" if i == len(ids) - 1 else None)
        assert out.request_id == "r" and out.prompt_token_ids == prompt_ids and out.prompt == "User said:"
    # Later steps did not change what was handed out earlier.
    assert received == copies
    assert received[-1].outputs[0].text == tok.decode(ids) == SENTENCE
    assert len(op) == 0  # finished requests are forgotten


def delta_script(ids, other_ids, with_logprobs=True):
    """n=2: sample 0 streams `ids`, sample 1 streams `other_ids`, but some steps only have sample 0
    (sample 1 is 'stalled'), and sample 1 finishes last."""
    steps, j = [], 0
    for i, t in enumerate(ids):
        step = [SampleOutput("r", 0, [t], logprobs=fake_logprobs(t, i, 2) if with_logprobs else None,
                             finish_reason="length" if i == len(ids) - 1 else None)]
        if i % 3 != 1 and j < len(other_ids) - 1:
            step.append(SampleOutput("r", 1, [other_ids[j]], logprobs=fake_logprobs(other_ids[j], 50 + j, 2)
                                     if with_logprobs else None))
            j += 1
        steps.append(step)
    steps.append([SampleOutput("r", 1, [other_ids[-1]], logprobs=fake_logprobs(other_ids[-1], 99, 2)
                               if with_logprobs else None, finish_reason="length")])
    return steps


def test_delta_outputs_hold_only_new_text_and_add_up_to_cumulative(tok, ids, other_ids, prompt_ids):
    steps = delta_script(ids, other_ids)
    deltas, _, _ = run(tok, make_request(prompt_ids, n=2, logprobs=2, output_kind=DELTA), steps)
    cumulative, _, _ = run(tok, make_request(prompt_ids, n=2, logprobs=2, output_kind=CUMULATIVE), steps)
    assert len(deltas) == len(steps)
    for step, out in zip(steps, deltas):
        # Only the samples this step touched are in the output, each with its own index.
        assert sorted(c.index for c in out.outputs) == sorted(s.sample_index for s in step)
        for c in out.outputs:
            (s,) = [s for s in step if s.sample_index == c.index]
            assert c.token_ids == s.new_token_ids
            assert len(c.logprobs) == 1 and s.new_token_ids[0] in c.logprobs[0]
    assert [o.finished for o in deltas] == [False] * (len(steps) - 1) + [True]

    final = by_index(cumulative[-1])
    for index, expected_text in ((0, SENTENCE), (1, OTHER)):
        mine = [c for out in deltas for c in out.outputs if c.index == index]
        assert "".join(c.text for c in mine) == final[index].text == expected_text
        assert [t for c in mine for t in c.token_ids] == final[index].token_ids
        assert [e for c in mine for e in c.logprobs] == final[index].logprobs
        assert mine[-1].cumulative_logprob == pytest.approx(final[index].cumulative_logprob)
        assert mine[-1].finish_reason == final[index].finish_reason == "length"
        assert all(c.finish_reason is None for c in mine[:-1])
    # The emoji's first byte tokens render as nothing: that step's delta has the token but no text.
    emoji_step = ids.index(tok.encode(" 👍", add_special_tokens=False)[0])
    (c0,) = [c for c in deltas[emoji_step].outputs if c.index == 0]
    assert c0.text == "" and c0.token_ids == [ids[emoji_step]]


def test_delta_outputs_are_not_changed_by_later_steps(tok, ids, other_ids, prompt_ids):
    request = make_request(prompt_ids, n=2, logprobs=2, output_kind=DELTA)
    op = OutputProcessor(tok)
    op.add_request(request)
    received, copies = [], []
    for step in delta_script(ids, other_ids):
        for out in op.process(step).request_outputs:
            received.append(out)
            copies.append(copy.deepcopy(out))
    assert received == copies


def test_final_only_emits_one_output_when_every_sample_finished(tok, ids, other_ids, prompt_ids):
    steps = delta_script(ids, other_ids)
    final_outputs, processed, _ = run(tok, make_request(prompt_ids, n=2, logprobs=2, output_kind=FINAL_ONLY), steps)
    # Sample 0 finished one step before the end: still nothing until sample 1 finished too.
    assert all(not p.request_outputs for p in processed[:-1])
    assert len(final_outputs) == 1
    (out,) = final_outputs
    cumulative, _, _ = run(tok, make_request(prompt_ids, n=2, logprobs=2, output_kind=CUMULATIVE), steps)
    assert out.finished
    assert out == cumulative[-1]
    assert by_index(out)[0].text == SENTENCE and by_index(out)[1].text == OTHER
    assert by_index(out)[0].token_ids == ids and by_index(out)[1].token_ids == other_ids


# ---- stop strings --------------------------------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_stop_string_ends_the_request_mid_stream(tok, ids, prompt_ids, include, kind):
    request = make_request(prompt_ids, stop=["xyz", " fox"], include_stop_str_in_output=include, output_kind=kind)
    op = OutputProcessor(tok)
    op.add_request(request)
    fox = ids.index(tok.encode(" fox", add_special_tokens=False)[0])
    outputs = []
    for i, t in enumerate(ids):
        result = op.process([SampleOutput("r", 0, [t])])
        outputs.extend(result.request_outputs)
        if i < fox:
            assert result.samples_to_finish == []
        elif i == fox:
            assert result.samples_to_finish == [request.sample_id(0)] == ["r"]
            assert result.requests_to_abort == []
        else:  # the core may still send a token from a step already under way: ignored
            assert result.request_outputs == [] and result.samples_to_finish == []
    assert len(outputs) == fox + 1
    last = outputs[-1].outputs[0]
    text = "".join(o.outputs[0].text for o in outputs) if kind == DELTA else last.text
    tokens = [t for o in outputs for t in o.outputs[0].token_ids] if kind == DELTA else last.token_ids
    assert text == ("Hello, world! The quick brown fox" if include else "Hello, world! The quick brown")
    assert tokens == ids[:fox + 1]
    assert outputs[-1].finished and last.finish_reason == "stop" and last.stop_reason == " fox"
    assert all(not o.finished for o in outputs[:-1])
    assert len(op) == 0


def test_stop_string_inside_a_token_cuts_the_text_there(tok, ids, prompt_ids):
    for include, expected in ((False, "Hello, world! The quick b"), (True, "Hello, world! The quick brow")):
        outputs, processed, _ = run(tok, make_request(prompt_ids, stop="row", include_stop_str_in_output=include),
                                    [[SampleOutput("r", 0, [t])] for t in ids[:8]])
        assert outputs[-1].finished
        assert outputs[-1].outputs[0].text == expected
        assert outputs[-1].outputs[0].stop_reason == "row"
        assert [p.samples_to_finish for p in processed].count(["r"]) == 1


def test_text_that_may_start_a_stop_string_is_held_back_in_deltas(tok, ids, prompt_ids):
    # " brown" could be the start of " brown cow": a stream must not show it until " fox" rules that out.
    brown = ids.index(tok.encode(" brown", add_special_tokens=False)[0])
    outputs, _, _ = run(tok, make_request(prompt_ids, stop=" brown cow", output_kind=DELTA), single_stream(ids))
    texts = [o.outputs[0].text for o in outputs]
    assert texts[brown] == ""
    assert texts[brown + 1] == " brown fox"
    assert "".join(texts) == SENTENCE
    assert outputs[-1].outputs[0].finish_reason == "length" and outputs[-1].outputs[0].stop_reason is None


def test_stop_string_in_one_of_n_samples_finishes_only_that_sample(tok, ids, other_ids, prompt_ids):
    request = make_request(prompt_ids, n=2, stop=" ok")
    op = OutputProcessor(tok)
    op.add_request(request)
    ok = other_ids.index(tok.encode(" ok", add_special_tokens=False)[0])
    last = None
    for i, t in enumerate(ids):
        step = [SampleOutput("r", 0, [t], finish_reason="length" if i == len(ids) - 1 else None)]
        if i < len(other_ids):
            step.append(SampleOutput("r", 1, [other_ids[i]]))
        result = op.process(step)
        assert result.samples_to_finish == (["r#1"] if i == ok else [])
        (last,) = result.request_outputs
        if ok <= i < len(ids) - 1:
            assert not last.finished
            assert by_index(last)[1].finish_reason == "stop"
    assert last.finished
    # Sample 1's token after the stop (".") was ignored.
    assert by_index(last)[1].text == "Café au lait, 中文"
    assert by_index(last)[1].token_ids == other_ids[:ok + 1]
    assert by_index(last)[1].stop_reason == " ok"
    assert by_index(last)[0].text == SENTENCE and by_index(last)[0].finish_reason == "length"


@pytest.mark.parametrize("min_tokens, expected", [(3, "Hello, world"), (4, "Hello, world! The quick brown fox")])
def test_stop_strings_count_only_after_min_tokens(tok, ids, prompt_ids, min_tokens, expected):
    # "!" completes with the 4th token: honoured when min_tokens=3 (4 > 3), ignored when min_tokens=4,
    # which leaves the second "!" (9th token) to stop it.
    assert tok.decode(ids[:4]) == "Hello, world!"
    outputs, processed, _ = run(tok, make_request(prompt_ids, stop="!", min_tokens=min_tokens),
                                [[SampleOutput("r", 0, [t])] for t in ids])
    (c,) = outputs[-1].outputs
    assert outputs[-1].finished and c.finish_reason == "stop" and c.stop_reason == "!"
    assert c.text == expected
    assert len(c.token_ids) == (4 if min_tokens == 3 else 9)


# ---- stop token ids, EOS, length -------------------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out_unless_asked(tok, ids, prompt_ids, include):
    bang = ids[3]  # "!"
    steps = [[SampleOutput("r", 0, [t])] for t in ids[:3]]
    steps.append([SampleOutput("r", 0, [bang], finish_reason="stop", stop_reason=bang)])
    for kind in (CUMULATIVE, DELTA):
        outputs, processed, _ = run(
            tok, make_request(prompt_ids, stop_token_ids=[bang], include_stop_str_in_output=include, output_kind=kind),
            steps)
        text = "".join(o.outputs[0].text for o in outputs) if kind == DELTA else outputs[-1].outputs[0].text
        tokens = ([t for o in outputs for t in o.outputs[0].token_ids] if kind == DELTA
                  else outputs[-1].outputs[0].token_ids)
        assert text == ("Hello, world!" if include else "Hello, world")
        assert tokens == ids[:4]
        c = outputs[-1].outputs[0]
        assert outputs[-1].finished and c.finish_reason == "stop" and c.stop_reason == bang
        # The core ended the sample itself: nothing for it to free.
        assert all(p.samples_to_finish == [] for p in processed)


def test_eos_text_is_left_out_even_when_special_tokens_are_shown(tok, ids, prompt_ids):
    steps = [[SampleOutput("r", 0, [t])] for t in ids[:3]] + [[SampleOutput("r", 0, [EOS], finish_reason="stop")]]
    outputs, _, _ = run(tok, make_request(prompt_ids, skip_special_tokens=False), steps)
    c = outputs[-1].outputs[0]
    assert c.text == "Hello, world" and c.token_ids == ids[:3] + [EOS]
    assert c.finish_reason == "stop" and c.stop_reason is None
    outputs, _, _ = run(tok, make_request(prompt_ids, skip_special_tokens=False, include_stop_str_in_output=True),
                        steps)
    assert outputs[-1].outputs[0].text == "Hello, world<|im_end|>"


def test_length_finish_on_the_token_that_completes_a_stop_string_reports_the_stop(tok, ids, prompt_ids):
    fox = ids.index(tok.encode(" fox", add_special_tokens=False)[0])
    outputs, processed, _ = run(tok, make_request(prompt_ids, stop=" fox"), single_stream(ids[:fox + 1]))
    c = outputs[-1].outputs[0]
    assert outputs[-1].finished
    assert c.finish_reason == "stop" and c.stop_reason == " fox"
    assert c.text == "Hello, world! The quick brown"
    assert c.token_ids == ids[:fox + 1]
    # The core already finished the sample (length): it must not be told to free it again.
    assert all(p.samples_to_finish == [] for p in processed)


def test_length_finish_releases_text_held_back_for_a_stop_string(tok, ids, prompt_ids):
    brown = ids.index(tok.encode(" brown", add_special_tokens=False)[0])
    outputs, _, _ = run(tok, make_request(prompt_ids, stop=" brown cow", output_kind=DELTA),
                        single_stream(ids[:brown + 1]))
    assert outputs[-2].outputs[0].text == " quick"
    assert outputs[-1].outputs[0].text == " brown"
    assert outputs[-1].outputs[0].finish_reason == "length"


# ---- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY])
def test_an_error_sample_output_fails_the_whole_request(tok, ids, other_ids, prompt_ids, kind):
    request = make_request(prompt_ids, n=3, output_kind=kind)
    op = OutputProcessor(tok)
    op.add_request(request)
    first = op.process([SampleOutput("r", i, [t]) for i, t in enumerate(ids[:3])])
    assert first.requests_to_abort == []
    result = op.process([SampleOutput("r", 0, [ids[3]]),
                         SampleOutput("r", 2, [], finish_reason="error", error="the step failed: out of memory")])
    assert result.requests_to_abort == ["r"]
    (out,) = result.request_outputs
    assert out.finished and out.error == "the step failed: out of memory"
    assert sorted(c.index for c in out.outputs) == [0, 1, 2]
    assert [c.finish_reason for c in out.outputs] == ["error"] * 3
    assert len(op) == 0
    # Anything still in flight for it is dropped.
    assert op.process([SampleOutput("r", 1, [ids[4]])]).request_outputs == []


def test_a_request_whose_processing_raises_fails_alone(tok, ids, other_ids, prompt_ids):
    poison = ids[5]  # " quick"; OTHER does not contain it
    assert poison not in other_ids

    class CrashingDecoder:
        """The real tokenizer, except that decoding the poison token raises."""

        backend_tokenizer = None  # no DecodeStream: every token is decoded here, where the poison raises

        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def decode(self, token_ids, **kwargs):
            if poison in list(token_ids):
                raise RuntimeError("secret internal detail")
            return self._inner.decode(token_ids, **kwargs)

    op = OutputProcessor(CrashingDecoder(tok))
    op.add_request(make_request(prompt_ids, "bad", n=2))
    op.add_request(make_request(prompt_ids, "good", output_kind=DELTA))
    seen_good = []
    for i in range(6):
        result = op.process([SampleOutput("bad", 0, [ids[i]]), SampleOutput("bad", 1, [ids[i]]),
                             SampleOutput("good", 0, [other_ids[i]])])
        outs = {o.request_id: o for o in result.request_outputs}
        seen_good.append(outs["good"].outputs[0].text)
        assert not outs["good"].finished and outs["good"].error is None
        if i < 5:
            assert result.requests_to_abort == [] and not outs["bad"].finished
    assert result.requests_to_abort == ["bad"]
    bad = outs["bad"]
    assert bad.finished and [c.finish_reason for c in bad.outputs] == ["error", "error"]
    assert bad.error and "secret" not in bad.error  # the client is told it failed, not the internals
    assert bad.outputs[0].text == "Hello, world! The"
    assert len(op) == 1
    # The other request goes on as if nothing happened.
    for t in other_ids[6:-1]:
        seen_good.append(op.process([SampleOutput("good", 0, [t])]).request_outputs[0].outputs[0].text)
    final = op.process([SampleOutput("good", 0, [other_ids[-1]], finish_reason="length")]).request_outputs[0]
    assert "".join(seen_good) + final.outputs[0].text == OTHER
    assert final.finished and final.outputs[0].finish_reason == "length"


# ---- logprobs --------------------------------------------------------------------------------------------


def test_logprobs_entries_and_cumulative_logprob(tok, ids, prompt_ids):
    k = 2
    steps = []
    for i, t in enumerate(ids[:6]):
        steps.append([SampleOutput("r", 0, [t], logprobs=fake_logprobs(t, i, k, in_top=i != 4),
                                   finish_reason="length" if i == 5 else None)])
    outputs, _, _ = run(tok, make_request(prompt_ids, logprobs=k), steps)
    c = outputs[-1].outputs[0]
    assert len(c.logprobs) == 6
    for i, (t, entry, step) in enumerate(zip(ids, c.logprobs, steps)):
        lp = step[0].logprobs
        sampled = entry[t]
        assert sampled.logprob == pytest.approx(lp.logprob)
        assert sampled.decoded_token == tok.decode([t])
        top = lp.top_token_ids.tolist()[:k]
        assert set(entry) == {t, *top}
        if i == 4:  # sampled outside the top k: rank unknown
            assert sampled.rank is None and len(entry) == k + 1
        else:  # sampled at rank 2: it is one of the top k
            assert sampled.rank == 2 and len(entry) == k
        for rank, tid in enumerate(top, start=1):
            if tid != t:
                assert entry[tid].rank == rank
                assert entry[tid].logprob == pytest.approx(float(lp.top_logprobs[rank - 1]))
                assert entry[tid].decoded_token == tok.decode([tid])
    assert c.cumulative_logprob == pytest.approx(sum(s[0].logprobs.logprob for s in steps))
    assert math.isfinite(c.cumulative_logprob)


def test_logprobs_zero_gives_the_sampled_token_only_and_none_gives_nothing(tok, ids, prompt_ids):
    steps = [[SampleOutput("r", 0, [t], logprobs=fake_logprobs(t, i, 2))] for i, t in enumerate(ids[:3])]
    outputs, _, _ = run(tok, make_request(prompt_ids, logprobs=0), steps)
    c = outputs[-1].outputs[0]
    assert [list(e) for e in c.logprobs] == [[t] for t in ids[:3]]
    assert c.cumulative_logprob == pytest.approx(sum(s[0].logprobs.logprob for s in steps))
    outputs, _, _ = run(tok, make_request(prompt_ids), steps)
    assert outputs[-1].outputs[0].logprobs is None and outputs[-1].outputs[0].cumulative_logprob is None


# ---- bookkeeping -----------------------------------------------------------------------------------------


def test_abort_drops_later_outputs(tok, ids, prompt_ids):
    op = OutputProcessor(tok)
    op.add_request(make_request(prompt_ids, "a"))
    op.add_request(make_request(prompt_ids, "b"))
    assert len(op.process([SampleOutput("a", 0, [ids[0]]), SampleOutput("b", 0, [ids[0]])]).request_outputs) == 2
    op.abort_request("a")
    op.abort_request("a")  # aborting twice (or an unknown id) is harmless
    result = op.process([SampleOutput("a", 0, [ids[1]]), SampleOutput("b", 0, [ids[1]])])
    assert [o.request_id for o in result.request_outputs] == ["b"]
    assert result.request_outputs[0].outputs[0].text == "Hello,"
    assert len(op) == 1
    # The id is free again after an abort, and after the request finishes.
    op.add_request(make_request(prompt_ids, "a"))
    op.process([SampleOutput("b", 0, [ids[2]], finish_reason="length")])
    op.add_request(make_request(prompt_ids, "b"))
    assert len(op) == 2


def test_merge_delta_equals_processing_both_steps_at_once(tok, ids, other_ids, prompt_ids):
    steps = delta_script(ids, other_ids)
    # Steps 1 and 2: sample 1 is in step 2 only; step 2 also finishes nothing. Then merge the final two.
    for a in (1, len(steps) - 3, len(steps) - 2):
        separate, _, _ = run(tok, make_request(prompt_ids, n=2, logprobs=2, output_kind=DELTA), steps)
        merged_steps = steps[:a] + [steps[a] + steps[a + 1]] + steps[a + 2:]
        together, _, _ = run(tok, make_request(prompt_ids, n=2, logprobs=2, output_kind=DELTA), merged_steps)
        merged = separate[a]
        merged.merge_delta(separate[a + 1])
        expected = together[a]
        assert merged.finished == expected.finished and merged.error == expected.error
        assert by_index(merged) == by_index(expected)
