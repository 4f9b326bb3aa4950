"""SMG, the peer ``bench.full_path`` measures our path against: where it is installed, how it
is started in front of a vLLM gRPC worker, and the tokenizer it needs.

SMG (PyPI ``smg``, the Rust gateway) is a benchmark-only dependency. It lives in its own venv,
``.venv-smg/`` at the repository root, installed by ``scripts/smg_venv.sh`` (also ``make
bench-peer-setup``) from ``bench/smg-requirements.txt`` (exact versions, hashes checked).

In front of a gRPC worker SMG does the tokenizer's work itself (its docs: "gRPC Workers"), so it
will not serve a model without one, even for requests that carry token ids: it loads the
tokenizer from ``--model-path`` (a local directory or a HuggingFace id) and, for the model the
worker reports, from the path in the worker's ``GetModelInfo``. :func:`write_tokenizer` writes
a small word-level tokenizer (one word per id, ``t<id>``) that both name; decoding it costs SMG
about as little as a tokenizer can, while our path decodes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

__all__ = [
    "SMG_VENV",
    "VOCAB_SIZE",
    "ensure_installed",
    "smg_argv",
    "smg_executable",
    "smg_fleet_argv",
    "smg_version",
    "write_tokenizer",
]

ROOT = Path(__file__).resolve().parent.parent
SMG_VENV = ROOT / ".venv-smg"
SETUP_SCRIPT = ROOT / "scripts" / "smg_venv.sh"
VOCAB_SIZE = 32000
_SPECIAL = {0: "<unk>", 1: "<s>", 2: "</s>"}


def smg_executable(venv: Path = SMG_VENV) -> Path:
    return venv / "bin" / "smg"


def ensure_installed(venv: Path = SMG_VENV) -> Path:
    """The ``smg`` executable, installing the pinned venv first when it is missing."""
    executable = smg_executable(venv)
    if not executable.exists():
        subprocess.run([str(SETUP_SCRIPT)], check=True, env=_env_with_venv(venv))
    if not executable.exists():
        raise RuntimeError(f"{SETUP_SCRIPT} ran but {executable} is still missing")
    return executable


def _env_with_venv(venv: Path) -> dict[str, str]:
    return {**os.environ, "SMG_VENV": str(venv)}


def smg_version(executable: Path) -> str:
    done = subprocess.run([str(executable), "--version"], capture_output=True, text=True, timeout=30)
    return (done.stdout.strip().splitlines() or ["unknown"])[0]


def write_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer over ids 0..VOCAB_SIZE-1 (``tokenizer.json`` in the layout of
    HuggingFace's tokenizers library, with its config files) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {_SPECIAL.get(i, f"t{i}"): i for i in range(VOCAB_SIZE)}
    added = [
        {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, text in _SPECIAL.items()
    ]  # fmt: skip
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 32768,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    model = {"model_type": "llama", "vocab_size": VOCAB_SIZE, "bos_token_id": 1, "eos_token_id": 2}
    (directory / "config.json").write_text(json.dumps(model))
    return directory


def smg_argv(
    executable: Path, port: int, engine: str, tokenizer: Path, metrics_port: int, log_level: str = "warn"
) -> list[str]:
    """``smg launch`` in front of one vLLM gRPC worker at ``engine`` (HOST:PORT), as its docs
    start it: the worker's ``grpc://`` URL and a model path for the tokenizer. Everything else
    is SMG's default (routing policy, concurrency limit, timeouts) except the addresses: the
    router and its metrics listener on loopback (the metrics one has a fixed default port)."""
    return smg_fleet_argv(executable, port, [engine], tokenizer, metrics_port, log_level)


def smg_fleet_argv(
    executable: Path,
    port: int,
    engines: list[str],
    tokenizer: Path,
    metrics_port: int,
    log_level: str = "warn",
) -> list[str]:
    """``smg launch`` in front of several vLLM gRPC workers (``--worker-urls`` takes a list),
    otherwise as :func:`smg_argv`."""
    return [
        str(executable), "launch",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *(f"grpc://{engine}" for engine in engines),
        "--model-path", str(tokenizer),
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--log-level", log_level,
    ]  # fmt: skip
