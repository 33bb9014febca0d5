"""The data plane between nodes: TCP sockets (always available) and UCX (ucxx). Never gRPC."""
