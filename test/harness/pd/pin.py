"""Bind a decode worker to the ports of the decode server it replaces (pd_harness restart_decode).

SGLang never pins these: CommonKVManager binds its ZMQ PULL socket with `bind_to_random_port`,
and our TransferEngine asks MORI-IO for port 0 (the engine picks one). A restarted decode server
therefore comes back at the same host with new ports, unless the port happens to be free and
drawn again. The harness pins them to test the same-endpoint restart on purpose: prefill must
recognise the endpoint, drop the dead incarnation's engine and serve the new one.

Called in the worker process after SGLang is set up and before the manager is built; it only
rebinds names in this process (SGLang's conn module, the softio module object).
"""

from __future__ import annotations

import time

# The dead process's port may be held for a moment (a peer's reconnect attempt can briefly
# occupy it as a source port on loopback): retry the bind, bounded.
BIND_RETRY_S = 10.0
BIND_NAP_S = 0.1


def pin_ports(cfg, pin: dict) -> None:
    rank_port = pin.get("rank_port")
    engine_port = pin.get("engine_port")
    if rank_port:
        _pin_rank_port(int(rank_port))
    if engine_port:
        if cfg.backend != "mori":
            raise ValueError("engine_port can be pinned on our backend's software engine only")
        _pin_engine_port(int(engine_port))


def _pin_rank_port(port: int) -> None:
    import zmq
    from sglang.srt.disaggregation.common import conn
    from sglang.srt.utils import network

    def bind_pinned(context, socket_type, host=None, restrict_peers=False):
        sock = context.socket(socket_type)
        network.config_socket(sock, socket_type)
        deadline = time.monotonic() + BIND_RETRY_S
        while True:
            try:
                sock.bind(f"tcp://{host or '127.0.0.1'}:{port}")
                return port, sock
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    sock.close(linger=0)
                    raise
                time.sleep(BIND_NAP_S)

    conn.get_zmq_socket_on_host = bind_pinned  # the name CommonKVManager.__init__ calls


def _pin_engine_port(port: int) -> None:
    import sglang_mori.softio as softio

    base = softio.IOEngineConfig

    class PinnedIOEngineConfig(base):
        def __init__(self, host: str = "", port_: int = 0):
            super().__init__(host, port_ or port)

    softio.IOEngineConfig = PinnedIOEngineConfig  # TransferEngine builds IOEngineConfig(host, 0)
