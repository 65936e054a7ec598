"""Sandboxes (issue 48): art_ray.sandbox's namespace pool against today's subprocess sandbox
(bench/subprocess_sandbox.py::run_python, code_math's before it moved onto the pool), in one invocation.

Measured: warm exec latency p50/p99 at concurrency 1/8/32 and execs/s at 32 (trivial Python,
`print(sum(range(1000)))`; each concurrent client holds its own lease, so the pool has as many slots as
clients); 8 slots ready; reset; the isolation battery (tests/test_sandbox.py); processes and workspace files
left after N execs; the caller's peak RSS under an output flood. The last line is one JSON object.

    flock /tmp/artray-cpu.lock python bench/sandbox.py            # N = 10,000, 1 GB flood
    flock /tmp/artray-cpu.lock python bench/sandbox.py --quick    # N = 1,000, 256 MB flood (~1 min)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "code_math"), str(Path(__file__).parent)]

from common import print_result, print_table  # noqa: E402
from subprocess_sandbox import run_python  # noqa: E402  (the baseline: code_math's earlier sandbox)

from art_ray.sandbox import SandboxLimits, SandboxPool  # noqa: E402

TRIVIAL = "print(sum(range(1000)))"
LIMITS = SandboxLimits(wall_s=10, output_bytes=65536)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def peak_rss_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024


def restart_peak() -> float:
    Path("/proc/self/clear_refs").write_text("5")
    return peak_rss_mb()


async def pool_latency(concurrency: int, execs: int) -> dict:
    async with SandboxPool(slots=concurrency, limits=LIMITS) as pool:
        latencies: list[float] = []

        async def client(count: int) -> None:
            async with pool.lease() as box:
                for _ in range(count):
                    began = time.perf_counter()
                    result = await box.python(TRIVIAL)
                    latencies.append(time.perf_counter() - began)
                    assert result.stdout == "499500\n", result

        began = time.perf_counter()
        await asyncio.gather(*(client(execs // concurrency) for _ in range(concurrency)))
        wall = time.perf_counter() - began
    return {
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "execs_per_s": len(latencies) / wall,
    }


def baseline_latency(concurrency: int, execs: int) -> dict:
    latencies: list[float] = []

    def one(_: int) -> None:
        began = time.perf_counter()
        result = run_python(TRIVIAL)
        latencies.append(time.perf_counter() - began)
        assert result.stdout == "499500\n", result

    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as threads:
        list(threads.map(one, range(execs)))
    wall = time.perf_counter() - began
    return {
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "execs_per_s": len(latencies) / wall,
    }


async def pool_start_and_reset(slots: int = 8, resets: int = 50) -> tuple[float, float]:
    began = time.perf_counter()
    async with SandboxPool(slots=slots, limits=LIMITS) as pool:
        async with pool.lease() as box:  # ready means: a first command answered
            await box.run("true")
        ready = time.perf_counter() - began
        async with pool.lease() as box:
            durations = []
            for _ in range(resets):
                await box.write_file("f.txt", "x")
                began = time.perf_counter()
                await box.reset()
                durations.append(time.perf_counter() - began)
    return ready, 1000 * statistics.median(durations)


async def pool_leaks(execs: int, slots: int = 8) -> tuple[int, int]:
    """N execs that each leave a file and a background process; each lease runs 10. Afterwards: processes
    and workspace files left in the slots (reset between leases must have taken them)."""
    async with SandboxPool(slots=slots, limits=LIMITS) as pool:

        async def lease_of_ten() -> None:
            async with pool.lease() as box:
                for index in range(10):
                    await box.run(f"echo x > f{index}; (sleep 100 &)")

        for _ in range(execs // (10 * slots)):
            await asyncio.gather(*(lease_of_ten() for _ in range(slots)))
        processes = files = 0
        for _ in range(slots):
            async with pool.lease() as box:
                processes += await box.slot.process_count()
                files += len(await box.list_dir())
    return processes, files


def host_processes_of(uids: range) -> int:
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid in uids
            except FileNotFoundError:
                continue
    return count


async def pool_flood(megabytes: int) -> float:
    async with SandboxPool(slots=1, limits=LIMITS) as pool, pool.lease() as box:
        base = restart_peak()
        result = await box.run(f"head -c {megabytes}M /dev/zero", timeout_s=60)
        assert result.truncated and not result.timed_out, result
        return peak_rss_mb() - base


def baseline_flood(megabytes: int) -> float:
    base = restart_peak()
    run_python(
        f"import sys\nfor _ in range({megabytes}):\n    sys.stdout.write('x' * (1 << 20))", timeout_s=60
    )
    return peak_rss_mb() - base


def battery() -> tuple[int, int]:
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "test_sandbox.py"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", completed.stdout)) else 0
    failed = int(m.group(1)) if (m := re.search(r"(\d+) failed", completed.stdout)) else 0
    return passed, passed + failed


def baseline_holes() -> dict:
    """Today's sandbox on two of its holes: a finished program reported timed out, host /tmp written."""
    marker = Path(f"/tmp/artray-bench-{os.getpid()}")
    grandchild = run_python("import os, time\nos.fork() == 0 and time.sleep(30)\nprint(42)")
    run_python(f"open('{marker}', 'w').write('x')")
    written = marker.exists()
    marker.unlink(missing_ok=True)
    return {"grandchild_timed_out": grandchild.timed_out, "host_tmp_written": written}


