"""metrics_host=@hostname: /metrics on the address the host's own name resolves to (a container's
or pod's network address), not on every interface as 0.0.0.0 was."""

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from shared.settings import CommonSettings, load_settings
from shared.telemetry.metrics import OWN_ADDRESS, MetricsServer, bind_address


def test_hostname_binds_the_address_the_host_name_resolves_to():
    registry = CollectorRegistry()
    Counter("tandem_probe", "a counter to find", registry=registry).inc()
    expected = socket.gethostbyname(socket.gethostname())
    with MetricsServer(registry, OWN_ADDRESS, 0) as server:
        assert server._server.server_address[0] == expected != "0.0.0.0"
        url = f"http://{expected}:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert b"tandem_probe_total 1.0" in reply.read()


def test_any_other_host_is_bound_as_given():
    assert bind_address("127.0.0.1") == "127.0.0.1" and bind_address("10.2.3.4") == "10.2.3.4"


def test_a_host_name_that_does_not_resolve_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "no-such-host.invalid")
    with pytest.raises(ValueError, match="'no-such-host.invalid' does not resolve"):
        bind_address(OWN_ADDRESS)


def test_the_setting_takes_it_from_the_environment():
    env = {"TANDEM_METRICS_HOST": OWN_ADDRESS}
    assert load_settings(CommonSettings, [], env=env).metrics_host == "@hostname"
