"""The demo's memory, all processes, by role: `make demo`'s script run as a subprocess while its process tree
(the driver, the embedded Ray cluster it starts, Serve's actors, the vLLM engine's processes, the trainer
rank, the rollout runners) is sampled every --interval seconds.

PSS (proportional set size, /proc/PID/smaps_rollup) counts a page shared by k processes as 1/k in each, so
the processes' PSS add up to what the demo really holds; RSS would count torch's shared libraries once per
process. Reported: the peak of the summed PSS, each role's PSS at that moment and its own peak; when the
demo said it was registered and when it had its first held-out sample (seconds from the script's start),
and the CPU seconds each role used until registered (where the start's time goes on a box with few cores).
Sampling costs the demo some CPU: its wall time here runs above `make demo`'s.
Last line: {"bench": "memory", "peak_pss_gib", "at_peak_gib": {role: GiB}, "role_peak_gib",
"registered_seconds", "first_held-out_sample_seconds", "cpu_seconds_until_registered", "demo_seconds"}.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import print_result, print_table  # noqa: E402

ROOT = Path(__file__).parents[1]
GIB = 2**30
# (role, pattern on the process's command line); the first match names it
ROLES = [
    ("vLLM engine core", r"^VLLM::EngineCore"),
    ("vLLM engine worker", r"^VLLM::Worker"),
    ("inference replica (Serve)", r"ServeReplica:[^:]+:InferenceReplica"),
    ("trainer rank", r"TrainerWorker"),
    ("rollout runners", r"RolloutRunner"),
    ("Serve controller", r"ServeController"),
    ("Serve proxy", r"ProxyActor"),
    ("LoRA registry", r"LoRARegistry"),
    ("capture store", r"CaptureStore"),
    ("Ray gcs_server", r"gcs_server"),
    ("Ray raylet", r"/raylet "),
    ("Ray dashboard", r"dashboard"),
    ("Ray log monitor", r"log_monitor"),
    ("Ray idle workers", r"default_worker\.py|ray::IDLE"),
    ("driver (the script)", r"examples/one_word/train\.py|multi_tenant\.py --child"),
]

# lines of the demo's output, and what their appearance means
MILESTONES = {"registered": ": registered in ", "first held-out sample": "held-out before"}


def role_of(cmdline: str) -> str:
    for role, pattern in ROLES:
        if re.search(pattern, cmdline):
            return role
    return "other: " + (cmdline.split(" ")[0].rsplit("/", 1)[-1] or "?")[:40]


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children[parent].append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def pss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time the process has used."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sample(root: int, cpu_by_pid: dict[int, tuple[str, float]]) -> dict[str, int]:
    """PSS by role now; `cpu_by_pid` keeps each process's role and latest CPU time (a process that
    exits keeps its last one)."""
    by_role: dict[str, int] = defaultdict(int)
    for pid in descendants(root):
        pss = pss_bytes(pid)
        if pss:
            role = role_of(cmdline(pid))
            by_role[role] += pss
            if (used := cpu_seconds(pid)) is not None:
                cpu_by_pid[pid] = (role, used)
    return dict(by_role)


def cpu_by_role(cpu_by_pid: dict[int, tuple[str, float]]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for role, used in cpu_by_pid.values():
        totals[role] += used
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=None, help="the demo's --steps (default: its own)")
    args = parser.parse_args()
    storage = tempfile.mkdtemp(prefix="art-ray-memory-")
    command = [sys.executable, str(ROOT / "examples/one_word/train.py"), "--storage", storage]
    if args.steps is not None:
        command += ["--steps", str(args.steps)]
    start = time.perf_counter()
    log = Path(storage) / "demo.log"
    demo = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    seen: dict[str, float] = {}

    def follow() -> None:  # the demo's output to its log, and when its milestones appeared
        with log.open("w", buffering=1) as out:
            for line in demo.stdout:
                out.write(line)
                for milestone, marker in MILESTONES.items():
                    if marker in line and milestone not in seen:
                        seen[milestone] = time.perf_counter() - start

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    peak_total, at_peak = 0, {}
    role_peak: dict[str, int] = defaultdict(int)
    cpu_by_pid: dict[int, tuple[str, float]] = {}
    cpu_until_registered: dict[str, float] = {}
    while demo.poll() is None:
        by_role = sample(demo.pid, cpu_by_pid)
        if "registered" in seen and not cpu_until_registered:
            cpu_until_registered = cpu_by_role(cpu_by_pid)
        total = sum(by_role.values())
        if total > peak_total:
            peak_total, at_peak = total, by_role
        for role, pss in by_role.items():
            role_peak[role] = max(role_peak[role], pss)
        time.sleep(args.interval)
    reader.join()
    seconds = time.perf_counter() - start
    if demo.returncode != 0:
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"the demo exited {demo.returncode}")
    rows = [
        [role, at_peak.get(role, 0) / GIB, role_peak[role] / GIB]
        for role in sorted(role_peak, key=lambda r: -at_peak.get(r, 0))
    ]
    rows.append(["all processes", peak_total / GIB, peak_total / GIB])
    for name, at in seen.items():
        print(f"{name}: {at:.1f} s after the script started")
    if cpu_until_registered:
        print_table(
            f"CPU seconds by role until registered ({seen['registered']:.0f} s on {os.cpu_count()} cores)",
            ["process", "CPU s"],
            [[role, used] for role, used in sorted(cpu_until_registered.items(), key=lambda r: -r[1])],
        )
    print_table(
        f"`make demo`'s script, PSS by role (GiB), sampled every {args.interval} s over {seconds:.0f} s",
        ["process", "at the peak", "own peak"],
        rows,
    )
    print_result(
        {
            "bench": "memory",
            "peak_pss_gib": round(peak_total / GIB, 2),
            "at_peak_gib": {role: round(pss / GIB, 3) for role, pss in at_peak.items()},
            "role_peak_gib": {role: round(pss / GIB, 3) for role, pss in role_peak.items()},
            "demo_seconds": round(seconds, 1),
            **{f"{name.replace(' ', '_')}_seconds": round(at, 1) for name, at in seen.items()},
            "cpu_seconds_until_registered": {
                role: round(used, 1) for role, used in cpu_until_registered.items()
            },
        }
    )


if __name__ == "__main__":
    main()
