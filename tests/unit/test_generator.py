"""The testkit generator: determinism and every stop rule a sidecar test relies on."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from testkit.generator import (
    EOS_TRIGGER_TOKEN,
    FIRST_ORDINARY_ID,
    Generator,
    ModelSpec,
    SamplingSpec,
    detokenize,
    generate,
    prompt_logprobs,
)

MODEL = ModelSpec(vocab_size=32000, eos_token_ids=(2, 3), context_length=64)
PROMPT = (101, 202, 303)


def ids(toks: list) -> list[int]:  # type: ignore[type-arg]
    return [t.token_id for t in toks]


def text(toks: list) -> str:  # type: ignore[type-arg]
    return "".join(t.text for t in toks)


def test_same_request_same_tokens() -> None:
    sp = SamplingSpec(max_tokens=12, seed=7)
    assert ids(generate(MODEL, PROMPT, sp)) == ids(generate(MODEL, PROMPT, sp))


def test_seed_index_and_prompt_change_the_stream() -> None:
    base = ids(generate(MODEL, PROMPT, SamplingSpec(max_tokens=8)))
    assert ids(generate(MODEL, PROMPT, SamplingSpec(max_tokens=8, seed=1))) != base
    assert ids(generate(MODEL, PROMPT, SamplingSpec(max_tokens=8), index=1)) != base
    assert ids(generate(MODEL, (*PROMPT, 404), SamplingSpec(max_tokens=8))) != base


def test_max_tokens_ends_with_length() -> None:
    toks = generate(MODEL, PROMPT, SamplingSpec(max_tokens=5))
    assert len(toks) == 5
    assert all(t.finish is None for t in toks[:-1])
    assert toks[-1].finish is not None
    assert toks[-1].finish.reason == "length"


def test_no_max_tokens_runs_to_context_length() -> None:
    toks = generate(MODEL, PROMPT, SamplingSpec())
    assert len(toks) == MODEL.context_length - len(PROMPT)
    assert toks[-1].finish is not None
    assert toks[-1].finish.reason == "length"


def test_ordinary_tokens_avoid_special_ids() -> None:
    toks = generate(MODEL, PROMPT, SamplingSpec(max_tokens=40))
    assert all(t.token_id >= FIRST_ORDINARY_ID for t in toks)


def test_stop_token_id_stops_and_is_reported() -> None:
    full = ids(generate(MODEL, PROMPT, SamplingSpec(max_tokens=10)))
    stop_id = full[3]
    toks = generate(MODEL, PROMPT, SamplingSpec(max_tokens=10, stop_token_ids=(stop_id,)))
    assert ids(toks) == full[: full.index(stop_id) + 1]
    fin = toks[-1].finish
    assert fin is not None
    assert fin.reason == "stop"
    assert fin.matched_token_id == stop_id
    assert not fin.is_eos


def test_min_tokens_masks_stop_ids_before_it() -> None:
    full = ids(generate(MODEL, PROMPT, SamplingSpec(max_tokens=10)))
    stop_id = full[0]
    toks = generate(MODEL, PROMPT, SamplingSpec(max_tokens=10, min_tokens=4, stop_token_ids=(stop_id,)))
    assert len(toks) >= 4
    assert stop_id not in ids(toks)[:4]


def test_eos_rule_stops_at_the_kth_token() -> None:
    toks = generate(MODEL, (EOS_TRIGGER_TOKEN, 3, 500), SamplingSpec(max_tokens=10))
    assert len(toks) == 3
    assert toks[-1].token_id == 2
    fin = toks[-1].finish
    assert fin is not None
    assert fin.reason == "stop"
    assert fin.is_eos
    assert fin.matched_token_id == 2


def test_ignore_eos_emits_eos_and_continues() -> None:
    toks = generate(MODEL, (EOS_TRIGGER_TOKEN, 2), SamplingSpec(max_tokens=6, ignore_eos=True))
    assert len(toks) == 6
    assert toks[1].token_id == 2
    assert toks[-1].finish is not None
    assert toks[-1].finish.reason == "length"


def test_eos_is_withheld_before_min_tokens() -> None:
    toks = generate(MODEL, (EOS_TRIGGER_TOKEN, 2), SamplingSpec(max_tokens=6, min_tokens=3))
    assert 2 not in ids(toks)
    assert toks[-1].finish is not None
    assert toks[-1].finish.reason == "length"


def test_stop_string_across_tokens_is_cut_from_text() -> None:
    full = generate(MODEL, PROMPT, SamplingSpec(max_tokens=20))
    full_text = text(full)
    # Pick a stop string that starts inside one token and ends in a later one.
    first = detokenize(full[0].token_id)
    stop = full_text[len(first) - 1 : len(first) + 2]
    toks = generate(MODEL, PROMPT, SamplingSpec(max_tokens=20, stop=(stop,)))
    fin = toks[-1].finish
    assert fin is not None
    assert fin.reason == "stop"
    assert fin.matched_stop_str == stop
    at = full_text.find(stop)
    assert text(toks) == full_text[:at]
    kept = generate(MODEL, PROMPT, SamplingSpec(max_tokens=20, stop=(stop,), include_stop_str_in_output=True))
    assert text(kept) == full_text[: at + len(stop)]
    assert ids(kept) == ids(toks) == ids(full)[: len(toks)]


def test_some_ids_detokenize_to_space_separated_words() -> None:
    words = [detokenize(i) for i in range(FIRST_ORDINARY_ID, FIRST_ORDINARY_ID + 200)]
    assert any(w.startswith(" ") and len(w) > 1 for w in words)
    assert detokenize(2) == ""


def test_logprobs_shape() -> None:
    toks = generate(MODEL, PROMPT, SamplingSpec(max_tokens=6, logprobs=3))
    for t in toks:
        lp = t.logprobs
        assert lp is not None
        assert lp.token_id == t.token_id
        assert lp.logprob <= 0
        assert len(lp.top) == 3
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        if lp.rank <= 3:
            assert lp.top[lp.rank - 1] == (t.token_id, lp.logprob)
    none = generate(MODEL, PROMPT, SamplingSpec(max_tokens=2))
    assert all(t.logprobs is None for t in none)
    zero = generate(MODEL, PROMPT, SamplingSpec(max_tokens=2, logprobs=0))
    assert all(t.logprobs is not None and t.logprobs.top == () for t in zero)


def test_prompt_logprobs_first_position_is_none() -> None:
    plp = prompt_logprobs(PROMPT, 2, MODEL)
    assert len(plp) == len(PROMPT)
    assert plp[0] is None
    assert all(
        p is not None and p.token_id == tok and len(p.top) == 2
        for p, tok in zip(plp[1:], PROMPT[1:], strict=True)
    )


def test_step_after_finish_is_an_error() -> None:
    gen = Generator(MODEL, PROMPT, SamplingSpec(max_tokens=1))
    assert gen.step().finish is not None
    try:
        gen.step()
    except RuntimeError:
        return
    raise AssertionError("step after finish must raise")


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 31999), min_size=1, max_size=8),
    max_tokens=st.integers(1, 30),
    min_tokens=st.integers(0, 30),
    seed=st.none() | st.integers(0, 2**31 - 1),
    index=st.integers(0, 3),
    stop=st.lists(st.text(alphabet="abcde ", min_size=1, max_size=3), max_size=2),
)
def test_properties(
    prompt: list[int], max_tokens: int, min_tokens: int, seed: int | None, index: int, stop: list[str]
) -> None:
    sp = SamplingSpec(
        max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), seed=seed, stop=tuple(stop)
    )
    a = generate(MODEL, prompt, sp, index)
    b = generate(MODEL, prompt, sp, index)
    assert ids(a) == ids(b)
    assert text(a) == text(b)
    assert 1 <= len(a) <= max_tokens
    assert [t.finish is not None for t in a] == [False] * (len(a) - 1) + [True]
    assert len(a) >= min(sp.min_tokens, MODEL.context_length - len(prompt))
    fin = a[-1].finish
    assert fin is not None
    if fin.matched_stop_str is not None and sp.min_tokens == 0:
        # Before min_tokens stop strings are not looked for (as in vLLM), so only then.
        assert fin.matched_stop_str not in text(a)


def test_top_n_beyond_the_vocabulary_ends_with_every_other_token() -> None:
    """A top-N larger than the vocabulary used to draw forever (the engine's loop hung)."""
    small = ModelSpec(vocab_size=2 * FIRST_ORDINARY_ID, eos_token_ids=(2,), context_length=64)
    rows = prompt_logprobs((150, 160), 10 * small.vocab_size, small)
    row = rows[1]
    assert row is not None
    top_ids = [t for t, _ in row.top]
    assert len(top_ids) == len(set(top_ids)) == small.vocab_size - FIRST_ORDINARY_ID - 1
    assert row.token_id in top_ids
    assert all(FIRST_ORDINARY_ID <= t < small.vocab_size for t in top_ids)


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(100, 31999), min_size=1, max_size=8),
    length=st.integers(1, 40),
    cut=st.integers(0, 40),
    seed=st.none() | st.integers(0, 2**31),
    logprobs=st.none() | st.integers(0, 3),
)
def test_a_continuation_from_any_token_generates_the_rest_of_the_stream(
    prompt: list[int], length: int, cut: int, seed: int | None, logprobs: int | None
) -> None:
    # What a frontend that migrates a generation relies on: prompt + the first k tokens, with
    # the budget reduced by k, gives tokens k+1.. of the original, logprobs included.
    cut = min(cut, length)
    whole = generate(MODEL, prompt, SamplingSpec(max_tokens=length, seed=seed, logprobs=logprobs))
    done = [t.token_id for t in whole[:cut]]
    rest = generate(
        MODEL, [*prompt, *done], SamplingSpec(max_tokens=length - cut, seed=seed, logprobs=logprobs)
    )
    assert [(t.token_id, t.logprobs) for t in rest] == [(t.token_id, t.logprobs) for t in whole[cut:]]
