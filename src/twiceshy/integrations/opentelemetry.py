"""OpenTelemetry spans and metrics for every protected call, through the ledger's observer hook.

One line, where the ledger is made::

    ledger.observe(TwiceshyTelemetry())

For each protected call, once it is answered (a :class:`twiceshy.CallEvent`):

- a span ``twiceshy <tool>`` of kind INTERNAL, timed by the event, with the attributes
  ``twiceshy.tool``, ``twiceshy.key`` (when there is one), ``twiceshy.effect``,
  ``twiceshy.outcome`` and ``twiceshy.replayed`` (whether the caller got an earlier call's
  outcome rather than one of its own run); when the caller got an exception, status ERROR, the
  exception recorded as a span event and ``error.type``;
- one count on the counter ``twiceshy.calls`` and one point on the histogram
  ``twiceshy.call.duration`` (seconds), both with ``twiceshy.tool``, ``twiceshy.effect``,
  ``twiceshy.outcome`` and, on failure, ``error.type``; never the key, whose every value is new.

The span is opened before the call starts, in the caller's context (the observer's ``around``
hook), and is the current span while the call runs: its parent is the span current where the
tool was called, and the spans the tool opens while it runs (an HTTP request to the provider) are
its children. It is ended once the call is answered. An event told without the hook (the
observer called by hand) gets a span back-dated to the event's times.

Only ``opentelemetry-api`` is used; without an SDK configured every span and point is a no-op.
Install with ``pip install 'twiceshy[opentelemetry]'``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from opentelemetry import metrics, trace

from .. import CallEvent, Effect, __version__

__all__ = ["TwiceshyTelemetry"]

SCOPE = "twiceshy"
"""The instrumentation scope of the tracer and the meter (with twiceshy's version)."""

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
"""The histogram's advised bucket boundaries: OpenTelemetry's for durations in seconds."""


def _error_type(error: BaseException) -> str:
    """The exception's fully qualified class name, as ``error.type`` and ``exception.type`` say."""
    cls = type(error)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def _description(error: BaseException) -> str:
    """The span status's description: the type and message (a message that cannot be read,
    whose ``__str__`` raises, left out: the call is still recorded)."""
    try:
        message = str(error)
    except Exception:
        message = ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


class TwiceshyTelemetry:
    """A ledger observer that turns each protected call into a span and two metric points.

    Give it to a ledger with ``ledger.observe(TwiceshyTelemetry())`` or
    ``Ledger(..., observers=[TwiceshyTelemetry()])``. It keeps no per-call state: one instance
    may observe any number of ledgers, from any thread or task.

    Every call that ended in an exception gets status ERROR, whatever its outcome: the caller
    did not get a result. That includes twiceshy's honest answers (``OutcomeUnknown``,
    ``InProgress``), refusals before anything ran, and a recorded failure replayed to a retry;
    ``twiceshy.outcome`` tells them apart. A call that returned leaves the status unset, as
    OpenTelemetry asks of instrumentation.

    Args:
        tracer_provider: where spans go; by default the global one
            (``opentelemetry.trace.get_tracer_provider()``, followed once it is set).
        meter_provider: where metrics go; by default the global one, likewise.
    """

    __slots__ = ("_calls", "_duration", "_open", "_tracer")

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self._tracer = trace.get_tracer(SCOPE, __version__, tracer_provider=tracer_provider)
        # The span of the call being answered in this context (one per observer instance).
        self._open: ContextVar[trace.Span | None] = ContextVar("twiceshy_span", default=None)
        meter = metrics.get_meter(SCOPE, __version__, meter_provider=meter_provider)
        self._calls = meter.create_counter(
            "twiceshy.calls", unit="{call}", description="Protected tool calls, by outcome."
        )
        self._duration = meter.create_histogram(
            "twiceshy.call.duration",
            unit="s",
            description="How long protected tool calls took to be answered.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )

    @contextmanager
    def around(self, tool: str, effect: Effect) -> Iterator[None]:
        """The call's span, current while the call runs (the ledger enters it for each call)."""
        with self._tracer.start_as_current_span(
            f"twiceshy {tool}",
            kind=trace.SpanKind.INTERNAL,
            attributes={"twiceshy.tool": tool, "twiceshy.effect": effect.value},
            # __call__ records what the caller got; the ledger's own exit must not add to it.
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            token = self._open.set(span)
            try:
                yield
            finally:
                self._open.reset(token)

    def __call__(self, event: CallEvent) -> None:
        """Record one answered call: its span, its count and its duration."""
        labels = {
            "twiceshy.tool": event.tool,
            "twiceshy.effect": event.effect.value,
            "twiceshy.outcome": event.outcome.value,
        }
        if event.error is not None:
            labels["error.type"] = _error_type(event.error)
        attributes: dict[str, str | bool] = {**labels, "twiceshy.replayed": event.replayed}
        if event.key is not None:
            attributes["twiceshy.key"] = event.key
        span = self._open.get()
        opened = span is None
        start = round(event.started * 1e9)
        end = start + round(event.duration * 1e9)
        if span is None:
            # Told without ``around``: a span back-dated to when the call began.
            span = self._tracer.start_span(
                f"twiceshy {event.tool}",
                kind=trace.SpanKind.INTERNAL,
                attributes=attributes,
                start_time=start,
            )
        else:
            span.set_attributes(attributes)
            end = time.time_ns()
        if event.error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, _description(event.error)))
            try:
                # Escaped: the caller got it, the span's operation did not handle it.
                span.record_exception(event.error, timestamp=end, escaped=True)
            except Exception:  # the SDK reads the message, whose __str__ raised
                span.add_event("exception", {"exception.type": labels["error.type"]}, timestamp=end)
        if opened:
            span.end(end_time=end)
        self._calls.add(1, labels)
        self._duration.record(event.duration, labels)

    def __repr__(self) -> str:
        return "TwiceshyTelemetry()"
