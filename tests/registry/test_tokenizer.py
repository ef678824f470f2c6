"""posttrain.registry.tokenizer against transformers on tokenizers trained here (no downloads).

A small byte-level BPE is trained once; it is wrapped in transformers with a Qwen-style ChatML
template and a Llama-3-style template (BOS from the post-processor, `{{ bos_token }}` in the
template) and saved with transformers' own save_pretrained. Our runtime must give the same ids.
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from posttrain.registry.tokenizer import ChatTemplateError, Tokenizer

transformers = pytest.importorskip("transformers")

SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>",
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
]  # fmt: skip

QWEN_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + tool_call.arguments | tojson + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

TEXTS = [
    "Hello world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n  indented",
    "digits 1234567890 and 3.14159, 2024-01-01",
    "unicode: café naïve Ωμέγα 日本語のテキスト",
    "emoji 🤖🚀 and 👩‍💻 sequences",
    "special <|im_end|> inside text and <s> too",
    "",
]

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}],
    "multi": [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue 🔵"},
        {"role": "user", "content": "Another one, in français?"},
        {"role": "assistant", "content": "Rouge, c'est ça."},
    ],
    "system": [SYSTEM, {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! 123"}],
    "open": [SYSTEM, {"role": "user", "content": "Count to three"}],
}


def _sentences(n: int = 400) -> list[str]:
    rng = random.Random(0)
    words = "the a model learns to answer user assistant system question tokens fast slow blue red".split()
    words += ["café", "naïve", "日本", "🤖", "Ωμέγα", "42", "3.14", "\n", "\t", "  "]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) for _ in range(n)]


@pytest.fixture(scope="session")
def base_backend() -> Backend:
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_sentences(), trainer)
    return tok


def _copy(backend: Backend) -> Backend:
    return Backend.from_str(backend.to_str())


@pytest.fixture(scope="session")
def model_dirs(base_backend, tmp_path_factory) -> dict:
    """Two model directories written by transformers' save_pretrained."""
    root = tmp_path_factory.mktemp("tok")
    qwen = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_copy(base_backend),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN_TEMPLATE,
    )
    qwen.save_pretrained(root / "qwen")

    llama_backend = _copy(base_backend)
    bos = "<|begin_of_text|>"
    llama_backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, llama_backend.token_to_id(bos))]
    )
    llama = transformers.PreTrainedTokenizerFast(
        tokenizer_object=llama_backend,
        bos_token=bos,
        eos_token="<|eot_id|>",
        chat_template=LLAMA3_TEMPLATE,
        model_max_length=4096,
    )
    llama.save_pretrained(root / "llama")
    eos_ids = [llama_backend.token_to_id("<|end_of_text|>"), llama_backend.token_to_id("<|eot_id|>")]
    (root / "llama" / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return {"qwen": root / "qwen", "llama": root / "llama"}


@pytest.fixture(scope="session")
def pair(model_dirs):
    """name -> (ours, transformers')"""
    cache = {}

    def get(name: str):
        if name not in cache:
            path = model_dirs[name]
            cache[name] = (Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path))
        return cache[name]

    return get


def hf_chat_ids(hf, messages, **kwargs) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kwargs)
    # transformers 5 returns a BatchEncoding by default, 4.x a plain list
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def masked_runs(tok: Tokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """Decoded text of each contiguous run of masked tokens."""
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs, current = runs + [current], []
    runs += [current] if current else []
    return [tok.decode(r) for r in runs]


# ---------------------------------------------------------------- loading and plain encoding


def test_transformers_writes_standalone_template(model_dirs):
    # transformers 5 moves a single template out of tokenizer_config.json into chat_template.jinja
    config = json.loads((model_dirs["qwen"] / "tokenizer_config.json").read_text())
    jinja = model_dirs["qwen"] / "chat_template.jinja"
    assert jinja.is_file() or "chat_template" in config
    assert Tokenizer.from_pretrained(model_dirs["qwen"]).chat_template == QWEN_TEMPLATE


@pytest.mark.parametrize("name", ["qwen", "llama"])
def test_encode_matches_transformers(pair, name):
    ours, hf = pair(name)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text
    assert ours.encode_batch(TEXTS) == [hf.encode(t) for t in TEXTS]
    assert ours.vocab_size == len(hf)


def test_special_ids(pair):
    qwen, hf_qwen = pair("qwen")
    assert qwen.bos_id is None and qwen.eos_id == hf_qwen.eos_token_id == qwen.token_to_id("<|im_end|>")
    assert qwen.pad_id == hf_qwen.pad_token_id and qwen.eos_ids == {qwen.eos_id}
    assert qwen.model_max_length is None

    llama, hf_llama = pair("llama")
    assert llama.bos_id == hf_llama.bos_token_id and llama.encode("hi")[0] == llama.bos_id
    assert llama.pad_id == llama.eos_id == llama.token_to_id("<|eot_id|>")  # no pad token: falls back to EOS
    assert llama.eos_ids == {llama.token_to_id("<|eot_id|>"), llama.token_to_id("<|end_of_text|>")}
    assert llama.model_max_length == 4096


@pytest.mark.parametrize("name", ["qwen", "llama"])
def test_decode_round_trips(pair, name):
    ours, hf = pair(name)
    for text in TEXTS:
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids) == hf.decode(ids)
    assert ours.decode(ours.encode("a <s> b"), skip_special_tokens=True) == "a  b"
    chat = ours.apply_chat_template(CONVERSATIONS["multi"])
    assert ours.decode(chat) == ours.apply_chat_template(CONVERSATIONS["multi"], tokenize=False)


