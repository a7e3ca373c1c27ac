"""Shared by the coordinator and the worker: checkpoints, manifests, experts, tensors,
placement and migration planning, auth and errors; no networking here."""
