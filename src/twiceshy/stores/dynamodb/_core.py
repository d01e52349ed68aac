"""What a DynamoDB store and its async twin share: the settings, read from a URL or from keyword
arguments and checked once, the item layout, the clock and the error messages (no I/O).

:class:`Core` is made before anything is sent, so a bad setting is refused with a
:class:`ValueError` naming it before any request leaves.
"""

from __future__ import annotations

import functools
import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import parse_qsl, urlencode, urlsplit

import botocore.loaders  # type: ignore[import-untyped]

from .. import redacted_url
from .._skew import ClockSkew
from ._errors import Errors
from ._items import Layout

_TABLE_NAME: Final = re.compile(r"[A-Za-z0-9_.-]{3,255}")

# twiceshy's URL options, and how each is read.
_TEXT_OPTIONS: Final = (
    "region",
    "endpoint_url",
    "prefix",
    "profile",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
)
_NUMBER_OPTIONS: Final = ("connect_timeout", "read_timeout", "poll_interval", "create_timeout")
_WHOLE_OPTIONS: Final = ("max_attempts",)
_OPTIONS: Final = frozenset(_TEXT_OPTIONS + _NUMBER_OPTIONS + _WHOLE_OPTIONS)


def split_url(url: str) -> dict[str, Any]:
    """The keyword arguments of :class:`DynamoDBStore` a ``dynamodb://TABLE?...`` URL names.

    Raises:
        ValueError: the URL names no table, or an option is unknown, repeated or malformed.
    """
    safe = redacted_url(url)
    parts = urlsplit(url)
    if parts.scheme.lower() != "dynamodb" or not parts.netloc or parts.path not in ("", "/"):
        raise ValueError(
            f"not a DynamoDB ledger URL: {safe!r}; expected dynamodb://TABLE?region=REGION"
        )
    options: dict[str, Any] = {"table": parts.netloc}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in _OPTIONS:
            known = ", ".join(sorted(_OPTIONS))
            raise ValueError(
                f"DynamoDB ledger URL {safe!r}: unknown option {name!r} (known: {known})"
            )
        if name in options:
            raise ValueError(f"DynamoDB ledger URL {safe!r} repeats {name!r}")
        try:
            if name in _NUMBER_OPTIONS:
                options[name] = float(value)
            elif name in _WHOLE_OPTIONS:
                options[name] = int(value)
            else:
                options[name] = value
        except ValueError:
            raise ValueError(
                f"DynamoDB ledger URL {safe!r}: option {name}= must be a number"
            ) from None
    return options


@functools.cache
def data_loader() -> Any:
    """botocore's loader of service descriptions, shared by every store of the process: it only
    reads files that never change, and sharing it makes a store's client about 5x faster to
    build (each new loader reads and parses DynamoDB's whole description again)."""
    return botocore.loaders.create_loader()


