"""A GRPO step of the email agent's shape, with its shared prefix computed once a step against in every
row (trainer/packing.py `pack_step`).

The batch: 4 questions x 6 samples. Each prompt is the email agent's own (examples/email_agent: its
system prompt and tool schemas through SmolLM2's chat template, then the question), followed by 230
fixed trained tokens, the size of an email agent conversation's own part (its calls, the tool results
between them). Rewards vary in every group, so all 24 conversations train. Each way trains SmolLM2-135M
(LoRA r=16 alpha=32, float32, rows of 1280 tokens, one row a forward, as the example's trainer) on one
in-process trainer rank (TrainerWorker, DeepSpeed on gloo) in a process of its own with `--threads`
torch threads, `--steps` measured steps after a warm-up; it reports the median `time/step_seconds` and
the process's peak RSS. Last line: {"bench": "step_prefix", "ratio": seconds once a step / seconds in
every row, ...}.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "examples" / "email_agent"))
sys.path.insert(0, str(ROOT / "tests"))

from common import print_result, print_table  # noqa: E402

QUESTIONS, SAMPLES, OWN_TOKENS, ROW = 4, 6, 230, 1280


def groups(base_model: str) -> list:
    from factories import served_choice
    from inbox import SYSTEM, TOOLS, held_out_scenarios
    from transformers import AutoTokenizer

    from art_ray import Trajectory, TrajectoryGroup

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    rng = random.Random(0)
    result = []
    for scenario in held_out_scenarios(QUESTIONS):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": scenario.question}]
        prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        trajectories = []
        for sample in range(SAMPLES):
            ids = tuple(rng.randrange(1000, 20000) for _ in range(OWN_TOKENS))
            trajectories.append(
                Trajectory(
                    messages_and_choices=[
                        *messages,
                        served_choice(
                            "a",
                            token_ids=ids,
                            logprobs=tuple(-rng.uniform(0.5, 3.0) for _ in ids),
                            prompt_token_ids=tuple(prompt),
                        ),
                    ],
                    reward=float(sample % 3),
                )
            )
        result.append(TrajectoryGroup(trajectories))
    return result


def measure(share_step_prefix: bool, steps: int, threads: int) -> dict:
    """Runs in a child process: one trainer rank, a warm-up step, then `steps` measured ones."""
    from art_ray import LoRASpec, ModelConfig, TrainConfig
    from art_ray.models import SMOLLM2, prepare
    from art_ray.placement import Reservation
    from art_ray.trainer.config import TrainerConfig
    from art_ray.trainer.train_batch import rl_batches
    from art_ray.trainer.worker import TrainerWorker

    base = str(prepare(SMOLLM2))
    config = TrainerConfig(
        model="bench",
        project="bench",
        base_model=base,
        settings=ModelConfig(
            lora=LoRASpec(r=16, alpha=32), sequence_length=ROW, max_model_len=ROW, micro_batch_rows=1
        ),
        rank=Reservation(num_cpus=float(threads)),
        threads=threads,
    )
    rank = TrainerWorker(config, 0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rank.setup("127.0.0.1", port)
    train_config = TrainConfig(learning_rate=5e-4, scale_rewards=False)
    [batch] = rl_batches(
        groups(base), rank.tokenizer, train_config, ROW, 1, share_step_prefix=share_step_prefix
    )
    seconds = []
    for _ in range(steps + 1):
        [metrics] = list(rank.train("bench", batch, train_config))
        seconds.append(metrics["time/step_seconds"])
    step = batch.steps[0]
    return {
        "seconds": statistics.median(seconds[1:]),
        "rows": len(step.rows),
        "prefix": len(step.prefix),
        "computed_tokens": len(step.prefix) + sum(sum(1 for s in row.segment_ids if s) for row in step.rows),
        "trained_tokens": metrics["data/trained_tokens"],
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def run_child(share_step_prefix: bool, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", "on" if share_step_prefix else "off"]
    command += ["--steps", str(args.steps), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=["on", "off"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child == "on", args.steps, args.threads)), flush=True)
        return
    every_row, once = run_child(False, args), run_child(True, args)
    print_table(
        f"email agent step ({QUESTIONS} x {SAMPLES}, {OWN_TOKENS} own tokens each), {args.threads} threads, "
        f"median of {args.steps}",
        ["prefix", "rows", "computed tokens", "trained tokens", "step s", "peak RSS GiB"],
        [
            [name, r["rows"], r["computed_tokens"], r["trained_tokens"], r["seconds"], r["peak_rss_gib"]]
            for name, r in (("in every row", every_row), (f"once a step ({once['prefix']})", once))
        ],
    )
    print_result(
        {
            "bench": "step_prefix",
            "ratio": round(once["seconds"] / every_row["seconds"], 3),
            "seconds_once": round(once["seconds"], 2),
            "seconds_every_row": round(every_row["seconds"], 2),
            "tokens_ratio": round(once["computed_tokens"] / every_row["computed_tokens"], 3),
            "peak_rss_gib_once": round(once["peak_rss_gib"], 2),
            "peak_rss_gib_every_row": round(every_row["peak_rss_gib"], 2),
            "prefix": once["prefix"],
        }
    )


if __name__ == "__main__":
    main()
