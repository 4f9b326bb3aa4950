"""What validating one request body costs in the frontend's format plugins, in process.

For each format (vLLM ``/inference/v1/generate``, SGLang ``/generate``) and a valid and an
invalid body: the whole ``parse_generate`` (JSON, every check, the sub-request built or the
refusal written) and the pydantic model validation alone (``vllm_model`` / ``sglang_model``).
The valid bodies are typical (a 512-token prompt, a few sampling parameters, streamed); the
invalid ones have several type errors, so pydantic lists them all. Reported: the minimum over
``--rounds`` of the mean CPU time per call, in microseconds (on a shared machine the minimum
is the round least disturbed by the neighbours).

Run: ``python -m bench.validation_cost [--calls 2000] [--rounds 15]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from sidecar_common.api import sidecar_pb2
from sidecar_frontend.formats import sglang, vllm
from sidecar_frontend.formats.base import Format, FormatContext, Route, parse_whole
from sidecar_frontend.formats.sglang import model as sglang_model
from sidecar_frontend.formats.sglang.model import ModelErrors
from sidecar_frontend.formats.vllm import model as vllm_model
from sidecar_frontend.formats.vllm.errors import Invalid

__all__ = ["main", "microseconds_per_call"]

HEADERS = {"Content-Type": "application/json"}
PROMPT = list(range(1000, 1512))

VLLM_VALID = {
    "token_ids": PROMPT,
    "sampling_params": {
        "max_tokens": 128,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 7,
        "stop_token_ids": [2],
    },
    "stream": True,
    "stream_options": {"include_usage": True},
}
VLLM_INVALID = {
    "token_ids": [*PROMPT[:-1], "x"],
    "sampling_params": {"max_tokens": "many", "temperature": "hot", "stop": 5},
    "stream": "maybe",
    "priority": 1.5,
}
SGLANG_VALID = {
    "rid": "bench-1",
    "input_ids": PROMPT,
    "sampling_params": {"max_new_tokens": 128, "temperature": 0.7, "top_p": 0.9, "stop_token_ids": [2]},
    "stream": True,
}
SGLANG_INVALID = {
    "rid": 5,
    "input_ids": PROMPT,
    "stream": None,
    "return_logprob": "x",
    "lora_path": 3,
    "priority": 1.5,
}


def _context(engine: str) -> FormatContext:
    info = sidecar_pb2.ModelInfo(
        engine=engine,
        served_model_name="bench-model",
        max_context_length=4096,
        vocab_size=32000,
        max_num_seqs=256,
        data_parallel_size=1,
        eos_token_ids=[2],
    )
    return FormatContext(model_info=info, new_id=lambda: "0" * 32, wall_time=0.0)


def microseconds_per_call(call: Callable[[], object], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(calls):
            call()
        best = min(best, (time.process_time() - start) / calls)
    return best * 1e6


def _model_call(validate: Callable[[object], object], body: object) -> Callable[[], object]:
    def call() -> object:
        try:
            return validate(body)
        except (Invalid, ModelErrors) as err:
            return err

    return call


def _parse_call(fmt: Format, route: Route, body: object, ctx: FormatContext) -> Callable[[], object]:
    raw = json.dumps(body).encode()

    def call() -> object:
        return parse_whole(fmt, route, raw, HEADERS, ctx)

    return call


def cases() -> dict[str, Callable[[], object]]:
    vllm_ctx, sglang_ctx = _context("vllm"), _context("sglang")
    out: dict[str, Callable[[], object]] = {}
    for label, body in (("valid", VLLM_VALID), ("invalid", VLLM_INVALID)):
        out[f"vllm {label}: parse_generate"] = _parse_call(vllm.FORMAT, vllm.GENERATE, body, vllm_ctx)
        out[f"vllm {label}: model alone"] = _model_call(vllm_model.validate_generate, body)
    for label, body in (("valid", SGLANG_VALID), ("invalid", SGLANG_INVALID)):
        out[f"sglang {label}: parse_generate"] = _parse_call(sglang.FORMAT, sglang.GENERATE, body, sglang_ctx)
        out[f"sglang {label}: model alone"] = _model_call(sglang_model.validate_generate, body)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    for name, call in cases().items():
        call()  # warm: pydantic builds nothing lazily, but imports and caches settle
        print(f"{name:36} {microseconds_per_call(call, args.calls, args.rounds):8.1f} µs")


if __name__ == "__main__":
    main()
