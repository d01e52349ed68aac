"""OpenTelemetry spans and metrics of protected calls, read back from the SDK's in-memory stores."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import opentelemetry
import opentelemetry.trace
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import twiceshy
from twiceshy import Outcome
from twiceshy.integrations import opentelemetry as otel
from twiceshy.integrations.opentelemetry import TwiceshyTelemetry

OUTCOME_UNKNOWN = "twiceshy.errors.OutcomeUnknown"


class Declined(Exception):
    """A provider's certain refusal: recorded and replayed."""


@dataclass
class Telemetry:
    """An observer wired to SDK providers whose spans and metrics stay in memory."""

    observer: TwiceshyTelemetry
    exporter: InMemorySpanExporter
    reader: InMemoryMetricReader
    tracer_provider: TracerProvider

    def ledger(self) -> tuple[twiceshy.Ledger, list[twiceshy.CallEvent]]:
        """A memory ledger observed by this telemetry, and the events it told."""
        events: list[twiceshy.CallEvent] = []
        return twiceshy.Ledger("memory://", observers=[self.observer, events.append]), events

    def spans(self) -> list[ReadableSpan]:
        """The finished spans twiceshy made, in the order they ended."""
        return [
            span
            for span in self.exporter.get_finished_spans()
            if span.instrumentation_scope is not None
            and span.instrumentation_scope.name == "twiceshy"
        ]

    def points(self, name: str) -> list[Any]:
        """The data points of the metric ``name`` collected so far."""
        data = self.reader.get_metrics_data()
        assert data is not None
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    """TwiceshyTelemetry with explicit SDK providers; the global providers are never touched."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    observer = TwiceshyTelemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)
    yield Telemetry(observer, exporter, reader, tracer_provider)
    tracer_provider.shutdown()
    meter_provider.shutdown()


def exception_events(span: ReadableSpan) -> list[Mapping[str, Any]]:
    """The attributes of a span's ``exception`` events."""
    return [dict(e.attributes or {}) for e in span.events if e.name == "exception"]


def times(span: ReadableSpan) -> tuple[int, int]:
    """A finished span's start and end (nanoseconds since the epoch)."""
    assert span.start_time is not None
    assert span.end_time is not None
    return span.start_time, span.end_time


def test_executed_and_replayed_calls_make_one_span_each(telemetry: Telemetry) -> None:
    """A call and its retry make two INTERNAL spans with tool, key, effect and outcome; the
    retry's is marked replayed."""
    ledger, _ = telemetry.ledger()

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> int:
        return amount

    with twiceshy.run("otel-1"):
        assert charge(1) == charge(1) == 1
    key = twiceshy.idempotency_key("otel-1", "charge", {"amount": 1})
    spans = telemetry.spans()
    assert [span.name for span in spans] == ["twiceshy charge", "twiceshy charge"]
    assert [dict(span.attributes or {}) for span in spans] == [
        {
            "twiceshy.tool": "charge",
            "twiceshy.key": key,
            "twiceshy.effect": "keyed",
            "twiceshy.outcome": outcome,
            "twiceshy.replayed": replayed,
        }
        for outcome, replayed in (("executed", False), ("replayed", True))
    ]
    for span in spans:
        assert span.kind is SpanKind.INTERNAL
        assert span.status.status_code is StatusCode.UNSET
        assert not span.events
        assert span.instrumentation_scope is not None
        assert span.instrumentation_scope.name == "twiceshy"
        assert span.instrumentation_scope.version == twiceshy.__version__


