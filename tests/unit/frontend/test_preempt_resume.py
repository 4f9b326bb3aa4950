"""What a preempted sub-request runs once readmitted (Attempts.after_preemption over
Migration.after_preemption): the same request while nothing was delivered, else the continuation
from the delivered tokens; never a move, never against the migration limit; and the client's
outputs across any number of pauses equal an undisturbed run's."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.attempts import Attempts
from sidecar_frontend.migration import Finish, Refusal, RefusalReason, resume_refusal

VOCAB = 97
PROMPT = [11, 12, 13]


def request(max_tokens: int = 8, **sampling: int) -> sidecar_pb2.PreprocessedRequest:
    req = sidecar_pb2.PreprocessedRequest(request_id="r", token_ids=PROMPT)
    req.stop_conditions.max_tokens = max_tokens
    req.stop_conditions.ignore_eos = True
    for key, value in sampling.items():
        setattr(req.sampling_options, key, value)
    return req


def engine(req: sidecar_pb2.PreprocessedRequest) -> list[sidecar_pb2.LLMEngineOutput]:
    """A deterministic engine, one token an output: token i follows from the one before it
    (the prompt's last at first), so its output is a function of the prompt alone."""
    outs = []
    last = req.token_ids[-1]
    cum = 0.0
    for _ in range(req.stop_conditions.max_tokens):
        last = (last * 7 + 3) % VOCAB
        cum -= float(last)  # whole numbers: sums are exact, whatever the grouping
        outs.append(sidecar_pb2.LLMEngineOutput(token_ids=[last], cum_log_probs=cum))
    prompt = len(req.token_ids)
    done = len(outs)
    outs[-1].finish_reason = sidecar_pb2.LENGTH
    outs[-1].completion_usage.CopyFrom(
        sidecar_pb2.CompletionUsage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)
    )
    return outs


def seen(outputs: list[sidecar_pb2.LLMEngineOutput]) -> tuple[list[int], list[float], tuple[int, int]]:
    tokens = [t for out in outputs for t in out.token_ids]
    cums = [out.cum_log_probs for out in outputs if out.HasField("cum_log_probs")]
    usage = outputs[-1].completion_usage
    return tokens, cums, (usage.prompt_tokens, usage.completion_tokens)


def test_nothing_delivered_runs_the_same_request_again_and_counts_no_move() -> None:
    original = request()
    attempts = Attempts(original, migration_limit=0)
    assert attempts.after_preemption() is original
    assert attempts.moves == 0


def test_after_tokens_the_continuation_counts_no_migration_even_with_migration_off() -> None:
    original = request(max_tokens=8)
    attempts = Attempts(original, migration_limit=0)
    for out in engine(original)[:3]:
        attempts.delivered(out)
    following = attempts.after_preemption()
    assert isinstance(following, sidecar_pb2.PreprocessedRequest)
    delivered = list(attempts.progress.tokens[0])
    assert list(following.token_ids) == PROMPT + delivered
    assert following.stop_conditions.max_tokens == 5
    assert attempts.moves == 0
    assert attempts.migration.migrations == 0


def test_a_pause_after_the_last_token_before_the_terminal_ends_as_length() -> None:
    original = request(max_tokens=4)
    attempts = Attempts(original)
    outputs = engine(original)
    for out in outputs[:-1]:
        attempts.delivered(out)
    last = sidecar_pb2.LLMEngineOutput()
    last.token_ids.extend(outputs[-1].token_ids)
    attempts.delivered(last)  # every token, but not its terminal
    following = attempts.after_preemption()
    assert isinstance(following, Finish)
    assert following.terminal.finish_reason == sidecar_pb2.LENGTH
    assert following.terminal.completion_usage.completion_tokens == 4


@pytest.mark.parametrize(
    ("sampling", "why"),
    [({}, None), ({"n": 1}, None), ({"n": 2}, RefusalReason.MULTIPLE_CHOICES)],
)
def test_which_requests_can_resume(sampling: dict[str, int], why: RefusalReason | None) -> None:
    assert resume_refusal(request(**sampling)) is why


def test_guided_decoding_cannot_resume() -> None:
    guided = request()
    guided.sampling_options.guided_decoding.regex = "[a-z]+"
    assert resume_refusal(guided) is RefusalReason.GUIDED_DECODING
    attempts = Attempts(guided)
    attempts.delivered(engine(guided)[0])
    assert attempts.after_preemption() == Refusal(RefusalReason.GUIDED_DECODING)


@given(st.lists(st.integers(0, 12), max_size=6), st.integers(1, 12))
def test_any_pauses_leave_the_client_an_undisturbed_run(cuts: list[int], max_tokens: int) -> None:
    original = request(max_tokens=max_tokens)
    reference = engine(original)
    attempts = Attempts(original, migration_limit=0)
    client: list[sidecar_pb2.LLMEngineOutput] = []
    current = original
    for cut in [*cuts, None]:
        outputs = engine(current)
        for out in outputs if cut is None else outputs[:cut]:
            client.append(attempts.delivered(out))
        if attempts.complete:
            break
        following = attempts.after_preemption()
        if isinstance(following, Finish):
            client.append(attempts.finish(following))
            break
        assert isinstance(following, sidecar_pb2.PreprocessedRequest)
        current = following
    assert attempts.complete
    assert seen(client) == seen(reference)
    assert attempts.moves == 0
