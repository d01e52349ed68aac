"""How large and how deep arguments may be, and that keying stays cheap for hostile values."""

from __future__ import annotations

import hashlib
import sys

import pytest

import twiceshy
from twiceshy import canonical_json
from twiceshy._canonical import canonical_digest

MIB = 1_048_576


@pytest.fixture
def ledger() -> twiceshy.Ledger:
    return twiceshy.Ledger("memory://", counts_interval=None)


def test_arguments_past_the_size_bound_are_refused_naming_the_option(
    ledger: twiceshy.Ledger,
) -> None:
    """Past 1 MiB the call is refused before it runs, and the error says which option lifts it;
    max_arg_bytes= lifts it."""
    runs: list[int] = []

    @ledger.tool(effect=twiceshy.KEYED)
    def store_document(text: str) -> int:
        runs.append(len(text))
        return len(text)

    @ledger.tool(effect=twiceshy.KEYED, max_arg_bytes=4 * MIB)
    def store_large(text: str) -> int:
        runs.append(len(text))
        return len(text)

    document = "x" * (2 * MIB)
    with twiceshy.run("run-1"):
        with pytest.raises(twiceshy.UnkeyableValue) as refused:
            store_document(document)
        assert store_large(document) == 2 * MIB
    assert "larger than 1048576 bytes; the call did not run" in str(refused.value)
    assert "max_arg_bytes=" in str(refused.value)
    assert "key_args=" in str(refused.value)
    assert refused.value.bound == "max_bytes"
    assert runs == [2 * MIB]


def test_a_document_beside_its_keyed_arguments_is_fingerprinted_not_bounded(
    ledger: twiceshy.Ledger,
) -> None:
    """With key_args, a 3 MiB document is kept as a fingerprint: the same document replays,
    another one under the same key is refused and nothing runs."""
    runs: list[str] = []

    @ledger.tool(effect=twiceshy.UNSAFE, key_args=["name"])
    def upload(name: str, document: str) -> str:
        runs.append(name)
        return name

    document = "é" * (3 * MIB // 2)
    with twiceshy.run("run-2"):
        assert upload("report.txt", document) == "report.txt"
        assert upload("report.txt", document) == "report.txt"
        with pytest.raises(twiceshy.KeyReuseMismatch):
            upload("report.txt", document + "!")
    assert runs == ["report.txt"]
    (record,) = ledger.store.records("")
    text = canonical_json({"name": "report.txt", "document": document}, max_bytes=8 * MIB)
    assert record.fingerprint == hashlib.sha256(f"upload:{text}".encode()).hexdigest()


def test_arguments_past_the_depth_bound_are_refused_naming_the_option(
    ledger: twiceshy.Ledger,
) -> None:
    """Nesting past the bound names max_arg_depth=, which lifts it."""

    @ledger.tool(effect=twiceshy.KEYED)
    def shallow(tree: object) -> None:
        return None

    @ledger.tool(effect=twiceshy.KEYED, max_arg_depth=200)
    def deep(tree: object) -> None:
        return None

    tree: object = []
    for _ in range(100):
        tree = [tree]
    with twiceshy.run("run-3"):
        with pytest.raises(twiceshy.UnkeyableValue, match="max_arg_depth="):
            shallow(tree)
        assert deep(tree) is None


def test_bounds_must_be_positive_whole_numbers(ledger: twiceshy.Ledger) -> None:
    """A bound of 0, a bool or a float is refused when the tool is declared."""
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="max_arg_bytes"):
            ledger.guard("g", effect=twiceshy.KEYED, max_arg_bytes=bad)  # type: ignore[arg-type]


def test_big_integers_are_written_exactly() -> None:
    """Integers past Python's int-to-str limit are written in full, signs included."""
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        for value in (7**60_000, -(3**40_001), 10**9_999 + 1):
            assert canonical_json({"n": value}) == '{"n":' + str(value) + "}"
            assert canonical_json([value]) == "[" + str(value) + "]"
    finally:
        sys.set_int_max_str_digits(old)


def test_an_integer_too_long_for_the_bound_is_refused_unwritten() -> None:
    """A hostile integer (tens of millions of digits) is refused by its size alone."""
    hostile = 1 << 100_000_000  # about 30 million digits
    with pytest.raises(twiceshy.UnkeyableValue, match="larger than"):
        canonical_json({"n": hostile})


@pytest.mark.parametrize(
    "value",
    [
        {"a": 1, "b": [1.5, None, True], "c": {"é": "\ud83d\ude00", "lone": "\udc00"}},
        ["x" * 70_000, {"k": "y" * 70_000}, "\ud83d\ude00" * 40_000],
        {str(n): n for n in range(5_000)},
    ],
)
def test_a_fingerprint_hashed_as_written_equals_the_whole_texts(value: object) -> None:
    """Hashing the canonical text piece by piece gives the SHA-256 of the whole text."""
    text = canonical_json(value, max_bytes=8 * MIB)
    expected = hashlib.sha256(b"tool:" + text.encode()).hexdigest()
    assert canonical_digest(value, b"tool:") == expected
