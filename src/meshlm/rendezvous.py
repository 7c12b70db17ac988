"""torch's c10d rendezvous, with every listening socket bound to one address.

torch's c10d rendezvous opens its TCP stores on the wildcard address: every
interface of the machine accepts connections. A one-node job should not be
reachable from the network at all, and a multi-node job should listen only on
the address it was given. TCPStore accepts a socket that is already bound
(`master_listen_fd`), so we bind it ourselves and hand it over; the rendezvous
protocol itself is torch's dynamic rendezvous, unchanged.

Three things listen during a job: the rendezvous store (on the endpoint's host),
the store the ranks share for their process group (on the node that becomes
rank 0), and gloo's sockets in every rank (pinned with GLOO_SOCKET_IFNAME).
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from meshlm import compat

BACKEND = "meshlm-c10d"
DEFAULT_PORT = 29400  # torchrun's c10d default


def bound_store(host: str, port: int, timeout_s: float = 60) -> TCPStore:
    """A TCPStore server listening on host:port only (port 0: a free one, read it from `.port`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=1024)
    bound_port = sock.getsockname()[1]
    # multi_tenant: the rendezvous and the ranks' process group may share this server.
    return TCPStore(
        host,
        bound_port,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # the store owns (and closes) the socket


class _Backend(C10dRendezvousBackend):
    @property
    def name(self) -> str:  # the registry checks that a handler's backend has the name it was asked for
        return BACKEND


_stores: dict[str, TCPStore] = {}  # run id -> this launcher's rendezvous store, to ask who joined


def node_key(run_id: str, node_rank: int) -> str:
    return f"meshlm/{run_id}/node-{node_rank}"


def nodes_joined(run_id: str, nnodes: int) -> list[int] | None:
    """The node ranks whose launcher reached the rendezvous store, or None when this one never did."""
    store = _stores.get(run_id)
    if store is None:
        return None
    return [n for n in range(nnodes) if store.check([node_key(run_id, n)])]


def _create_handler(params):
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    timeout_s = params.get_as_int("read_timeout", 60)
    if params.get_as_bool("is_host"):
        store = bound_store(host, port, timeout_s)
    else:  # wait for the host as long as for the other nodes (join_timeout), then fail
        store = TCPStore(
            host,
            port,
            is_master=False,
            multi_tenant=True,
            timeout=datetime.timedelta(seconds=params.get_as_int("join_timeout", 600)),
        )
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
    store.set(node_key(params.run_id, params.get_as_int("node_rank", 0)), "joined")
    _stores[params.run_id] = store
    handler = create_handler(store, _Backend(store, params.run_id), params)
    # The node that becomes rank 0 opens a second store for the ranks' process group; torch would bind
    # it to the wildcard address, we bind it to this node's address (params.local_addr).
    compat.serve_store_with(handler, lambda addr, port: bound_store(addr, port))
    # torch keeps that store across restarts, so the restarted ranks find the previous attempt's keys
    # (gloo/NCCL addresses of dead processes) and race them: "Connection refused" at init
    # (pytorch#135712, #167288). A fresh store per rendezvous round; the round is the same on every node.
    join = handler.next_rendezvous

    def next_rendezvous():
        compat.forget_shared_store(handler)
        return join()

    handler.next_rendezvous = next_rendezvous
    return handler


def register() -> None:
    rendezvous_handler_registry.register(BACKEND, _create_handler)  # idempotent for the same creator


def local_address(endpoint_host: str, port: int) -> str:
    """This machine's address on the route to the rendezvous host (no packet is sent)."""
    infos = socket.getaddrinfo(endpoint_host, port, type=socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """Name of the network interface holding an IPv4 address (Linux), for GLOO_SOCKET_IFNAME."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # interface without an IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def pin_gloo(address: str) -> None:
    """Make the ranks' gloo sockets listen on `address`'s interface unless the user chose one."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        name = interface_of(address)
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name
