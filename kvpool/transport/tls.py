"""TLS for the TCP data plane (``--data-tls``): Python's ``ssl`` with the control plane's
certificate and key on the node, the CA on the clients (docs/security.md, "Data-plane TLS").

The data plane's sends are ``sendall`` of memoryviews and its receives ``recv_into``, which
``ssl.SSLSocket`` implements, so a wrapped socket serves unchanged; UCX and NIXL bytes do not
go through it (only their handshake on the TCP connection does).
"""

from __future__ import annotations

import ssl


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """TLS for a data-plane listener, from the control plane's certificate and key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


def client_tls_context(root_certs: bytes) -> ssl.SSLContext:
    """TLS for data-plane reads and writes: the node's certificate must chain to ``root_certs``
    (PEM) and name the address dialled (an IP SAN for an IP)."""
    context = ssl.create_default_context(cadata=root_certs.decode("ascii"))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
