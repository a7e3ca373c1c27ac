"""Build mlx-lm's own switch module for one MoE layer (class, activation and quantization from
the model's architecture) and run it: over the stacked resident experts in one gathered call,
or one expert at a time while experts stream, computing exactly what one process would."""

from __future__ import annotations

import contextlib
import io

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import _get_classes, infer_quant_config

from engine.errors import CorruptData, ShoalError
from engine.manifest import MoeLayer
from engine.moe_layers import get_module
from engine.mtp import attach_skeleton as attach_mtp_skeleton
from engine.tensors import to_mlx

# mlx-lm's switch modules sort a call's pairs from this many on; a worker's call copies the
# caller's pair count up to it (see ExpertRunner.gathered).
SORT_PAIRS = 64


def build_skeleton(config: dict) -> nn.Module:
    """The model's mlx-lm module tree with lazy random weights that are never evaluated."""
    try:
        model_class, args_class = _get_classes(config)
    except ValueError as e:
        kind = config.get("model_type")
        raise ShoalError(f"this mlx-lm cannot build model type {kind}: {e}") from None
    with contextlib.redirect_stdout(io.StringIO()):
        model = model_class(args_class.from_dict(config))
    attach_mtp_skeleton(model, config)  # its experts are served like any other layer's
    return model


def switch_widths(module: nn.Module) -> tuple[int, int]:
    """(input, output) width of an mlx-lm switch module, from its own first and last linear:
    not always the model's hidden size (Kimi K3 and nemotron_h run experts in a latent space)."""
    first, last = (
        (module.gate_proj, module.down_proj) if isinstance(module, SwitchGLU)
        else (module.fc1, module.fc2)
    )
    return int(first.input_dims), int(last.output_dims)


