"""How a release's gate decides, on simulated arms (no cluster): art_ray/releases.py's `decide` and `apply`
checked after every request, as `OnlineTrainer` can.

A canary of step 1 against stable step 0 at the policy's first stage (5%, then 25%, 50%, 100%). Each
request goes to an arm by the release's share; 2% of the stable step's replies are cut at their token
limit; 30% of replies get a 0/1 score (mean 0.5 on the stable arm). Three kinds of candidate:
- good: the same as stable. A rollback is a false alarm; the rate must stay under the policy's alpha;
- cuts its replies: 60% cut at the limit (a broken adapter): rolled back on the guardrail;
- worse answers: mean score 0.2 (a preference reversed): rolled back on the score, later (it matures).
Reports per kind: the share of seeds that rolled back or promoted within the requests, and the median
requests (all arms) and candidate requests before a rollback. Last line: {"bench": "release_gate", ...}.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import print_result, print_table  # noqa: E402

from art_ray.releases import ArmStats, Release, ReleasePolicy, apply, decide, start_canary  # noqa: E402

REPLY = {"message": {"role": "assistant", "content": "Sure."}, "finish_reason": "stop"}
CUT = {"message": {"role": "assistant", "content": "Sure, and"}, "finish_reason": "length"}
KINDS = {"good": (0.02, 0.5), "cuts its replies": (0.6, 0.5), "worse answers": (0.02, 0.2)}


def run(seed: int, cut: float, score: float, requests: int, policy: ReleasePolicy) -> tuple[str, int, int]:
    """(outcome, requests until it, candidate requests until it)."""
    rng = random.Random(seed)
    release = start_canary(Release(model="run", stable=0, policy=policy), 1)
    stats = {0: ArmStats(), 1: ArmStats()}
    seen = 0
    for request in range(requests):
        arm = 1 if rng.random() < release.share else 0
        seen += arm
        arm_cut, arm_score = (cut, score) if arm else (0.02, 0.5)
        stats[arm].add_turn(CUT if rng.random() < arm_cut else REPLY)
        if rng.random() < 0.3:
            stats[arm].score.add(float(rng.random() < arm_score))
        decision = decide(release, stats)
        release = apply(release, decision)
        if decision.action in ("rollback", "promote"):
            return decision.action, request + 1, seen
    return "undecided", requests, seen


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=300)
    parser.add_argument("--requests", type=int, default=2000, help="requests per simulated release")
    args = parser.parse_args()
    policy = ReleasePolicy()
    rows, result = [], {"bench": "release_gate", "alpha": policy.alpha, "seeds": args.seeds}
    for kind, (cut, score) in KINDS.items():
        outcomes = [run(seed, cut, score, args.requests, policy) for seed in range(args.seeds)]
        rolled = [o for o in outcomes if o[0] == "rollback"]
        rate = len(rolled) / len(outcomes)
        promoted = sum(o[0] == "promote" for o in outcomes) / len(outcomes)
        median_all = statistics.median(o[1] for o in rolled) if rolled else None
        median_candidate = statistics.median(o[2] for o in rolled) if rolled else None
        rows.append([kind, f"{rate:.3f}", f"{promoted:.3f}", median_all, median_candidate])
        key = kind.split()[0]
        result[f"{key}_rollback_rate"] = round(rate, 4)
        result[f"{key}_promote_rate"] = round(promoted, 4)
        result[f"{key}_median_requests_to_rollback"] = median_all
        result[f"{key}_median_candidate_requests_to_rollback"] = median_candidate
    title = f"{args.seeds} simulated releases of each kind, {args.requests} requests each, checked at each"
    headers = [
        "candidate",
        "rolled back",
        "promoted",
        "median requests to rollback",
        "of them to the candidate",
    ]
    print_table(title, headers, rows)
    print_result(result)


if __name__ == "__main__":
    main()
