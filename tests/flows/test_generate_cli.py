"""`posttrain generate` on a preset (random weights, no tokenizer files): the built-in byte-level
ChatML tokenizer stands in; other models without a tokenizer fail with a message, not a traceback."""

from __future__ import annotations

import re

import pytest

from posttrain.registry.byte_tokenizer import MIN_VOCAB, byte_tokenizer
from posttrain.flows.cli import main

LINE = re.compile(r"^(?P<prompt>'.*') -> (?P<text>'.*'|\".*\") \((?P<reason>stop|length)\)$")


def _lines(out: str) -> list[re.Match]:
    lines = out.strip("\n").split("\n")
    matches = [LINE.match(line) for line in lines]
    assert all(matches), lines
    return matches


def test_generate_preset_without_tokenizer(capsys):
    prompts = ["hello", "add 12 30", "naïve 日本"]
    assert main(["generate", "debug", *prompts, "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert [m["prompt"] for m in _lines(out)] == [repr(p) for p in prompts]  # one line per prompt, in order


def test_generate_preset_with_explicit_tokenizer(tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    byte_tokenizer(512).save_pretrained(tok_dir)
    assert main(["generate", "debug", "hi", "--max-new-tokens", "4", "--tokenizer", str(tok_dir)]) == 0
    explicit = capsys.readouterr().out
    assert main(["generate", "debug", "hi", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out == explicit  # same tokenizer, same random weights, greedy


def test_generate_checkpoint_without_tokenizer_says_pass_tokenizer(tmp_path, capsys):
    from posttrain.core.model import build_model, get_preset
    from posttrain.registry.hf import save_pretrained

    save_pretrained(build_model(get_preset("debug")), tmp_path / "ckpt")
    assert main(["generate", str(tmp_path / "ckpt"), "hi"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer.json" in err and "--tokenizer" in err and "Traceback" not in err


def test_generate_unknown_preset(capsys):
    assert main(["generate", "no-such-preset", "hi"]) == 2
    assert "unknown model preset 'no-such-preset'" in capsys.readouterr().err


def test_byte_tokenizer_ids_are_bytes():
    tok = byte_tokenizer(512)
    assert tok.vocab_size == 512
    text = "héllo, 世界!\n\t 12+30"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    im_start, im_end, pad = (tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert (pad, im_start, im_end) == (256, 257, 258)
    assert chat == [im_start, *b"user\nhi", im_end, ord("\n"), im_start, *b"assistant\n"]
    assert tok.eos_ids == {im_end} and tok.pad_id == pad
    # every id a 512-token model can emit has a token; the reserved ones are special
    assert tok.decode([104, 105, 300, 511], skip_special_tokens=True) == "hi"
    assert tok.decode([511]) == "<|reserved_252|>"


def test_byte_tokenizer_too_small_vocab():
    assert byte_tokenizer(MIN_VOCAB).vocab_size == MIN_VOCAB == 259
    with pytest.raises(ValueError, match="needs 259 ids"):
        byte_tokenizer(MIN_VOCAB - 1)