def test_outcome_unknown_is_an_error_with_the_exception(telemetry: Telemetry) -> None:
    """An UNSAFE call that timed out, and its retry, are ERROR spans recording OutcomeUnknown."""
    ledger, _ = telemetry.ledger()

    @ledger.tool(effect=twiceshy.UNSAFE)
    def wire(amount: int) -> None:
        raise TimeoutError("read timed out")

    with twiceshy.run("otel-2"):
        for _ in range(2):
            with pytest.raises(twiceshy.OutcomeUnknown):
                wire(100)
    spans = telemetry.spans()
    assert len(spans) == 2
    for span in spans:
        attributes = dict(span.attributes or {})
        assert attributes["twiceshy.outcome"] == "unknown"
        assert attributes["twiceshy.effect"] == "unsafe"
        assert attributes["error.type"] == OUTCOME_UNKNOWN
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description is not None
        assert span.status.description.startswith("OutcomeUnknown: ")
        (event,) = exception_events(span)
        assert event["exception.type"] == OUTCOME_UNKNOWN
        assert event["exception.escaped"] == "True"
        assert span.start_time is not None
        assert span.end_time is not None
        assert span.start_time <= span.events[0].timestamp <= span.end_time


def test_a_replayed_failure_is_an_error_too(telemetry: Telemetry) -> None:
    """A certain failure is an ERROR span when it happens and when it is replayed to a retry."""
    ledger, _ = telemetry.ledger()

    @ledger.tool(effect=twiceshy.UNSAFE, definite=[Declined])
    def charge(amount: int) -> None:
        raise Declined("card declined")

    with twiceshy.run("otel-3"):
        for _ in range(2):
            with pytest.raises(Declined):
                charge(1)
    spans = telemetry.spans()
    assert [(span.attributes or {})["twiceshy.outcome"] for span in spans] == [
        "executed",
        "replayed",
    ]
    for span in spans:
        assert span.status.status_code is StatusCode.ERROR
        (event,) = exception_events(span)
        assert event["exception.message"] == "card declined"
        assert (span.attributes or {})["error.type"] == event["exception.type"]


def test_a_refused_call_has_no_key(telemetry: Telemetry) -> None:
    """A call refused before a key was made is an ERROR span without ``twiceshy.key``."""
    ledger, _ = telemetry.ledger()
    tool = ledger.tool(effect=twiceshy.KEYED, name="charge")(lambda: None)
    with pytest.raises(twiceshy.MissingScope):
        tool()
    (span,) = telemetry.spans()
    assert dict(span.attributes or {}) == {
        "twiceshy.tool": "charge",
        "twiceshy.effect": "keyed",
        "twiceshy.outcome": "refused",
        "twiceshy.replayed": False,
        "error.type": "twiceshy.errors.MissingScope",
    }
    assert span.status.status_code is StatusCode.ERROR
    assert [e["exception.type"] for e in exception_events(span)] == ["twiceshy.errors.MissingScope"]


def test_joined_async_calls_are_children_of_the_task_span(telemetry: Telemetry) -> None:
    """Two concurrent async calls of one intent, executed and joined, both under the task's span."""
    ledger, _ = telemetry.ledger()
    tracer = telemetry.tracer_provider.get_tracer("agent")
    release = asyncio.Event()

    @ledger.tool(effect=twiceshy.KEYED)
    async def charge(amount: int) -> int:
        await release.wait()
        return amount

    async def main() -> list[int]:
        with tracer.start_as_current_span("agent step"), twiceshy.run("otel-4"):
            leader = asyncio.create_task(charge(7))
            await asyncio.sleep(0)  # the leader claims the key and waits in the tool
            joiner = asyncio.create_task(charge(7))
            await asyncio.sleep(0)  # the joiner joins the leader's flight
            release.set()
            return list(await asyncio.gather(leader, joiner))

    assert asyncio.run(main()) == [7, 7]
    spans = telemetry.spans()
    assert sorted(str((span.attributes or {})["twiceshy.outcome"]) for span in spans) == [
        "executed",
        "joined",
    ]
    (step,) = [s for s in telemetry.exporter.get_finished_spans() if s.name == "agent step"]
    for span in spans:
        assert span.parent is not None
        assert span.parent.span_id == step.context.span_id
        assert span.context.trace_id == step.context.trace_id
        assert span.status.status_code is StatusCode.UNSET


