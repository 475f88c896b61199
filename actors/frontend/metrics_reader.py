"""vLLM's metrics reader (``vllm.v1.metrics.reader``): the engine's metrics as objects, what
``LLM.get_metrics()`` returns. Read from the same Prometheus text ``/metrics`` serves (the
``vllm:`` names), so the two never disagree: a counter under its family name (no ``_total``),
the accepted drafts per position as one ``Vector``, a histogram's cumulative buckets by ``le``."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["Metric", "Counter", "Gauge", "Histogram", "Vector", "metrics_snapshot"]

VECTORS = {"vllm:spec_decode_num_accepted_tokens_per_pos": "position"}   # counter -> its index label
_SAMPLE = re.compile(r'^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)   # upper bound ("+Inf" last) -> cumulative count


def _labels(text: str | None) -> dict[str, str]:
    return {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
            for k, v in _LABEL.findall(text or "")}


def _key(labels: dict[str, str]) -> tuple:
    return tuple(sorted(labels.items()))


def metrics_snapshot(text: str) -> list[Metric]:
    """The ``vllm:`` metrics of Prometheus exposition ``text``, one object per label set."""
    kinds: dict[str, str] = {}
    out: list[Metric] = []
    vectors: dict[tuple, Vector] = {}
    histograms: dict[tuple, Histogram] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            kinds[name.removesuffix("_total") if kind == "counter" else name] = kind
            continue
        m = _SAMPLE.match(line)
        if line.startswith("#") or m is None or not m.group(1).startswith("vllm:"):
            continue
        sample, labels, value = m.group(1), _labels(m.group(2)), float(m.group(3))
        family = sample.removesuffix("_total")
        if kinds.get(family) == "counter" and family in VECTORS:
            position = int(labels.pop(VECTORS[family]))
            vec = vectors.get((family, _key(labels)))
            if vec is None:
                vec = vectors[(family, _key(labels))] = Vector(family, labels, [])
                out.append(vec)
            vec.values.extend([0] * (position + 1 - len(vec.values)))
            vec.values[position] = int(value)
        elif kinds.get(family) == "counter":
            out.append(Counter(family, labels, int(value)))
        elif kinds.get(sample) == "gauge":
            out.append(Gauge(sample, labels, value))
        else:
            base, _, part = sample.rpartition("_")
            if kinds.get(base) != "histogram" or part not in ("bucket", "sum", "count"):
                continue
            le = labels.pop("le", None)
            hist = histograms.get((base, _key(labels)))
            if hist is None:
                hist = histograms[(base, _key(labels))] = Histogram(base, labels, 0, 0.0)
                out.append(hist)
            if part == "bucket" and le is not None:
                hist.buckets[le] = int(value)
            elif part == "sum":
                hist.sum = value
            elif part == "count":
                hist.count = int(value)
    return out
