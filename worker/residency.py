"""What this worker holds in memory, and the expert compute that serves a request.

Today every held expert is loaded at start; this is the one place that decides which
experts are resident and runs them.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.errors import InvalidInput
from engine.experts import LayerExperts, build_layer_experts, build_skeleton
from engine.tensors import from_numpy
from worker.store import StoreScan, read_expert

MAX_ROWS = 1 << 20  # far above any prefill chunk; refuses absurd requests before allocating


@dataclass(frozen=True)
class Request:
    """One decoded ExpertRequest: numpy views of the wire bytes."""

    layer: int
    hidden: np.ndarray  # (n, hidden_size), wire byte layout of `dtype`
    dtype: str
    rows: np.ndarray  # (m,) int32
    experts: np.ndarray  # (m,) int32


class Residency:
    """The worker's experts, one mlx-lm switch module per layer, and the lock that serialises
    MLX work (MLX evaluation is not meant to run from several threads at once)."""

    def __init__(self, scan: StoreScan) -> None:
        self.scan = scan
        config = scan.manifest.config
        self.hidden_size = int(config.get("hidden_size") or config["text_config"]["hidden_size"])
        by_layer: dict[int, dict[int, dict[str, mx.array]]] = defaultdict(dict)
        for (layer, expert), path in sorted(scan.held.items()):
            by_layer[layer][expert] = read_expert(path)
        skeleton = build_skeleton(config)
        self.layers: dict[int, LayerExperts] = {
            layer: build_layer_experts(skeleton, config, scan.manifest.layer(layer), tensors)
            for layer, tensors in by_layer.items()
        }
        self._lock = threading.Lock()

    def held(self) -> list[tuple[int, int]]:
        return [(layer, e) for layer, le in sorted(self.layers.items()) for e in le.expert_ids]

    def validate(self, request: Request) -> LayerExperts:
        layer = self.layers.get(request.layer)
        if layer is None:
            raise InvalidInput(f"this worker holds no experts of layer {request.layer}")
        n, width = request.hidden.shape
        if width != self.hidden_size:
            raise InvalidInput(
                f"hidden states have width {width}, the model's is {self.hidden_size}"
            )
        if not 0 < n <= MAX_ROWS:
            raise InvalidInput(f"request carries {n} hidden states; allowed 1 to {MAX_ROWS}")
        if request.rows.shape != request.experts.shape or request.rows.size == 0:
            raise InvalidInput("rows and experts must be non-empty and of the same length")
        if request.rows.min() < 0 or request.rows.max() >= n:
            raise InvalidInput(f"a row index is outside the {n} hidden states sent")
        bad = request.experts[
            (request.experts < 0)
            | (request.experts >= layer.layer.num_experts)
            | (layer.local_index[np.clip(request.experts, 0, layer.layer.num_experts - 1)] < 0)
        ]
        if bad.size:
            shown = ", ".join(str(e) for e in sorted(set(bad.tolist()))[:8])
            raise InvalidInput(
                f"layer {request.layer}: this worker does not hold expert(s) {shown}"
            )
        return layer

    def compute(self, request: Request) -> mx.array:
        """Validate, then run the experts; returns (m, hidden_size) in the activation dtype."""
        layer = self.validate(request)
        with self._lock:
            out = layer(from_numpy(request.hidden, request.dtype), request.rows, request.experts)
            mx.eval(out)
        return out
