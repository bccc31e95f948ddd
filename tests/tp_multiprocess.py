"""One process of a multi-process tensor-parallel run on localhost (run by ``tests/test_tp.py``).

    python tests/tp_multiprocess.py PROCESS_ID NUM_PROCESSES PORT MODEL_FOLDER OUT.json

Each process has one CPU device; ``jax.distributed`` joins them into one mesh of
NUM_PROCESSES devices with gloo collectives. Every process submits the same requests
(multi-controller SPMD) and writes the greedy tokens and top logprobs it received.
"""

import json
import sys

import jax


def main(process_id: int, num_processes: int, port: int, folder: str, out: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=120)
    from jaxpaged import LLM, SamplingParams

    from tp_cases import ENGINE, GREEDY, PROMPTS

    assert jax.device_count() == num_processes and jax.local_device_count() == 1
    llm = LLM(folder, tensor_parallel_size=num_processes, **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    mine = llm.runner.kv.k.addressable_shards
    result = {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[lp[t].logprob for lp in o.outputs[0].logprobs for t in sorted(lp)] for o in outs],
        "local_pool_shard": list(mine[0].data.shape),
        "global_pool": list(llm.runner.kv.k.shape),
    }
    with open(out, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    pid, n, port, folder, out = sys.argv[1:]
    main(int(pid), int(n), int(port), folder, out)
