"""The secrets twiceshy never shows: one place hides them for reprs, logs, errors and the CLI.

What shows a URL or a message about one goes through :func:`hide_secrets`: the password of any
URL in it, the value of any setting named like a secret (``password=``, ``sslpassword=``,
``token=``...) in a URL's query or a connection string, and the secrets of the ledger URL the
line is about wherever a driver quoted them (a message may quote a URL that does not parse, or a
driver's own rewording of it). :func:`twiceshy.stores.redacted_url` is :func:`redacted`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Final
from urllib.parse import unquote, unquote_plus

__all__ = ["hide_secrets", "redacted", "scrubbed"]

_HIDDEN: Final = "***"
_SHORTEST_SCRUBBED: Final = 4
# A name=value setting: a URL's query parameter, a key=value connection string's keyword. Each
# pattern starts only where a run of its characters starts: a long message is read once.
_SETTING: Final = re.compile(
    r"(?<![A-Za-z0-9_.%-])(?P<head>(?P<name>[A-Za-z_%][A-Za-z0-9_.%-]*) *= *)"
    r"(?P<secret>'(?:[^'\\]|\\.)*'?|[^\s&#]*)"
)
# The settings whose value is a secret: libpq's password and sslpassword, redis-py's password,
# and the like (a name is read percent-decoded, as the drivers read it).
_SECRET_NAME: Final = re.compile(r"pass|pwd|secret|token|auth", re.IGNORECASE)
# What a message puts after a value it quotes: a value already hidden, followed by these, is
# left alone.
_ALREADY_HIDDEN: Final = re.compile(r"\*\*\*['\")\]},:;.]*")


def _passwords(text: str) -> Iterator[tuple[int, int]]:
    """Where the passwords of the URLs in ``text`` are, as ``(start, end)`` offsets.

    A URL's password follows ``user:`` up to the last ``@`` before its query: found even in a
    URL that does not parse (a bad host or port; a password with a ``/`` left unencoded, as
    base64 has one), and in any text quoting one. Read piece by piece, so that a long message
    is read once (a pattern would try every ``://`` against the rest of the text).
    """
    offset = 0
    for token in re.split(r"(\s+)", text):
        pieces = token.split("://")
        at = offset + len(pieces[0]) + 3  # where the piece after a "://" starts in the text
        for piece in pieces[1:]:
            authority = re.split(r"[?#]", piece, maxsplit=1)[0]
            user, colon, password = authority[: max(authority.rfind("@"), 0)].partition(":")
            if colon and "/" not in user and not _ALREADY_HIDDEN.fullmatch(password):
                start = at + len(user) + 1
                yield start, start + len(password)
            at += len(piece) + 3
        offset += len(token)


def _hide_passwords(text: str) -> str:
    kept: list[str] = []
    last = 0
    for start, end in _passwords(text):
        kept += [text[last:start], _HIDDEN]
        last = end
    return "".join(kept) + text[last:]


def _hide_setting(match: re.Match[str]) -> str:
    if not _SECRET_NAME.search(unquote(match["name"])) or _ALREADY_HIDDEN.fullmatch(
        match["secret"]
    ):
        return match[0]
    return match["head"] + _HIDDEN


def _secrets(url: str) -> set[str]:
    """The secrets of a URL, as written and as a driver may quote them (percent-decoded)."""
    found = {url[start:end] for start, end in _passwords(url)}
    found |= {
        m["secret"] for m in _SETTING.finditer(url) if _SECRET_NAME.search(unquote(m["name"]))
    }
    forms = set()
    for secret in found:
        bare = secret.strip("'")
        forms |= {secret, bare, unquote(bare), unquote_plus(bare)}
    return {s for s in forms if s and not _ALREADY_HIDDEN.fullmatch(s)}


def hide_secrets(text: str, url: str | None = None) -> str:
    """``text`` without secrets, for every line the command line prints about a ledger.

    The password of every URL in it, and the value of every setting named like a secret
    (``password=``, ``sslpassword=``, ``token=``...), whether a URL's query parameter or a
    connection string's keyword, become ``***``; so do the secrets of ``url`` wherever they
    appear, percent-decoded too (a driver may quote them so).

    Args:
        text: a URL, or a message that may quote one.
        url: the ledger URL the message is about, if known.
    """
    if url is not None:
        # The longest first: a secret may contain a shorter one. One of a few characters is
        # left to the URL-shaped passes: hiding every "1" of a message would garble its ports
        # and counts, and so short a password hides nothing anyway.
        for secret in sorted(_secrets(url), key=len, reverse=True):
            if len(secret) >= _SHORTEST_SCRUBBED:
                text = text.replace(secret, _HIDDEN)
    return _SETTING.sub(_hide_setting, _hide_passwords(text))


def redacted(url: str) -> str:
    """The URL without its secrets."""
    return hide_secrets(url, url)


def scrubbed(message: str, url: str) -> str:
    """A message about the ledger ``url`` without the URL's secrets."""
    return hide_secrets(message, url)
