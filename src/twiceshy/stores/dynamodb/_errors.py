"""botocore's failures as twiceshy's errors, for both DynamoDB stores (no I/O).

Every error a store raises is a :class:`~twiceshy.StoreError` chained ``from`` the SDK's own:
a server that cannot be reached, a connection that broke, or throttling that outlasted the
SDK's retries is a :class:`~twiceshy.StoreUnavailable`. Each message says what the ledger was
doing and, where it can, what to do; no message shows a secret of the ledger's settings. The
callers write the ``raise ... from`` themselves, so the traceback shows where the failure met
the store.
"""

from __future__ import annotations

from typing import Final

from botocore.exceptions import (  # type: ignore[import-untyped]
    ClientError,
    ConnectionError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from ..._redaction import scrubbed
from ...errors import StoreError, StoreUnavailable

CONDITION_FAILED: Final = "ConditionalCheckFailedException"
NO_TABLE: Final = "ResourceNotFoundException"
TABLE_IN_USE: Final = "ResourceInUseException"

# Answers that say the table is busy rather than wrong; botocore has already retried them.
_BUSY: Final = frozenset(
    {
        "ProvisionedThroughputExceededException",
        "ThrottlingException",
        "RequestLimitExceeded",
        "InternalServerError",
        "ServiceUnavailable",
        "LimitExceededException",
    }
)
_REFUSED: Final = frozenset(
    {
        "AccessDeniedException",
        "UnrecognizedClientException",
        "InvalidSignatureException",
        "MissingAuthenticationTokenException",
        "ExpiredTokenException",
        "IncompleteSignatureException",
    }
)


def code(exc: BaseException) -> str | None:
    """The error code of a DynamoDB answer (``ConditionalCheckFailedException``...), if any."""
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", "")) or None
    return None


class Errors:
    """Turns the SDK's failures into twiceshy's errors for one ledger.

    Args:
        where: the ledger as messages name it (table, region, endpoint; never a secret).
        secrets: a URL-shaped text holding the ledger's secrets (its URL, or its credentials
            as query parameters), each hidden from every message as ``***``.
    """

    __slots__ = ("_secrets", "where")

    def __init__(self, where: str, secrets: str) -> None:
        self.where = where
        self._secrets = secrets

    def scrub(self, message: str) -> str:
        """``message`` without the ledger's secrets."""
        return scrubbed(message, self._secrets)

    def of(self, what: str, exc: BaseException) -> StoreError:
        """The twiceshy error for ``exc``, met while doing ``what``."""
        said = self.scrub(str(exc))
        found = code(exc)
        if isinstance(exc, ConnectionError | HTTPClientError):
            return StoreUnavailable(
                f"DynamoDB ledger {self.where} cannot be reached ({what}): {said}. Check "
                "endpoint_url= and region= in the ledger URL, and that the server is running"
            )
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return StoreError(
                f"DynamoDB ledger {self.where} ({what}): {said}. Give AWS credentials: the "
                "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), a profile (profile= "
                "in the ledger URL), or a role of the machine"
            )
        if found in _BUSY:
            return StoreUnavailable(
                f"DynamoDB ledger {self.where} is overloaded ({what}), after the SDK's "
                f"retries: {said}. Raise the table's capacity, or use on-demand capacity"
            )
        if found in _REFUSED:
            return StoreError(
                f"DynamoDB refused the ledger's request ({what}) on {self.where}: {said}. "
                "Check the credentials, and that they allow the actions listed in "
                "docs/stores/dynamodb.md (IAM permissions)"
            )
        if found == NO_TABLE:
            return StoreError(
                f"DynamoDB ledger {self.where} ({what}): the table does not exist (deleted "
                f"since it was opened?): {said}"
            )
        if found == "ValidationException" and "size" in said.lower():
            return StoreError(
                f"DynamoDB ledger {self.where} ({what}): {said}. An item holds at most 400 KB: "
                "keep results smaller, e.g. Ledger(max_result_bytes=300_000)"
            )
        if isinstance(exc, UnicodeError):
            return StoreError(
                f"DynamoDB ledger cannot store text that is not UTF-8 ({what}): {said}"
            )
        return StoreError(f"DynamoDB ledger {self.where} failed ({what}): {said}")

    def closed(self) -> StoreError:
        """The error for a store used after ``close()``."""
        return StoreError(f"DynamoDB ledger {self.where} is closed")
