"""FP8 KV-cache scales calibrated over the ranks of a torchrun job (the calibrating `convert` of a recipe with
a `kv_cache` section): what `quantkit.calibrate.calibrate` computes, data parallel.

Every rank streams the decoder layers with the KV observer and the expert token counter attached, and
forwards only its own batches of the executor's batch plan (calib/parallel.py: the same batches as one
process, each on one rank). Then the per-layer maxima are combined with a max and the token and expert
counts with sums: both exact, so the scales are the single process's bit for bit whatever the world size.
The per-layer values are a few floats and integers: they travel as small metadata (World.all_gather)."""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..dist import World


def calibrate_ranks(model_dir, world: World, *, dataset=None, num_samples: int, seq_len: int, strategy: str,
                    device: str | None = None, log: Callable[[str], None] | None = None, dtype: str | None = None):
    """`calibrate(model_dir, dataset=..., num_samples=..., seq_len=..., strategy=..., device=...)` over the
    ranks of `world` (every rank calls it with the same arguments and gets the same CalibrationResult)."""
    from ..errors import CalibrationError
    from ..pack.kv import STRATEGIES
    from .data import DEFAULT_SEED, load_calibration_data, load_tokenizer
    from .executor import LayerExecutor
    from .kv_scales import kv_result, observer_bytes
    from .observers import ExpertTokenCounter, KVCacheObserver
    from .parallel import Parallel

    t0 = time.perf_counter()

    def observe():
        if strategy not in STRATEGIES:
            raise CalibrationError(f"unknown KV-cache strategy {strategy!r}", hint="use --strategy tensor or attn_head")
        ex = LayerExecutor(model_dir, device=device, dtype=dtype)
        data = load_calibration_data(dataset, tokenizer=load_tokenizer(model_dir), vocab_size=ex.config.vocab_size,
                                     num_samples=num_samples, seq_len=seq_len, seed=DEFAULT_SEED)
        lengths = [len(s) for s in data.samples]
        plan = ex.plan_memory(lengths, statistics=lambda i, layer: observer_bytes(ex, ex.call_tokens(lengths)))
        if log is not None and world.leader:
            log(plan.summary())
        par = Parallel(world, lengths, ex.batch_tokens)
        ex.share = set(par.mine) if par.distributed else None
        kv, experts = KVCacheObserver(), ExpertTokenCounter()
        ex.run(data.samples, [kv, experts]).close()
        ex.measured_peak_bytes()
        mine = {"k": {i: t.tolist() for i, t in kv.k_amax.items()}, "v": {i: t.tolist() for i, t in kv.v_amax.items()},
                "mla": dict(kv.mla), "tokens": dict(kv.tokens), "indexer": dict(kv.indexer_k_amax),
                "counts": {i: c.tolist() for i, c in experts.counts.items()}, "top_k": dict(experts.top_k)}
        return ex, data, plan, mine

    ex, data, plan, mine = world.step(observe, "calibrating the KV-cache scales")
    everyone = world.all_gather(mine)

    def merge():
        kv, experts = KVCacheObserver(), ExpertTokenCounter()
        for part in everyone:  # maxima and sums: exact, whatever the order
            for i, k in part["k"].items():
                k, v = torch.tensor(k, dtype=torch.float32), torch.tensor(part["v"][i], dtype=torch.float32)
                if i in kv.k_amax:
                    k, v = torch.maximum(k, kv.k_amax[i]), torch.maximum(v, kv.v_amax[i])
                kv.k_amax[i], kv.v_amax[i] = k, v
                kv.mla[i] = part["mla"][i]
                kv.tokens[i] = kv.tokens.get(i, 0) + part["tokens"][i]
            for i, a in part["indexer"].items():
                kv.indexer_k_amax[i] = max(a, kv.indexer_k_amax.get(i, 0.0))
            for i, c in part["counts"].items():
                c = torch.tensor(c, dtype=torch.int64)
                experts.counts[i] = experts.counts[i] + c if i in experts.counts else c
            experts.top_k.update(part["top_k"])
        return kv_result(model_dir, ex, kv, experts, strategy, data, t0, plan)

    return world.step(merge, "combining the KV-cache statistics")
