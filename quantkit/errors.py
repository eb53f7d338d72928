"""Named errors. Every failure a user can cause or meet has its own class, a one-line message and a
hint; the CLI maps them to `error: <message>` + `hint: <hint>` and exit code 1 (never a traceback unless
QUANTKIT_DEBUG=1). Library code raises these; it never prints."""

from __future__ import annotations


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived (the command line turns them into this, `signals.raise_on_termination`), so that
    every cleanup runs as for Ctrl-C: worker processes ended, temporary folders removed, journals kept."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class QuantkitError(Exception):
    """Base of every domain failure (exit code 1)."""

    hint: str = ""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        if hint is not None:
            self.hint = hint

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.__class__.__name__


# --- reading checkpoints ---------------------------------------------------------------------------
class CheckpointNotFound(QuantkitError):
    hint = "pass a local directory holding config.json and *.safetensors shards"


class ConfigError(QuantkitError):
    hint = "config.json must be a JSON object as written by transformers' save_pretrained"


class ConfigMissing(ConfigError):
    hint = "a checkpoint directory needs the model's config.json next to its shards"


class ConfigMismatch(ConfigError):
    """config.json claims something its tensors contradict (layers, hidden size, vocab, experts, heads)."""

    hint = "the config.json does not belong to these shards (or one of them is corrupt); restore the release's own"


class UnsafeCheckpoint(QuantkitError):
    hint = ("quantkit reads safetensors only and never unpickles; convert .bin/.pt files first, e.g. "
            "load them in a trusted environment and call model.save_pretrained(dir, safe_serialization=True)")


class HeaderError(QuantkitError):
    """A safetensors header is malformed, oversized, or inconsistent with the file."""

    hint = "the shard is corrupt or was not written by a safetensors writer; re-download or re-export it"


class TruncatedShard(HeaderError):
    hint = "the shard is shorter than its header says; the download or copy was probably interrupted"


class HeaderTooLarge(HeaderError):
    hint = ("the 8-byte header length is beyond the 100 MB cap the safetensors format allows; the file is "
            "corrupt or not a safetensors file")


class HeaderNotJSON(HeaderError):
    hint = "the shard's header is not a UTF-8 JSON object; the file is corrupt or not a safetensors file"


class DuplicateKey(HeaderError):
    hint = ("a JSON object in the header repeats a key, so readers could disagree on which entry wins; "
            "re-export the shard with a safetensors writer")


class InvalidOffsets(HeaderError):
    hint = ("tensor data_offsets must be non-negative integers that tile the data buffer exactly (no overlap, "
            "no hole, no trailing bytes); re-export the shard with a safetensors writer")


class TensorSizeMismatch(HeaderError):
    hint = "a tensor's dtype and shape do not match the size of its data; re-export the shard with a safetensors writer"


class IndexError_(QuantkitError):
    hint = "model.safetensors.index.json must map tensor names to shard files inside the checkpoint directory"


class MissingShard(IndexError_):
    hint = "the index names a shard file that is not in the directory; the download is incomplete, fetch the missing shard"


class UnsafeShardName(IndexError_):
    hint = ("shard names must be plain file names inside the checkpoint directory (no path separators, no '..', "
            "no symlinks pointing elsewhere); the index is corrupt or hostile")


class DuplicateTensor(QuantkitError):
    hint = "a tensor name appears in two shards; the checkpoint is inconsistent, re-export it"


class UnsupportedDtype(QuantkitError):
    hint = "supported weight dtypes: bfloat16, float16, float32, float8_e4m3fn (with block scales)"


# --- recipes and quantization ----------------------------------------------------------------------
class RecipeError(QuantkitError):
    hint = "see docs/recipes.md for the schema, or pass a shipped recipe name such as int4-experts-rtn"


class GroupSizeError(QuantkitError):
    hint = ("choose a group_size that divides in_features, or set `fallback: channel` (or another group "
            "size) in the recipe's scheme")


class W4AFP8ShapeError(GroupSizeError):
    """A W4AFP8 recipe on a model whose expert widths vLLM's W4AFP8 MoE kernel cannot take (rule W2)."""

    hint = "serve it with one of the --tp values named, or use a W4A16 recipe (int4-experts-rtn, glm)"


class NonFiniteWeight(QuantkitError):
    hint = "the source weight holds NaN/Inf values; fix or re-export the checkpoint, or add the module to the recipe's ignore list"


class QuantizationError(QuantkitError):
    hint = "run with QUANTKIT_DEBUG=1 for the traceback and report it"


