"""Interim demo (until the training loop lands): build the local models and sample SmolLM2 on vLLM.

Prints the answer with its sampled token ids and logprobs (what art-ray trains on), then one JSON line.
"""

import json
import time

from art_ray.models import SMOLLM2, TINY, prepare
from art_ray.serving.engine_config import EngineConfig


def main() -> None:
    start = time.time()
    prepare(TINY)
    config = EngineConfig(model=str(prepare(SMOLLM2)))
    config.apply_env()
    from vllm import LLM, SamplingParams

    llm = LLM(**config.vllm_kwargs())
    question = "What is the capital of France?"
    output = llm.chat(
        [{"role": "user", "content": question}], SamplingParams(max_tokens=16, temperature=0, logprobs=0)
    )
    completion = output[0].outputs[0]
    print(f"Q: {question}\nA: {completion.text}")
    print("token ids:", list(completion.token_ids))
    pairs = zip(completion.token_ids, completion.logprobs, strict=True)
    print("logprobs: ", [round(entry[token].logprob, 3) for token, entry in pairs])
    print(
        json.dumps(
            {
                "task": "paris",
                "answer": completion.text,
                "paris": "paris" in completion.text.lower(),
                "seconds": round(time.time() - start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
