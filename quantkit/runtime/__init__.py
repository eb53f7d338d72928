"""Reference runtime for the INT4 and FP4 checkpoints quantkit writes: Triton kernels, each with a plain
torch reference beside it, for INT4 and FP4 (NVFP4, MXFP4) GEMM (W4A16), fused INT4 / FP4 MoE, paged decode attention over a BF16/FP8
KV cache (GQA and MLA latent) with an in-kernel page-ownership check, and a paged KV pool.

This is a correctness reference and a benchmark harness for the formats, not a serving engine: no
scheduler, no CUDA graphs, no tensor parallelism. Triton is optional; without it every function
runs with backend="torch". Set TRITON_INTERPRET=1 *before* importing this package to run the
kernels on a CPU (Triton reads it when the kernels are defined). See docs/runtime.md.
"""

from ._triton import interpreting, triton_available
from .decode import DecodeInputs, DecodeResult, decode_step
from .fp4 import FP4Experts, PackedFP4, fp4_gemm, fp4_gemm_ref, fuse_gate_up_fp4, fused_moe_fp4, fused_moe_fp4_ref
from .fused_moe import Int4Experts, fused_moe_int4, fused_moe_int4_ref, moe_align_block_size
from .int4 import (PackedInt4, dequantize_int4, int4_gemm, int4_gemm_ref, pack_int4, unpack_int4,
                   unpack_zero_point)
from .kv_pool import PagedKVPool, PoolSize
from ..errors import KVPoolError, KVPoolExhausted
from .paged_attention import (FP8_DTYPE, PagedKV, block_table_violations_ref, dequantize_kv, paged_decode_attention,
                              paged_decode_attention_ref, paged_mla_decode_attention,
                              paged_mla_decode_attention_ref, quantize_kv, write_kv_cache, write_kv_cache_ref)

__all__ = [
    "interpreting", "triton_available",
    "PackedInt4", "pack_int4", "unpack_int4", "unpack_zero_point", "dequantize_int4", "int4_gemm", "int4_gemm_ref",
    "Int4Experts", "moe_align_block_size", "fused_moe_int4", "fused_moe_int4_ref",
    "PackedFP4", "fp4_gemm", "fp4_gemm_ref", "FP4Experts", "fuse_gate_up_fp4", "fused_moe_fp4", "fused_moe_fp4_ref",
    "FP8_DTYPE", "PagedKV", "quantize_kv", "dequantize_kv", "block_table_violations_ref",
    "paged_decode_attention", "paged_decode_attention_ref",
    "paged_mla_decode_attention", "paged_mla_decode_attention_ref", "write_kv_cache", "write_kv_cache_ref",
    "PagedKVPool", "PoolSize", "KVPoolError", "KVPoolExhausted", "DecodeInputs", "DecodeResult", "decode_step",
]
