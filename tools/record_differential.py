"""Record the real servers' answers for tests/integration/frontend/test_differential.py.

Runs the real vLLM 0.33.0 and SGLang 0.5.23 HTTP code (installed from PyPI into a throwaway
virtualenv outside the repository; nothing of theirs is committed) with only the engine behind
it replaced, sends each row of ``tests/integration/frontend/differential_{vllm,sglang}.json``
whose ``how`` is ``"run"`` and writes what came back into the row's ``real``. Rows whose
``how`` says ``read: ...`` were derived by reading the real code and are left alone.

    python tools/record_differential.py [--venv /tmp/differential-venv] [--format vllm|sglang|all]
    python tools/record_differential.py --format vllm --rows "row name" ...   # only those rows
    python tools/record_differential.py --random 400   # the random-body tables instead

``--random N`` draws N bodies per format from a fixed seed (lax and wrong values for the
request fields) and records the real answer to each into
``tests/unit/frontend/data/validation_random_{vllm,sglang}.json``, which
``tests/unit/frontend/test_format_validation_random.py`` compares with the format plugins.

What is real and what is a stand-in:

* vLLM: the real FastAPI router (``/inference/v1/generate``), the real request models and
  their validators, the real exception handlers and the real ``ServingTokens`` request and
  response code. Replaced: the engine client (``generate`` first runs vLLM's own input checks,
  ``InputProcessor._validate_params`` and ``_validate_model_inputs`` on a stand-in of the
  configuration they read (the testkit model's vocabulary and context, ``--max-logprobs``
  20), then draws tokens and prompt logprobs from ``testkit.generator``, the same
  deterministic model the testkit engines serve, laid out as vLLM's engine lays them out, and
  raises vLLM's own engine exceptions for the fault rows), the renderer (token prompts pass
  through) and the served-model registry (one model, ``testkit-model``).
* SGLang: the real FastAPI app of ``sglang.srt.entrypoints.http_server`` (parse stage, JSON
  contract gate, error handlers, stream error events). Replaced: the tokenizer manager; the
  stand-in runs the real ``GenerateReqInput.normalize_batch_and_arguments`` and the real
  ``SamplingParams(...).normalize/verify`` and refuses to go further, so only rows refused by
  those stages can be recorded by running; the others are ``read:`` rows.

The recording is deterministic except for the fields the test normalises (ids SGLang draws,
``created``, latencies).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import struct
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "integration" / "frontend"
VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"
# Import-time needs of the two servers' HTTP code (not their full dependency lists); fastapi
# within vLLM 0.33's pin. torch and torchvision as a pair PyPI builds for each other (SGLang's
# imports need torchvision; PyPI's torchvision 0.28 does not load on the CPU-only torch 2.13
# build): about 7 GB of venv, nothing of it used beyond imports.
RUNTIME = [
    "torch==2.14.1",
    "torchvision==0.29.1",
    "pydantic>=2.12",
    "fastapi>=0.133,<0.137",
    "starlette",
    "uvicorn",
    "httpx",
    "python-multipart",
    "msgspec",
    "numpy",
    "regex",
    "cachetools",
    "psutil",
    "requests",
    "tqdm",
    "blake3",
    "py-cpuinfo",
    "transformers<5.21",
    "huggingface_hub",
    "tokenizers",
    "safetensors",
    "protobuf",
    "orjson",
    "prometheus_client",
    "prometheus-fastapi-instrumentator",
    "pillow",
    "openai",
    "pyzmq",
    "cloudpickle",
    "pyyaml",
    "einops",
    "cbor2",
    "ijson",
    "pybase64",
    "partial-json-parser",
    "jsonschema",
    "python-json-logger",
    "setproctitle",
    "watchfiles",
    "aiohttp",
    "sentencepiece",
    "filelock",
    "typing_extensions",
    "oss-harmony",
    "uvloop",
    "xgrammar",
    "llguidance",
    "IPython",
    "dill",
    "compressed-tensors",
    "gguf",
    "soundfile",
]


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    marker = venv / ".differential-ready"
    if marker.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, *RUNTIME], check=True)
    subprocess.run([*pip, "--no-deps", f"vllm=={VLLM_VERSION}", f"sglang=={SGLANG_VERSION}"], check=True)
    marker.touch()
    return python


# ----------------------------------------------------------------------------- capture


def capture(response: Any) -> dict[str, Any]:
    """Status, the headers a client reads, and the body (JSON text, or the SSE payloads)."""
    content_type = response.headers.get("content-type")
    real: dict[str, Any] = {"status": response.status_code, "content_type": content_type}
    text = response.content.decode()
    if content_type and content_type.startswith("text/event-stream"):
        assert text.endswith("\n\n"), text
        blocks = text.split("\n\n")[:-1]
        assert all(b.startswith("data: ") for b in blocks), blocks
        real["events"] = [b[len("data: ") :] for b in blocks]
    else:
        real["body"] = text
    return real


def send(client: Any, request: dict[str, Any]) -> Any:
    headers = dict(request.get("headers", {}))
    if "json" in request:
        content = json.dumps(request["json"]).encode()
        headers.setdefault("content-type", "application/json")
    else:
        content = request.get("body", "").encode()
    return client.request(request.get("method", "POST"), request["path"], content=content, headers=headers)


# --------------------------------------------------------------------------------- vLLM


def vllm_client(rows_by_id: dict[str, dict[str, Any]]) -> Any:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from testkit.generator import Generator, ModelSpec, SamplingSpec, prompt_logprobs
    from vllm.entrypoints.scale_out.token_in_token_out.api_router import attach_router
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.exceptions import QueueOverflowError
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.renderers import BaseRenderer
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
    from vllm.v1.engine.input_processor import InputProcessor

    model = ModelSpec(vocab_size=32000, eos_token_ids=(2,), context_length=4096)

    def fault_of(request_id: str) -> dict[str, Any] | None:
        for key, row in rows_by_id.items():
            if request_id.endswith(key):
                fault: dict[str, Any] | None = row.get("fault")
                return fault
        return None

    def float32(value: float) -> float:
        # vLLM's sampler computes logprobs as float32 tensors; .tolist() widens them.
        return float(struct.unpack("f", struct.pack("f", value))[0])

    def logprobs_at(position: Any) -> dict[int, Logprob]:
        # The engine's order: the sampled token first, then the top-k by rank.
        entries = {position.token_id: Logprob(float32(position.logprob), position.rank)}
        for rank, (token, logprob) in enumerate(position.top, start=1):
            entries.setdefault(token, Logprob(float32(logprob), rank))
        return entries

    # vLLM's own input checks, run in its engine's order (InputProcessor.process_inputs: the
    # sampling parameters' verify, then the prompt's length and vocabulary) on a stand-in of
    # the configuration they read: a tokenizer-less model of the testkit's size, vLLM's
    # default --max-logprobs 20, structured outputs configured (so their tokenizer check
    # runs). The data-parallel rank check, written inline in process_inputs, is not run here
    # (the rank rows are "read:" rows).
    model_config = types.SimpleNamespace(
        max_logprobs=20,
        get_vocab_size=lambda: model.vocab_size,
        max_model_len=model.context_length,
        runner_type="generate",
        is_diffusion=False,
        return_sampling_mask=False,
        enable_trace_replay=False,
    )
    checks = types.SimpleNamespace(
        model_config=model_config,
        speculative_config=None,
        structured_outputs_config=types.SimpleNamespace(),
        tokenizer=None,
        vllm_config=types.SimpleNamespace(
            use_v2_model_runner=False,
            cache_config=types.SimpleNamespace(kv_sharing_fast_prefill=False),
            reasoning_config=None,
        ),
        diffusion_config=None,
        skip_prompt_length_check=False,
        supports_mm_inputs=False,
        validate_logits_processors_params=lambda params: None,
        resolve_watermarking=lambda params: False,
        renderer=types.SimpleNamespace(tokenizer=None, model_config=model_config),
    )
    checks.renderer.validate_token_ids = types.MethodType(BaseRenderer.validate_token_ids, checks.renderer)
    checks._validate_prompt_len = types.MethodType(InputProcessor._validate_prompt_len, checks)
    checks._validate_model_input = types.MethodType(InputProcessor._validate_model_input, checks)

    def check_input(engine_input: Any, params: Any) -> None:
        InputProcessor._validate_params(checks, params, ("generate",))
        InputProcessor._validate_model_inputs(checks, None, engine_input)

    def prompt_logprobs_of(prompt: list[int], k: int | None) -> Any:
        # vLLM's engine: none for the first position, then per position the prompt token with
        # its rank and the top k (vllm/logprobs.py:append_logprobs_for_next_position).
        if k is None:
            return None
        return [None if p is None else logprobs_at(p) for p in prompt_logprobs(prompt, k, model)]

    class Engine:
        errored = False
        dead_error = EngineDeadError()

        def __init__(self) -> None:
            self.vllm_config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=256))
            self.admission_fault: dict[str, Any] | None = None

        def check_admission(self, n: int = 1) -> None:
            if self.admission_fault and self.admission_fault["kind"] == "overloaded":
                raise QueueOverflowError()

        async def abort(self, request_ids: Any) -> None:
            return None

        async def generate(self, engine_input: Any, params: Any, request_id: str, **_: Any) -> Any:
            prompt = list(engine_input["prompt_token_ids"])
            check_input(engine_input, params)
            fault = fault_of(request_id)
            stop_ids = tuple(params.stop_token_ids or ())
            spec = SamplingSpec(
                max_tokens=params.max_tokens,
                min_tokens=params.min_tokens,
                stop_token_ids=stop_ids,
                ignore_eos=params.ignore_eos,
                seed=params.seed,
                n=params.n,
                logprobs=params.logprobs,
            )
            delta = params.output_kind == RequestOutputKind.DELTA
            generators = [Generator(model, tuple(prompt), spec, index) for index in range(params.n)]
            tokens: list[list[int]] = [[] for _ in generators]
            logprobs: list[list[dict[int, Logprob]]] = [[] for _ in generators]
            finishes: list[Any] = [None] * len(generators)
            sent = 0
            while not all(g.done for g in generators):
                for index, generator in enumerate(generators):
                    if generator.done:
                        continue
                    if fault and fault["kind"] == "engine_dead" and sent >= fault["after"]:
                        raise EngineDeadError()
                    if fault and fault["kind"] == "engine_error" and sent >= fault["after"]:
                        # AsyncLLM.generate wraps any failure of its own in EngineGenerateError.
                        raise EngineGenerateError()
                    token = generator.step()
                    sent += 1
                    tokens[index].append(token.token_id)
                    if token.logprobs is not None:
                        logprobs[index].append(logprobs_at(token.logprobs))
                    finishes[index] = token.finish
                    if delta:
                        yield output(
                            request_id,
                            prompt,
                            index,
                            [token.token_id],
                            logprobs[index][-1:],
                            token.finish,
                            spec,
                        )
            if not delta:
                outs = [
                    completion(index, tokens[index], logprobs[index], finishes[index], spec)
                    for index in range(len(generators))
                ]
                plp = prompt_logprobs_of(prompt, params.prompt_logprobs)
                yield RequestOutput(request_id, None, prompt, plp, outs, finished=True)

    def completion(index: int, token_ids: list[int], lps: list[Any], finish: Any, spec: Any) -> Any:
        reason = None
        stop_reason = None
        if finish is not None:
            reason = finish.reason
            # vLLM's check_stop: a stop id the request lists is its stop_reason (EOS listed there
            # too, the issue-17 observation); an unlisted EOS stops with none.
            if finish.matched_token_id is not None and finish.matched_token_id in spec.stop_token_ids:
                stop_reason = finish.matched_token_id
            elif finish.is_eos and token_ids and token_ids[-1] in spec.stop_token_ids:
                stop_reason = token_ids[-1]
        return CompletionOutput(
            index=index,
            text="",
            token_ids=token_ids,
            cumulative_logprob=None,
            logprobs=lps if spec.logprobs is not None else None,
            finish_reason=reason,
            stop_reason=stop_reason,
        )

    def output(
        request_id: str, prompt: list[int], index: int, token_ids: list[int], lps: Any, finish: Any, spec: Any
    ) -> Any:
        return RequestOutput(
            request_id,
            None,
            prompt,
            None,
            [completion(index, token_ids, lps, finish, spec)],
            finished=finish is not None,
        )

    class Renderer:
        async def preprocess_completion(self, request: Any, prompt_input: Any, **_: Any) -> Any:
            return ({"type": "token", "prompt_token_ids": prompt_input},)

    engine = Engine()
    serving = ServingTokens.__new__(ServingTokens)
    served = types.SimpleNamespace(name="testkit-model")
    serving.__dict__.update(
        engine_client=engine,
        models=types.SimpleNamespace(
            model_name=lambda lora=None: "testkit-model",
            base_model_paths=[served],
            lora_requests={},
            is_base_model=lambda name: name == "testkit-model",
        ),
        request_logger=None,
        force_no_detokenize=True,  # --tokens-only
        has_tokenizer=False,
        online_renderer=Renderer(),
        model_config=types.SimpleNamespace(max_model_len=4096, is_encoder_decoder=False),
        default_sampling_params={},
        override_max_tokens=None,
        enable_prompt_tokens_details=False,
        enable_log_outputs=False,
        return_tokens_as_token_ids=False,
        renderer=types.SimpleNamespace(tokenizer=None),
    )
    app = FastAPI()
    app.state.args = types.SimpleNamespace(tokens_only=True, log_error_stack=False)
    app.state.serving_tokens = serving
    app.state.engine_client = engine
    attach_router(app)
    init_exception_handler(app)
    client = TestClient(app, raise_server_exceptions=False)
    client.engine = engine  # type: ignore[attr-defined]
    return client


# ------------------------------------------------------------------------------- SGLang


class StopHere(Exception):
    """The SGLang stand-in got past every stage it runs for real: the row cannot be recorded."""


def sglang_client() -> Any:
    from fastapi.testclient import TestClient
    from sglang.srt.entrypoints import http_server
    from sglang.srt.sampling.sampling_params import SamplingParams

    class TokenizerManager:
        def create_abort_task(self, obj: Any) -> None:
            return None

        def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
            return None  # nothing runs: aborting finds nothing, as for an unknown rid

        async def generate_request(self, obj: Any, request: Any) -> Any:
            obj.normalize_batch_and_arguments()
            params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
            for sampling in params:
                checked = SamplingParams(**sampling)
                checked.normalize(None)
                checked.verify(32000)
            raise StopHere(obj)
            yield  # an async generator, as the real one

    http_server._global_state = types.SimpleNamespace(tokenizer_manager=TokenizerManager())
    return TestClient(http_server.app, raise_server_exceptions=True)


# --------------------------------------------------------------------------------- main


def dump_table(table: dict[str, Any]) -> str:
    """One row a line, so that a re-recording shows as a per-row diff."""
    head = {key: value for key, value in table.items() if key != "rows"}
    lines = [json.dumps(row, ensure_ascii=False) for row in table["rows"]]
    text = json.dumps(head, ensure_ascii=False)[:-1] + ', "rows": [\n'
    return text + ",\n".join(lines) + "\n]}\n"


def request_id_of(row: dict[str, Any]) -> str:
    body = row["request"].get("json")
    request_id = body.get("request_id") if isinstance(body, dict) else None
    return request_id if isinstance(request_id, str) else row["name"]


def record(fmt: str, only: frozenset[str] = frozenset()) -> None:
    """Record every ``run`` row of the format's table, or only the rows named in ``only``
    (a re-recording of the rest would change nothing but vLLM's clock in them)."""
    path = DATA / f"differential_{fmt}.json"
    table = json.loads(path.read_text())
    rows = table["rows"]
    if fmt == "vllm":
        rows_by_id = {request_id_of(row): row for row in rows}
        client = vllm_client(rows_by_id)
        version = f"vllm {VLLM_VERSION}"
    else:
        client = sglang_client()
        version = f"sglang {SGLANG_VERSION}"
    for row in rows:
        if row["how"] != "run" or (only and row["name"] not in only):
            continue
        if fmt == "vllm":
            client.engine.admission_fault = row.get("fault")
        response = send(client, row["request"])
        row["real"] = capture(response)
        print(f"{fmt}: {row['name']}: {row['real']['status']}", file=sys.stderr)
    import fastapi
    import pydantic

    table["recorded_with"] = f"{version} (fastapi {fastapi.__version__}, pydantic {pydantic.VERSION})"
    path.write_text(dump_table(table))


# ------------------------------------------------------------------------- random bodies

RANDOM_DATA = REPO / "tests" / "unit" / "frontend" / "data"
_VALUES: list[Any] = [0, 1, -1, 2, 3, 5.0, 2.5, -0.5, "3", "2.5", "yes", "x", "", True, False, None]
_VALUES += [2**63, [], {}, [1], ["a"], {"a": 1}, 1e30, [None], [1, "a"], [[1], [2.5]]]
_VLLM_SAMPLING = [
    *("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature"),
    *("watermarking", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos"),
    *("max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens"),
    *("include_stop_str_in_output", "output_kind", "stream_interval", "logit_bias", "bad_words"),
    *("extra_args", "structured_outputs", "unknown_key"),
]
_VLLM_TOP = [
    *("request_id", "token_ids", "sampling_params", "model", "reasoning_ended"),
    *("reasoning_parser_kwargs", "return_token_ids", "output_mode", "stream", "stream_options"),
    *("priority", "kv_transfer_params", "ec_transfer_params", "content_parts", "features"),
    *("token_offsets", "unknown"),
]
_SGLANG_TOP = [
    *("rid", "text", "input_ids", "sampling_params", "stream", "return_logprob"),
    *("logprob_start_len", "top_logprobs_num", "lora_path", "session_params"),
    *("return_text_in_logprobs", "return_prompt_token_ids", "log_metrics", "priority"),
    *("custom_logit_processor", "return_hidden_states", "data_parallel_rank", "bootstrap_port"),
    *("extra_key", "routing_key", "token_ids_logprob", "custom_labels", "modalities"),
    "max_thinking_tokens",
]


def random_bodies(fmt: str, count: int) -> list[Any]:
    import random

    rng = random.Random(f"{fmt}-17")
    bodies: list[Any] = []
    for _ in range(count):
        if fmt == "vllm":
            body: dict[str, Any] = {"token_ids": [5, 6, 7], "sampling_params": {}}
            for key in rng.sample(_VLLM_TOP, rng.randint(0, 3)):
                if key == "sampling_params" and rng.random() < 0.8:
                    names = rng.sample(_VLLM_SAMPLING, rng.randint(1, 4))
                    body[key] = {name: rng.choice(_VALUES) for name in names}
                else:
                    body[key] = rng.choice(_VALUES)
        else:
            body = {"input_ids": [5, 6, 7]}
            for key in rng.sample(_SGLANG_TOP, rng.randint(1, 3)):
                body[key] = rng.choice(_VALUES)
        bodies.append(body)
    return bodies


def record_random(fmt: str, count: int) -> None:
    client = vllm_client({}) if fmt == "vllm" else sglang_client()
    path = "/inference/v1/generate" if fmt == "vllm" else "/generate"
    rows = []
    for body in random_bodies(fmt, count):
        request = {"method": "POST", "path": path, "json": body}
        try:
            real = capture(send(client, request))
        except StopHere:
            real = {"status": None}  # past every stage the SGLang stand-in runs
        if real.get("status") == 200:
            real = {"status": 200}  # an accepted body: the generation itself is not compared here
        elif "body" in real and real["body"].startswith('{"object":"error"'):
            # Cut what FastAPI appends to SGLang's parse-stage message: the server's file path
            # and line, and the list again (tests/integration/frontend/test_differential.py).
            error = json.loads(real["body"])
            error["message"] = error["message"].split("\n\n  File ", 1)[0]
            real["body"] = json.dumps(error, ensure_ascii=False, separators=(",", ":"))
        rows.append({"body": body, "real": real})
    import fastapi
    import pydantic

    version = VLLM_VERSION if fmt == "vllm" else SGLANG_VERSION
    table = {
        "format": fmt,
        "recorded_with": f"{fmt} {version} (fastapi {fastapi.__version__}, pydantic {pydantic.VERSION})",
        "rows": rows,
    }
    RANDOM_DATA.mkdir(exist_ok=True)
    (RANDOM_DATA / f"validation_random_{fmt}.json").write_text(dump_table(table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path("/tmp/differential-venv"))
    parser.add_argument("--format", choices=["vllm", "sglang", "all"], default="all")
    parser.add_argument("--random", type=int, default=0, metavar="N", help="record N random bodies")
    parser.add_argument("--rows", nargs="+", default=[], metavar="NAME", help="record only these rows")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.inner:
        python = ensure_venv(args.venv)
        # The repository (tests data) and the testkit, whose generator the vLLM stand-in draws from.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), str(REPO / "testkit" / "src")))}
        command = [str(python), __file__, "--inner", "--format", args.format, "--random", str(args.random)]
        if args.rows:
            command += ["--rows", *args.rows]
        raise SystemExit(subprocess.run(command, env=env, check=False).returncode)
    asyncio.set_event_loop(asyncio.new_event_loop())
    logging.disable(logging.CRITICAL)  # the servers log every refusal
    for fmt in ("vllm", "sglang") if args.format == "all" else (args.format,):
        if args.random:
            record_random(fmt, args.random)
        else:
            record(fmt, frozenset(args.rows))


if __name__ == "__main__":
    main()
