"""The incremental SSE parser: any split of the byte stream gives the same events."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sidecar_sglang.sse import SseParser


def parse(chunks: list[bytes]) -> list[str]:
    parser = SseParser()
    return [event for chunk in chunks for event in parser.feed(chunk)]


def test_sglang_stream() -> None:
    raw = b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    assert parse([raw]) == ['{"a": 1}', '{"b": 2}', "[DONE]"]


def test_crlf_cr_comments_multiline_and_other_fields() -> None:
    raw = b": keep-alive\r\n\r\nevent: x\r\ndata: one\r\ndata:two\r\nid: 3\r\n\r\ndata: cr\r\rdata: tail"
    assert parse([raw]) == ["one\ntwo", "cr"]


def test_blank_lines_without_data_emit_nothing() -> None:
    assert parse([b"\n\n\n: c\n\n"]) == []


def test_long_line_split_across_many_reads() -> None:
    payload = "x" * 200_000 + "é"
    raw = f"data: {payload}\n\n".encode()
    assert parse([raw[i : i + 997] for i in range(0, len(raw), 997)]) == [payload]
    assert parse([bytes([b]) for b in raw[-50:]]) == []  # a tail alone is not an event


events = st.lists(
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=30),
    min_size=1,
    max_size=3,
)


@given(
    st.lists(events, max_size=6),
    st.sampled_from([b"\n", b"\r\n", b"\r"]),
    st.lists(st.integers(0, 400), max_size=12),
)
def test_any_split_gives_the_same_events(data: list[list[str]], eol: bytes, cuts: list[int]) -> None:
    raw = b"".join(
        b"".join(b"data: " + line.encode() + eol for line in lines) + b": comment" + eol + eol
        for lines in data
    )
    expected = ["\n".join(lines) for lines in data]
    assert parse([raw]) == expected
    points = sorted({min(c, len(raw)) for c in cuts})
    pieces = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]
    assert parse(pieces) == expected
