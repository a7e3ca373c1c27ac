"""Settings Shoal gives its own processes for the libraries under them, unless the user chose:
MLX's CUDA graphs off where every MoE layer evaluates (a worker, a coordinator with workers),
MLX's default where nothing does (a coordinator alone). Elsewhere than CUDA it means nothing.
"""

from __future__ import annotations

import os

# MLX's CUDA backend launches each evaluation's kernels as they come instead of capturing a
# CUDA graph first: a coordinator evaluates at every MoE layer and a worker at every request,
# short runs of kernels where capturing a graph costs more than it saves (docs/benchmarks.md,
# H200 table); the same kernels run either way (`benchmarks.probes.greedy_digest`: every
# logit's bits equal).
# MLX reads the setting once per process, at its first kernel; elsewhere it means nothing.
GRAPHS = "MLX_USE_CUDA_GRAPHS"
CHOSEN_BY_SHOAL = "SHOAL_CUDA_GRAPHS_DEFAULTED"  # set beside it when Shoal chose, not the user


def launch_directly() -> None:
    """Turn MLX's CUDA graphs off for this process and those it starts, unless the user set
    MLX_USE_CUDA_GRAPHS (either way: theirs is kept). Call it before MLX's first kernel: MLX
    reads the setting once. Short evaluations of a few kernels (a worker's request, the
    router's choice a coordinator must read at every MoE layer) cost more to capture into a
    graph than the graph saves; a coordinator alone with every expert resident evaluates once
    a token, as mlx-lm does, and keeps MLX's default (docs/benchmarks.md)."""
    if GRAPHS not in os.environ:
        os.environ[GRAPHS] = "0"
        os.environ[CHOSEN_BY_SHOAL] = "1"


def environment_as_given() -> dict[str, str]:
    """This process's environment without what `launch_directly` added: for starting another
    program (mlx-lm's own baselines in `shoal bench`) as the user would have run it."""
    env = dict(os.environ)
    if env.pop(CHOSEN_BY_SHOAL, None):
        env.pop(GRAPHS, None)
    return env


def raise_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, as far as the OS lets
    it (macOS refuses more than its per-process maximum, which it does not report), and return
    the limit in force. mlx-lm's import sets 2048 and lowers the hard limit to 4096, so call
    this after it. Each connection a server holds is a file: at the soft limit new ones fail.
    Nothing is done where the `resource` module does not exist (Windows)."""
    try:
        import resource
    except ImportError:
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    while target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            target //= 2
    return soft
