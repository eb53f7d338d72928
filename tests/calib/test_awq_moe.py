"""AWQ on a MoE layer: the norm fold is stored exactly as searched, the router sees what it saw before up to
its storage rounding, the per-expert searches use routing weights, coverage fallbacks are reported."""

import json

import torch

from quantkit.calib.data import load_calibration_data
from quantkit.calib.hessians import routed_batches
from quantkit.calib.spool import run_calibrated
from quantkit.calib.weights import load_layer_weights
from quantkit.read.checkpoint import Checkpoint
from quantkit.read.safetensors import SafetensorsFile
from quantkit.testing import make_tiny_model

from calib.test_passes import recipe


def test_routed_batches_carry_routing_weights():
    gen = torch.Generator().manual_seed(0)
    t, k, e, h = 50, 2, 5, 8
    x = torch.randn(t, h, generator=gen)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    seen = set()
    for ids, xs, mask, ws in routed_batches(x, idx, e, h, weights=w):
        for r, ex in enumerate(ids.tolist()):
            tok, slot = (idx == ex).nonzero(as_tuple=True)  # tokens routed to ex, in token order
            c = len(tok)
            assert torch.equal(xs[r, :c], x[tok]) and torch.equal(ws[r, :c], w[tok, slot])
            assert mask[r, :c].all() and not mask[r, c:].any() and not ws[r, c:].any()
            seen.add(ex)
    assert seen == set(idx.unique().tolist())
    assert all(len(b) == 3 for b in routed_batches(x, idx, e, h))  # unchanged without weights


def test_routed_batches_chunk_experts_of_similar_counts():
    # skewed routing: expert 3 gets most tokens. Chunks go busiest first, so each pads to its own busiest
    gen = torch.Generator().manual_seed(1)
    t, e, h = 400, 8, 4
    p = torch.tensor([1, 1, 1, 12, 1, 2, 4, 1], dtype=torch.float)
    idx = torch.multinomial(p.expand(t, e), 1, generator=gen)  # top-1
    counts = torch.bincount(idx.flatten(), minlength=e)
    x = torch.randn(t, h, generator=gen)
    budget = 3 * int(counts.max()) * h * 4  # three of the busiest expert's padded blocks
    chunks = list(routed_batches(x, idx, e, h, budget=budget))
    order = torch.cat([ids for ids, _, _ in chunks])
    assert sorted(order.tolist()) == counts.nonzero().flatten().tolist()
    assert counts[order].tolist() == sorted(counts[order].tolist(), reverse=True)
    for ids, xs, mask in chunks:
        assert xs.shape[1] == int(counts[ids].max()) and len(ids) * xs.shape[1] * h * 4 <= max(budget, xs[0].numel() * 4)
    padded = sum(xs.shape[0] * xs.shape[1] for _, xs, _ in chunks)

    def id_order_padding():  # the same greedy chunking over the experts in id order
        total, chunk = 0, []
        for c in counts[counts > 0].tolist():
            if chunk and (len(chunk) + 1) * max(chunk + [c]) * h * 4 > budget:
                total, chunk = total + len(chunk) * max(chunk), []
            chunk.append(c)
        return total + len(chunk) * max(chunk)

    assert padded < 0.8 * id_order_padding()
    for ids, xs, mask in chunks:  # at most a quarter of a chunk's rows are padding
        assert mask.sum() >= 0.75 * mask.numel() - 1e-9
    # one chunk would hold every expert within the budget, but padding them all to the busiest is not done
    assert len(list(routed_batches(x, idx, e, h))) > 1


def _spool(spool, index):
    out, meta = {}, {}
    for name in index["layers"]:
        with SafetensorsFile(spool / f"{name}.safetensors") as f:
            out.update({k: f.get(k) for k in f.header.tensors})
        meta.update(json.loads((spool / f"{name}.json").read_text())["modules"])
    return out, meta


