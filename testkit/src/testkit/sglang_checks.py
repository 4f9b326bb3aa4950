"""The testkit SGLang engine's request checks, in SGLang 0.5.23's order (pure).

Two kinds, because SGLang refuses at two places and each wire shows them differently:

* the tokenizer manager's (input length, total tokens, dp rank, ``SamplingParams.verify``)
  raise: ``RequestRejected``, which gRPC ends with INTERNAL (the Rust server's status for any
  bridge error) and HTTP answers 400;
* the scheduler's (``set_finish_with_abort``: a disaggregated request without bootstrap, input
  past ``max_req_input_len``, ``logprob_start_len`` past the prompt) accept the request and end
  it at once with an ``abort`` finish of status 400, a clean terminal on both wires.
"""

from __future__ import annotations

import math
from dataclasses import replace

from testkit.sglang_core import DEFAULT_MAX_NEW_TOKENS, NativeRequest, RequestRejected
from testkit.sglang_info import SglangEngineConfig

__all__ = [
    "check_request",
    "lora_disabled_refusal",
    "lora_not_loaded_refusal",
    "scheduler_refusal",
    "verify_sampling",
]

# SamplingParams: a temperature below this samples greedily (top_k forced to 1 first).
_SAMPLING_EPS = 1e-6


def _range_error(name: str, value: float, low: float, high: float, low_in: bool, high_in: bool) -> str | None:
    above = value >= low if low_in else value > low
    below = value <= high if high_in else value < high
    if above and below:  # NaN fails both
        return None
    span = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
    return f"{name} must be in {span}, got {value}."


