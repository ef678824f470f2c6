"""A tokenizer for model presets, which have random weights and ship none: built in memory,
no training, no files.

Ids 0-255 are the 256 bytes (GPT-2's byte-to-unicode alphabet, so any text encodes, one id per
UTF-8 byte, and decodes back exactly), then the ChatML special tokens `<|endoftext|>` (pad),
`<|im_start|>` and `<|im_end|>` (EOS: the end of an assistant turn), then `<|reserved_N|>`
special tokens up to the model's vocabulary size, so that every id a model can emit has a token.
"""

from __future__ import annotations

from posttrain.registry.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
PAD, BOS_TURN, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (PAD, BOS_TURN, EOS)
NUM_BYTES = 256
MIN_VOCAB = NUM_BYTES + len(SPECIALS)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what tokenizers' ByteLevel uses):
    printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(NUM_BYTES):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(NUM_BYTES + extra)
            extra += 1
    return table


def byte_tokenizer(vocab_size: int = MIN_VOCAB) -> Tokenizer:
    """The byte-level ChatML tokenizer with exactly `vocab_size` ids (at least MIN_VOCAB)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"a byte-level tokenizer needs {MIN_VOCAB} ids ({NUM_BYTES} bytes + {', '.join(SPECIALS)}); "
                         f"the model has {vocab_size}")
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - MIN_VOCAB)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIALS, *reserved)])
    config = {"eos_token": EOS, "pad_token": PAD, "model_max_length": None}
    return Tokenizer(backend, config, chat_templates={"default": CHATML}, origin="<byte-level tokenizer for a preset>")