def test_the_parent_is_the_callers_span_and_tool_spans_are_children(telemetry: Telemetry) -> None:
    """The span's parent is the span current at the call; a span the tool opened is its child."""
    ledger, _ = telemetry.ledger()
    tracer = telemetry.tracer_provider.get_tracer("agent")

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> int:
        with tracer.start_as_current_span("POST /v1/charges"):
            time.sleep(0.002)
        return amount

    with tracer.start_as_current_span("agent step") as step, twiceshy.run("otel-5"):
        charge(1)
    with twiceshy.run("otel-5"):
        charge(1)  # outside any span: a root span
    finished = {span.name: span for span in telemetry.exporter.get_finished_spans()}
    inside, outside = telemetry.spans()
    request = finished["POST /v1/charges"]
    step_id = step.get_span_context().span_id
    assert inside.parent is not None
    assert inside.parent.span_id == step_id
    assert request.parent is not None
    assert request.parent.span_id == inside.context.span_id
    assert inside.context.trace_id == request.context.trace_id
    (inside_start, inside_end), (request_start, request_end) = times(inside), times(request)
    assert inside_start <= request_start <= request_end <= inside_end
    assert outside.parent is None
    assert outside.context.trace_id != inside.context.trace_id


def test_span_timing_covers_the_events(telemetry: Telemetry) -> None:
    """A span opens before the call begins and ends after it is answered."""
    ledger, events = telemetry.ledger()

    @ledger.tool(effect=twiceshy.KEYED)
    def slow(n: int) -> int:
        time.sleep(0.02)
        return n

    before = time.time_ns()
    with twiceshy.run("otel-6"):
        slow(1)
        slow(1)
    after = time.time_ns()
    spans = telemetry.spans()
    assert len(spans) == len(events) == 2
    for span, event in zip(spans, events, strict=True):
        start, end = times(span)
        # The event's clock is wall time from a monotonic measure: allow a microsecond.
        assert start <= event.started * 1e9 + 1_000
        assert end >= (event.started + event.duration) * 1e9 - 1_000
        assert before <= start <= end <= after
    (first_start, first_end), (second_start, _) = times(spans[0]), times(spans[1])
    assert first_end - first_start >= 20_000_000
    assert first_end <= second_start


def test_an_event_told_by_hand_gets_a_span_of_its_times(telemetry: Telemetry) -> None:
    """Without the ledger's ``around``, the span is back-dated to the event's times."""
    event = twiceshy.CallEvent(
        tool="charge",
        effect=twiceshy.KEYED,
        outcome=Outcome.REPLAYED,
        key="k" * 64,
        error=None,
        started=1_800_000_000.25,
        duration=0.125,
    )
    telemetry.observer(event)
    (span,) = telemetry.spans()
    start, end = times(span)
    assert abs(start - 1_800_000_000_250_000_000) < 1_000  # a float of seconds, in nanoseconds
    assert end - start == 125_000_000
    assert dict(span.attributes or {})["twiceshy.outcome"] == "replayed"
    assert span.parent is None


