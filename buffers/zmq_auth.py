"""The broker socket's hardening: CURVE authentication (``buffer.zmq.auth = "curve"``), a message
size bound, and the bind address.

Size: ``ZMQ_MAXMSGSIZE`` is set to twice ``buffer.max_message_bytes`` (plus 64 KiB; see
:func:`socket_limit`). libzmq checks it per frame, as the frame header arrives: a peer
announcing a larger frame is disconnected before anything is allocated, with no reply and no
count anywhere (its request times out; a DEALER reconnects by itself, and the broker keeps
serving everybody). Set just above the limit, as it was, a producer's group a little too large
cost its worker "the connection dropped" in a crash loop and left the status blank; so the
headroom is wide, and a group within it reaches the broker, which rejects it with the counted
reason ``oversized`` (``rejected`` in the status) and a reply. Our clients never send one
(:class:`~buffers.zmq_client.ZmqBufferClient` refuses it, naming the key and the size), so
only a foreign peer meets the hard limit. A hostile peer can make the broker hold at most one
message of its frames, each under twice the limit, at a time.

Bind address: ``buffer.zmq.host`` (127.0.0.1 by default); binding elsewhere without CURVE is
logged as a warning.

Why CURVE: the broker serves anything that can reach its port (groups in, batches out,
``shutdown``), so off loopback it must know who is talking. CURVE encrypts the connection and,
with a ZAP authenticator, admits only clients whose public key the operator placed in
``clients/``. A client with no key or an unknown key never completes the handshake: its
requests are never delivered (it times out) and the broker keeps serving everybody else.

Layout of ``buffer.zmq.curve_keys_dir`` (what :func:`generate_curve_keys` writes)::

    server.key          server public key (every client needs it)
    server.key_secret   server key pair (the broker only)
    client.key_secret   a client key pair (copy to each client machine)
    clients/*.key       public keys of the authorised clients

The authorised keys are read when the broker starts: restart it to admit a new client.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from asyncrl.config.schema import BufferConfig

logger = logging.getLogger(__name__)

OVERSIZE_HEADROOM = 2  # MAXMSGSIZE is this many times max_message_bytes (plus FRAME_SLACK): a
# group over the limit still reaches the broker, which rejects it with a counted reason
FRAME_SLACK = 64 << 10
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SERVER = "server"
CLIENT = "client"
CLIENTS_DIR = "clients"


def generate_curve_keys(keys_dir: str | Path, clients: Iterable[str] = (CLIENT,)) -> Path:
    """Create the server key pair and one authorised key pair per client name (existing
    key files are kept, so this is safe to run again to add a client)."""
    root = Path(keys_dir)
    (root / CLIENTS_DIR).mkdir(parents=True, exist_ok=True)
    for name in (SERVER, *clients):
        if not (root / f"{name}.key_secret").exists():
            _, secret = zmq.auth.create_certificates(root, name)
            os.chmod(secret, 0o600)
        if name != SERVER:
            shutil.copyfile(root / f"{name}.key", root / CLIENTS_DIR / f"{name}.key")
    return root


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise FileNotFoundError(f"buffer.zmq.curve_keys_dir: no {path} (generate keys with "
                                f"buffers.zmq_auth.generate_curve_keys)")
    public, secret_key = zmq.auth.load_certificate(path)
    if secret and secret_key is None:
        raise ValueError(f"{path} holds no secret key")
    return public, secret_key


class CurveServer:
    """The broker's side: its key pair, and a ZAP handler admitting only ``clients/*.key``."""

    def __init__(self, context: zmq.Context, keys_dir: str) -> None:
        if not keys_dir:
            raise ValueError("buffer.zmq.auth = \"curve\" needs buffer.zmq.curve_keys_dir")
        root = Path(keys_dir)
        self.public, self.secret = _load(root / f"{SERVER}.key_secret", secret=True)
        clients = root / CLIENTS_DIR
        if not any(clients.glob("*.key")):
            logger.warning("no authorised client keys in %s: every client will be refused",
                           clients)
        self._auth = ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(clients))

    def apply(self, socket: zmq.Socket) -> None:
        """Make ``socket`` a CURVE server (call before bind)."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True

    def stop(self) -> None:
        self._auth.stop()


def apply_curve_client(socket: zmq.Socket, keys_dir: str | Path, name: str = CLIENT) -> None:
    """Give a client socket its key pair and the server's public key (call before connect)."""
    root = Path(keys_dir)
    server_public, _ = _load(root / f"{SERVER}.key", secret=False)
    public, secret = _load(root / f"{name}.key_secret", secret=True)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = server_public


def socket_limit(max_message_bytes: int) -> int:
    """The largest frame the broker's socket receives (larger: the peer is disconnected)."""
    return OVERSIZE_HEADROOM * max_message_bytes + FRAME_SLACK


def bind_router(context: zmq.Context, config: BufferConfig
                ) -> tuple[zmq.Socket, CurveServer | None, str]:
    """The broker's ROUTER, hardened and bound to ``tcp://host:port`` (port 0 picks a free
    one); returns it, its CURVE server (to stop on close) and the address clients dial."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.MAXMSGSIZE, socket_limit(config.max_message_bytes))
    curve, zmq_cfg = None, config.zmq
    if zmq_cfg.auth == "curve":
        curve = CurveServer(context, zmq_cfg.curve_keys_dir)
        curve.apply(socket)
    elif zmq_cfg.host not in LOOPBACK:
        logger.warning("buffer broker binds %s without authentication (buffer.zmq.auth = "
                       "\"curve\" enables it)", zmq_cfg.host)
    socket.bind(f"tcp://{zmq_cfg.host}:{zmq_cfg.port or '*'}")
    endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    host = "127.0.0.1" if zmq_cfg.host in ("0.0.0.0", "*", "") else zmq_cfg.host
    address = f"tcp://{host}:{int(endpoint.rsplit(':', 1)[1])}"
    logger.info("buffer broker listening on %s (bound %s, auth %s)", address, endpoint,
                zmq_cfg.auth)
    return socket, curve, address