def _quantize_like_checkpoint(
    module: nn.Module, path: str, config: dict, weights: dict[str, mx.array]
) -> None:
    """Quantize the switch module's linears the way mlx-lm's loader would for these weights."""
    quantization = config.get("quantization")
    if not quantization:
        return

    def predicate(relative: str, child: nn.Module) -> bool | dict:
        full = f"{path}.{relative}"
        if full in quantization:
            return quantization[full]
        if not hasattr(child, "to_quantized") or f"{relative}.scales" not in weights:
            return False
        params = infer_quant_config(relative, child, weights)
        if f"{relative}.global_scale" in weights:
            params["global_scale"] = True
        return params

    nn.quantize(
        module,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


class ExpertRunner:
    """One MoE layer's switch module (mlx-lm's class, quantized like the checkpoint), run on
    the experts a worker holds.

    Two ways, one computation: `gathered` gives the module a stack of several experts and
    computes every (row, expert) pair in one call, as the single-process model does over all
    its experts; `__call__` gives it one expert's own tensors as a one-expert stack (`w[None]`,
    a view), so a worker that streams can keep any subset of experts, each in its own arrays,
    and evict or load them one by one. Either way the result for a (token, expert) pair is
    mlx-lm's module applied to that expert. Not thread-safe: the caller serialises MLX work.
    """

    def __init__(
        self, skeleton: nn.Module, config: dict, layer: MoeLayer, sample: dict[str, mx.array]
    ) -> None:
        self.layer = layer
        self.module = get_module(skeleton, layer.path)
        one = {name: array[None] for name, array in self.check(sample, "sample").items()}
        _quantize_like_checkpoint(self.module, layer.path, config, one)
        expected = dict(tree_flatten(self.module.parameters()))
        for name, array in one.items():
            shape = None if name not in expected else tuple(expected[name].shape[1:])
            if shape != tuple(array.shape[1:]):
                raise CorruptData(
                    f"expert tensor {layer.path}.{name} has shape {tuple(array.shape[1:])}, "
                    f"the model expects {shape}"
                )
        self.input_width, self.output_width = switch_widths(self.module)
        # where each parameter lives in the module: (its module, its name there), so that an
        # expert's tensors are put in place without walking the module tree at every call
        self._places = {}
        for name in expected:
            path, _, leaf = name.rpartition(".")
            self._places[name] = (get_module(self.module, path) if path else self.module, leaf)
        self._loaded: dict[str, mx.array] | None = None  # the stack the module holds now
        self._index_cache: dict[int, mx.array] = {}
        # On a GPU a pair's bits depend on how many pairs its call has (measured on CUDA: a
        # row's 4 experts in a call of 4 differ from the same 4 in a call of 8; calls of 8 and
        # 16 agree: MLX picks its kernel by the call's size). So a worker, which
        # gets only some of each row's experts, pads its call to the caller's count; on the
        # CPU every pair's bits are the same whatever the call, and padding would only cost.
        self.pads = mx.default_device().type == mx.DeviceType.gpu

    def check(self, tensors: dict[str, mx.array], what: str) -> dict[str, mx.array]:
        """Refuse an expert file whose tensors are not the ones this layer's module holds."""
        if set(tensors) != set(self.layer.params):
            raise CorruptData(
                f"{what} holds tensors {sorted(tensors)}, expected {sorted(self.layer.params)}"
            )
        return tensors

    def stack(self, experts: list[dict[str, mx.array]]) -> dict[str, mx.array]:
        """One array per parameter holding `experts` in order (a copy), and each expert's
        tensors replaced in place by views into it, so the experts' memory is not held twice."""
        stacked = {name: mx.stack([tensors[name] for tensors in experts])
                   for name in self.layer.params}
        mx.eval(stacked)
        for j, tensors in enumerate(experts):
            for name, array in stacked.items():
                tensors[name] = mx.squeeze(array[j : j + 1], 0)  # a slice is a view; [j] copies
        mx.eval([list(t.values()) for t in experts])
        return stacked

    def gathered(self, stacked: dict[str, mx.array], hidden: np.ndarray | mx.array,
                 dtype: mx.Dtype, rows: np.ndarray, positions: np.ndarray,
                 call_pairs: int = 0) -> mx.array:
        """Pair i: row `rows[i]` of `hidden` (host bytes, viewed as `dtype`, or an MLX array
        when the caller is in this process) through the expert at `positions[i]` of the
        stack; (m, output width). The stack is given to the module once, not per call; a
        request's host arrays go to MLX as one buffer.

        `call_pairs` is the pair count of the caller's whole switch call (all workers'). Where
        the backend's kernels depend on it (`pads`), a call with fewer pairs is padded up to
        min(call_pairs, SORT_PAIRS) with pairs of an expert of the stack that no real pair
        uses, whose outputs are dropped: the call then runs the kernel, and sorts or not, as
        the single-process model's call does, and no real pair shares a group with padding."""
        self._load(stacked)
        n, m = hidden.shape[0], positions.size
        padding = self._padding(stacked, positions, call_pairs)
        if padding:
            positions = np.concatenate([positions, np.full(padding[0], padding[1], np.int32)])
            if n == 1:  # one row (a decode step): its pairs and the padding as one row
                return self._by_row(hidden, dtype, positions.reshape(1, -1))[:m]
            rows = np.concatenate([rows, np.zeros(padding[0], np.int32)])
        else:
            per_row = m // n
            # rows are checked to lie in [0, n): with one row (a decode step) all are 0
            if per_row * n == m and (n == 1 or (rows.reshape(n, per_row)
                                                == np.arange(n)[:, None]).all()):
                # Each row's pairs together and equally many (always so in decode): the module
                # takes the rows as they are, as the single-process model does, no gather.
                return self._by_row(hidden, dtype, positions.reshape(n, per_row))
        if isinstance(hidden, mx.array):
            x, (at, inds) = hidden, to_mlx(([rows], mx.int32), ([positions], mx.int32))
        else:
            x, at, inds = to_mlx(([hidden], dtype), ([rows], mx.int32), ([positions], mx.int32))
        return self.module(x[at], inds[:, None])[:m, 0, :]

    def _by_row(self, hidden: np.ndarray | mx.array, dtype: mx.Dtype,
                positions: np.ndarray) -> mx.array:
        """Row r of `hidden` through the experts at `positions[r]` (n, per row), as mlx-lm's
        model calls the module: (n * per row, output width)."""
        if isinstance(hidden, mx.array):
            x, inds = hidden, mx.array(positions)
        else:
            x, inds = to_mlx(([hidden], dtype), ([positions], mx.int32))
        return self.module(x, inds).reshape(positions.size, -1)

    def whole(self, stacked: dict[str, mx.array], x: mx.array, inds: mx.array) -> mx.array:
        """The module over a stack of every expert of the layer, in expert order, called on
        mlx-lm's own arguments as the single-process model calls it: lazy, nothing evaluated."""
        self._load(stacked)
        return self.module(x, inds)

    def _load(self, stacked: dict[str, mx.array]) -> None:
        """Give the module the stack, unless it holds it already."""
        if self._loaded is not stacked:
            self._put(stacked)
            self._loaded = stacked

    def _put(self, params: dict[str, mx.array]) -> None:
        """Give the module these parameters (every one of the layer's)."""
        for name, array in params.items():
            module, leaf = self._places[name]
            module[leaf] = array

    def _padding(self, stacked: dict[str, mx.array], positions: np.ndarray,
                 call_pairs: int) -> tuple[int, int] | None:
        """(pairs to add, the stack position of an expert no real pair uses), or None."""
        short = min(call_pairs, SORT_PAIRS) - positions.size if self.pads else 0
        if short <= 0:
            return None
        held = next(iter(stacked.values())).shape[0]
        used = set(positions.tolist())
        unused = next((e for e in range(held) if e not in used), None)
        return None if unused is None else (short, unused)

    def __call__(self, tensors: dict[str, mx.array], hidden: mx.array) -> mx.array:
        """The expert whose tensors are given, applied to every row of `hidden`: (n, hidden)."""
        self._put({name: a[None] for name, a in tensors.items()})
        self._loaded = None
        n = hidden.shape[0]
        if n not in self._index_cache:
            self._index_cache[n] = mx.zeros((n, 1), dtype=mx.int32)
        return self.module(hidden, self._index_cache[n])[:, 0, :]