def test_a_failing_around_is_logged_and_the_call_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An observer whose ``around`` raises is left out of that call; the tool runs once."""

    class Broken:
        def __call__(self, event: twiceshy.CallEvent) -> None:
            pass

        def around(self, tool: str, effect: twiceshy.Effect) -> Any:
            raise RuntimeError("no tracer")

    ledger = twiceshy.Ledger("memory://", observers=[Broken()])
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> int:
        runs.append(amount)
        return amount

    with twiceshy.run("otel-9"):
        assert charge(3) == charge(3) == 3
    assert runs == [3]
    assert "an observer failed around charge" in caplog.text


def test_calls_are_counted_by_outcome(telemetry: Telemetry) -> None:
    """``twiceshy.calls`` counts by tool, effect and outcome; the histogram has a point per call."""
    ledger, events = telemetry.ledger()

    @ledger.tool(effect=twiceshy.KEYED)
    def charge(amount: int) -> int:
        return amount

    @ledger.tool(effect=twiceshy.UNSAFE)
    def wire(amount: int) -> None:
        raise TimeoutError

    with pytest.raises(twiceshy.MissingScope):
        charge(1)
    with twiceshy.run("otel-7"):
        charge(1)
        charge(1)
        charge(1)
        charge(2)
        with pytest.raises(twiceshy.OutcomeUnknown):
            wire(1)
    counts = {
        tuple(sorted(dict(point.attributes).items())): point.value
        for point in telemetry.points("twiceshy.calls")
    }

    def labels(tool: str, effect: str, outcome: str, error: str | None = None) -> tuple[Any, ...]:
        found = {"twiceshy.tool": tool, "twiceshy.effect": effect, "twiceshy.outcome": outcome}
        if error is not None:
            found["error.type"] = error
        return tuple(sorted(found.items()))

    assert counts == {
        labels("charge", "keyed", "refused", "twiceshy.errors.MissingScope"): 1,
        labels("charge", "keyed", "executed"): 2,
        labels("charge", "keyed", "replayed"): 2,
        labels("wire", "unsafe", "unknown", OUTCOME_UNKNOWN): 1,
    }
    histogram = telemetry.points("twiceshy.call.duration")
    assert sum(point.count for point in histogram) == len(events) == 6
    assert sum(point.sum for point in histogram) == pytest.approx(sum(e.duration for e in events))
    assert {tuple(point.explicit_bounds) for point in histogram} == {otel.DURATION_BUCKETS}
    assert sum(e.outcome is Outcome.REPLAYED for e in events) == 2


class Garbled(Exception):
    """A provider's error whose message cannot be read (its ``__str__`` raises)."""

    def __str__(self) -> str:
        raise AttributeError("no attribute 'detail'")


def test_an_error_whose_message_cannot_be_read_is_still_traced_and_counted(
    telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    """The span gets status ERROR and the call its count, whatever the error's ``__str__`` does."""
    ledger, _ = telemetry.ledger()

    @ledger.tool(effect=twiceshy.KEYED, definite=[Garbled])
    def charge(amount: int) -> None:
        raise Garbled

    with twiceshy.run("otel-10"), pytest.raises(Garbled):
        charge(1)
    (span,) = telemetry.spans()
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["error.type"].endswith("Garbled")
    (point,) = telemetry.points("twiceshy.calls")
    assert point.value == 1
    assert "an observer failed" not in caplog.text


def test_importing_the_integration_leaves_opentelemetry_alone() -> None:
    """``twiceshy.integrations.opentelemetry`` does not shadow the ``opentelemetry`` package."""
    assert otel.__name__ == "twiceshy.integrations.opentelemetry"
    assert vars(otel)["trace"] is opentelemetry.trace
    assert sys.modules["opentelemetry"] is opentelemetry
    assert opentelemetry.__name__ == "opentelemetry"
    assert not hasattr(opentelemetry, "TwiceshyTelemetry")


GLOBAL_PROVIDERS = """
import json
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import twiceshy
from twiceshy.integrations.opentelemetry import TwiceshyTelemetry

ledger = twiceshy.Ledger("memory://")
ledger.observe(TwiceshyTelemetry())  # made before any provider is set
tool = ledger.tool(effect=twiceshy.KEYED, name="t")(lambda: 1)
with twiceshy.run("early"):
    tool()  # no SDK yet: a no-op

exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
tracer_provider = TracerProvider()
tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(tracer_provider)
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
with twiceshy.run("late"):
    tool()
    tool()
points = [
    (dict(p.attributes)["twiceshy.outcome"], p.value)
    for r in reader.get_metrics_data().resource_metrics
    for s in r.scope_metrics
    for m in s.metrics
    if m.name == "twiceshy.calls"
    for p in m.data.data_points
]
spans = [(s.name, s.attributes["twiceshy.outcome"]) for s in exporter.get_finished_spans()]
print(json.dumps({"spans": spans, "calls": sorted(points)}))
"""


def test_without_providers_it_follows_the_global_ones() -> None:
    """With no providers given, spans and metrics go to the global ones, even when set later.

    Run in a fresh interpreter: global providers can be set only once per process.
    """
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", GLOBAL_PROVIDERS],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "spans": [["twiceshy t", "executed"], ["twiceshy t", "replayed"]],
        "calls": [["executed", 1], ["replayed", 1]],
    }
