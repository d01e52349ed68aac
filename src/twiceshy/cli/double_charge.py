"""The double charge that ``twiceshy demo`` re-enacts on this machine.

The testing kit's provider double (:class:`twiceshy.testing.FakeProvider`) listens on
127.0.0.1. It commits every charge at once but answers the first request of each act only after
the client's read timeout has passed, so the agent sees a timeout for a charge that went
through. Three acts run the same story:

1. a plain retry loop: the retry charges the customer a second time. That double charge is the
   failure twiceshy exists for, and the report paints it red;
2. a ``KEYED`` tool: every attempt sends the same idempotency key, the provider deduplicates, and
   every later call gets the first charge. A third call comes later, as a model's does when it
   reads the timeout in its history: the ledger answers it, and the provider never sees it;
3. an ``UNSAFE`` tool (a provider that cannot deduplicate): the caller gets ``OutcomeUnknown``,
   and nothing runs the charge again.

:func:`run_demo` returns the numbers as a :class:`DemoResult`; with a console it also prints them:
a charge count above one in red (the customer paid twice), one in green.
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Final

from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

import twiceshy
from twiceshy.testing import FakeProvider

from .._redaction import redacted

__all__ = ["Act", "Call", "DemoResult", "print_report", "run_demo"]

CLIENT_TIMEOUT: Final = 0.3
"""The client's read timeout, in seconds."""

LATE_BY: Final = 0.3
"""How long after the client's timeout the provider answers the first request of an act."""

AMOUNT: Final = 4900
"""The charge, in cents."""

Tool = Callable[[int, str], str]


class ProviderError(Exception):
    """The provider refused the request: it certainly made no charge."""


# -- the payment provider ------------------------------------------------------------------------


@contextmanager
def _provider_running() -> Iterator[_Client]:
    """The testing kit's provider double (deduplicating by key, as Stripe does), served on
    loopback while the block runs."""
    provider = FakeProvider(deduplicate=True)
    with provider.serve() as base:
        yield _Client(base, provider)


class _Client:
    """The agent's HTTP client for the provider: ``urllib`` with a short read timeout."""

    def __init__(self, base_url: str, provider: FakeProvider) -> None:
        self._base = base_url
        self._provider = provider
        # No proxies: the provider is on this machine, whatever the environment says.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def answer_late(self) -> None:
        """The provider makes the next charge, but answers past the client's read timeout."""
        self._provider.lose_answers(late=CLIENT_TIMEOUT + LATE_BY)

    def create_charge(self, amount: int, customer: str, *, key: str | None = None) -> str:
        """Create a charge; the id of the charge.

        Raises:
            TimeoutError: the answer did not come in time (the charge may have been made).
            urllib.error.URLError: the provider could not be reached, or timed out while
                connecting.
            ProviderError: the provider refused the request.
        """
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        request = urllib.request.Request(
            f"{self._base}/v1/charges",
            data=json.dumps({"amount": amount, "customer": customer}).encode(),
            headers=headers,
            method="POST",
        )
        try:
            with self._opener.open(request, timeout=CLIENT_TIMEOUT) as response:
                charge = json.load(response)
        except urllib.error.HTTPError as exc:
            with exc:
                raise ProviderError(f"HTTP {exc.code}: {exc.read().decode()}") from None
        return str(charge["id"])

    def books(self, customer: str) -> tuple[list[str], int]:
        """The provider's charges for a customer, and how many charge requests it received."""
        mine = [
            seen
            for seen in self._provider.requests
            if seen.operation == "POST /v1/charges" and seen.fields.get("customer") == customer
        ]
        charges = [str(seen.answer["id"]) for seen in mine if seen.took_effect]
        return charges, len(mine)