# ---------------------------------------------------------------- chat templates


@pytest.mark.parametrize("name", ["qwen", "llama"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(pair, name, conversation, add_generation_prompt):
    ours, hf = pair(name)
    messages = CONVERSATIONS[conversation]
    kw = {"add_generation_prompt": add_generation_prompt}
    assert ours.apply_chat_template(messages, tokenize=False, **kw) == hf.apply_chat_template(
        messages, tokenize=False, **kw
    )
    ids = ours.apply_chat_template(messages, **kw)
    assert ids == hf_chat_ids(hf, messages, **kw)
    if name == "llama":  # BOS comes from the template only, never doubled by the post-processor
        assert ids[0] == ours.bos_id and ids[1] != ours.bos_id


def test_tools_and_tojson_match_transformers(pair):
    ours, hf = pair("qwen")
    tools = [{"type": "function", "function": {"name": "météo", "description": "<weather> & more 🌦",
                                                "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "météo", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": "18°C"},
        {"role": "assistant", "content": "It is 18°C."},
    ]  # fmt: skip
    text = ours.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text == hf.apply_chat_template(messages, tools=tools, tokenize=False)
    assert '"météo"' in text and "<weather> & more 🌦" in text  # no ASCII or HTML escaping
    assert ours.apply_chat_template(messages, tools=tools) == hf_chat_ids(hf, messages, tools=tools)
    indented = "{{ messages[0] | tojson(indent=2) }}|{{ strftime_now('%Y') }}"
    assert ours.apply_chat_template(messages, tokenize=False, chat_template=indented) == hf.apply_chat_template(
        messages, tokenize=False, chat_template=indented
    )
    tagged = "{% for m in messages %}{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}"
    assert ours.apply_chat_template(messages, tokenize=False, chat_template=tagged) == "userassistanttoolassistant"


# ---------------------------------------------------------------- loss masks


@pytest.mark.parametrize("name,end", [("qwen", "<|im_end|>"), ("llama", "<|eot_id|>")])
@pytest.mark.parametrize("conversation", ["single", "multi", "system"])
def test_assistant_mask_covers_assistant_content(pair, name, end, conversation):
    ours, hf = pair(name)
    messages = CONVERSATIONS[conversation]
    ids, mask = ours.encode_chat_with_mask(messages)
    assert ids == hf_chat_ids(hf, messages) and len(mask) == len(ids)
    expected = [m["content"] + end for m in messages if m["role"] == "assistant"]
    assert masked_runs(ours, ids, mask) == expected


def test_assistant_mask_with_tool_calls(pair):
    ours, _ = pair("qwen")
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "w", "arguments": {"c": 1}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    ids, mask = ours.encode_chat_with_mask(messages)
    runs = masked_runs(ours, ids, mask)
    assert runs == ['<tool_call>\n{"name": "w", "arguments": {"c": 1}}\n</tool_call><|im_end|>', "Sunny.<|im_end|>"]


def test_mask_falls_back_to_character_offsets(pair):
    # "Assistant: " + "Hello" tokenizes as "Assistant:" + " Hello": the prompt's tokens are not a prefix
    ours, _ = pair("qwen")
    template = (
        "{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content }}\n"
        "{% else %}Assistant: {{ m.content }}{{ eos_token }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}Assistant: {% endif %}"
    )
    messages = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "the blue one"},  # " the" is one token of the trained vocab
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "red, café 🤖"},  # offsets are in characters, not bytes
    ]
    prompt_ids = ours.encode(ours.apply_chat_template(messages[:1], True, tokenize=False, chat_template=template), False)
    ids, mask = ours.encode_chat_with_mask(messages, chat_template=template)
    assert ids[: len(prompt_ids)] != prompt_ids  # the token-prefix path cannot work here
    runs = masked_runs(ours, ids, mask)
    assert runs == [" the blue one<|im_end|>", " red, café 🤖<|im_end|>"]  # boundary token keeps its space