async def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="N = 1,000 and a 256 MB flood")
    args = parser.parse_args()
    leak_execs, flood_mb, execs = (1000, 256, 320) if args.quick else (10_000, 1024, 1280)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

    pool_by_c, base_by_c = {}, {}
    for concurrency in (1, 8, 32):
        pool_by_c[concurrency] = await pool_latency(concurrency, execs)
        base_by_c[concurrency] = baseline_latency(concurrency, min(execs, 128))
    ready_s, reset_ms = await pool_start_and_reset()
    leaked_processes, leaked_files = await pool_leaks(leak_execs)
    stray_host = host_processes_of(range(100000, 100064))
    pool_flood_mb = await pool_flood(flood_mb)
    base_flood_mb = baseline_flood(flood_mb)
    holes = baseline_holes()
    passed, total = battery()

    rows = []
    for c in (1, 8, 32):
        rows.append(
            [
                f"warm p50 ms, c={c}",
                base_by_c[c]["p50_ms"],
                pool_by_c[c]["p50_ms"],
                "<= 10" if c == 32 else "",
            ]
        )
        rows.append(
            [
                f"warm p99 ms, c={c}",
                base_by_c[c]["p99_ms"],
                pool_by_c[c]["p99_ms"],
                "<= 100" if c == 32 else "",
            ]
        )
    rows += [
        ["execs/s, c=32", base_by_c[32]["execs_per_s"], pool_by_c[32]["execs_per_s"], ">= 300"],
        ["8 slots ready s", "-", ready_s, "<= 1"],
        ["reset ms (median)", "-", reset_ms, "<= 20"],
        [f"left after {leak_execs} execs (procs/files)", "-", f"{leaked_processes}/{leaked_files}", "0/0"],
        [
            f"caller peak RSS +MB, {flood_mb} MB flood",
            base_flood_mb,
            pool_flood_mb,
            f"<= {2 * 2 * LIMITS.output_bytes / 2**20:.2f}",
        ],
        ["grandchild: finished reported timed out", holes["grandchild_timed_out"], False, "False"],
        ["host /tmp written", holes["host_tmp_written"], False, "False"],
        ["battery (tests/test_sandbox.py)", "-", f"{passed}/{total}", "all"],
    ]
    print_table(
        f"Sandboxes, {stamp}: subprocess run_python vs the namespace pool",
        ["", "baseline", "pool", "goal"],
        rows,
    )
    print_result(
        {
            "bench": "sandbox",
            "date": stamp,
            "quick": args.quick,
            "p50_ms_c32": round(pool_by_c[32]["p50_ms"], 2),
            "p99_ms_c32": round(pool_by_c[32]["p99_ms"], 2),
            "execs_per_s_c32": round(pool_by_c[32]["execs_per_s"], 1),
            "baseline_p50_ms_c32": round(base_by_c[32]["p50_ms"], 1),
            "baseline_execs_per_s_c32": round(base_by_c[32]["execs_per_s"], 1),
            "ready_8_slots_s": round(ready_s, 3),
            "reset_ms": round(reset_ms, 2),
            "battery": f"{passed}/{total}",
            "leaked_processes": leaked_processes + stray_host,
            "leaked_files": leaked_files,
            "leak_execs": leak_execs,
            "flood_mb": flood_mb,
            "caller_rss_growth_mb": round(pool_flood_mb, 2),
            "baseline_caller_rss_growth_mb": round(base_flood_mb, 1),
        }
    )


if __name__ == "__main__":
    asyncio.run(main())
