"""`quantkit report`: the HTML page built from real `convert` outputs (RTN; GPTQ with starved experts and
attn_head KV scales; a dense model), checked as text (sections, tables, no network reference), at
Kimi K2 scale (61 layers x 384 experts from a synthetic manifest), and in a real headless Chromium
(no console message, the figures in the DOM, a screenshot whose heatmap is not blank).

The browser test skips when /usr/bin/chromium is absent, unless QUANTKIT_REQUIRE_BROWSER is set (CI),
in which case it fails.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import os
import random
import re
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from quantkit.cli import main as cli_main  # noqa: E402
from quantkit.errors import CheckpointNotFound, ConfigError, QuantkitError  # noqa: E402
from quantkit.report import build_report  # noqa: E402
from quantkit.testing import make_tiny_model  # noqa: E402
from harness import run_bounded

CHROMIUM = Path("/usr/bin/chromium")


def _cli(*args) -> str:
    """Run `quantkit ARGS` in-process (the CLI contract, not library internals); return its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli_main([str(a) for a in args])
        except SystemExit as e:
            assert e.code in (None, 0), f"quantkit {' '.join(map(str, args))} exited with {e.code}"
    return out.getvalue()


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Converted tiny models: `rtn` (no calibration, no KV), `gptq` (16 experts, 2 x 16 tokens: some
    experts starve and fall back; attn_head KV scales; verify.json beside it), `dense` (no experts)."""
    d = tmp_path_factory.mktemp("report")
    src = make_tiny_model("qwen3_moe", d / "src", experts=16)
    dense_src = make_tiny_model("qwen3", d / "dense_src")
    _cli("convert", src, d / "rtn", "--recipe", "int4-experts-rtn")
    _cli("calibrate", src, "-o", d / "kv.safetensors", "--num-samples", 2, "--seq-len", 16, "--strategy", "attn_head")
    _cli("convert", src, d / "gptq", "--recipe", "int4-experts-gptq", "--num-samples", 2, "--seq-len", 16,
         "--kv-scales", d / "kv.safetensors")
    (d / "gptq" / "verify.json").write_text(_cli("verify", d / "gptq", "--json"))
    _cli("convert", dense_src, d / "dense", "--recipe", "int4-experts-rtn", "--allow-unmatched")  # no experts: a copy
    return {"src": src, "rtn": d / "rtn", "gptq": d / "gptq", "dense": d / "dense", "tmp": d}


@pytest.fixture(scope="module")
def gptq_report(outputs):
    res = build_report(outputs["gptq"], reference=outputs["src"], output=outputs["tmp"] / "gptq.html")
    return res, Path(res.output).read_text(encoding="utf-8")


# ---- the page as text ---------------------------------------------------------------------------------
def test_gptq_report_has_every_figure_and_the_fallbacks(outputs, gptq_report):
    res, page = gptq_report
    manifest = json.loads((outputs["gptq"] / "quantkit_manifest.json").read_text())
    fallbacks = manifest["calibration"]["fallbacks"]
    assert fallbacks, "the fixture should starve some of the 16 experts (2 samples x 16 tokens)"

    assert res.figures == ["fig-sqnr-heatmap", "fig-sqnr-layers", "fig-expert-tokens", "fig-kv-scales", "fig-bytes"]
    doc = res.to_json()
    assert doc["output"] == res.output and doc["figures"] == res.figures
    assert doc["bytes"] == Path(res.output).stat().st_size
    for fig_id in res.figures:
        assert len(re.findall(rf'<svg\b[^>]*\bid="{fig_id}"', page)) == 1
    assert page.count("<figcaption>") == len(res.figures)
    # every starved expert is listed (one row per expert), with its reason
    for module, reason in fallbacks.items():
        assert module.rsplit(".", 1)[0] in page
        assert reason.replace("<", "&lt;") in page
    # the worst module by recorded SQNR heads the worst-modules table
    worst = min((e["sqnr_db"], n.rsplit(".", 1)[0]) for n, e in manifest["tensors"].items() if e.get("sqnr_db") is not None)
    table = page[page.index("modules with the lowest SQNR"):]
    assert table.index(worst[1]) < table.index("</table>")
    # header: recipe, reference (shown only), verify picked up from OUT/verify.json
    assert "int4-experts-gptq" in page and str(outputs["src"]) in page
    assert "verify.json" in page and 'class="ok">pass' in page
    assert "verify-layers" in res.skipped  # verify ran without --reference: no per-layer SQNR
    # GPTQ's held-out check: how many modules kept RTN / a re-solve with a higher damping, as the manifest says
    mods = {n.rsplit(".", 1)[0]: e for n, e in manifest["tensors"].items() if "heldout" in e}
    calibrated = {m: e for m, e in mods.items() if m not in fallbacks}
    kept = [e["heldout"].get("kept") for e in calibrated.values()]
    assert f"{kept.count('rtn')} of {len(calibrated)} calibrated expert modules kept RTN" in page
    assert (f"{kept.count('retry')} kept a second GPTQ solve" in page) == bool(kept.count("retry"))


def test_sections_without_data_say_why(outputs, tmp_path):
    rtn = build_report(outputs["rtn"], output=tmp_path / "rtn.html")
    assert rtn.figures == ["fig-sqnr-heatmap", "fig-sqnr-layers", "fig-bytes"]
    assert set(rtn.skipped) == {"tokens", "kv", "verify"}
    page = Path(rtn.output).read_text()
    for sentence in rtn.skipped.values():
        assert html.escape(sentence) in page
    assert "No calibration, so no fallbacks." in page

    dense = build_report(outputs["dense"])  # default output: OUT/quantkit_report.html
    assert Path(dense.output) == outputs["dense"] / "quantkit_report.html"
    assert dense.figures == ["fig-bytes"]
    assert {"sqnr", "tokens", "kv", "verify", "worst-modules"} <= set(dense.skipped)


def test_verify_metrics_and_layers(outputs, tmp_path):
    verify = {
        "passed": False, "integrity": {"ok": True}, "format": {"ok": True},
        "metrics": {"kl_divergence": 7.6e-05, "top1_agreement": 0.9375,
                    "perplexity_reference": 492.7, "perplexity_quantized": 493.9},
        "layers": [{"layer": 0, "min_sqnr_db": 20.3, "mean_sqnr_db": 20.5, "modules": 48,
                    "worst_module": "model.layers.0.mlp.experts.2.gate_proj", "ok": True},
                   {"layer": 1, "min_sqnr_db": -9.6, "mean_sqnr_db": 18.0, "modules": 48,
                    "worst_module": "model.layers.1.mlp.experts.2.down_proj", "ok": False}],
        "generation": {"tokens": 32, "prompts": 4, "agreement": 0.94, "matching_prefix": 0.8},
        "checks": [{"name": "weight_sqnr", "ok": False, "value": -9.558, "threshold": 10.0, "detail": "1 layer(s) below"}],
        "thresholds": {"min_sqnr_db": 10.0},
    }
    res = build_report(outputs["rtn"], output=tmp_path / "r.html", verify_json=verify)
    page = Path(res.output).read_text()
    assert res.figures[-1] == "fig-verify-layers"
    assert 'class="bad">FAIL' in page and "7.6e-05" in page and "model.layers.1.mlp.experts.2.down_proj" in page

    path = tmp_path / "v.json"
    path.write_text(json.dumps(verify))
    assert build_report(outputs["rtn"], output=tmp_path / "r2.html", verify_json=path).figures == res.figures
    path.write_text('{"not": "a verify object"}')
    with pytest.raises(ConfigError):
        build_report(outputs["rtn"], output=tmp_path / "r3.html", verify_json=path)
    with pytest.raises(ConfigError):
        build_report(outputs["rtn"], output=tmp_path / "r3.html", verify_json=tmp_path / "missing.json")


def test_unusable_input_raises_named_errors(outputs, tmp_path):
    with pytest.raises(CheckpointNotFound):
        build_report(tmp_path / "nope", output=tmp_path / "r.html")
    with pytest.raises(CheckpointNotFound, match="quantkit_manifest.json"):
        build_report(outputs["src"], output=tmp_path / "r.html")  # a source checkpoint, not a convert output
    with pytest.raises(CheckpointNotFound):
        build_report(outputs["rtn"], reference=tmp_path / "nope", output=tmp_path / "r.html")
    out = tmp_path / "out"
    shutil.copytree(outputs["rtn"], out)
    manifest = out / "quantkit_manifest.json"
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "status": "in_progress"}))
    with pytest.raises(CheckpointNotFound, match="did not finish"):
        build_report(out, output=tmp_path / "r.html")
    manifest.write_text("{not json")
    with pytest.raises(ConfigError):
        build_report(out, output=tmp_path / "r.html")
    assert issubclass(ConfigError, QuantkitError) and not (tmp_path / "r.html").exists()


def test_deterministic(outputs, tmp_path):
    a = build_report(outputs["gptq"], output=tmp_path / "a.html")
    b = build_report(outputs["gptq"], output=tmp_path / "b.html")
    assert Path(a.output).read_bytes() == Path(b.output).read_bytes()


# Attributes and CSS that make a browser fetch something; only in-page fragments and data: URIs may follow.
_ATTR = re.compile(r"""\b(?:src|href|srcset|action|poster|data|formaction|background)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>]+))""", re.IGNORECASE)
_CSS_URL = re.compile(r"""(?:url\(|@import)\s*["']?([^"')\s;]*)""", re.IGNORECASE)


def _fetched(page: str) -> list[str]:
    """Every attribute value or CSS reference that would make a browser load something."""
    values = [next(v for v in m.groups() if v is not None) for m in _ATTR.finditer(page)]
    values += [m.group(1) for m in _CSS_URL.finditer(page)]
    return [v for v in values if not v.strip().startswith(("#", "data:"))]


def test_no_network_reference(gptq_report, outputs, tmp_path):
    pages = [gptq_report[1], Path(build_report(outputs["dense"], output=tmp_path / "d.html").output).read_text()]
    for page in pages:
        assert _fetched(page) == []
        assert not re.search(r"(?:https?|ftp|wss?):|(?<![:\w])//[\w.-]+\.\w", page, re.IGNORECASE), "a URL in the page"
        assert "<script" not in page and "<link" not in page and "<iframe" not in page
        assert "default-src 'none'" in page  # CSP: a browser would refuse any fetch anyway
    assert _fetched('<img src="https://x.org/a.png"><a href=#top><div style="background:url(//cdn.x/y)">') == \
        ["https://x.org/a.png", "//cdn.x/y"]


# ---- scale ----------------------------------------------------------------------------------------------
def _synthetic_output(root: Path, layers: int = 61, experts: int = 384) -> Path:
    """A convert-shaped output of a Kimi K2-sized MoE: one small real shard (the KV scales), and a manifest
    listing 61 x 384 experts x 3 projections (layer 0 dense) with SQNR, tokens and fallbacks."""
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    rng = random.Random(0)
    (root / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                                                  "num_hidden_layers": layers, "n_routed_experts": experts}))
    kv = {f"model.layers.{L}.self_attn.{k}_scale": torch.tensor([0.01 + 0.001 * L]) for L in range(layers) for k in "kv"}
    save_file(kv, str(root / "model-kv-scales.safetensors"), metadata={"format": "pt"})
    tensors = {n: {"shape": [1], "dtype": "float32", "shard": "model-kv-scales.safetensors", "kv_cache": "tensor"}
               for n in kv}
    expert_tokens, fallbacks = {}, {}
    for L in range(1, layers):
        prefix = f"model.layers.{L}.mlp.experts"
        counts = [int(rng.expovariate(1 / 200)) for _ in range(experts)]
        expert_tokens[prefix] = counts
        for e in range(experts):
            for p in ("gate_proj", "up_proj", "down_proj"):
                fb = f"{counts[e]} routed tokens < min_tokens 15: Hessian from all tokens" if counts[e] < 15 else None
                if fb:
                    fallbacks[f"{prefix}.{e}.{p}"] = fb
                meta = {"scheme": "int4-g32-sym", "method": "gptq", "sqnr_db": round(rng.gauss(19, 0.8), 4),
                        "tokens": counts[e], "fallback": fb}
                for t in ("weight_packed", "weight_scale", "weight_shape"):
                    tensors[f"{prefix}.{e}.{p}.{t}"] = meta
    manifest = {"status": "complete", "recipe": {"name": "kimi-k2"}, "summary": {"bytes_read": 2 * 10**12},
                "calibration": {"num_tokens": 65536, "expert_tokens": expert_tokens, "fallbacks": fallbacks},
                "kv_cache": {"strategy": "tensor", "tensors": 2 * layers}, "tensors": tensors}
    (root / "quantkit_manifest.json").write_text(json.dumps(manifest))
    return root


