"""art-ray's apps deploy with `serve.start` then `serve.run`; `serve.run` starts Serve again under the hood
and logs "Connecting to existing Serve app ... will not be applied" on every deploy, a fresh start too."""

from __future__ import annotations

import inspect
import logging

from art_ray.serve_deploy import CONNECTING_TO_EXISTING, _quiet_reconnect, proxy_url
from art_ray.serving.replica_grpc import SERVE_REPLICA_GRPC_ADDRESS, NodeAddressBinding

NOTICE = (
    CONNECTING_TO_EXISTING + ' in namespace "serve". New http_options/controller_options will not be applied.'
)


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_reconnect_notice_is_dropped_only_while_an_app_deploys() -> None:
    logger = logging.getLogger("ray.serve")
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with _quiet_reconnect():
            logger.info(NOTICE)
            logger.info("Deployed app 'art' successfully.")
        logger.info(NOTICE)  # serve.start's own: Serve was running with options of its own, real news
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert handler.messages == ["Deployed app 'art' successfully.", NOTICE]


def test_proxy_urls_dial_loopback_for_a_wildcard_host() -> None:
    assert proxy_url("0.0.0.0", 8000, "/smol/") == "http://127.0.0.1:8000/smol"
    assert proxy_url("127.0.0.1", 8001) == "http://127.0.0.1:8001"
    assert proxy_url("10.1.2.3", 8000, "/") == "http://10.1.2.3:8000"


def test_a_replicas_grpc_server_binds_the_node_address_in_place_of_every_interface() -> None:
    from ray.serve._private import replica

    # what the binding replaces: Serve's own call, the one that put the port on every interface
    assert f'add_port_to_grpc_server(self._server, "{SERVE_REPLICA_GRPC_ADDRESS}")' in inspect.getsource(
        replica.Replica._on_initialized
    )
    bound: list[str] = []

    def add_port(_server: object, address: str) -> int:
        bound.append(address)
        return 7

    binding = NodeAddressBinding(add_port, "127.0.0.1")
    assert binding(None, SERVE_REPLICA_GRPC_ADDRESS) == 7
    assert binding(None, "10.0.0.5:9000") == 7
    assert bound == ["127.0.0.1:0", "10.0.0.5:9000"]
