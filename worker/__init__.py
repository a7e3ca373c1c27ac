"""The worker: shoal-worker's daemon, its gRPC service and expert lane, and the expert files
it holds in memory and on its drives."""

import os

# gRPC's C core logs at INFO by default (a refused TLS handshake prints a line per retry):
# only errors unless the user asks for more. It reads the setting once, at import, hence here.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