def test_kimi_k2_scale_renders_in_seconds_and_stays_small(tmp_path):
    out = _synthetic_output(tmp_path / "k2")
    t0 = time.perf_counter()
    res = build_report(out, output=tmp_path / "k2.html")
    seconds = time.perf_counter() - t0
    page = Path(res.output).read_text()
    assert res.figures == ["fig-sqnr-heatmap", "fig-sqnr-layers", "fig-expert-tokens", "fig-kv-scales", "fig-bytes"]
    assert res.bytes < 3_000_000, res.bytes
    assert seconds < 20, seconds  # ~5 s on 2 cores, half of it reading the 40 MB manifest and importing matplotlib
    # the heatmap is one embedded image (plus the colour bar's), not one element per cell
    start = re.search(r'<svg\b[^>]*\bid="fig-sqnr-heatmap"', page).start()
    heat = page[start:page.index("</svg>", start)]
    assert heat.count("<image") <= 2 and heat.count("<path") + heat.count("<use") < 300
    assert "... and" in page  # the fallback table is capped; the manifest keeps them all


# ---- a real browser ---------------------------------------------------------------------------------------
def _chromium_or_skip() -> str:
    if CHROMIUM.exists():
        return str(CHROMIUM)
    if "QUANTKIT_REQUIRE_BROWSER" in os.environ:
        pytest.fail(f"QUANTKIT_REQUIRE_BROWSER is set but {CHROMIUM} is missing (apt-get install -y chromium)")
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install -y chromium); set QUANTKIT_REQUIRE_BROWSER to make this fail")