# -- the results ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    """One call the agent made, and what it got.

    Attributes:
        charge_id: the charge id the call returned, or ``None`` when it raised.
        error: the type name of what it raised, or ``None``.
        message: ``str()`` of what it raised, or ``""``.
        reached_provider: whether the provider received a request during the call.
        created: the charges the provider made during the call.
    """

    charge_id: str | None
    error: str | None
    message: str
    reached_provider: bool
    created: tuple[str, ...]

    def describe(self, *, charged_before: bool = False, later: bool = False) -> Text:
        """One line for the report.

        Args:
            charged_before: the act's customer was already charged before this call, so a
                charge it made is a second one: the double charge, in red.
            later: the model's later call (not a retry of an error): said so.
        """
        if self.error is not None:
            got = "timeout" if self.error in ("TimeoutError", "URLError") else self.error
            if self.created:
                note = f" (charged {', '.join(self.created)})"
            elif self.reached_provider:
                note = " (no new charge)"
            else:
                note = ", provider not called"
            return Text.assemble((got, "yellow"), note)
        if self.created and charged_before:
            return Text.assemble((str(self.charge_id), "bold red"), (", charged AGAIN", "bold red"))
        if self.created:
            return Text.assemble((str(self.charge_id), "bold"), ", a new charge")
        if self.reached_provider:
            return Text.assemble((str(self.charge_id), "bold"), ", deduplicated by key")
        if later:
            return Text.assemble((str(self.charge_id), "bold"), ", replayed (a later call)")
        return Text.assemble((str(self.charge_id), "bold"), ", replayed from the ledger")


@dataclass(frozen=True, slots=True)
class Act:
    """One act of the demo.

    Attributes:
        title: what protects the charge.
        subtitle: how.
        calls: the calls the agent made, in order.
        charges: the charges the provider holds for the act's customer, in order.
        requests: how many charge requests reached the provider.
        expected: how many charges the act should end with (2 for the plain loop: the story
            shows the double charge happening).
        later: whether the last call is the model's later one, made after the act's retries.
    """

    title: str
    subtitle: str
    calls: tuple[Call, ...]
    charges: tuple[str, ...]
    requests: int
    expected: int
    later: bool = False

    @property
    def ok(self) -> bool:
        """Whether the provider holds the expected number of charges."""
        return len(self.charges) == self.expected

    @property
    def charged_twice(self) -> bool:
        """Whether the customer was charged more than once for the one purchase."""
        return len(self.charges) > 1

    def describe_calls(self) -> Text:
        """The act's calls, one line each; a second charge in red."""
        lines = []
        charged = False
        for number, call in enumerate(self.calls, 1):
            later = self.later and number == len(self.calls)
            lines.append(call.describe(charged_before=charged, later=later))
            charged = charged or bool(call.created)
        return Text("\n").join(lines)


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What the demo found.

    Attributes:
        plain: act 1, the plain retry loop.
        keyed: act 2, the ``KEYED`` tool.
        unsafe: act 3, the ``UNSAFE`` tool.
        message: what the model reads in act 3: ``str()`` of the ``OutcomeUnknown``.
        ledger_url: the ledger the acts used, as shown (without its secrets).
        scope: the run scope of this demo run.
        seconds: how long the acts took.
    """

    plain: Act
    keyed: Act
    unsafe: Act
    message: str
    ledger_url: str
    scope: str
    seconds: float

    @property
    def acts(self) -> tuple[Act, Act, Act]:
        """The three acts, in order."""
        return self.plain, self.keyed, self.unsafe

    @property
    def ok(self) -> bool:
        """Whether the story came out as told: 2, 1 and 1 charges, one id, an honest error."""
        keyed_ids = {c.charge_id for c in self.keyed.calls if c.charge_id is not None}
        return (
            all(act.ok for act in self.acts)
            and keyed_ids == set(self.keyed.charges)
            and all(c.error == "OutcomeUnknown" for c in self.unsafe.calls)
            and bool(self.message)
        )


# -- the acts -------------------------------------------------------------------------------------


def _call(tool: Tool, customer: str, client: _Client) -> tuple[Call, BaseException | None]:
    """Make one call as the agent, watching the provider's books around it."""
    charges_before, requests_before = client.books(customer)
    charge_id: str | None = None
    error: Exception | None = None
    try:
        charge_id = tool(AMOUNT, customer)
    except Exception as exc:  # whatever the agent would see
        error = exc
    charges_after, requests_after = client.books(customer)
    call = Call(
        charge_id=charge_id,
        error=None if error is None else type(error).__name__,
        message="" if error is None else str(error),
        reached_provider=requests_after > requests_before,
        created=tuple(c for c in charges_after if c not in charges_before),
    )
    return call, error


def _act(
    title: str,
    subtitle: str,
    tool: Tool,
    customer: str,
    client: _Client,
    *,
    expected: int,
    again: bool = False,
) -> tuple[Act, list[BaseException]]:
    """The agent calls the tool, retries once on an error (as frameworks do), maybe calls again.

    The act's first charge request is made at once and answered past the client's timeout.
    """
    calls: list[Call] = []
    errors: list[BaseException] = []
    client.answer_late()
    for _ in range(2):
        call, error = _call(tool, customer, client)
        calls.append(call)
        if error is None:
            break
        errors.append(error)
    if again:
        # Later, the model calls the tool once more: it saw the timeout in its history.
        call, error = _call(tool, customer, client)
        calls.append(call)
        if error is not None:
            errors.append(error)
    charges, requests = client.books(customer)
    act = Act(title, subtitle, tuple(calls), tuple(charges), requests, expected, later=again)
    return act, errors


def _acts(ledger: twiceshy.Ledger, scope: str, client: _Client) -> tuple[Act, Act, Act, str]:
    def plain_charge(amount: int, customer: str) -> str:
        return client.create_charge(amount, customer)

    # attempts=1 lets the timeout reach the caller, so the retry is visibly the caller's own.
    @ledger.tool(effect=twiceshy.KEYED, attempts=1, definite=[ProviderError])
    def create_charge(amount: int, customer: str) -> str:
        return client.create_charge(amount, customer, key=twiceshy.current_key())

    # A provider that cannot deduplicate: no key is sent, and the tool says so.
    @ledger.tool(effect=twiceshy.UNSAFE, definite=[ProviderError])
    def create_charge_unkeyed(amount: int, customer: str) -> str:
        return client.create_charge(amount, customer)

    plain, _ = _act(
        "plain retry loop",
        "retries, no key",
        plain_charge,
        "cus_act1_plain",
        client,
        expected=2,
    )
    with twiceshy.run(scope):
        keyed, _ = _act(
            "twiceshy, KEYED",
            "same key each try",
            create_charge,
            "cus_act2_keyed",
            client,
            expected=1,
            again=True,
        )
        unsafe, errors = _act(
            "twiceshy, UNSAFE",
            "cannot dedupe",
            create_charge_unkeyed,
            "cus_act3_unsafe",
            client,
            expected=1,
        )
    unknown = [e for e in errors if isinstance(e, twiceshy.OutcomeUnknown)]
    return plain, keyed, unsafe, str(unknown[0]) if unknown else ""