def _salient_model(path):
    """A tiny qwen3_moe whose MoE inputs have a few large channels (post-attention norm weights x 8), where
    scaling those channels up before quantizing clearly helps."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_model("qwen3_moe", path / "base")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[:6] *= 8
    model.save_pretrained(path / "src", max_shard_size="300KB")
    return path / "src"


def test_norm_fold_is_exact_and_router_compensated(tmp_path):
    src = _salient_model(tmp_path)
    data = load_calibration_data(None, vocab_size=512, num_samples=16, seq_len=64)
    index = run_calibrated(src, recipe("awq", clip="false", scale_down="false"), data.samples, tmp_path / "spool")
    sd, meta = _spool(tmp_path / "spool", index)
    ck = Checkpoint.open(src)
    folded = 0
    for layer in range(2):
        nname = f"model.layers.{layer}.post_attention_layernorm.weight"
        rname = f"model.layers.{layer}.mlp.gate.weight"
        if nname not in sd:
            assert rname not in sd  # no fold: nothing else changed either
            continue
        folded += 1
        src_w = load_layer_weights(ck, layer)
        norm0 = src_w["post_attention_layernorm.weight"]
        norm1, router1 = sd[nname].float(), sd[rname].float()
        for t in (norm1, router1):  # already rounded to the source dtype: convert's cast changes nothing
            assert torch.equal(t, t.to(torch.bfloat16).float())
        s = norm0 / norm1  # the effective scale the experts were multiplied by
        assert not torch.allclose(s, torch.ones_like(s))
        assert not torch.equal(s, torch.exp2(torch.round(torch.log2(s))))  # not restricted to powers of two
        # the router override is the original router times exactly that scale, rounded once to bf16
        assert torch.equal(router1, (src_w["mlp.gate.weight"] * s).to(torch.bfloat16).float())
    assert folded >= 1
    assert all(m["awq_clip"] == "none" and m["awq_down_alpha"] == -1 for m in meta.values())


def test_awq_coverage_fallback_reported(tmp_path):
    src = make_tiny_model("qwen3_moe", tmp_path / "src", experts=8)
    data = load_calibration_data(None, vocab_size=512, num_samples=4, seq_len=32)
    # 128 tokens x top-2 over 8 experts: 32 routed tokens per expert on average, so min_tokens 40 puts
    # most experts below the threshold
    index = run_calibrated(src, recipe("awq", min_tokens=40, fallback="rtn"), data.samples, tmp_path / "spool")
    mods = index["modules"]
    low = {m: e for m, e in mods.items() if e["fallback"]}
    assert low and len(low) < len(mods)
    for m, e in low.items():
        assert "< min_tokens 40: down scale 1, no clipping" in e["fallback"]
        assert e["awq_down_alpha"] == -1 and e["awq_clip"] == "none"
    index2 = run_calibrated(src, recipe("awq", min_tokens=40), data.samples, tmp_path / "spool2")
    assert {m for m, e in index2["modules"].items() if e["fallback"]} == set(low)
    assert all("searched on all tokens" in index2["modules"][m]["fallback"] for m in low)


def test_search_owners_balance_tokens_and_experts():
    from quantkit.calib.awq_pass import search_owners

    tokens = [900, 10, 10, 10, 10, 10, 300, 300, 5, 0]
    assert search_owners(tokens, 1) == [0] * len(tokens)
    own = search_owners(tokens, 3)
    assert own == search_owners(list(tokens), 3)  # a function of the counts alone: every rank computes the same
    fixed = sum(tokens) / len(tokens)
    load = [sum(t + fixed for t, o in zip(tokens, own) if o == r) for r in range(3)]
    assert own[0] != own[6] and own[6] != own[7] and own[0] != own[7]  # the three busiest on three ranks
    # the greedy (longest first) is within 4/3 of the best split, which is at least the mean and the busiest
    assert max(load) <= 4 / 3 * max(sum(load) / 3, tokens[0] + fixed) + 1e-9
    assert sorted(own.count(r) for r in range(3)) != [0, 0, len(tokens)]


def test_routed_batches_only_some_experts():
    gen = torch.Generator().manual_seed(2)
    t, k, e, h = 60, 2, 6, 4
    x = torch.randn(t, h, generator=gen)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    only = torch.tensor([True, False, True, False, False, True])
    every = {int(i): xs[r] for ids, xs, _ in routed_batches(x, idx, e, h) for r, i in enumerate(ids)}
    some = {int(i): xs[r] for ids, xs, _ in routed_batches(x, idx, e, h, only=only) for r, i in enumerate(ids)}
    assert sorted(some) == [0, 2, 5]
    for i, xs in some.items():
        c = int((idx == i).sum())
        assert torch.equal(xs[:c], every[i][:c])


def test_routed_batches_give_a_subset_the_operands_of_the_whole():
    """A rank that searches some experts (`only`, AWQ's per-expert searches split over ranks) gets each of
    them padded to the length it has among all experts, so the products over its tokens (Grams, means, the
    clip rows picked by stride) are the very same operations as on one rank: a different padded length
    changes a BLAS reduction's blocking and the bytes (seen on the bench MoE on 2 ranks). Here the busiest
    expert of the block the subset's experts share is left out of the subset."""
    gen = torch.Generator().manual_seed(3)
    t, e, h = 52, 6, 4
    x = torch.randn(t, h, generator=gen)
    # expert 3 takes every token's first slot (alone in its chunk); the others share one chunk, padded to
    # expert 4's 12 tokens, the busiest of them (0, 1, 2 and 5 have 10 each)
    second = torch.tensor([4] * 12 + [0] * 10 + [1] * 10 + [2] * 10 + [5] * 10)
    idx = torch.stack([torch.full((t,), 3), second[torch.randperm(t, generator=gen)]], 1)
    only = torch.tensor([True, True, True, False, False, True])
    every = {int(i): (xs[r], ws[r]) for ids, xs, _, ws in routed_batches(x, idx, e, h, weights=torch.ones(t, 2))
             for r, i in enumerate(ids)}
    some = {int(i): (xs[r], ws[r]) for ids, xs, _, ws in routed_batches(x, idx, e, h, weights=torch.ones(t, 2),
                                                                        only=only) for r, i in enumerate(ids)}
    assert sorted(some) == [0, 1, 2, 5]
    for i, (xs, ws) in some.items():
        assert xs.shape == every[i][0].shape and torch.equal(xs, every[i][0]) and torch.equal(ws, every[i][1]), i


def test_awq_in_chunks_of_experts_gives_the_same_bytes(tmp_path, monkeypatch):
    # every whole-layer step of AWQ is per expert: one expert per chunk (and per searched block) must give
    # exactly what one chunk of every expert gives
    from quantkit.calib import awq_pass

    src = make_tiny_model("qwen3_moe", tmp_path / "src", experts=8)
    data = load_calibration_data(None, vocab_size=512, num_samples=8, seq_len=64)
    whole = run_calibrated(src, recipe("awq"), data.samples, tmp_path / "whole")
    ref, ref_meta = _spool(tmp_path / "whole", whole)
    gu_bytes = max(t.numel() for k, t in ref.items() if k.endswith("gate_proj.weight_packed")) * 8 * 2 * 4
    monkeypatch.setattr(awq_pass, "EXPERT_CHUNK_BYTES", gu_bytes)  # one expert's float32 gate/up per chunk
    assert len(awq_pass._expert_chunks(8, gu_bytes // 4)) == 8
    chunked = run_calibrated(src, recipe("awq"), data.samples, tmp_path / "chunked")
    got, got_meta = _spool(tmp_path / "chunked", chunked)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert got_meta == ref_meta


def test_rows_w_mean_in_chunks_matches_one_piece(monkeypatch):
    from quantkit.calib import awq_pass

    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(6, 20, 64, generator=gen), torch.randn(9, 64, generator=gen)]
    whole = awq_pass._rows_w_mean(parts, 32)
    assert torch.equal(whole, awq_pass._group_w_mean(torch.cat([parts[0].reshape(-1, 64), parts[1]]), 32))
    monkeypatch.setattr(awq_pass, "W_MEAN_BYTES", 7 * 64 * 4)  # 7 rows at a time: crosses the part boundary
    assert torch.allclose(awq_pass._rows_w_mean(parts, 32), whole, rtol=1e-6, atol=0)
