"""Deterministic token generation for the testkit engines (pure: no I/O, no clock, no globals).

Rules a test can rely on:

* The same (prompt, seed, choice index, limits) always gives the same tokens. The seed and
  the choice index each change the stream.
* Autoregressive: each token is drawn from everything before it (prompt and tokens so far),
  so a continuation whose prompt is the prompt plus the first k tokens (with the budgets
  reduced by k) generates exactly the rest of the stream, token and logprob alike. That is
  what a frontend that migrates a generation relies on. (The EOS rule below counts from the
  prompt it was given, so it does not carry over to a continuation.)
* Ids below ``FIRST_ORDINARY_ID`` (100) are *special*: they are never drawn at random and
  detokenize to "". EOS ids and the stop ids a test picks by hand therefore live there, or a
  test takes a stop id from a stream it generated first.
* EOS rule: a prompt whose first token is ``EOS_TRIGGER_TOKEN`` (99) makes the k-th generated
  token (1-based) the first EOS id, where k is the prompt's second token (1 when absent);
  every choice obeys it. Before ``min_tokens`` the EOS is not emitted (as an engine masks it),
  and with ``ignore_eos`` it is emitted and generation goes on.
* Ordinary ids detokenize to ``PIECES[id % len(PIECES)]``: single letters, digits and
  space-prefixed words, so a stop string can match across token boundaries.
* Finish precedence per token, as vLLM's scheduler checks it: nothing before ``min_tokens``;
  then EOS, then stop token ids, then stop strings, then the length limit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = [
    "EOS_TRIGGER_TOKEN",
    "FIRST_ORDINARY_ID",
    "PIECES",
    "Finish",
    "GeneratedToken",
    "Generator",
    "ModelSpec",
    "PositionLogprobs",
    "SamplingSpec",
    "detokenize",
    "generate",
    "iter_tokens",
    "prompt_logprobs",
]

FIRST_ORDINARY_ID = 100
EOS_TRIGGER_TOKEN = 99

PIECES: tuple[str, ...] = (
    *"abcdefghijklmnopqrstuvwxyz",
    *"0123456789",
    " the", " cat", " sat", " on", " mat", " a", " dog", " ran", " to", " big", " red", " sun",
    " and", " is", " it", " of", " in", " we", " go", " up", " old", " new", " day", " map",
    ".", ",", "!", "?",
)  # fmt: skip

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread pure hash of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _fold(values: Sequence[int], start: int) -> int:
    h = start
    for v in values:
        h = _mix(h ^ (v & _MASK64))
    return h


def detokenize(token_id: int) -> str:
    """The text of one token: special ids are empty (as with skip_special_tokens)."""
    if token_id < FIRST_ORDINARY_ID:
        return ""
    return PIECES[token_id % len(PIECES)]


@dataclass(frozen=True)
class ModelSpec:
    """What the served 'model' is: vocabulary, EOS ids (the first is the primary) and context."""

    vocab_size: int = 32000
    eos_token_ids: tuple[int, ...] = (2,)
    context_length: int = 4096

    def __post_init__(self) -> None:
        if self.vocab_size < 2 * FIRST_ORDINARY_ID:
            raise ValueError(f"vocab_size must be at least {2 * FIRST_ORDINARY_ID}")
        if self.context_length < 2:
            raise ValueError("context_length must be at least 2")


@dataclass(frozen=True)
class SamplingSpec:
    """Engine-neutral limits: each server maps its wire's sampling parameters onto these."""

    max_tokens: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class PositionLogprobs:
    """One position's logprob data, kept neutral so each server formats it its own way.

    ``top`` holds the ``k`` most likely ids in rank order (rank 1 first) with their logprobs;
    the chosen token may or may not be among them, its own rank is ``rank``.
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Finish:
    """How a choice ended. ``is_eos`` marks a stop on an EOS id (``matched_token_id`` is it)."""

    reason: str  # "stop" | "length"
    matched_token_id: int | None = None
    matched_stop_str: str | None = None
    is_eos: bool = False


@dataclass(frozen=True)
class GeneratedToken:
    """One generated token. ``text`` is the newly visible text (stop strings held back/cut)."""

    token_id: int
    text: str
    logprobs: PositionLogprobs | None
    finish: Finish | None = None


def _logprobs_at(h: int, token_id: int, k: int, vocab_size: int) -> PositionLogprobs:
    # Logprobs fall with rank; the chosen token's rank is 1..3 so tests see both the case
    # where it leads the alternatives and the case where it does not.
    rank = 1 + (h % 3)
    step = 0.25 + (h >> 8) % 100 / 100.0
    span = vocab_size - FIRST_ORDINARY_ID
    # Never more alternatives than the vocabulary has (the draw below would never end).
    width = min(max(k, rank), span - 1)
    ids: list[int] = []
    seen = {token_id}
    r = h
    while len(ids) < width:
        r = _mix(r)
        cand = FIRST_ORDINARY_ID + r % span
        if cand not in seen:
            seen.add(cand)
            ids.append(cand)
    ids[rank - 1] = token_id
    values = [-round(step * (i + 0.5), 4) for i in range(width)]
    return PositionLogprobs(
        token_id=token_id,
        logprob=values[rank - 1],
        rank=rank,
        top=tuple(zip(ids[:k], values[:k], strict=True)),
    )


def prompt_logprobs(prompt: Sequence[int], k: int, model: ModelSpec) -> list[PositionLogprobs | None]:
    """Per prompt position: None for the first (nothing precedes it), then logprob data."""
    out: list[PositionLogprobs | None] = [None]
    h = _fold(prompt[:1], 0x51ED)
    for tok in prompt[1:]:
        h = _mix(h ^ tok)
        out.append(_logprobs_at(h, tok, k, model.vocab_size))
    return out


@dataclass
class Generator:
    """A state machine for one choice: ``step()`` until a token carries a ``finish``."""

    model: ModelSpec
    prompt: tuple[int, ...]
    sampling: SamplingSpec
    index: int = 0
    _count: int = field(default=0, init=False)
    _state: int = field(default=0, init=False)
    _context: int = field(default=0, init=False)  # hash of the prompt and the tokens so far
    _salt: int = field(default=0, init=False)  # the seed and the choice index
    _limit: int = field(default=0, init=False)
    _eos_at: int | None = field(default=None, init=False)
    _text: str = field(default="", init=False)
    _sent_chars: int = field(default=0, init=False)
    _done: bool = field(default=False, init=False)
    _text_stop: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        seed = -1 if self.sampling.seed is None else self.sampling.seed
        self._context = _fold(self.prompt, 0xC0FFEE)
        self._salt = _fold((seed, self.index), 0x5EED)
        room = max(0, self.model.context_length - len(self.prompt))
        mt = self.sampling.max_tokens
        self._limit = room if mt is None else min(mt, room)
        if self.prompt and self.prompt[0] == EOS_TRIGGER_TOKEN and self.model.eos_token_ids:
            self._eos_at = max(1, self.prompt[1]) if len(self.prompt) > 1 else 1

    @property
    def limit(self) -> int:
        """The most tokens this choice can produce (max_tokens capped by the context)."""
        return self._limit

    @property
    def done(self) -> bool:
        return self._done

    def _draw(self, forbidden: frozenset[int]) -> int:
        span = self.model.vocab_size - FIRST_ORDINARY_ID
        h = self._state
        while True:
            tok = FIRST_ORDINARY_ID + h % span
            if tok not in forbidden:
                return tok
            h = _mix(h)

    def step(self) -> GeneratedToken:
        if self._done:
            raise RuntimeError("generator already finished")
        sp = self.sampling
        self._state = _mix(self._context ^ self._salt)
        pos = self._count + 1  # 1-based position of the token being made
        gate_open = pos > sp.min_tokens
        eos = self.model.eos_token_ids[0] if self.model.eos_token_ids else None
        if eos is not None and self._eos_at == pos and gate_open:
            tok = eos
        else:
            # Before min_tokens an engine masks stop ids; after it they come from the draw.
            tok = self._draw(frozenset() if gate_open else frozenset(sp.stop_token_ids))
        self._count = pos
        self._context = _mix(self._context ^ (tok & _MASK64))

        finish: Finish | None = None
        if gate_open:
            if not sp.ignore_eos and tok in self.model.eos_token_ids:
                finish = Finish("stop", matched_token_id=tok, is_eos=True)
            elif tok in sp.stop_token_ids:
                finish = Finish("stop", matched_token_id=tok, is_eos=tok in self.model.eos_token_ids)
        text = self._advance_text(tok, finish, gate_open)
        if finish is None and self._text_stop is not None:
            finish = Finish("stop", matched_stop_str=self._text_stop)
        if finish is None and pos >= self._limit:
            finish = Finish("length")
        if finish is not None:
            self._done = True
            text += self._flush()
        lp = None
        if sp.logprobs is not None:
            lp = _logprobs_at(self._state, tok, max(0, sp.logprobs), self.model.vocab_size)
        return GeneratedToken(token_id=tok, text=text, logprobs=lp, finish=finish)

    def _advance_text(self, tok: int, finish: Finish | None, gate_open: bool) -> str:
        if finish is not None and finish.is_eos:
            return ""
        start = len(self._text)
        self._text += detokenize(tok)
        stops = self.sampling.stop
        if stops and gate_open:
            longest = max(len(s) for s in stops)
            from_ = max(0, start - longest + 1)
            for s in stops:
                at = self._text.find(s, from_)
                if at >= 0:
                    self._text_stop = s
                    end = at + len(s) if self.sampling.include_stop_str_in_output else at
                    self._text = self._text[:end]
                    return ""
            # Hold back a tail that could still become a stop string.
            visible = max(self._sent_chars, len(self._text) - (longest - 1))
        else:
            visible = len(self._text)
        piece = self._text[self._sent_chars : visible]
        self._sent_chars = visible
        return piece

    def _flush(self) -> str:
        piece = self._text[self._sent_chars :]
        self._sent_chars = len(self._text)
        return piece

    @property
    def text(self) -> str:
        """The choice's visible text so far (complete once finished)."""
        return self._text


def generate(
    model: ModelSpec, prompt: Sequence[int], sampling: SamplingSpec, index: int = 0
) -> list[GeneratedToken]:
    """The whole choice at once; the last token carries the finish (empty if limit is 0)."""
    return list(iter_tokens(model, prompt, sampling, index))


def iter_tokens(
    model: ModelSpec, prompt: Sequence[int], sampling: SamplingSpec, index: int = 0
) -> Iterator[GeneratedToken]:
    gen = Generator(model, tuple(prompt), sampling, index)
    if gen.limit <= 0:
        return
    while not gen.done:
        yield gen.step()
