"""The coordinator: the dense model with mlx-lm and each MoE layer's experts sent to the
workers (the runtime, in this folder), with the `shoal` command (cli/), the HTTP server
(server/) and the tools that operate a cluster (ops/) around it."""

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
