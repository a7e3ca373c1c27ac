"""The coordinator: the dense model with mlx-lm and each MoE layer's experts sent to the
workers (the runtime, in this folder), with the `shoal` command (cli/), the HTTP server
(server/) and the tools that operate a cluster (ops/) around it.

gRPC's C core logs at INFO by default (a refused TLS handshake prints a line per retry on the
user's terminal): only errors, unless the user asks for more. It reads the setting once, when
grpc is first imported, hence here."""

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
