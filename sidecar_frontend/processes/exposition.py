"""One Prometheus scrape from the scrapes of ``--processes N`` (pure: text in, text out).

Each process's metrics are its own (its requests, its view of the workers). The parent's
``/metrics`` shows them all in one exposition, each sample with a ``process`` label naming
the process it came from (``"0"`` to ``"N-1"``), and the parent's own series unlabelled:
Prometheus scrapes one target, and ``sum without (process) (...)`` gives the frontend's total.

The text format requires every sample of a metric family to follow its ``# HELP`` and
``# TYPE`` lines in one group, so the merge groups by family: the families in the order they
first appear, each with its header once (the first text's) and then the samples of every
text in turn. A family is what a ``# HELP`` or ``# TYPE`` line names; a sample before any
header forms a family of its own name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

__all__ = ["PROCESS_LABEL", "label_sample", "merge_expositions"]

PROCESS_LABEL: Final = "process"


@dataclass
class _Family:
    header: list[str] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)


def label_sample(line: str, label: str, value: str) -> str:
    """``name{a="b"} 1`` -> ``name{label="value",a="b"} 1``; ``name 1`` -> ``name{label="value"} 1``.
    A metric name holds neither ``{`` nor a space, so the first of them ends it; whatever the
    label values hold comes after."""
    brace = line.find("{")
    space = line.find(" ")
    pair = f'{label}="{_escape(value)}"'
    if brace != -1 and (space == -1 or brace < space):
        rest = line[brace + 1 :]
        return f"{line[: brace + 1]}{pair}{'' if rest.startswith('}') else ','}{rest}"
    if space == -1:
        return line  # not a sample line; left as it is
    return f"{line[:space]}{{{pair}}}{line[space:]}"


def merge_expositions(texts: Sequence[tuple[str | None, str]], label: str = PROCESS_LABEL) -> str:
    """``texts``: (label value, exposition) pairs; a None value leaves that text's samples as
    they are (the parent's own). One exposition of every family of them all."""
    families: dict[str, _Family] = {}
    for value, text in texts:
        for name, header, samples in _blocks(text):
            family = families.get(name)
            if family is None:
                family = families[name] = _Family(header=header)
            family.samples.extend(s if value is None else label_sample(s, label, value) for s in samples)
    out: list[str] = []
    for family in families.values():
        out.extend(family.header)
        out.extend(family.samples)
    return "\n".join(out) + "\n" if out else ""


def _blocks(text: str) -> list[tuple[str, list[str], list[str]]]:
    """One text's families in order: (name, its HELP/TYPE lines, its sample lines)."""
    blocks: list[tuple[str, list[str], list[str]]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            words = line.split(None, 3)
            if len(words) < 3 or words[1] not in ("HELP", "TYPE"):
                continue  # a comment
            name = words[2]
            if not blocks or blocks[-1][0] != name or blocks[-1][2]:
                blocks.append((name, [], []))
            blocks[-1][1].append(line)
            continue
        if not blocks:
            blocks.append((line.split("{", 1)[0].split(" ", 1)[0], [], []))
        blocks[-1][2].append(line)
    return blocks


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
