"""TRL's GRPOTrainer on examples/code_math, the peer of bench/learning.py: the same model, prompt
(problems.messages_for), sandboxed reward (problems.score on execute.run_program_blocking: art-ray's
sandbox pool, as the example's), training problems in the
same order per seed, group size, groups per step, learning rate, LoRA shape, temperature and token limit,
for a budget of training minutes. Held-out correctness is greedy (transformers' generate) on
problems.held_out_problems, before training and every `--eval-every` training minutes; evaluation time is
not counted. Runs in its own process with every core; bench/learning.py starts it. Last line: one JSON
object {"system": "trl", "seed", "startup_s", "points": [{"minutes", "step", "correct", "n"}], ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "code_math"))

from execute import run_program_blocking  # noqa: E402
from problems import MAX_TOKENS, extract_code, held_out_problems, make_problem, messages_for, score  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--eval-every", type=float, default=1.5, help="training minutes between evaluations")
    parser.add_argument("--held-out", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=6)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--scale-rewards", choices=["group", "none"], default="none")
    parser.add_argument("--steps-per-generation", type=int, default=1, help="optimizer steps per batch")
    parser.add_argument("--output-dir", required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # This run generates with transformers (use_vllm off): TRL does not see the vLLM that art-ray installs,
    # which it would otherwise import at start (10 s here) and warn about its version
    sys.modules["vllm"] = None  # type: ignore[assignment]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # use_cpu: DeepSpeed's probe would warn it found no GPU
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from art_ray.models import resolve_base_model

    torch.set_num_threads(os.cpu_count() or 1)
    start = time.perf_counter()
    path = resolve_base_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = random.Random(args.seed)  # the problem stream bench/learning.py's art-ray runs draw, in order
    problems = [make_problem(rng, level=1) for _ in range(4000)]
    dataset = Dataset.from_list([{"prompt": messages_for(p), "answer": p.answer} for p in problems])
    held_out = held_out_problems(args.held_out)

    def reward(completions, answer, **kwargs) -> list[float]:  # noqa: ANN001, ANN003
        rewards = []
        for completion, expected in zip(completions, answer, strict=True):
            result = run_program_blocking(extract_code(completion[0]["content"]))
            rewards.append(score(result.stdout, result.exit_code, expected)[0])
        return rewards

    def evaluate(policy) -> float:  # noqa: ANN001
        """Greedy held-out correctness, in batches with left padding."""
        tokenizer.padding_side = "left"
        correct = 0
        was_training = policy.training
        policy.eval()
        with torch.no_grad():
            for index in range(0, len(held_out), 32):
                batch = held_out[index : index + 32]
                prompts = [
                    tokenizer.apply_chat_template(messages_for(p), tokenize=False, add_generation_prompt=True)
                    for p in batch
                ]
                encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
                output = policy.generate(
                    **encoded, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
                replies = tokenizer.batch_decode(
                    output[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True
                )
                for problem, reply in zip(batch, replies, strict=True):
                    result = run_program_blocking(extract_code(reply))
                    correct += score(result.stdout, result.exit_code, problem.answer)[1]["correct"]
        policy.train(was_training)
        return correct / len(held_out)

    points: list[dict] = []
    clock = {"train_s": 0.0, "mark": 0.0, "next_eval": args.eval_every * 60, "eval_s": 0.0}

    class Budget(TrainerCallback):
        """Counts training time only; evaluates every `--eval-every` minutes; stops at the budget."""

        def on_train_begin(self, args_, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            clock["mark"] = time.perf_counter()

        def on_step_end(self, args_, state, control, model=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
            clock["train_s"] += time.perf_counter() - clock["mark"]
            done = clock["train_s"] >= args.minutes * 60
            if done or clock["train_s"] >= clock["next_eval"]:
                evaluated = time.perf_counter()
                correct = evaluate(model)
                clock["eval_s"] += time.perf_counter() - evaluated
                minutes = clock["train_s"] / 60
                points.append({"minutes": minutes, "step": state.global_step, "correct": correct})
                print(
                    f"TRL seed {args.seed} step {state.global_step}: {minutes:.2f} min, correct {correct:.3f}"
                )
                while clock["next_eval"] <= clock["train_s"]:
                    clock["next_eval"] += args.eval_every * 60
            control.should_training_stop = done
            clock["mark"] = time.perf_counter()

    config = GRPOConfig(
        output_dir=args.output_dir,
        learning_rate=args.learning_rate,
        # the step's rollouts (generation batch) split into steps_per_generation optimizer steps
        per_device_train_batch_size=args.groups_per_step * args.group_size // args.steps_per_generation,
        num_generations=args.group_size,
        max_completion_length=MAX_TOKENS,
        temperature=args.temperature,
        beta=0.0,
        scale_rewards=args.scale_rewards,
        steps_per_generation=args.steps_per_generation,
        logging_steps=1,
        max_steps=len(problems) // args.groups_per_step * args.steps_per_generation,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        shuffle_dataset=False,
        seed=args.seed,
        lr_scheduler_type="constant",
        # float32 without recomputation, as art-ray's CPU trainer: TRL 1.x's bf16 and gradient
        # checkpointing defaults made each step minutes long on this CPU (no native bf16)
        bf16=False,
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=args.lora_rank,
            lora_alpha=2 * args.lora_rank,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        ),
        callbacks=[Budget()],
    )
    startup_s = time.perf_counter() - start
    baseline = evaluate(trainer.model)
    points.insert(0, {"minutes": 0.0, "step": 0, "correct": baseline})
    print(f"TRL seed {args.seed} step 0: correct {baseline:.3f}", flush=True)
    trainer.train()
    for point in points:
        point["n"] = len(held_out)
    print(
        json.dumps(
            {
                "system": "trl",
                "seed": args.seed,
                "startup_s": round(startup_s, 1),
                "eval_s": round(clock["eval_s"], 1),
                "steps": trainer.state.global_step,
                "points": points,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
