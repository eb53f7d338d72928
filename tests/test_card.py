"""The model card (quantkit/card.py) of real conversions: valid YAML front matter that huggingface_hub's own
ModelCard parser accepts, a body that tells what was quantized and how to serve it."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from quantkit.card import MLA_KV_SCALES_CAVEAT, START, ModelCardError, split_front_matter, write_model_card
from harness import run_bounded

QK = Path(sys.executable).parent / "quantkit"


def qk(*args):
    env = {**os.environ, "QUANTKIT_DEBUG": "0"}
    p = run_bounded([str(QK), *map(str, args)], env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    return p


@pytest.fixture(scope="module")
def converted(tiny_models, tmp_path_factory):
    src = tiny_models("qwen3_moe")
    d = tmp_path_factory.mktemp("card")
    qk("convert", src, d / "q", "--recipe", "int4-experts-rtn")
    qk("calibrate", src, "-o", d / "kv.safetensors", "--num-samples", 2, "--seq-len", 16)
    qk("convert", src, d / "qkv", "--recipe", "int4-experts-rtn", "--kv-scales", d / "kv.safetensors")
    return {"src": src, "q": d / "q", "qkv": d / "qkv"}


@pytest.fixture
def out(converted, tmp_path):
    """A fresh copy of a converted checkpoint per test (cards are written into it)."""
    def copy(name):
        return Path(shutil.copytree(converted[name], tmp_path / name))
    return copy


def front_matter(path: Path) -> tuple[dict, str]:
    text = path.read_text()
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    meta = yaml.safe_load(head)
    assert isinstance(meta, dict)
    return meta, body


def test_card_yaml_and_hub_parser(converted, out):
    from huggingface_hub import ModelCard

    q = out("q")
    path = write_model_card(q, converted["src"], source_id="org/tiny")
    assert path == q / "README.md"
    meta, body = front_matter(path)
    assert meta["base_model"] == "org/tiny" and meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert isinstance(meta["tags"], list) and all(isinstance(t, str) for t in meta["tags"])
    assert {"compressed-tensors", "quantkit", "int4", "w4a16", "moe"} <= set(meta["tags"])
    assert "fp8-kv" not in meta["tags"]
    assert "quantized_by" not in meta and "\n# quantized_by:" in path.read_text()  # a placeholder for the user

    card = ModelCard.load(path)  # the Hub client's own parser
    data = card.data.to_dict()
    assert data["base_model"] == "org/tiny" and data["base_model_relation"] == "quantized"
    assert data["library_name"] == "transformers" and "compressed-tensors" in data["tags"]
    assert ModelCard(path.read_text()).data.to_dict() == data

    manifest = json.loads((q / "quantkit_manifest.json").read_text())
    assert "| `int4-g32-sym` |" in body and "| 24 | rtn 24 |" in body
    summary = manifest["summary"]
    assert f"{summary['bytes_read'] / 1e3:.2f} kB (source shards) -> {summary['bytes_written'] / 1e3:.2f} kB" in body
    assert "vllm serve ./MODEL\n" in body and "--kv-cache-dtype fp8" not in body
    assert "Not measured" in body and "round-to-nearest needs none" in body


def test_kv_scales_add_the_fp8_kv_cache_flag(out):
    qkv = out("qkv")
    meta, body = front_matter(write_model_card(qkv, source_id="org/tiny"))
    assert "fp8-kv" in meta["tags"]
    assert "vllm serve ./MODEL --kv-cache-dtype fp8\n" in body and "strategy `tensor`" in body
    assert "--kv-scales kv.safetensors" in body  # the reproduce line
    assert MLA_KV_SCALES_CAVEAT not in body  # qwen3_moe is not MLA

    cfg = json.loads((qkv / "config.json").read_text())
    (qkv / "config.json").write_text(json.dumps({**cfg, "kv_lora_rank": 512}))  # as DeepSeek-V3 / Kimi / GLM-5
    _, body = front_matter(write_model_card(qkv, source_id="org/tiny"))
    assert MLA_KV_SCALES_CAVEAT in body
    _, body = front_matter(write_model_card(qkv, source_id="org/tiny", mla_kv_caveat=None))
    assert MLA_KV_SCALES_CAVEAT not in body


def test_no_mla_caveat_without_kv_scales(out):
    q = out("q")
    cfg = json.loads((q / "config.json").read_text())
    (q / "config.json").write_text(json.dumps({**cfg, "kv_lora_rank": 512}))
    assert MLA_KV_SCALES_CAVEAT not in write_model_card(q, source_id="org/tiny").read_text()


def test_source_readme_is_kept_and_metadata_merged(converted, out):
    q = out("q")
    original = ("---\nlicense: apache-2.0\nlanguage:\n- en\nbase_model: upstream/base\npipeline_tag: "
                "image-text-to-text\ntags:\n- chat\nmodel-index:\n- name: upstream\n  results: []\n---\n"
                "# Upstream model\n\nThe original description.\n")
    (q / "README.md").write_text(original)  # as convert copies the source's README.md
    path = write_model_card(q, converted["src"])
    meta, body = front_matter(path)
    assert meta["base_model"] == converted["src"].name  # no hub id known: the source directory's name
    assert meta["license"] == "apache-2.0" and meta["language"] == ["en"]
    assert meta["pipeline_tag"] == "image-text-to-text" and "model-index" not in meta
    assert meta["tags"][:2] == ["compressed-tensors", "quantkit"] and "chat" in meta["tags"]
    assert body.index("The original description.") < body.index(START)
    assert "# license:" not in path.read_text()  # no placeholder: the source's license is there

    # the user fills in quantized_by; a re-run replaces the section, keeps the rest
    text = path.read_text().replace("# quantized_by: YOUR_HF_USERNAME", "quantized_by: alice\n#", 1)
    path.write_text(text)
    assert split_front_matter(text)[0]["quantized_by"] == "alice"
    write_model_card(q, converted["src"], source_id="org/tiny")
    meta2, body2 = front_matter(path)
    assert body2.count(START) == 1 and body2.count("The original description.") == 1
    assert meta2["quantized_by"] == "alice" and meta2["base_model"] == "org/tiny"
    assert "# quantized_by:" not in path.read_text() and meta2["tags"].count("int4") == 1


def test_verify_report_and_calibration(out):
    q = out("q")
    report = {"passed": True, "metrics": {"kl_divergence": 0.0123, "top1_agreement": 0.9375,
                                          "perplexity_reference": 7.25, "perplexity_quantized": 7.5},
              "layers": [{"layer": 0, "min_sqnr_db": 18.04}, {"layer": 1, "min_sqnr_db": 21.0}],
              "generation": {"agreement": 0.9},
              "data": {"source": "quantkit:default.jsonl", "num_samples": 8, "seq_len": 128}}
    (q / "verify.json").write_text(json.dumps(report))
    # a calibrated conversion's manifest: GPTQ experts, two of them starved (as convert records them)
    mpath = q / "quantkit_manifest.json"
    m = json.loads(mpath.read_text())
    for e in m["tensors"].values():
        if e.get("method") == "rtn":
            e["method"] = "gptq"
    m["calibration"] = {"source": "quantkit:default.jsonl", "num_samples": 16, "seq_len": 256, "num_tokens": 4096,
                        "tokenizer": "bytes-mod-vocab", "compute_dtype": "bfloat16",
                        "expert_tokens": {"model.layers.0.mlp.experts": [0, 3, 900, 1200],
                                          "model.layers.1.mlp.experts": [700, 800, 1000, 1100]},
                        "fallbacks": {f"model.layers.0.mlp.experts.{e}.{p}_proj": "rtn: too few tokens"
                                      for e in (0, 1) for p in ("gate", "up", "down")}}
    mpath.write_text(json.dumps(m))
    meta, body = front_matter(write_model_card(q, source_id="org/tiny"))
    assert "gptq" in meta["tags"]
    assert "| top-1 agreement | 93.75% |" in body and "| mean next-token KL divergence | 0.0123 |" in body
    assert "7.25 -> 7.5" in body and "18.0 dB" in body and "| verify | passed |" in body
    assert "tokenizer `bytes-mod-vocab`, layers computed in bfloat16." in body
    assert "16 samples x 256 tokens" in body and "min 0, median 900, max 1200; 1 saw none" in body
    assert "Starved experts (too few calibration tokens, fallback used): 2 (rtn: too few tokens: 2)" in body
    # an explicit report wins over verify.json
    _, body = front_matter(write_model_card(q, source_id="org/tiny", verify_report={**report, "passed": False}))
    assert "| verify | FAILED |" in body


def test_hub_snapshot_names_the_base_model(out, tmp_path):
    q = out("q")
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("a" * 40)
    meta, body = front_matter(write_model_card(q, snap))
    assert meta["base_model"] == "org/tiny" and "[org/tiny](https://huggingface.co/org/tiny)" in body


def test_unfinished_conversion_has_no_card(out):
    q = out("q")
    (q / "quantkit_manifest.json").write_text(json.dumps({"status": "in_progress"}))
    with pytest.raises(ModelCardError):
        write_model_card(q)


@pytest.mark.parametrize("label, words", [
    ("int4-g32-sym", ["INT4 weights", "group 32", "symmetric", "W4A16"]),
    ("fp8-block128x128", ["FP8 (e4m3) weights", "128x128 blocks", "W8A8"]),
    ("nvfp4-g16", ["NVFP4 weights", "group 16", "FP8 (e4m3) scale", "FP32 global scale", "W4A16"]),
    ("mxfp4-g32+source", ["MXFP4 weights", "group 32", "E8M0", "as stored in the source"]),
])
def test_schemes_are_described_in_words(label, words):
    from quantkit.card import describe_scheme

    text = describe_scheme(label)
    assert all(w in text for w in words), text


def test_engine_run_in_the_card(out):
    q = out("q")
    report = {"passed": True, "metrics": {}, "data": {"num_samples": 4, "seq_len": 64},
              "engine_run": {"status": "ok", "engine": "vllm 0.32.0", "platform": "CpuPlatform",
                             "perplexity_engine": 517.19, "perplexity_ratio": 1.00013, "top1_agreement": 0.98,
                             "generation": {"agreement": 0.96875},
                             "kv_scales": {"equal": True, "compared": 2, "file_layers": 2,
                                           "layers": [{"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8"}]}}}
    _, body = front_matter(write_model_card(q, source_id="org/tiny", verify_report=report))
    assert "Run in vllm 0.32.0 (CpuPlatform)" in body and "| perplexity ratio, engine / reference | 1.0001 |" in body
    assert "| KV scales held by the engine = the file's | yes (2/2 layers, cache fp8) |" in body
    line = "this vLLM build cannot run an FP8 KV cache on this machine: FP8 KV cache on CPU requires AVX-512 or AMX."
    _, body = front_matter(write_model_card(q, source_id="org/tiny", verify_report={
        **report, "engine_run": {"status": "cannot_run", "engine": "vllm 0.32.0", "platform": "CpuPlatform",
                                 "line": line}}))
    assert f"Run in vllm 0.32.0 (CpuPlatform): {line}" in body


def _first_packed(m):
    return next(n for n in m["tensors"] if n.endswith(".weight_packed"))


# a manifest is hostile input: a field of the wrong type leaves that part of the card out, never a crash
HOSTILE_MANIFEST = {
    "kv_cache_string": lambda m: m.update(kv_cache="x"),
    "kv_origin_string": lambda m: m["kv_cache"].update(origin="x"),
    "notes_number": lambda m: m.update(notes=-1),
    "recipe_list": lambda m: m.update(recipe=[1]),
    "tool_string": lambda m: m.update(tool="x"),
    "quantization_config_list": lambda m: m.update(quantization_config=[]),
    "summary_list": lambda m: m.update(summary=[1]),
    "tensors_list": lambda m: m.update(tensors=[1]),
    "tensor_entry_string": lambda m: m["tensors"].update({_first_packed(m): "x"}),
    "scheme_null": lambda m: m["tensors"][_first_packed(m)].update(scheme=None),
    "scheme_list": lambda m: m["tensors"][_first_packed(m)].update(scheme=[]),
    "shape_string": lambda m: m["tensors"][_first_packed(m)].update(shape="ab"),
    "dtype_list": lambda m: m["tensors"][_first_packed(m)].update(dtype=[]),
    "calibration_fields": lambda m: m.update(calibration={"expert_tokens": [1], "fallbacks": "x",
                                                          "input_scale_fallbacks": [2]}),
    "expert_tokens_strings": lambda m: m.update(calibration={"expert_tokens": {"l0": "abc"}}),
}


@pytest.mark.parametrize("case", list(HOSTILE_MANIFEST))
def test_card_of_a_hostile_manifest(out, case):
    d = out("qkv")
    m = json.loads((d / "quantkit_manifest.json").read_text())
    HOSTILE_MANIFEST[case](m)
    path = write_model_card(d, manifest=m)
    meta, body = front_matter(path)
    assert "quantkit" in meta["tags"] and START in body


def test_manifest_strings_cannot_break_out_of_their_place_in_the_card(out):
    """A note with a newline stays one list item; a recipe name with a backtick stays one code span; a recipe
    text holding a fence does not end the card's fence (the generated section still closes where it should)."""
    d = out("q")
    m = json.loads((d / "quantkit_manifest.json").read_text())
    m["notes"] = ["first line\n\n# Injected heading"]
    m["recipe"] = {**m["recipe"], "name": "r`\n## x", "text": "name: r\n```\n# Injected\n````\n"}
    _, body = front_matter(write_model_card(d, manifest=m))
    lines = body.splitlines()
    assert "# Injected heading" not in lines and "## x" not in lines and "# Injected" in lines
    assert "- first line # Injected heading" in lines
    fence = next(ln for ln in lines if ln.endswith("yaml") and ln.startswith("`"))
    assert fence == "`````yaml" and lines[lines.index("# Injected") + 2] == "`````"