def verify_sampling(req: NativeRequest, max_new_tokens: int | None, vocab_size: int) -> None:
    """RequestRejected with SGLang's message for what its SamplingParams.verify refuses.
    ``max_new_tokens`` None skips the min/max check (the prefill half drops min_new_tokens)."""
    temperature = 1.0 if req.temperature is None else req.temperature
    if not math.isfinite(temperature) or temperature < 0.0:
        raise RequestRejected(f"temperature must be a non-negative finite number, got {temperature}.")
    checks = (
        ("top_p", req.top_p, 0.0, 1.0, False, True),
        ("min_p", req.min_p, 0.0, 1.0, True, True),
    )
    for name, value, low, high, low_in, high_in in checks:
        error = None if value is None else _range_error(name, value, low, high, low_in, high_in)
        if error:
            raise RequestRejected(error)
    top_k = -1 if req.top_k is None else req.top_k
    if temperature < _SAMPLING_EPS:
        top_k = 1  # greedy: SamplingParams replaces top_k before verify sees it
    if top_k != -1 and top_k < 1:
        raise RequestRejected(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    penalties = (
        ("frequency_penalty", req.frequency_penalty, -2.0, 2.0, True, True),
        ("presence_penalty", req.presence_penalty, -2.0, 2.0, True, True),
    )
    for name, value, low, high, low_in, high_in in penalties:
        error = None if value is None else _range_error(name, value, low, high, low_in, high_in)
        if error:
            raise RequestRejected(error)
    rep = req.repetition_penalty
    if rep is not None and not 0.0 < rep <= 2.0:
        raise RequestRejected(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rep}.")
    if req.min_new_tokens < 0:
        raise RequestRejected(f"min_new_tokens must be in [0, max_new_tokens], got {req.min_new_tokens}.")
    if max_new_tokens is not None:
        if max_new_tokens < 0:
            raise RequestRejected(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        if req.min_new_tokens > max_new_tokens:
            raise RequestRejected(
                f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {req.min_new_tokens}."
            )
    for key, _ in req.logit_bias or ():
        _check_logit_bias_key(key, vocab_size)


def _check_token_ids_logprob(ids: object, vocab_size: int) -> None:
    # SGLang's tokenizer manager, after the length checks: a flat list of ids in the vocabulary.
    if not ids:
        return
    if not isinstance(ids, list | tuple):
        raise RequestRejected("token_ids_logprob must be a flat list of integers.")
    for token in ids:
        if not isinstance(token, int):
            raise RequestRejected("token_ids_logprob must be a flat list of integers.")
        if token < 0 or token >= vocab_size:
            raise RequestRejected(
                f"token_ids_logprob contains out-of-vocabulary token id {token}; "
                f"valid range is [0, {vocab_size})."
            )


def _check_logit_bias_key(key: str, vocab_size: int) -> None:
    # SGLang calls int() on each key (its ValueError text is then the refusal), then range-checks.
    try:
        token = int(key)
    except ValueError as err:
        raise RequestRejected(str(err)) from None
    if not 0 <= token < vocab_size:
        raise RequestRejected(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")


def lora_disabled_refusal(adapter: str) -> str:
    """SGLang's sentence for a LoRA adapter asked of a server started without --enable-lora."""
    return (
        f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. Please launch the server "
        "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
    )


def lora_not_loaded_refusal(adapter: str, loaded: tuple[str, ...]) -> str:
    """SGLang's sentence for an adapter it has never loaded (the tokenizer manager lists the
    names it knows as a Python ``dict_keys``)."""
    known = dict.fromkeys(loaded).keys()
    return f"Got LoRA adapter that has never been loaded: {adapter}\nAll loaded adapters: {known}."


def check_request(cfg: SglangEngineConfig, req: NativeRequest) -> tuple[NativeRequest, str | None]:
    """SGLang's checks in its order. The tokenizer manager's raise (RequestRejected: gRPC
    INTERNAL, HTTP 400); the scheduler's are returned as a message: the request is
    accepted and ends at once with an ``abort`` finish of status 400."""
    if req.lora_path:
        # The tokenizer manager's first checks (before it looks at the prompt).
        if not cfg.lora_enabled:
            raise RequestRejected(lora_disabled_refusal(req.lora_path))
        if req.lora_path not in cfg.lora_paths:
            raise RequestRejected(lora_not_loaded_refusal(req.lora_path, cfg.lora_paths))
    ctx = cfg.context_length
    n_in = len(req.input_ids)
    if n_in == 0:
        raise RequestRejected("The input_ids is empty; at least one token is required.")
    bad = [t for t in req.input_ids if t < 0 or t >= cfg.vocab_size]
    if bad:
        # SGLang's HTTP server's sentence (sglang-server's request checks), naming the first.
        raise RequestRejected(
            f"input_ids contains out-of-vocabulary token id {bad[0]}; valid range is [0, {cfg.vocab_size})."
        )
    dp = cfg.dp_size
    rank = req.routed_dp_rank
    if rank is not None and not (dp <= 1 and rank == 0) and not 0 <= rank < dp:
        raise RequestRejected(f"routed_dp_rank={rank} out of range [0, {dp})")
    if n_in >= ctx:
        raise RequestRejected(
            f"The input ({n_in} tokens) is longer than the model's context length ({ctx} tokens)."
        )
    max_new = DEFAULT_MAX_NEW_TOKENS if req.max_new_tokens is None else req.max_new_tokens
    # SGLang's tokenizer manager checks the total only for a max_new_tokens the request gave;
    # an absent one (its default) is capped by the scheduler instead, never refused.
    explicit = req.max_new_tokens is not None
    if explicit and n_in + max_new > ctx and cfg.disaggregation_mode != "prefill":
        raise RequestRejected(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
            f"You requested a total of {n_in + max_new} tokens: {n_in} tokens from the input "
            f"messages and {max_new} tokens for the completion. Please reduce the number of tokens "
            "in the input messages or the completion to fit within the limit."
        )
    _check_token_ids_logprob(req.token_ids_logprob, cfg.vocab_size)
    verify_sampling(req, None if cfg.disaggregation_mode == "prefill" else max_new, cfg.vocab_size)
    if req.n != 1:
        raise RequestRejected("The testkit SGLang engine serves n=1 only.")
    if req.return_logprob and not 0 <= req.top_logprobs_num <= cfg.vocab_size:
        # SGLang has no check (its top-k over the vocabulary fails inside the scheduler);
        # the testkit refuses rather than compute an impossible top-N.
        raise RequestRejected(
            f"top_logprobs_num={req.top_logprobs_num} out of range [0, {cfg.vocab_size}] (testkit)"
        )
    if cfg.disaggregation_mode == "prefill":
        # The prefill server computes the KV cache and the first token only.
        req = replace(req, max_new_tokens=1, min_new_tokens=0)
    else:
        req = replace(req, max_new_tokens=max_new)
    return req, scheduler_refusal(cfg, req)


def scheduler_refusal(cfg: SglangEngineConfig, req: NativeRequest) -> str | None:
    """What SGLang's scheduler ends with ``set_finish_with_abort`` (status 400), if anything."""
    n_in = len(req.input_ids)
    if cfg.disaggregation_mode != "null" and req.bootstrap is None:
        return (
            f"Invalid request: Disaggregated request received without bootstrap room id. req.rid={req.rid!r}"
        )
    max_input = min(cfg.context_length, cfg.kv_capacity_tokens) - 1
    if n_in >= max_input:
        return (
            f"Input length ({n_in} tokens) exceeds the maximum allowed length ({max_input} tokens). "
            "Use a shorter input or enable --allow-auto-truncate."
        )
    if req.return_logprob and req.logprob_start_len > n_in:
        return (
            f"req.logprob_start_len={req.logprob_start_len} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={n_in}. Please use a smaller logprob_start_len."
        )
    if req.return_routed_experts:
        # Checked whether or not the server returns routed experts (--enable-return-routed-experts).
        start = req.routed_experts_start_len
        if start > n_in:
            return (
                f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={n_in}. Please use a smaller routed_experts_start_len."
            )
        if start < 0:
            return (
                f"recv_req.routed_experts_start_len={start} is lower than 0. "
                "Please use a non-negative routed_experts_start_len."
            )
    return None
