"""Would a CPU decode step run faster on two CPU devices, attention split by rows? (#18)

XLA:CPU runs each op of a decode step on the machine's threads together, and the paged
attention's small gathers and batched dots use a second core poorly (1.12x on 2 vCPUs, see
docs/measurements.md, twenty-sixth session), while the same attention split by rows over two
CPU devices (``--xla_force_host_platform_device_count=2``, one thread each) runs 1.35-1.4x
faster. This script times one decode forward of the default model's shapes (SmolLM2-135M,
float32, random weights, 64-token blocks, rows at contexts ``ctx +- spread``) structured
four ways, each in its own process (the device count is fixed when jax starts), the
processes alternating over ``--rounds``:

- ``engine``: the engine's own forward (``runner.StepPrograms().forward`` of the CPU form), one device;
- ``one device``: this script's forward, one device: what the variants below restructure
  (close to ``engine`` if the script models the engine's forward well);
- ``rows split, MLP split``: two devices; each holds half the rows and the KV blocks of its
  rows' sequences, and runs their attention block (q/k/v, attention, o; those weights on
  both devices); the MLP is tensor-parallel over all rows (an all-gather of the rows before,
  gate/up split by columns, down by rows, a reduce-scatter back to each device's rows after);
  the LM head split by vocabulary (SGLang's "DP attention");
- ``rows split, all replicated``: two devices, each with every weight and half the rows, no
  collectives in the layers: two engine replicas in one program.

``--no-attention`` also times the script's forwards with attention left out (the queries
pass through; the K/V write kept): what the structure costs the matmuls.

    python scripts/bench_dp_attention.py              # 3 rounds, 48 rows, ~3 min
    python scripts/bench_dp_attention.py --rows 96 --ctx 400
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = {"engine": 1, "one device": 1, "rows split, MLP split": 2, "rows split, all replicated": 2}
BS = 64


def child(args) -> dict:
    """One variant, timed in this process: ``{"median_ms", "min_ms"}``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpaged.config import LlamaConfig
    from jaxpaged.kv_cache import KVPool, write_kv
    from jaxpaged.model import apply_rope, rms_norm, rope_inv_freq
    from jaxpaged.pallas.xla import xla_paged_decode_attention

    cfg = LlamaConfig.smollm2_135m()
    L, Dm, N, K, H, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            cfg.intermediate_size, cfg.vocab_size)
    eps, scale, inv_freq = cfg.rms_norm_eps, H ** -0.5, jnp.asarray(rope_inv_freq(cfg))
    rng = np.random.default_rng(0)
    R, variant, attend = args.rows, args.variant, not args.no_attention
    lens = np.full(R, args.ctx) if R == 1 else rng.integers(args.ctx - args.spread, args.ctx + args.spread + 1, R)
    W = -(-int(lens.max()) // BS)

    def pool_and_table(rows_lens):
        """A pool with each row's W blocks (block 0 the null block) and their table."""
        S = len(rows_lens)
        shape = (L, S * W + 1, K, BS, H)
        kv = KVPool(*(jnp.asarray(rng.standard_normal(shape, dtype=np.float32)) for _ in range(2)))
        return kv, (1 + rng.permutation(S * W).reshape(S, W)).astype(np.int32)

    def timed(step):
        jax.block_until_ready(step())
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            jax.block_until_ready(step())
            ts.append(time.perf_counter() - t)
        return {"median_ms": 1e3 * float(np.median(ts)), "min_ms": 1e3 * min(ts)}

    if variant == "engine":
        from jaxpaged import runner
        from jaxpaged.loader import build_model
        from jaxpaged.model import runtime_form
        from bench_common import decode_metadata, random_params

        model = runtime_form(build_model(cfg, random_params(cfg), dtype=jnp.float32))
        parts = runner.split_model(model)
        kv, bt = pool_and_table(lens)
        md = decode_metadata(lens, bt, BS)
        tokens, idx, box = jnp.asarray(rng.integers(0, V, R), jnp.int32), jnp.arange(R), [kv]

        forward = runner.StepPrograms().forward

        def step():
            logits, box[0] = forward(*parts, box[0], tokens, md, idx)[:2]
            return logits

        return timed(step)

    # The script's forward: the CPU form's [out, in] weights, one array per layer and name,
    # read through lax.switch (no copies), the tied embedding as the LM head.
    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)

    layers = [dict(qkv=w((N + 2 * K) * H, Dm), o=w(Dm, N * H), gu=w(2 * F, Dm), down=w(Dm, F),
                   n1=np.ones(Dm, np.float32), n2=np.ones(Dm, np.float32)) for _ in range(L)]
    head, final_norm = w(V, Dm), np.ones(Dm, np.float32)

    def mm(x, w):  # x @ w.T
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))

    def mlp(x, p):
        g, u = jnp.split(mm(rms_norm(x, p["n2"], eps), p["gu"]), 2, axis=1)
        return mm(jax.nn.silu(g) * u, p["down"])

    def forward(ps, head, final_norm, kv, x, bt, ctx, mlp_step, logits_of):
        """30 layers over this device's rows ``x``; ``mlp_step(x, layer)`` adds the MLP."""
        S = x.shape[0]
        pos = ctx - 1
        slots = bt[jnp.arange(S), pos // BS] * BS + pos % BS

        def layer_fn(carry, layer):
            x, kv = carry
            qkv = jax.lax.switch(layer, [lambda x, p=p: mm(rms_norm(x, p["n1"], eps), p["qkv"]) for p in ps], x)
            q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=1)
            q, k, v = apply_rope(q.reshape(S, N, H), pos, inv_freq), apply_rope(k.reshape(S, K, H), pos, inv_freq), \
                v.reshape(S, K, H)
            kv = write_kv(kv, layer, k, v, slots)
            o = xla_paged_decode_attention(q, kv.k, kv.v, layer, bt, ctx, scale=scale) if attend else q
            x = jax.lax.switch(layer, [lambda x, o, p=p: x + mm(o.reshape(S, N * H), p["o"]) for p in ps], x, o)
            return (mlp_step(x, layer), kv), None

        (x, kv), _ = jax.lax.scan(layer_fn, (x, kv), jnp.arange(L))
        return logits_of(rms_norm(x, final_norm, eps), head), kv

    def local_mlp(ps):
        return lambda x, layer: jax.lax.switch(layer, [lambda x, p=p: x + mlp(x, p) for p in ps], x)

    x0 = rng.standard_normal((R, Dm), dtype=np.float32)
    if variant == "one device":
        kv, bt = pool_and_table(lens)
        ps = jax.tree.map(jnp.asarray, layers)

        def fwd(ps, head, final_norm, kv, x, bt, ctx):
            return forward(ps, head, final_norm, kv, x, bt, ctx, local_mlp(ps), mm)

        f = jax.jit(fwd, donate_argnums=3)
        const = (ps, jnp.asarray(head), jnp.asarray(final_norm))
        data = (jnp.asarray(x0), jnp.asarray(bt), jnp.asarray(lens, jnp.int32))
    else:
        mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
        split_mlp = variant == "rows split, MLP split"
        halves = [pool_and_table(lens[:R // 2]), pool_and_table(lens[R // 2:])]
        kv = KVPool(*(jnp.concatenate([getattr(h[0], n) for h in halves], axis=1) for n in ("k", "v")))
        bt = np.concatenate([h[1] for h in halves])  # each half's ids local to its device's pool
        spec = dict(qkv=P(), o=P(), n1=P(), n2=P(), gu=P("d", None) if split_mlp else P(),
                    down=P(None, "d") if split_mlp else P())
        if split_mlp:  # gate and up each split by columns: each device holds [gate_d; up_d]
            for p in layers:
                g, u = np.split(p["gu"], 2)
                p["gu"] = np.concatenate([np.concatenate([gd, ud]) for gd, ud in zip(np.split(g, 2), np.split(u, 2))])
        head_spec = P("d", None) if split_mlp else P()

        def put(a, s):
            return jax.device_put(a, NamedSharding(mesh, s))

        def fwd(ps, head, final_norm, kv, x, bt, ctx):
            def mlp_step(x, layer):
                if not split_mlp:
                    return local_mlp(ps)(x, layer)
                rows = jax.lax.all_gather(x, "d", tiled=True)
                part = jax.lax.switch(layer, [lambda r, p=p: mlp(r, p) for p in ps], rows)
                return x + jax.lax.psum_scatter(part, "d", tiled=True)

            def logits_of(x, head):
                if not split_mlp:
                    return mm(x, head)
                return jax.lax.all_gather(mm(jax.lax.all_gather(x, "d", tiled=True), head), "d", axis=1, tiled=True)

            return forward(ps, head, final_norm, kv, x, bt, ctx, mlp_step, logits_of)

        rows_spec = P("d")
        f = jax.jit(jax.shard_map(fwd, mesh=mesh, in_specs=([spec] * L, head_spec, P(), P(None, "d"), rows_spec,
                                                             rows_spec, rows_spec),
                                  out_specs=(P() if split_mlp else rows_spec, P(None, "d")), check_vma=False),
                    donate_argnums=3)
        const = ([{n: put(a, spec[n]) for n, a in p.items()} for p in layers], put(head, head_spec), put(final_norm, P()))
        kv = KVPool(put(kv.k, P(None, "d")), put(kv.v, P(None, "d")))
        data = (put(x0, rows_spec), put(bt, rows_spec), put(np.asarray(lens, np.int32), rows_spec))
    box = [kv]

    def step():
        logits, box[0] = f(*const, box[0], *data)
        return logits

    return timed(step)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=170)
    ap.add_argument("--spread", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--no-attention", action="store_true", help="also time the forwards without attention")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child processes
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return
    if args.rows % 2:
        ap.error(f"--rows {args.rows}: the two-device variants split the rows in halves")
    from bench_common import machine_header

    print(f"# bench_dp_attention  {machine_header()}")
    cases = [(v, False) for v in VARIANTS]
    if args.no_attention:
        cases += [(v, True) for v in VARIANTS if v != "engine"]
    results = {c: [] for c in cases}
    for _ in range(args.rounds):
        for variant, bare in cases:
            env = dict(os.environ)
            if VARIANTS[variant] > 1:
                env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
            cmd = [sys.executable, __file__, "--variant", variant, "--rows", str(args.rows), "--ctx", str(args.ctx),
                   "--spread", str(args.spread), "--reps", str(args.reps)] + (["--no-attention"] if bare else [])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            results[variant, bare].append(json.loads(out.strip().splitlines()[-1]))
    base = sorted(r["median_ms"] for r in results["engine", False])[args.rounds // 2]
    print(f"\n## one decode forward, {args.rows} rows at contexts {args.ctx} +- {args.spread} (default model's "
          f"shapes, float32, blocks of {BS}); ms, each round's median of {args.reps} calls")
    print(f"{'forward':<48}{'rounds (median ms)':>28}{'best min':>10}{'engine / this':>15}")
    for (variant, bare), rs in results.items():
        meds = sorted(r["median_ms"] for r in rs)
        name = variant + (", without attention" if bare else "")
        rounds = " / ".join(f"{r['median_ms']:.1f}" for r in rs)
        print(f"{name:<48}{rounds:>28}"
              f"{min(r['min_ms'] for r in rs):>10.1f}{base / meds[len(meds) // 2]:>15.2f}")


if __name__ == "__main__":
    main()
