"""A Ray cluster whose nodes all run on this machine, on loopback only.

Ray turns 127.0.0.1 / localhost into the machine's own address wherever it
meets one (`ray start --node-ip-address`, `--address`, `ray.init(address=...)`,
`_node_ip_address`: `ray._private.services.resolve_ip_for_localhost`), so
that other machines could reach the node. On one machine that sends every
connection to the machine's network address, which a firewall or sandbox
may refuse (`ConnectionError: Failed to connect to Ray cluster at
<address>:6399`). `keep_loopback()` leaves loopback addresses as given; it
changes nothing for any other address.

    python -m kvsieve.service.scale.loopback start --head --node-ip-address 127.0.0.1 --port 6399 ...
    python -m kvsieve.service.scale.loopback start --address 127.0.0.1:6399 --node-ip-address 127.0.0.1 ...

runs Ray's own `ray` command (same flags) with loopback kept; `kvsieve
serve` keeps loopback by itself when its Ray address or node address is a
loopback one (service/scale/launch.py). See docs/scale.md.
"""

from __future__ import annotations

import ipaddress
import sys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def keep_loopback() -> None:
    """Make Ray leave loopback hosts as they are (ray==2.60.0: the one
    function every path above goes through)."""
    from ray._private import services

    resolve = services.resolve_ip_for_localhost
    if getattr(resolve, "kvsieve_keeps_loopback", False):
        return

    def resolve_keeping_loopback(host: str):
        return host if host and is_loopback(host) else resolve(host)

    resolve_keeping_loopback.kvsieve_keeps_loopback = True
    services.resolve_ip_for_localhost = resolve_keeping_loopback


def main(argv: list[str] | None = None) -> int:
    keep_loopback()
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", *(sys.argv[1:] if argv is None else argv)]
    return ray_main()


if __name__ == "__main__":
    sys.exit(main())
