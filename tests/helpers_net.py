"""Free TCP ports for the tests' servers (Ray's metrics endpoint, Prometheus, gloo)."""

from __future__ import annotations

import random

from appliance.metrics.endpoint import port_is_free

# Below Linux's ephemeral range (32768-60999), from which the kernel hands out the local ports of
# outgoing connections and of bind(0) (Ray's agents pick their ports that way), and above Ray's
# worker ports (10002-19999), so a port found free here is unlikely to be taken while the
# process it is meant for starts up, as a bind(0) port can be.
_LOW, _HIGH = 20000, 32000
_handed_out: set[int] = set()
_rng = random.Random()


def free_port() -> int:
    """A port that binds on all interfaces now (the driver's own check of --metrics-port) and
    that no earlier call in this process gave."""
    for _ in range(1000):
        port = _rng.randrange(_LOW, _HIGH)
        if port not in _handed_out and port_is_free(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free TCP port in {_LOW}-{_HIGH}")
