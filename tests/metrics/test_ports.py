"""The metrics port: checked the way Ray's metrics agent binds it, auto-advanced when not given."""

from __future__ import annotations

import socket
import threading

import pytest

from appliance.errors import ConfigError
from appliance.metrics.endpoint import choose_metrics_port, port_is_free
from tests.helpers_net import free_port


def listening(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen()
    return s


def test_a_port_whose_last_connection_is_in_time_wait_is_free():
    port = free_port()
    server = listening(port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server closes first (as an HTTP/1.0 server does): TIME_WAIT on its side
    client.recv(1)
    client.close()
    server.close()
    assert port_is_free(port)  # a bind without SO_REUSEADDR fails here for a minute


def test_an_explicit_busy_port_is_an_error_and_the_default_moves_to_the_next_free_one():
    port = free_port()
    server = listening(port)
    try:
        assert not port_is_free(port)
        with pytest.raises(ConfigError, match=f"--metrics-port {port} is already in use"):
            choose_metrics_port(port)
        chosen = choose_metrics_port(None, default=port)
        assert chosen > port and port_is_free(chosen)
    finally:
        server.close()


def test_two_runs_choosing_at_once_get_different_ports():
    base, got = free_port(), []
    threads = [
        threading.Thread(target=lambda: got.append(choose_metrics_port(None, default=base)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 2
