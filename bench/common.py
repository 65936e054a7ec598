"""Helpers shared by the benchmarks: a local Ray cluster, a free loopback port, table printing, the box's
speed."""

from __future__ import annotations

import json
import socket
import statistics
import time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_local_ray(num_cpus: int = 4) -> None:
    """A cluster of this machine, as `RayBackend()` embeds one: loopback only, no metrics collection."""
    import ray

    from art_ray.serving.launch import embedded_ray

    with embedded_ray():
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def print_table(title: str, headers: list[str], rows: list[list[object]]) -> None:
    cells = [headers, *[[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for index, row in enumerate(cells):
        print("  ".join(value.rjust(width) for value, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def median(values: list[float]) -> float:
    return statistics.median(values)


def print_result(result: dict) -> None:
    print(json.dumps(result), flush=True)


def box_gflops() -> float:
    """The box's speed as the performance history records it: GFLOP/s of a 1024^2 fp32 matmul on one torch
    thread. On the 2-core dev box it moved between 63 and 107 from hour to hour, so a figure of a slow hour
    is compared with its own speed, not read as a regression."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        for _ in range(3):
            a @ b
        started = time.perf_counter()
        for _ in range(20):
            a @ b
        return round(2 * 1024**3 * 20 / (time.perf_counter() - started) / 1e9, 1)
    finally:
        torch.set_num_threads(threads)
