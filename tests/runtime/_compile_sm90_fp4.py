"""Compile the FP4 kernels (runtime/fp4.py) for sm_90 without a GPU, with _compile_sm90.py's machinery:
launches of fp4_gemm / fused_moe_fp4 are captured and lowered to a cubin, for NVFP4 and MXFP4, bf16 and
fp16, split-K, and both the CPU and the CUDA block configurations. Run as a script with TRITON_INTERPRET
unset; prints one line per kernel and exits non-zero on any failure."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _compile_sm90 as c  # noqa: E402  (pops TRITON_INTERPRET before triton is imported)
import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

c.TYPES.setdefault(torch.uint8, "u8")  # FP4 bytes and E8M0 / fp8-as-bytes scales


def _exercise():
    import quantkit.runtime.fp4 as f4
    from quantkit.quant.fp4 import choose_global_scale, rtn_mxfp4, rtn_nvfp4

    f4.resolve_backend = lambda backend, device: "triton"
    cpu_cfg, cuda_cfg = f4._moe_config, lambda s, e, dev: (16, 64, 64, 4)  # CUDA uses BLOCK_K 64 for MoE
    packed = lambda r: f4.PackedFP4.from_tensors(r.packed, r.scale, r.global_scale)  # noqa: E731
    for rtn in (rtn_nvfp4, rtn_mxfp4):
        w = packed(rtn(torch.randn(48, 256)))
        for dt in (torch.bfloat16, torch.float16):
            f4.fp4_gemm(torch.randn(3, 256).to(dt), w, split_k=2)
        g, u, d = torch.randn(4, 64, 128), torch.randn(4, 64, 128), torch.randn(4, 128, 64)
        if rtn is rtn_nvfp4:
            gs = choose_global_scale(g, u)
            rg, ru = rtn(g, gs), rtn(u, gs)
        else:
            rg, ru = rtn(g), rtn(u)
        ex = f4.FP4Experts(f4.fuse_gate_up_fp4(packed(rg), packed(ru)), packed(rtn(d)))
        for cfg in (cpu_cfg, cuda_cfg):
            f4._moe_config = cfg
            f4.fused_moe_fp4(torch.randn(5, 128).bfloat16(), torch.randint(0, 4, (5, 2)), torch.rand(5, 2), ex)
        f4._moe_config = cpu_cfg


if __name__ == "__main__":
    c._exercise = _exercise
    JITFunction.run = c._capture
    sys.exit(c.main())
