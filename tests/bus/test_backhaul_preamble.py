"""The backhaul's preamble (bus/contract/backhaul.py): what an edge sends a worker, and what the worker refuses."""

from __future__ import annotations

import pytest

from bus.contract.backhaul import MAX_LINE, PreambleError, error_line, parse_request, ping_line, request_line
from bus.transport.addresses import is_loopback, source_address


def test_a_request_line_reads_back() -> None:
    assert parse_request(request_line("0123456789abcd", 8080)) == ("0123456789abcd", 8080)
    assert parse_request(ping_line()) is None


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"GET / HTTP/1.1\r\n", "expected 'FAUXMAD-BACKHAUL/1 <machine id> <port>'"),
        (b"FAUXMAD-BACKHAUL/1 0123456789abcd\n", "expected"),
        (b"FAUXMAD-BACKHAUL/2 0123456789abcd 80\n", "expected"),
        (b"FAUXMAD-BACKHAUL/1 ../etc/passwd 80\n", "no valid machine id"),
        (b"FAUXMAD-BACKHAUL/1 0123456789ABCD 80\n", "no valid machine id"),
        (b"FAUXMAD-BACKHAUL/1 0123456789abcd 0\n", "no valid port"),
        (b"FAUXMAD-BACKHAUL/1 0123456789abcd 65536\n", "no valid port"),
        (b"FAUXMAD-BACKHAUL/1 0123456789abcd -1\n", "no valid port"),
        (b"FAUXMAD-BACKHAUL/1 0123456789abcd \xff\n", "not ASCII"),
    ],
)
def test_anything_else_is_refused_with_its_reason(line: bytes, why: str) -> None:
    with pytest.raises(PreambleError, match=why.replace("(", r"\(").replace(")", r"\)")):
        parse_request(line)


def test_an_error_is_one_line_within_the_limit() -> None:
    line = error_line("machine x\nhas\r\nno port " + "y" * 1000)
    assert line.startswith(b"error machine x has no port y") and line.endswith(b"\n")
    assert line.count(b"\n") == 1 and len(line) <= MAX_LINE


def test_loopback_is_its_own_source_address() -> None:
    assert source_address("127.0.0.1", 4222) == "127.0.0.1"
    assert is_loopback("127.0.0.2") and is_loopback("::1") and not is_loopback("10.0.0.11")
