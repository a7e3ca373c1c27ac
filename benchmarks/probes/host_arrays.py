"""What moving a small array between host and MLX costs on this backend, one kernel around it,
us (median): the probe behind `to_gpu_reader` in engine/tensors.py; each figure's name says
what it times (`--help`)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from engine.tensors import to_gpu_reader

SIZES = (4096, 16384, 65536)


def median_us(setup: Callable[[], object], timed: Callable[[object], object],
              count: int) -> float:
    """Median over `count` (after 10 untimed) of `timed(setup())`, setup untimed."""
    seconds = []
    for i in range(count + 10):
        state = setup()
        started = time.perf_counter()
        timed(state)
        if i >= 10:
            seconds.append(time.perf_counter() - started)
    return round(1e6 * statistics.median(seconds), 1)


def probe(size: int, count: int) -> dict[str, float]:
    resident = mx.random.normal((1, size // 4))
    mx.eval(resident)
    host = np.random.default_rng(0).random((1, size // 4), dtype=np.float32)

    def advised() -> mx.array:
        array = mx.array(host)
        to_gpu_reader(array)
        return array

    def fresh_output() -> mx.array:
        mx.clear_cache()
        y = resident * 2
        mx.eval(y)
        return y

    def warm_output() -> mx.array:
        y = resident * 2
        mx.eval(y)
        np.asarray(y)
        return y

    def plus_one(a: mx.array) -> None:
        mx.eval(a + 1)

    def read(y: mx.array) -> None:
        np.asarray(y)[0, 0]

    def advise_only(array: mx.array) -> None:
        to_gpu_reader(array)

    def read_output(advise: bool) -> mx.array:
        y = warm_output()
        np.asarray(y)[0, 0]
        if advise:
            to_gpu_reader(y)
        return y

    # kernel_on_resident: the floor; first_read_of_host_array: the same kernel on an array just
    # made from host bytes; first_read_advised: after to_gpu_reader (CUDA only, else as above);
    # host_read_device_output: np.asarray of a kernel's output in device memory, cache cleared;
    # host_read_warm: the same once MLX's cache holds managed buffers of that size;
    # kernel_after_host_read(_advised): a kernel on an output the host has just read, as the
    # dispatcher reads a layer's hidden states before the shared expert computes on them.
    return {
        "make_array": median_us(lambda: None, lambda _: mx.array(host), count),
        "advise_call": median_us(lambda: mx.array(host), advise_only, count),
        "kernel_on_resident": median_us(lambda: resident, plus_one, count),
        "first_read_of_host_array": median_us(lambda: mx.array(host), plus_one, count),
        "first_read_advised": median_us(advised, plus_one, count),
        "host_read_device_output": median_us(fresh_output, read, count),
        "host_read_warm": median_us(warm_output, read, count),
        "kernel_after_host_read": median_us(lambda: read_output(False), plus_one, count),
        "kernel_after_host_read_advised": median_us(lambda: read_output(True), plus_one,
                                                    count),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = {"device": str(mx.default_device()), "mlx": mx.__version__,
              "cuda": mx.cuda.is_available(),
              "bytes": {size: probe(size, args.count) for size in SIZES}}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for size, parts in report["bytes"].items():
        print(f"{size:>6} B: " + ", ".join(f"{k} {v}" for k, v in parts.items()))


if __name__ == "__main__":
    main()
