"""One scrape from the scrapes of ``--processes N`` (processes/exposition.py): every sample of
every process, labelled with its process, each family's header once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar_frontend.processes.exposition import label_sample, merge_expositions


@pytest.mark.parametrize(
    ("line", "labelled"),
    [
        ("up 1.0", 'up{process="0"} 1.0'),
        ('x_total{a="b"} 2.0', 'x_total{process="0",a="b"} 2.0'),
        ("x_total{} 2.0", 'x_total{process="0"} 2.0'),
        ('x{a="{ } ,"} 3', 'x{process="0",a="{ } ,"} 3'),
        ('x_bucket{le="+Inf"} 4 1700000000', 'x_bucket{process="0",le="+Inf"} 4 1700000000'),
    ],
)
def test_label_sample(line: str, labelled: str) -> None:
    assert label_sample(line, "process", "0") == labelled


def _exposition(requests: int, workers: list[str], observed: list[float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("frontend_requests", "requests", ["outcome"], registry=registry)
    counter.labels("ok").inc(requests)
    gauge = Gauge("frontend_worker_inflight", "in flight", ["worker"], registry=registry)
    for worker in workers:
        gauge.labels(worker).set(1)
    histogram = Histogram("frontend_duration_seconds", "duration", buckets=(0.1, 1.0), registry=registry)
    for value in observed:
        histogram.observe(value)
    Gauge("frontend_empty", "no sample", ["x"], registry=registry)
    return generate_latest(registry).decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in found, f"{key} twice"
            found[key] = sample.value
    return found


@given(
    processes=st.lists(
        st.tuples(
            st.integers(0, 5),
            st.lists(st.sampled_from(["a:1", "b:2", 'q"uote:3']), unique=True),
            st.lists(st.floats(0, 5)),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_every_sample_of_every_process_is_there_once_with_its_label(
    processes: list[tuple[int, list[str], list[float]]],
) -> None:
    parent = Gauge("frontend_process_up", "up", ["process"], registry=(registry := CollectorRegistry()))
    for index in range(len(processes)):
        parent.labels(str(index)).set(1)
    texts: list[tuple[str | None, str]] = [(None, generate_latest(registry).decode())]
    texts += [(str(i), _exposition(*args)) for i, args in enumerate(processes)]
    merged = merge_expositions(texts)
    # One header per family: the text format (and Prometheus) refuses a family split in two.
    helps = [line.split()[2] for line in merged.splitlines() if line.startswith("# HELP")]
    assert len(helps) == len(set(helps))
    expected = _samples(texts[0][1])
    for value, text in texts[1:]:
        for (name, labels), number in _samples(text).items():
            expected[(name, tuple(sorted((*labels, ("process", str(value))))))] = number
    assert _samples(merged) == expected


def test_nothing_to_merge_is_an_empty_exposition() -> None:
    assert merge_expositions([]) == ""