def run_demo(ledger_url: str | None = None, *, console: Console | None = None) -> DemoResult:
    """Re-enact the double charge, and twiceshy preventing it.

    Args:
        ledger_url: the ledger to use; by default a fresh SQLite file in a temporary directory,
            removed afterwards. Every run uses a scope of its own, so a persistent ledger can be
            used again and again.
        console: where to print the story; nothing is printed without one.

    Returns:
        The calls, charges and messages of the three acts.

    Raises:
        ValueError: the ledger URL names no known store.
        twiceshy.StoreError: the ledger cannot be used.
    """
    scope = f"demo-run-{secrets.token_hex(6)}"
    with ExitStack() as stack:
        if ledger_url is None:
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="twiceshy-demo-"))
            url = "sqlite:///" + f"{directory}/ledger.db"
        else:
            url = ledger_url
        ledger = stack.enter_context(twiceshy.Ledger(url))
        if console is not None:
            _print_intro(console)
            stack.enter_context(console.status("Re-enacting the incident...", spinner="dots"))
        started = time.perf_counter()
        client = stack.enter_context(_provider_running())
        plain, keyed, unsafe, message = _acts(ledger, scope, client)
    result = DemoResult(
        plain=plain,
        keyed=keyed,
        unsafe=unsafe,
        message=message,
        ledger_url=redacted(url) if ledger_url is not None else "a fresh SQLite file (temporary)",
        scope=scope,
        seconds=time.perf_counter() - started,
    )
    if console is not None:
        print_report(result, console)
    return result


# -- the report -----------------------------------------------------------------------------------


def _print_intro(console: Console) -> None:
    console.print(
        Text.assemble(
            ("twiceshy demo", "bold"),
            f": an agent charges a customer ${AMOUNT / 100:.2f}. The payment provider makes the "
            f"charge, but answers after the client's {CLIENT_TIMEOUT} s read timeout: the first "
            "call of every act times out, and the agent calls again.",
        )
    )


def print_report(result: DemoResult, console: Console) -> None:
    """Print the acts as a table, the message the model reads, and the verdict.

    A charge count above one (the customer paid twice) is red, one is green.
    """
    table = Table(
        title="One timeout, three ways",
        title_style="bold",
        box=box.ROUNDED,
        header_style="bold",
        show_lines=True,
    )
    table.add_column("act", width=17)
    table.add_column("calls\nmade", justify="right")
    table.add_column("charges\nat the\nprovider", justify="right")
    table.add_column("what the caller / model got")
    for act in result.acts:
        charges = len(act.charges)
        table.add_row(
            Text.assemble((act.title, "bold"), "\n", (act.subtitle, "dim")),
            str(len(act.calls)),
            Text(str(charges), style="bold red" if act.charged_twice else "bold green"),
            act.describe_calls(),
        )
    console.print()
    console.print(table)
    if result.keyed.later:
        console.print(
            Text.assemble(
                ("KEYED, third call: ", "bold"),
                "later in the run the model calls the tool again (it read the timeout in its "
                "history). Same arguments, same intent: the ledger answers with the first "
                "charge, and the provider never sees the call.",
            )
        )
    if result.message:
        console.print(
            Panel(
                Text(result.message),
                title="what the model reads after the UNSAFE act: str(OutcomeUnknown)",
                title_align="left",
                border_style="yellow",
            )
        )
    console.print(_verdict(result))
    console.print(
        f"ledger: {result.ledger_url}; scope: {result.scope}; {result.seconds:.1f} s",
        style="dim",
        markup=False,
        highlight=False,
    )


def _verdict(result: DemoResult) -> Text:
    """The story in two lines: the double charge in red, twiceshy's single charges in green."""
    if not result.ok:
        counts = " / ".join(str(len(act.charges)) for act in result.acts)
        return Text(
            f"The demo did not come out as told: charges at the provider {counts}, not 2 / 1 / 1.",
            style="bold red",
        )
    times = len(result.plain.charges)
    return Text.assemble(
        (
            "Without twiceshy, the plain retry loop charged the customer "
            f"{'twice' if times == 2 else f'{times} times'} for one purchase: the double "
            "charge twiceshy exists to prevent.",
            "bold red",
        ),
        "\n",
        (
            "With twiceshy, one charge each: KEYED (the provider deduplicated by key, the "
            "ledger replayed the rest), UNSAFE (OutcomeUnknown, never run again).",
            "bold green",
        ),
    )
