"""A listen address is checked before a server binds it: taken, foreign, unresolvable."""

from __future__ import annotations

import socket

from sidecar_common.ports import bind_problem


def test_a_free_port_and_port_zero_have_no_problem() -> None:
    assert bind_problem("127.0.0.1", 0) is None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert bind_problem("127.0.0.1", port) is None


def test_a_taken_port_is_named_as_in_use() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        assert bind_problem("127.0.0.1", port) == (
            f"cannot listen on 127.0.0.1:{port}: the address is in use by another process"
        )
        # The wildcard covers the taken address too.
        assert "in use" in str(bind_problem("0.0.0.0", port))


def test_an_address_of_another_host_and_an_unresolvable_name() -> None:
    assert bind_problem("192.0.2.1", 0) == "cannot listen on 192.0.2.1:0: not an address of this host"
    assert "does not resolve" in str(bind_problem("host.invalid", 0))
    assert bind_problem("192.0.2.1", 0, serving="serve metrics on") == (
        "cannot serve metrics on 192.0.2.1:0: not an address of this host"
    )