def test_mask_agrees_with_transformers_generation_tags(pair):
    # transformers can only mask templates annotated with {% generation %}; ours needs no annotation
    ours, hf = pair("qwen")
    tagged = (
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}"
        "{% else %}{{ m.content + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    for messages in (CONVERSATIONS["multi"], CONVERSATIONS["system"]):
        out = hf.apply_chat_template(
            messages, chat_template=tagged, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = ours.encode_chat_with_mask(messages, chat_template=tagged)
        assert ids == list(out["input_ids"])
        assert [int(m) for m in mask] == list(out["assistant_masks"])


def test_prompt_completion(pair):
    llama, _ = pair("llama")
    ids, mask = llama.encode_prompt_completion("Question: 2+2?\nAnswer:", " 4")
    assert ids == llama.encode("Question: 2+2?\nAnswer: 4") + [llama.eos_id]
    assert ids[0] == llama.bos_id and not mask[0]
    assert masked_runs(llama, ids, mask) == [" 4<|eot_id|>"]

    qwen, hf = pair("qwen")
    prompt = CONVERSATIONS["system"][:2]
    ids, mask = qwen.encode_prompt_completion(prompt, "Hello!")
    assert ids == hf_chat_ids(hf, [*prompt, {"role": "assistant", "content": "Hello!"}])
    assert masked_runs(qwen, ids, mask) == ["Hello!<|im_end|>"]
    # earlier assistant turns of a message-list prompt are context, not trained
    multi = CONVERSATIONS["multi"]
    ids, mask = qwen.encode_prompt_completion(multi[:3], [multi[3]])
    assert masked_runs(qwen, ids, mask) == [multi[3]["content"] + "<|im_end|>"]


# ---------------------------------------------------------------- saving and legacy formats


@pytest.mark.parametrize("name", ["qwen", "llama"])
def test_save_pretrained_loads_in_transformers(pair, name, tmp_path):
    ours, hf = pair(name)
    ours.save_pretrained(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = CONVERSATIONS["system"]
    for text in TEXTS:
        assert reloaded.encode(text) == ours.encode(text)
    assert hf_chat_ids(reloaded, messages, add_generation_prompt=True) == hf_chat_ids(
        hf, messages, add_generation_prompt=True
    )
    again = Tokenizer.from_pretrained(tmp_path)
    assert again.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert (again.bos_id, again.eos_id, again.pad_id) == (ours.bos_id, ours.eos_id, ours.pad_id)


def test_legacy_config_formats(base_backend, tmp_path):
    # old exports: named templates in the config, tokens in special_tokens_map.json, BOS via add_bos_token
    backend = _copy(base_backend)
    backend.post_processor = None
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "add_bos_token": True,
        "model_max_length": int(1e30),  # transformers' "no limit"
        "chat_template": [{"name": "default", "template": "D{{ bos_token }}"}, {"name": "tool_use", "template": "T"}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    special_map = {"bos_token": {"content": "<s>", "lstrip": False, "special": True}, "eos_token": "</s>"}
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_map))

    tok = Tokenizer.from_pretrained(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (tok.token_to_id("<s>"), tok.token_to_id("</s>"))
    assert tok.encode("hi")[0] == tok.bos_id and tok.encode("hi", add_special_tokens=False)[0] != tok.bos_id
    assert tok.model_max_length is None
    user = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(user, tokenize=False) == "D<s>"
    assert tok.apply_chat_template(user, tokenize=False, tools=[{"name": "f"}]) == "T"


# ---------------------------------------------------------------- errors


def test_missing_directory_or_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_template_errors(base_backend, tmp_path):
    _copy(base_backend).save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(tmp_path)
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match=r"no chat template.*tokenizer_config\.json"):
        tok.apply_chat_template(user)
    with pytest.raises(ChatTemplateError, match="raised: roles must alternate"):
        tok.apply_chat_template(user, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="syntax error"):
        tok.encode_chat_with_mask(user, chat_template="{% for %}")
    last_only = "{% for m in messages %}{{ m.content if loop.last else '.' }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="renders a turn differently"):
        tok.encode_chat_with_mask([*user, {"role": "assistant", "content": "a"}, *user], chat_template=last_only)
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([], chat_template="x")
