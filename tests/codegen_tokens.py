"""The default model's tokens and logprobs for a few requests, run by
``test_default_model.py::test_production_codegen_gives_the_same_tokens`` twice: in the suite's
process, whose XLA:CPU code generation is the quick one (see ``conftest.py``), and as a script
in a process with XLA's own settings, the code users run.

    python tests/codegen_tokens.py CACHE_DIR   # prints the results as JSON
"""

import json
import sys

PROMPTS = ["The three most common ways to cook an egg are",
           "def fibonacci(n):",
           "Paging the KV cache of a language model means"]


def run(model) -> list[dict]:
    """Greedy continuations of PROMPTS submitted together (prefill, mixed and decode steps)
    and one seeded sample, each with its tokens' logprobs and top-2 alternatives."""
    from jaxpaged import LLM, SamplingParams

    llm = LLM(model, max_num_batched_tokens=16, enable_prefix_caching=False)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, logprobs=2, ignore_eos=True)
    outs = llm.generate(PROMPTS + PROMPTS[:1], [greedy] * len(PROMPTS) + [seeded], use_tqdm=False)
    return [{"tokens": list(c.token_ids),
             "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs]}
            for o in outs for c in o.outputs]


if __name__ == "__main__":
    from jaxpaged.loader import load_model

    print(json.dumps(run(load_model(cache_dir=sys.argv[1]))))
