"""A kit to test your own tools for double effects: does a retry charge the card twice?

The incident to re-enact: a tool takes effect, its answer is lost (a timeout), and something
retries it. The kit has the three parts of that scene and the assertions to judge it:

- :class:`FakeProvider`: a payment or mail provider in the test's process that records every
  request and effect, deduplicates by idempotency key when told to (the provider a KEYED tool
  needs), and can take effect and then lose the answer (:meth:`FakeProvider.lose_answers`).
  :meth:`FakeProvider.serve` puts it behind HTTP on loopback.
- :class:`LoseAnswers`: wraps a function of yours (your provider's client) so that its calls
  happen and then raise, ``times`` times. For HTTP, :mod:`twiceshy.testing.httpx` and
  :mod:`twiceshy.testing.httpx2` have transports that do the same to requests.
- :func:`assert_took_effect_once`, :func:`assert_no_effect`, :func:`assert_same_key`: their
  failures list every request seen, its key and what became of it.

The pytest plugin (:mod:`twiceshy.testing.plugin`, registered by ``pip install twiceshy``) adds
the fixtures ``twiceshy_ledger``, ``twiceshy_ledger_factory`` and ``fake_provider``.

    >>> import twiceshy
    >>> from twiceshy.testing import FakeProvider, assert_took_effect_once
    >>> provider = FakeProvider(deduplicate=True)
    >>> ledger = twiceshy.Ledger("memory://")
    >>> @ledger.tool(effect=twiceshy.KEYED)
    ... def charge(amount: int, customer: str) -> str:
    ...     key = twiceshy.current_key()
    ...     return provider.charge(amount, customer, idempotency_key=key)["id"]
    >>> provider.lose_answers(times=1)  # the first attempt takes effect; its answer is lost
    >>> with twiceshy.run("run-1"):
    ...     charge(4900, "cus_1")
    'ch_1'
    >>> assert_took_effect_once(provider).handling
    <Handling.APPLIED: 'applied'>

The kit needs nothing outside the standard library; the HTTP transports need their client.
"""

from ._assertions import Recorded, assert_no_effect, assert_same_key, assert_took_effect_once
from ._errors import AnswerLost, IdempotencyKeyReused, ProviderDown
from ._faults import LoseAnswers
from ._provider import FakeProvider
from ._requests import Handling, ProviderRequest

__all__ = [
    "AnswerLost",
    "FakeProvider",
    "Handling",
    "IdempotencyKeyReused",
    "LoseAnswers",
    "ProviderDown",
    "ProviderRequest",
    "Recorded",
    "assert_no_effect",
    "assert_same_key",
    "assert_took_effect_once",
]