class Core:
    """The settings of a DynamoDB ledger and what follows from them; documented on
    :class:`~twiceshy.stores.dynamodb.DynamoDBStore`."""

    def __init__(
        self,
        table: str,
        *,
        region: str | None,
        endpoint_url: str | None,
        prefix: str,
        profile: str | None,
        aws_access_key_id: str | None,
        aws_secret_access_key: str | None,
        aws_session_token: str | None,
        connect_timeout: float,
        read_timeout: float,
        max_attempts: int,
        poll_interval: float,
        create_timeout: float,
        clock: Callable[[], float] | None,
    ) -> None:
        if not _TABLE_NAME.fullmatch(table):
            raise ValueError(
                f"a DynamoDB table name is 3 to 255 letters, digits, '_', '-' or '.': {table!r}"
            )
        if "#" in prefix:
            raise ValueError(f"a DynamoDB ledger prefix must not contain '#': {prefix!r}")
        if endpoint_url is not None:
            endpoint = urlsplit(endpoint_url)
            if endpoint.scheme not in ("http", "https"):
                raise ValueError(
                    "endpoint_url= must be an http:// or https:// URL: "
                    f"{redacted_url(endpoint_url)!r}"
                )
            if endpoint.username is not None or endpoint.password is not None:
                # Requests are signed with AWS credentials; a URL's user part would only be
                # shown (in the SDK's own messages) and never used.
                raise ValueError(
                    f"endpoint_url= must not carry a user or password: "
                    f"{redacted_url(endpoint_url)!r}; give credentials as aws_access_key_id= "
                    "and aws_secret_access_key=, or through the SDK's usual places"
                )
        for name, seconds in (
            ("connect_timeout", connect_timeout),
            ("read_timeout", read_timeout),
            ("poll_interval", poll_interval),
            ("create_timeout", create_timeout),
        ):
            if not (seconds > 0 and math.isfinite(seconds)):
                raise ValueError(f"{name}= must be a positive number of seconds")
        if max_attempts < 1:
            raise ValueError("max_attempts= must be at least 1")
        if (aws_access_key_id is None) != (aws_secret_access_key is None):
            raise ValueError("aws_access_key_id= and aws_secret_access_key= go together")
        self.layout = Layout(table, prefix)
        self.region = region
        self.endpoint_url = endpoint_url
        self.profile = profile
        self.credentials = {
            "aws_access_key_id": aws_access_key_id,
            "aws_secret_access_key": aws_secret_access_key,
            "aws_session_token": aws_session_token,
        }
        self.connect_timeout = float(connect_timeout)
        self.read_timeout = float(read_timeout)
        self.max_attempts = max_attempts
        self.poll_interval = float(poll_interval)
        self.create_timeout = float(create_timeout)
        self.now: Callable[[], float] = clock if clock is not None else time.time
        shown = f"table {table!r}" + (f" in {region}" if region else "")
        if endpoint_url is not None:
            shown += f" at {redacted_url(endpoint_url)}"
        secrets = {
            k: v for k, v in self.credentials.items() if v is not None and k != "aws_access_key_id"
        }
        self.errors = Errors(shown, "dynamodb://?" + urlencode(secrets))
        # DynamoDB has no clock an expression can read: leases and expiry are on the callers'.
        self.skew = ClockSkew(f"DynamoDB ledger {self.errors.where}")
        self.closed = False
        self.schema_ready = False
        self.lock = threading.Lock()

    @property
    def table(self) -> str:
        """The table's name."""
        return self.layout.table

    @property
    def prefix(self) -> str:
        """The first part of every partition key of this ledger."""
        return self.layout.prefix

    def describe(self) -> str:
        """The settings a repr shows: never a secret."""
        endpoint = (
            ""
            if self.endpoint_url is None
            else f", endpoint_url={redacted_url(self.endpoint_url)!r}"
        )
        return f"{self.table!r}, region={self.region!r}{endpoint}, prefix={self.prefix!r}"

    def client_options(self) -> dict[str, Any]:
        """The keyword arguments of ``create_client``, less ``config``."""
        options: dict[str, Any] = {"region_name": self.region, "endpoint_url": self.endpoint_url}
        options.update({k: v for k, v in self.credentials.items() if v is not None})
        return options

    def config_options(self) -> dict[str, Any]:
        """The keyword arguments of botocore's ``Config`` (or aiobotocore's ``AioConfig``).

        The SDK's own retries stay on (``standard`` mode): DynamoDB throttles, and every request
        this store sends recognises itself when sent again after a lost answer (a claim by its
        owner token, a write by its ``write_id``, a count flush by its id).
        """
        return {
            "connect_timeout": self.connect_timeout,
            "read_timeout": self.read_timeout,
            "retries": {"mode": "standard", "max_attempts": self.max_attempts},
            "tcp_keepalive": True,
            "user_agent_extra": "twiceshy",
        }

    def check_open(self) -> None:
        """Raise :class:`~twiceshy.StoreError` once the store is closed."""
        if self.closed:
            raise self.errors.closed()