class CalibratedResultError(QuantizationError):
    """A module's tensors in the calibration spool are missing or do not have the shapes the plan expects."""

    hint = "the calibration spool in the output's journal is not this plan's; re-run with --overwrite"


# --- writing ---------------------------------------------------------------------------------------
class OutputExists(QuantkitError):
    hint = "choose an empty directory, pass --overwrite to replace it, or --resume to continue a conversion"


class OutputBusy(OutputExists):
    hint = "wait for the other conversion to finish, or choose another directory"


class ResumeMismatch(QuantkitError):
    hint = "the output was started with another source, recipe or quantkit version; use --overwrite to start over"


class DiskFull(QuantkitError):
    hint = "free disk space (or choose another output directory) and re-run: finished shards are kept and --resume continues"


class VerificationFailed(QuantkitError):
    hint = "see the report above; re-run convert or inspect the named tensors"


class VerifyOptionError(QuantkitError):
    """An option of `verify` (or of the library call) outside what it accepts."""

    hint = "see `quantkit verify --help` and docs/verify.md"


class ThresholdError(VerifyOptionError):
    hint = ("thresholds are numbers: min_top1 and min_generation_agreement in [0, 1], max_kl, max_ppl_ratio "
            "and max_sqnr_drift_db >= 0; see docs/verify.md")


class KernelsUnavailable(VerifyOptionError):
    hint = "use --kernels torch"


class ReferenceModelError(QuantkitError):
    """The reference checkpoint `verify` compares against cannot be used for the numerics."""

    hint = "pass the checkpoint the conversion started from, one transformers can load"


class DemoError(QuantkitError):
    hint = "see `quantkit demo --help`"


# --- reading checkpoints (continued) ----------------------------------------------------------------
class SourceFormatError(QuantkitError):
    """The source's quantization_config or its tensors are a format convert cannot read."""

    hint = ("convert reads BF16/FP16/FP32 checkpoints, block-FP8 releases (quant_method fp8 with "
            "weight_block_size) and compressed-tensors FP8/INT4 checkpoints; see docs/format.md")


class SourceSchemeError(SourceFormatError):
    """A config group of the source's quantization_config describes no scheme its format allows."""

    hint = ("the source's config.json quantization_config is corrupt or was not written by compressed-tensors; "
            "restore the release's own config.json, or convert from the BF16 release; see docs/format.md, 'Sources'")


class SourceTensorError(SourceFormatError):
    """A quantized source module's tensors break its scheme (shapes, dtypes, scale values)."""

    hint = ("the source checkpoint is corrupt, or its quantized tensors were not written by a compressed-tensors "
            "writer; re-download the shard that holds the named tensor, or convert from the BF16 release")


# --- calibration ------------------------------------------------------------------------------------
class UnsupportedArchitecture(QuantkitError):
    # raised for a model type with arch.support_hint("calibrate"): the supported list, from arch.py's registry
    hint = ("calibration builds each decoder layer with transformers from the checkpoint's own tensors; RTN "
            "conversion (`quantkit convert --recipe int4-experts-rtn`) needs no calibration")


class UnsupportedWeights(QuantkitError):
    hint = ("calibration reads bfloat16/float16/float32 weights, block-FP8 (`weight` + `weight_scale_inv`) and "
            "compressed-tensors pack-quantized INT4; calibrate on the original checkpoint instead")


class DatasetError(QuantkitError):
    """A calibration dataset cannot be read or holds no usable rows."""

    hint = ("pass a .jsonl/.json file with a `text`, `messages` or `input_ids` field per row, a .txt file, "
            "a .parquet file, a `datasets.save_to_disk` folder, or omit --dataset for the shipped set")


class DatasetNotFound(DatasetError):
    hint = "check the path; a name that is not a local path is treated as a hub dataset id"


class CalibrationError(QuantkitError):
    """The activations went bad (NaN/Inf) or nothing was observed."""

    hint = "the model produced non-finite activations on the calibration data; check the checkpoint's weights"


class KVScalesError(QuantkitError):
    """A KV-scales file (or calibration result) does not fit the model being converted."""

    hint = ("the file must hold float32 model.layers.L.self_attn.k_scale / v_scale for every attention layer, "
            "shape [1] (strategy tensor) or [num_kv_heads, 1, 1] (attn_head); re-run `quantkit calibrate` "
            "on this model")


class PairMismatch(QuantkitError):
    """The two checkpoints of a prefill/decode pair do not belong together: other sources, KV scales that
    differ (a KV cache written under one scale and read under another is silent corruption), KV layouts that
    differ, or manifests that do not record each other."""

    hint = ("write both checkpoints in one run: `quantkit convert SRC OUT --recipe R --pair fp8-prefill` (one "
            "set of KV scales in both), or convert each with the same --kv-scales file")


