"""The coordinator: a generation (decoding/) over the cluster's members (cluster/), each MoE
layer's experts reached through the data plane (dataplane/), with the `shoal` command (cli/),
the HTTP server (server/) and the tools that operate a cluster (ops/) around it."""