def _chromium(browser: str, profile: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND", "--hide-scrollbars",
           "--enable-logging=stderr", "--v=0", *args, url]
    return run_bounded(cmd, timeout=120)


_CONSOLE = re.compile(r"\bCONSOLE\b.*")  # Chromium logs every console message (errors, CSP violations) this way


class _Elements(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: dict[str, str] = {}
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = dict(attrs)
        if "id" in a:
            self.ids[a["id"]] = tag


def test_headless_chromium_renders_it(gptq_report, tmp_path):
    browser = _chromium_or_skip()
    res, _ = gptq_report
    url = Path(res.output).resolve().as_uri()

    # the console check can fail: a page that breaks its CSP and throws is caught
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><head><meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'\">"
                   "</head><body><img src=\"http://example.invalid/x.png\"></body></html>")
    control = _chromium(browser, tmp_path / "p0", bad.resolve().as_uri(), "--dump-dom")
    assert _CONSOLE.findall(control.stderr), "Chromium's console log format changed: fix _CONSOLE"

    dom = _chromium(browser, tmp_path / "p1", url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert _CONSOLE.findall(dom.stderr) == []
    elements = _Elements()
    elements.feed(dom.stdout)
    for fig_id in res.figures:
        assert elements.ids.get(fig_id) == "svg", f"{fig_id} missing from the DOM"
    assert "parsererror" not in elements.tags and elements.tags.count("figcaption") == len(res.figures)

    png = tmp_path / "report.png"
    shot = _chromium(browser, tmp_path / "p2", url, f"--screenshot={png}", "--window-size=1200,1800")
    assert shot.returncode == 0 and png.is_file(), shot.stderr[-2000:]
    assert _CONSOLE.findall(shot.stderr) == []
    _assert_heatmap_drawn(png)


def _assert_heatmap_drawn(png: Path) -> None:
    """The screenshot is not blank, and it holds a heatmap: a band of rows, each mostly saturated
    colour (text and axes are grey), with many distinct colours (16 experts x 2 layers)."""
    from PIL import Image

    img = Image.open(png).convert("RGB")
    w, h = img.size
    px = img.load()
    non_white = 0
    band: list[int] = []  # rows that are mostly saturated colour
    for y in range(h):
        sat = 0
        for x in range(0, w, 2):
            r, g, b = px[x, y]
            non_white += (r, g, b) != (255, 255, 255)
            sat += max(r, g, b) - min(r, g, b) >= 60
        if sat >= w // 2 * 0.4:
            band.append(y)
    assert non_white > 0.05 * (w // 2) * h, "the screenshot is (nearly) blank"
    assert len(band) >= 40, f"no heatmap-like band of saturated rows ({len(band)} rows)"
    colours = {px[x, y] for y in band[:: max(1, len(band) // 20)] for x in range(0, w, 3)}
    assert len(colours) >= 12, f"the heatmap band has only {len(colours)} colours"


# ---- hostile inputs, synthetic and fast (issue 26.2; the subprocess/RSS versions: test_report_hostile.py) --
_VERIFY = {"passed": True, "checks": [{"name": "weight_sqnr", "ok": True, "value": 20.0, "threshold": 10.0}],
           "metrics": {"kl_divergence": 1e-4}, "thresholds": {"min_sqnr_db": 10.0},
           "layers": [{"layer": 1, "min_sqnr_db": 18.0, "mean_sqnr_db": 19.0, "ok": True},
                      {"layer": 2, "min_sqnr_db": 17.0, "mean_sqnr_db": 19.0, "ok": True}]}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A convert-shaped output of 3 layers x 4 experts (no model, no convert): seconds to copy and report."""
    return _synthetic_output(tmp_path_factory.mktemp("small") / "q", layers=3, experts=4)


def _edited(small, tmp_path, manifest=None) -> Path:
    out = tmp_path / "q"
    shutil.copytree(small, out)
    if manifest:
        m = json.loads((out / "quantkit_manifest.json").read_text())
        manifest(m)
        (out / "quantkit_manifest.json").write_text(json.dumps(m))
    return out


def _expert_entry(m) -> dict:
    return dict(m["tensors"]["model.layers.1.mlp.experts.0.gate_proj.weight_packed"])


def _set(doc, path, value):
    d = doc
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value


@pytest.mark.parametrize("path,value,error", [
    (("checks",), 10 ** 1000, "'checks' is not a list"),
    (("checks",), "s", "'checks' is not a list"),
    (("layers",), {"a": 1}, "'layers' is not a list"),
    (("metrics",), "s", "'metrics' is not an object"),
    (("generation",), [1, 2], "'generation' is not an object"),
    (("thresholds",), "s", "'thresholds' is not an object"),
    (("thresholds", "min_sqnr_db"), 1e308, "min_sqnr_db is not a number of dB"),
    (("thresholds", "min_sqnr_db"), "10", "min_sqnr_db is not a number of dB"),
    (("layers", 0, "layer"), 10 ** 1000, None),  # was "internal error: OverflowError": the row is left out
    (("layers", 0, "min_sqnr_db"), 1e308, None),  # drawn clipped to +-300 dB (1e308 broke matplotlib's axes)
    (("layers", 0, "min_sqnr_db"), -(10 ** 1000), None),  # not a float: left out
    (("checks", 0, "value"), 10 ** 4000, None),  # shown cut to 300 characters
    # every field the page reads, typed (each of these was drawn, exit 0: "passed": "false" as "skipped")
    (("passed",), "false", "'passed' is not true or false (got 'false')"),
    (("passed",), None, "'passed' is not true or false (got null)"),
    (("checks",), [5, None, "x"], "'checks[0]' is not an object (got 5)"),
    (("checks", 0, "name"), None, "'checks[0].name' is not a string (got null)"),
    (("checks", 0, "ok"), "true", "'checks[0].ok' is not true, false or null (got 'true')"),
    (("checks", 0, "value"), float("nan"), "'checks[0].value' is not a finite number or null (got nan)"),
    (("checks", 0, "value"), "20", "'checks[0].value' is not a finite number or null (got '20')"),
    (("checks", 0, "threshold"), float("nan"), "'checks[0].threshold' is not a number or null (got nan)"),
    (("checks", 0, "detail"), [1], "'checks[0].detail' is not a string or null (got a list)"),
    (("layers", 1), "x", "'layers[1]' is not an object (got 'x')"),
    (("layers", 0, "layer"), "1", "'layers[0].layer' is not an integer or null (got '1')"),
    (("layers", 0, "min_sqnr_db"), "a", "'layers[0].min_sqnr_db' is not a finite number or null (got 'a')"),
    (("layers", 0, "min_sqnr_db"), float("nan"), "'layers[0].min_sqnr_db' is not a finite number"),
    (("layers", 0, "mean_sqnr_db"), float("-inf"), "'layers[0].mean_sqnr_db' is not a finite number"),
    (("layers", 0, "ok"), "no", "'layers[0].ok' is not true, false or null"),
    (("layers", 0, "worst_module"), {}, "'layers[0].worst_module' is not a string or null (got an object)"),
    (("thresholds", "max_kl"), float("nan"), "'thresholds.max_kl' is not a number (got nan)"),
    (("metrics", "kl_divergence"), float("inf"), "'metrics.kl_divergence' is not a finite number or null (got inf)"),
    (("metrics", "kl_divergence"), "x" * 100_000, "'metrics.kl_divergence' is not a finite number or null (got 'xxx"),
    (("generation",), {"tokens": True}, "'generation.tokens' is not a finite number or null (got true)"),
    (("engine",), [1, 2], "'engine' is not an object (got a list)"),
    (("engine_run",), "ran", "'engine_run' is not an object (got 'ran')"),
    (("pair",), [5], "'pair' is not an object (got a list)"),
    (("integrity",), 1, "'integrity' is not an object (got 1)"),
    # what verify writes stays accepted (its nulls: the fixtures' real verify.json files): `--max-kl inf`, an
    # infinite threshold (no limit), and engine's object
    (("checks", 0, "threshold"), float("inf"), None),
    (("thresholds", "max_kl"), float("inf"), None),
    (("engine",), {"engine": "vllm", "ok": True}, None),
], ids=lambda x: x[:24] if isinstance(x, str) else "huge" if isinstance(x, int) and abs(x) > 1e300 else None)
def test_hostile_verify_json_fields(small, tmp_path, path, value, error):
    """verify.json is input: a field of the wrong type is one ConfigError naming it (a hostile value cut
    short); an absurd value is left out or clipped; never an internal error."""
    doc = json.loads(json.dumps(_VERIFY))
    _set(doc, path, value)
    f = tmp_path / "v.json"
    f.write_text(json.dumps(doc))  # NaN and Infinity as Python's json writes (and reads) them
    if error:
        with pytest.raises(ConfigError, match=re.escape(error)) as e:
            build_report(small, output=tmp_path / "r.html", verify_json=f)
        assert "\n" not in e.value.message and len(e.value.message) < 300 + len(str(f)), e.value.message[:400]
        assert "quantkit verify OUT --json" in e.value.hint
        assert not (tmp_path / "r.html").exists()
        return
    res = build_report(small, output=tmp_path / "r.html", verify_json=f)
    assert "fig-verify-layers" in res.figures and res.bytes < 1_000_000


def test_verify_json_rows_are_capped(small, tmp_path):
    from quantkit.report.model import MAX_FALLBACK_ROWS, MAX_METRICS

    doc = dict(_VERIFY, checks=[{"name": f"c{i}", "ok": True} for i in range(100_000)],
               metrics={f"m{i}": 1.0 for i in range(100_000)})
    t0 = time.perf_counter()
    res = build_report(small, output=tmp_path / "r.html", verify_json=doc)
    assert time.perf_counter() - t0 < 15
    page = Path(res.output).read_text()
    assert f"... and {100_000 - MAX_FALLBACK_ROWS} more checks" in page and res.bytes < 2_000_000, res.bytes
    assert f">m{MAX_METRICS - 1}<" in page and f">m{MAX_METRICS}<" not in page


@pytest.mark.parametrize("name,limit", [("quantkit_manifest.json", "REPORT_MAX_MANIFEST_BYTES"),
                                        ("verify.json", "MAX_JSON_BYTES")])
def test_oversized_inputs_are_refused_from_their_size(small, tmp_path, monkeypatch, name, limit):
    """A manifest or verify.json over its cap is refused before a byte of it is parsed (a sparse file: the
    test writes nothing); the error names the file and the limit. The report reads manifests up to 256 MiB
    (parsing costs ~80 ms per MB: a 339 MB one took 27 s) unless QUANTKIT_REPORT_MAX_MANIFEST_MB says more."""
    import quantkit.report as rep
    from quantkit.read import checkpoint as rc

    cap = getattr(rep, limit, None) or getattr(rc, limit)
    out = _edited(small, tmp_path)
    with open(out / name, "r+b" if (out / name).exists() else "wb") as f:
        f.truncate(cap + 1)
    t0 = time.perf_counter()
    msg = (f"is {cap + 1:,} bytes, over the {cap:,} bytes the report reads" if name.startswith("quantkit")
           else f"{name} is {cap + 1} bytes, over the {cap}-byte limit")
    with pytest.raises(ConfigError, match=msg):
        build_report(out, output=tmp_path / "r.html")
    assert time.perf_counter() - t0 < 5
    if name.startswith("quantkit"):  # a larger limit asked for: the file is parsed (and is not JSON here)
        monkeypatch.setenv(rep.REPORT_MANIFEST_ENV, "300")
        with pytest.raises(ConfigError, match="not valid JSON"):
            build_report(out, output=tmp_path / "r.html")


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "abc", "1e400", "-1", "0", "1e9", ""])
def test_manifest_limit_variable_is_a_positive_number_of_mib(small, tmp_path, monkeypatch, raw):
    """QUANTKIT_REPORT_MAX_MANIFEST_MB: a positive number of MiB up to REPORT_MAX_MANIFEST_MB_BOUND, else one
    ConfigError naming the variable whose hint speaks of it (not of config.json); empty is unset."""
    import quantkit.report as rep

    monkeypatch.setenv(rep.REPORT_MANIFEST_ENV, raw)
    if not raw.strip():
        assert build_report(small, output=tmp_path / "r.html").figures
        return
    with pytest.raises(ConfigError, match=re.escape(f"{rep.REPORT_MANIFEST_ENV}={raw!r} is not a number of MiB")) as e:
        build_report(small, output=tmp_path / "r.html")
    assert rep.REPORT_MANIFEST_ENV in e.value.hint and "config.json" not in e.value.hint


def test_manifest_limit_variable_takes_fractions(small, tmp_path, monkeypatch):
    import quantkit.report as rep

    size = (small / "quantkit_manifest.json").stat().st_size
    monkeypatch.setenv(rep.REPORT_MANIFEST_ENV, f"{(size - 1) / (1 << 20)!r}")  # one byte short
    with pytest.raises(ConfigError, match=f"over the {size - 1:,} bytes the report reads"):
        build_report(small, output=tmp_path / "r.html")
    monkeypatch.setenv(rep.REPORT_MANIFEST_ENV, f"{size / (1 << 20)!r}")
    assert build_report(small, output=tmp_path / "r.html").figures


def test_cli_a_mistyped_verify_json_is_one_error_line(small, tmp_path, capsys):
    """`"passed": "false"` was drawn as "Result: skipped", exit 0; now exit 1, an `error:` line naming the field
    and a `hint:` line, no page written."""
    f = tmp_path / "v.json"
    f.write_text(json.dumps(dict(_VERIFY, passed="false")))
    with pytest.raises(SystemExit) as e:
        cli_main(["report", str(small), "--verify-json", str(f), "-o", str(tmp_path / "r.html")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 2, err
    assert err[0].startswith("error: ") and "'passed' is not true or false" in err[0] and err[1].startswith("hint: ")
    assert not (tmp_path / "r.html").exists()


def test_huge_expert_ids_allocate_no_dense_grid(small, tmp_path):
    """Expert 16383 named in 2,000 layers: the dense grid would be 2,000 x 16,384 float64 cells (3.2 GB with
    its companions); the heatmap is skipped with the reason, and the report's Python/numpy allocations
    stay small (tracemalloc; numpy reports its buffers there)."""
    import tracemalloc

    def edit(m):
        e = _expert_entry(m)
        for layer in range(2000):
            m["tensors"][f"model.layers.{layer}.mlp.experts.16383.gate_proj.weight_packed"] = dict(e)
    out = _edited(small, tmp_path, edit)
    tracemalloc.start()
    try:
        res = build_report(out, output=tmp_path / "r.html")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    page = Path(res.output).read_text()
    assert "No layer x expert heatmap" in page and "fig-sqnr-heatmap" not in res.figures
    assert peak < 200e6, peak / 1e6


def test_expert_index_past_the_cap_is_a_config_error(small, tmp_path):
    from quantkit.report.model import MAX_EXPERTS

    def edit(m):
        m["tensors"][f"model.layers.1.mlp.experts.{MAX_EXPERTS}.gate_proj.weight_packed"] = _expert_entry(m)
    with pytest.raises(ConfigError, match=f"routed expert {MAX_EXPERTS}"):
        build_report(_edited(small, tmp_path, edit), output=tmp_path / "r.html")


def test_long_and_many_names_are_cut(small, tmp_path):
    """A 1 MB module name and 20,000 projection names: the page shows 300 characters of the name and 16
    projection names (with their count), in seconds (51 s for the 1 MB name before)."""
    def edit(m):
        e = _expert_entry(m)
        m["tensors"]["model.layers.1.mlp.experts.1." + "x" * 1_000_000 + ".weight_packed"] = dict(e, sqnr_db=-5.0)
        for i in range(20_000):
            m["tensors"][f"model.layers.2.mlp.experts.1.p{i}.weight_packed"] = dict(e)
    out = _edited(small, tmp_path, edit)
    t0 = time.perf_counter()
    res = build_report(out, output=tmp_path / "r.html")
    seconds = time.perf_counter() - t0
    page = Path(res.output).read_text()
    assert seconds < 15 and res.bytes < 2_000_000, (seconds, res.bytes)
    assert "x" * 301 not in page and "x" * 200 in page and ",029 characters)" in page
    assert "(20,004 names)" in page and "(the first 16 of 20,004 projection names)" in page


@pytest.mark.parametrize("name", ["$\\alpha$", "un$balanced", "$x^{2", "$$"])
def test_dollar_names_reach_a_figure_label_as_text(small, tmp_path, name):
    """A `$` in a projection name (manifest input) reaches the heatmap's title: matplotlib draws the literal
    text (mathtext off, report/__init__.py), so `$\\alpha$` is not an alpha and an unbalanced `$` no
    ParseFatalException; the page's tables and captions show the module name and the scheme as text too."""
    def edit(m):
        e = _expert_entry(m)
        for t in ("weight_packed", "weight_scale"):
            m["tensors"][f"model.layers.1.mlp.experts.1.{name}.{t}"] = dict(e, scheme=f"int4-{name}", sqnr_db=-3.0)
    out = _edited(small, tmp_path, edit)
    import matplotlib

    before = matplotlib.rcParams["text.parse_math"]
    res = build_report(out, output=tmp_path / "r.html")
    assert matplotlib.rcParams["text.parse_math"] == before  # the setting is scoped to the build
    page = Path(res.output).read_text()
    svg = page[re.search(r'<svg\b[^>]*\bid="fig-sqnr-heatmap"', page).start():]
    title = next(t for t in svg[:svg.index("</svg>")].split("<text")[1:] if "worst projection" in t)
    assert html.escape(name, quote=False) in title, title[:300]
    assert f"<td class=\"mono\">model.layers.1.mlp.experts.1.{html.escape(name)}</td>" in page  # worst-modules table
    assert f"int4-{html.escape(name)}" in page