class CalibrationNeeded(QuantkitError):
    """The recipe asks for FP8 KV-cache scales, and neither a scales file nor a calibrator is at hand."""

    hint = ("run `quantkit calibrate SRC --output kv.safetensors` first, then "
            "`quantkit convert SRC OUT --recipe RECIPE --kv-scales kv.safetensors`")


class DeviceError(QuantkitError):
    """A calibration device that is malformed or not present on this machine."""

    hint = "use --device cpu, cuda, cuda:N (N: a visible GPU) or auto (the first GPU when torch sees one, else cpu)"


class MeasurementError(QuantkitError):
    """`plan --measure` could not measure this machine: a helper process (a neighbour rank, a start-up probe)
    did not start, failed or printed nothing."""

    hint = "run the plan without --measure (the shipped table), or with --gpus 1 (no neighbour processes)"


class FitError(QuantkitError):
    """`plan --fit` found no mix of the candidate schemes that meets the memory target (the message says what
    would), or was asked to fit a target that means nothing."""

    hint = "lower --concurrency or --context-len, add GPUs, or allow a lower-bit scheme (--fit-schemes)"


class DeviceMemoryError(DeviceError):
    """A decoder layer's calibration does not fit in the device's free memory (found before any work)."""

    hint = ("free memory on the device (other processes), use a GPU with more memory, or calibrate on the host "
            "with --device cpu")


# --- the reference runtime --------------------------------------------------------------------------
class RunnerError(QuantkitError):
    hint = "see docs/runtime.md, 'Model runner'"


class UnsupportedModel(RunnerError):
    # raised for a model type with arch.support_hint("runner"): the supported list, from arch.py's registry
    hint = ("the runner implements default, linear or yarn RoPE, SiLU experts and no sliding window "
            "(docs/runtime.md, 'Model runner'); run other models with transformers or an inference engine")


class UnsupportedCheckpoint(RunnerError):
    hint = ("the runner executes compressed-tensors pack-quantized INT4 experts (what `quantkit convert` "
            "writes with an int4 recipe) and BF16/FP16/FP32 or INT4 dense weights")


class KVScalesMissing(RunnerError):
    hint = ("an FP8 KV cache needs calibrated scales: convert with --kv-scales (or a recipe with a kv_cache "
            "section), or pass kv_scales= a mapping or safetensors file of model.layers.L.self_attn.k_scale / v_scale")


class KVCacheViolation(RunnerError):
    hint = "a block table pointed at a page the request does not own; the request was aborted and freed"


class KVPoolError(QuantkitError):
    hint = "register a request with add_request before reserving, writing or freeing it"


class KVPoolExhausted(KVPoolError):
    hint = "the pool has too few free pages: free finished requests, or build the pool with more pages"


# --- several processes (torchrun) --------------------------------------------------------------------
class DistributedError(QuantkitError):
    hint = "launch with torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"


class RanksDisagree(DistributedError):
    """The ranks were started with different work (source, recipe, options, version)."""

    hint = "launch every node with the same arguments and quantkit version, on a shared filesystem"


class RankFailed(DistributedError):
    """Another rank failed; this one stops with it."""

    hint = "the error that rank printed says what to fix; every rank stopped with it"


# --- serving engines (quantkit/engine/) -----------------------------------------------------------
class EngineError(QuantkitError):
    """The serving engine could not be started or did not answer (not: the engine refused the checkpoint,
    which `verify --run` reports as a finding)."""

    hint = "check the engine's environment: --engine-python PATH must be the python vLLM is installed in"


# --- export (GGUF for llama.cpp) ---------------------------------------------------------------------
class ExportError(QuantkitError):
    hint = "quantkit export QMODEL OUT.gguf takes a checkpoint written by quantkit convert (or a compressed-tensors one)"


class NotRepresentable(ExportError):
    """The checkpoint holds something llama.cpp would compute differently (or cannot store): refused, never a GGUF
    that loads and computes something else."""

    hint = "docs/export.md lists what llama.cpp can run exactly; re-convert with a recipe it can (int4-experts-*, mxfp4-experts)"


# --- rotation ---------------------------------------------------------------------------------------
class RotationError(QuantkitError):
    """A recipe's `rotate:` cannot be applied to this source (a tensor it cannot turn exactly)."""

    hint = ("rotation turns BF16/FP16/FP32 and block-FP8 sources with untied embeddings and no MTP layer; drop "
            "`rotate:` from the recipe, or convert from the BF16 release (docs/recipes.md, Rotation)")
