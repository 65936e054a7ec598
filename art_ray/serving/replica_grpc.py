"""Each Serve replica's inter-deployment gRPC server on the node's own address when that is loopback.

Ray Serve starts that server on "[::]:0" whatever the node's address (ray/serve/_private/replica.py,
`_on_initialized`, Ray 2.60), while the handles that call it dial the replica's node address. On a node
whose address is loopback (an embedded cluster: `RayBackend()` with no address) it was the one socket of
the whole cluster that listened beyond loopback. A deployment's constructor runs before Serve starts that
server, so calling `bind_replica_grpc_to_node_address()` there binds it where it is dialed. On any other
node nothing changes: Serve's choice stands.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpc import aio

# what Serve binds: every interface, a free port
SERVE_REPLICA_GRPC_ADDRESS = "[::]:0"

AddPort = Callable[["aio.Server", str], int]


class NodeAddressBinding:
    """Ray's `add_port_to_grpc_server(server, address)` with Serve's all-interfaces address replaced by
    the node's, any other address kept."""

    def __init__(self, add_port: AddPort, node_address: str) -> None:
        self.add_port = add_port
        self.node_address = node_address

    def __call__(self, server: aio.Server, address: str) -> int:
        if address == SERVE_REPLICA_GRPC_ADDRESS:
            address = f"{self.node_address}:0"
        return self.add_port(server, address)


def bind_replica_grpc_to_node_address() -> None:
    """In a Serve replica's constructor: its inter-deployment gRPC server will listen on the node's
    address if that address is loopback."""
    import ray
    from ray.serve._private import replica

    node_ip = ipaddress.ip_address(ray.util.get_node_ip_address())
    if not node_ip.is_loopback:
        return
    node_address = f"[{node_ip}]" if node_ip.version == 6 else str(node_ip)
    if not isinstance(replica.add_port_to_grpc_server, NodeAddressBinding):
        replica.add_port_to_grpc_server = NodeAddressBinding(replica.add_port_to_grpc_server, node_address)
