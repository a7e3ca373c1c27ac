"""How each layer's dense MLP becomes routed experts (a `LayerPlan`): cut contiguously for the
exact split, where every token uses every expert; otherwise neurons clustered into experts
that fire together and a router and down projection fitted, layer by layer, on the dense
model's own text."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tqdm import tqdm

# Selected experts should get (nearly) equal softmax weight, so the router's logits are scaled
# down until they differ by about this much; top-k ranking survives any positive scaling.
ROUTER_SPREAD = 1e-4
# Ridge strength relative to the mean eigenvalue of the Gram matrix: a few hundred tokens
# underdetermine both fits, and a pull towards zero (router) or the dense weights (experts)
# generalises better than an exact fit.
RIDGE = 1.0
CLUSTER_ITERATIONS = 15

Sequence = tuple[int, ...]


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's MLP becomes experts: neuron indices per expert (E, size), the router
    (E, hidden) and the down projection (hidden, intermediate) the experts are cut from."""

    groups: np.ndarray
    router: np.ndarray
    down: np.ndarray


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The dense MLP's intermediate activations, silu(x W_g^T) * (x W_u^T)."""
    g = x @ gate.T
    return g / (1.0 + np.exp(-g)) * (x @ up.T)


def contiguous_groups(size: int, num_experts: int) -> np.ndarray:
    return np.arange(size).reshape(num_experts, size // num_experts)


def cluster_neurons(acts: np.ndarray, down: np.ndarray, num_experts: int, seed: int) -> np.ndarray:
    """Equal-size groups of neurons that fire on the same tokens (balanced spherical k-means on
    each neuron's contribution magnitude per token), so a few experts carry most of a token."""
    profile = (np.abs(acts) * np.linalg.norm(down, axis=0)).T
    profile /= np.linalg.norm(profile, axis=1, keepdims=True) + 1e-12
    size, capacity = profile.shape[0], profile.shape[0] // num_experts
    rng = np.random.default_rng(seed)
    centroids = profile[rng.choice(size, num_experts, replace=False)]
    for _ in range(CLUSTER_ITERATIONS):
        assign = balanced_assign(profile @ centroids.T, capacity)
        centroids = np.stack([profile[assign == e].mean(axis=0) for e in range(num_experts)])
        centroids /= np.linalg.norm(centroids, axis=1, keepdims=True) + 1e-12
    return np.stack([np.flatnonzero(assign == e) for e in range(num_experts)])


def balanced_assign(similarity: np.ndarray, capacity: int) -> np.ndarray:
    """Each row to its most similar column with room left, most decided rows first."""
    assign = np.empty(similarity.shape[0], dtype=np.int64)
    count = np.zeros(similarity.shape[1], dtype=np.int64)
    for row in np.argsort(-similarity.max(axis=1), kind="stable"):
        column = int(np.argmax(np.where(count < capacity, similarity[row], -np.inf)))
        assign[row] = column
        count[column] += 1
    return assign


def expert_norms(acts: np.ndarray, down: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """(tokens, experts): the norm of each expert's share of the dense MLP output."""
    return np.stack([np.linalg.norm(acts[:, g] @ down[:, g].T, axis=1) for g in groups], axis=1)


def ridge_solve(features: np.ndarray, targets: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """argmin_W |features @ W - targets|^2 + r |W - prior|^2, r = RIDGE * mean Gram eigenvalue."""
    gram = features.T @ features
    ridge = RIDGE * np.trace(gram) / gram.shape[0]
    return np.linalg.solve(
        gram + ridge * np.eye(gram.shape[0]), features.T @ targets + ridge * prior
    )


def fit_router(x: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Gate weights (experts, hidden) predicting each expert's output norm from the MLP input,
    scaled so the logits stay within ROUTER_SPREAD of each other."""
    router = ridge_solve(x, norms, np.zeros((x.shape[1], norms.shape[1]))).T
    largest = np.abs(x @ router.T).max()
    return router * (ROUTER_SPREAD / largest) if largest > 0 else router


def picked_activations(
    x: np.ndarray, acts: np.ndarray, groups: np.ndarray, router: np.ndarray, top_k: int
) -> np.ndarray:
    """The activations with every neuron of an expert the router does not pick set to zero."""
    picked = np.argsort(-(x @ router.T), axis=1)[:, :top_k]
    expert_mask = np.zeros((x.shape[0], len(groups)))
    np.put_along_axis(expert_mask, picked, 1.0, axis=1)
    expert_of = np.empty(acts.shape[1], dtype=np.int64)
    for expert, group in enumerate(groups):
        expert_of[group] = expert
    return acts * expert_mask[:, expert_of]


def plan_layer(
    x: np.ndarray,
    target: np.ndarray,
    mlp: tuple[np.ndarray, np.ndarray, np.ndarray],
    num_experts: int,
    top_k: int,
    seed: int,
) -> tuple[LayerPlan, np.ndarray]:
    """Experts, router and down projection for one layer from its inputs `x` and the output it
    should produce, and the output the planned MoE does produce on `x`.

    The down projection is refitted (ridge towards the dense one) so the experts the router
    picks reproduce the target, not only their own share: a picked expert stands in for the
    correlated ones that were dropped, here and in earlier layers.
    """
    gate, up, down = mlp
    acts = swiglu(x, gate, up)
    groups = cluster_neurons(acts, down, num_experts, seed)
    router = fit_router(x, expert_norms(acts, down, groups))
    kept = picked_activations(x, acts, groups, router, top_k)
    refitted = ridge_solve(kept, target, down.T).T
    plan = LayerPlan(groups, router.astype(np.float32), refitted.astype(np.float32))
    return plan, kept @ refitted.T


def exact_plans(config: dict, weights: dict[str, np.ndarray], num_experts: int) -> list[LayerPlan]:
    """Every token uses every expert with weight 1/E: any split is exact, and an all-zero
    router gives exactly equal weights."""
    hidden, size = config["hidden_size"], config["intermediate_size"]
    router = np.zeros((num_experts, hidden), np.float32)
    groups = contiguous_groups(size, num_experts)
    return [
        LayerPlan(groups, router, weights[f"model.layers.{layer}.mlp.down_proj.weight"])
        for layer in range(config["num_hidden_layers"])
    ]


def _rows(arrays: list[mx.array]) -> np.ndarray:
    """(1, length, hidden) arrays, one per sequence, as one (tokens, hidden) float64 matrix."""
    return np.concatenate([np.array(a[0].astype(mx.float32), dtype=np.float64) for a in arrays])


def fitted_plans(
    model: nn.Module,
    weights: dict[str, np.ndarray],
    sequences: tuple[Sequence, ...],
    num_experts: int,
    top_k: int,
    seed: int,
    progress: bool,
) -> list[LayerPlan]:
    """Plan layer by layer, running the dense model and the MoE-so-far side by side on the
    calibration text: each layer is fitted on the inputs the MoE really gives it, to bring the
    residual stream back to the dense model's."""
    dense = [model.model.embed_tokens(mx.array([ids])) for ids in sequences]
    moe = list(dense)
    lengths = np.cumsum([len(ids) for ids in sequences])[:-1]
    plans = []
    for index, layer in enumerate(tqdm(model.layers, desc="fit experts", disable=not progress)):
        prefix = f"model.layers.{index}.mlp"
        mlp = tuple(weights[f"{prefix}.{name}_proj.weight"] for name in ("gate", "up", "down"))
        dense = [layer(h, mask="causal") for h in dense]
        mids = [h + layer.self_attn(layer.input_layernorm(h), mask="causal") for h in moe]
        x = _rows([layer.post_attention_layernorm(h) for h in mids])
        mid = _rows(mids)
        plan, out = plan_layer(x, _rows(dense) - mid, mlp, num_experts, top_k, seed)
        moe = [mx.array(h[None].astype(np.float32)) for h in np.split(mid + out, lengths)]
        plans.append(plan)
    return plans
