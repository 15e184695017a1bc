"""Chat records: assistant-only loss masks, token by token, against hand-built expectations.

A real tokenizer is made offline: a small byte-level BPE trained here with `tokenizers`, wrapped
as transformers' PreTrainedTokenizerFast, with a ChatML template — once plain (lctrain finds the
assistant's tokens by rendering prefixes) and once with ``{% generation %}`` markers
(transformers' own assistant masks). The expectation is built by tokenizing the conversation's
pieces one by one and marking the assistant's by hand.
"""
from __future__ import annotations

import json
import random

import pytest

from lctrain.config import load_recipe
from lctrain.data import IGNORE, ByteTokenizer, prepare_data
from lctrain.data.formats import encode_chat
from lctrain.errors import DataError

CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHATML_GENERATION = (
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- m['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
WORDS = "the model reads long documents and answers questions about them quickly".split()


@pytest.fixture(scope="module")
def bpe():
    """A ~400-token byte-level BPE with ChatML specials, trained here (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


def _conversation(rng, turns):
    messages = [{"role": "system", "content": "Answer briefly."}] if rng.random() < 0.5 else []
    if rng.random() < 0.3:
        messages.append({"role": "assistant", "content": "Hello, ask me anything."})
    for _ in range(turns):
        messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(5))})
        messages.append({"role": "assistant",
                         "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))})
    return messages


def _expected(tok, messages):
    """ChatML tokenized piece by piece; the assistant's content and its <|im_end|> are True."""
    ids, mask = [], []
    for m in messages:
        pieces = [(f"<|im_start|>{m['role']}\n", False)]
        if m["role"] == "assistant":
            pieces += [(m["content"] + "<|im_end|>", True), ("\n", False)]
        else:
            pieces += [(m["content"] + "<|im_end|>\n", False)]
        for text, flag in pieces:
            piece = tok(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [flag] * len(piece)
    return ids, mask


@pytest.mark.parametrize("template", ["prefix", "generation"])
def test_chat_masks_match_a_hand_built_expectation(bpe, template):
    bpe.chat_template = CHATML if template == "prefix" else CHATML_GENERATION
    rng = random.Random(random.randrange(2**31))
    for _ in range(12):
        messages = _conversation(rng, rng.randint(1, 3))
        ids, mask = encode_chat(bpe, messages, "test")
        want_ids, want_mask = _expected(bpe, messages)
        assert ids == bpe.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert ids == want_ids  # the pieces tokenize as the whole does (the split is clean)
        assert mask == want_mask
        im_end = bpe.convert_tokens_to_ids("<|im_end|>")
        n_assistant = sum(m["role"] == "assistant" for m in messages)
        assert sum(1 for i, f in zip(ids, mask) if f and i == im_end) == n_assistant


def test_chat_labels_through_preparation(bpe, tmp_path):
    bpe.chat_template = CHATML
    rng = random.Random(random.randrange(2**31))
    convs = [_conversation(rng, 2) for _ in range(6)]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    cfg = load_recipe(None, [f"data.source={src}",
                             "data.long_samples=truncate_left"], seq_len=512)
    rows = prepare_data(cfg.data, bpe)
    assert rows.info["format"] == "chat" and len(rows) >= 1
    samples = {}
    for c in convs:
        ids, mask = _expected(bpe, c)
        labels = [ids[i + 1] if mask[i + 1] else IGNORE for i in range(len(ids) - 1)] + [IGNORE]
        samples[tuple(ids)] = labels
    found = 0
    for r in range(len(rows)):
        row = rows[r]
        lo = 0
        for n in row["doc_lens"].tolist():
            key = tuple(row["input_ids"][lo:lo + n].tolist())
            if key in samples:
                assert row["labels"][lo:lo + n].tolist() == samples[key]
                found += 1
            lo += n
    assert found == len(convs)


def test_byte_tokenizer_chat_format_token_by_token():
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "ok"},
                {"role": "assistant", "content": "yes"}]
    ids, mask = encode_chat(tok, messages, "test")
    b = lambda text: list(text.encode())  # noqa: E731
    want = ([256] + b("<|system|>\nBe terse.\n") + b("<|user|>\n2+2?\n") + b("<|assistant|>\n")
            + b("4") + [257] + b("<|user|>\nok\n") + b("<|assistant|>\n") + b("yes") + [257])
    assert ids == want
    marked = [i for i, f in zip(ids, mask) if f]
    assert marked == b("4") + [257] + b("yes") + [257]
    first = want.index(ord("4"))
    assert mask[first - 1] is False and mask[first] is True and mask[first + 1] is True
    prompt, _ = tok.encode_chat(messages[:2], add_generation_prompt=True)
    assert prompt == want[:first]  # the generation prompt opens the reply exactly


def test_chat_errors(bpe, tmp_path):
    bpe.chat_template = None
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                            {"role": "assistant", "content": "b"}]}) + "\n")
    cfg = load_recipe(None, [f"data.source={src}"], seq_len=64)
    with pytest.raises(DataError, match="has no chat template; set data.chat_template"):
        prepare_data(cfg.data, bpe)
    # a template that renders earlier replies differently from the last one
    bpe.chat_template = CHATML.replace("m['content']", "(m['content'] if loop.last else '...')")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    with pytest.raises(DataError, match="here: the chat template renders the conversation up to "
                                        "message 1 differently"):
        encode_chat(bpe, messages, "here")
    bpe.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DataError, match=r"here: the chat template cannot render .*roles must alternate"):
        encode_chat(bpe, messages, "here")
    with pytest.raises(DataError, match="here: each message must be an object with a string role"):
        encode_chat(ByteTokenizer(), [{"content": "no role"}], "here")
    with pytest.raises(DataError, match=r"here: message 0 \(user\) has content of type list, "
                                        r"not a string"):
        encode_chat(ByteTokenizer(), [{"role": "user", "content": ["parts"]}], "here")


CONTENT_FAULTS = [
    ({"role": "assistant"}, "message 1 (assistant) has no content"),
    ({"role": "assistant", "content": None},
     "message 1 (assistant) has content null, not a string"),
    ({"role": "assistant", "content": ["yo"]},
     "message 1 (assistant) has content of type list, not a string"),
]


@pytest.mark.parametrize("tokenizer", ["bytes", "template"])
@pytest.mark.parametrize("reply, fault", CONTENT_FAULTS, ids=["missing", "null", "list"])
def test_a_message_without_string_content_is_an_error_naming_the_record(bpe, tmp_path, tokenizer,
                                                                        reply, fault):
    """A missing or null content is a malformed record (like a missing role), never an empty
    reply: rendered, it would train on the end-of-turn marker alone."""
    bpe.chat_template = CHATML
    tok = ByteTokenizer() if tokenizer == "bytes" else bpe
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps(good) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, reply]}) + "\n")
    cfg = load_recipe(None, [f"data.source={src}",
                             "data.format=chat"], seq_len=64)
    with pytest.raises(DataError) as info:
        prepare_data(cfg.data, tok)
    assert str(info.value) == (f"{src}:2: {fault}; each message must be an object with a string "
                               f"role and a string content")


def test_a_malformed_message_is_an_error_even_where_the_record_would_be_skipped(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    cfg = load_recipe(None, [f"data.source={src}"], seq_len=64)
    with pytest.raises(DataError, match=r"c\.jsonl:1: message 0 \(user\) has no content;"):
        prepare_data(cfg.data, ByteTokenizer())


@pytest.mark.parametrize("tokenizer", ["bytes", "template"])
def test_a_conversation_whose_replies_are_all_empty_is_a_counted_skip(bpe, tmp_path, tokenizer):
    """As an empty completion is: nothing to train on, so skipped, counted and named in the
    banner. A conversation with some non-empty reply is kept whole."""
    from lctrain.data import rows_summary

    bpe.chat_template = CHATML
    tok = ByteTokenizer() if tokenizer == "bytes" else bpe
    user = {"role": "user", "content": "hi"}
    convs = [[user, {"role": "assistant", "content": ""}],
             [user, {"role": "assistant", "content": ""}, user,
              {"role": "assistant", "content": "ok"}],
             [user, {"role": "assistant", "content": "yes"}],
             [user, {"role": "assistant", "content": ""}, user,
              {"role": "assistant", "content": ""}]]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    cfg = load_recipe(None, [f"data.source={src}"], seq_len=256)
    rows = prepare_data(cfg.data, tok)
    assert rows.info["samples"] == 2 and rows.info["skipped"] == {
        "empty assistant reply": [2, f"{src}:1"]}
    assert f"2 skipped (empty assistant reply: 2, first at {src}:1)" in "\n".join(
        rows_summary(rows))
    if tokenizer == "bytes":  # the kept: an empty reply's eos, "ok" + eos; "yes" + eos
        assert rows.info["target_tokens"] == 1 + 3 + 4
    src.write_text(json.dumps({"messages": convs[0]}) + "\n")
    with pytest.raises(DataError) as info:
        prepare_data(cfg.data, tok)
    assert str(info.value) == (f"data.source {str(src)!r} yields no token to train on: 1 skipped "
                               f"(empty assistant reply: 1, first at {src}:1); check the records")


def test_an_empty_opening_reply_is_not_trained_on_by_prefix_rendering(bpe):
    """Prefix rendering finds an opening reply by its content; an empty one has none to find,
    so it is no target (and not an error)."""
    bpe.chat_template = CHATML
    messages = [{"role": "assistant", "content": ""}, {"role": "user", "content": "the model"},
                {"role": "assistant", "content": "answers"}]
    ids, mask = encode_chat(bpe, messages, "here")
    want_ids, want_mask = _expected(bpe, messages)
    opening = len(bpe("<|im_start|>assistant\n<|im_end|>", add_special_tokens=False)["input_ids"])
    assert ids == want_ids and any(want_mask[:opening])
    assert mask == [False] * opening + want_mask[opening:]


def test_no_chat_template_names_the_fixes_and_the_first_one_works(tmp_path):
    """The message says where a template goes, and that the built-in tokenizer is for random
    inits only (a model.path refuses it); adding the template as it says makes data ready."""
    from model_folders import make_model_folder

    from lctrain.data import load_tokenizer

    folder = make_model_folder(tmp_path, "llama3", weights=False)
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                            {"role": "assistant", "content": "b"}]}) + "\n")
    pretrained = load_recipe(None, [f"data.source={src}",
                                    "data.format=chat", f"model.path={folder}",
                                    "model.config=null", "data.tokenizer=null"], seq_len=64)
    with pytest.raises(DataError) as info:
        prepare_data(pretrained.data, load_tokenizer(pretrained))
    assert str(info.value) == (
        f"data.format is chat but the tokenizer {str(folder)!r} has no chat template; set "
        "data.chat_template (a name such as chatml or llama3, or a .jinja file), give the "
        "tokenizer one (a chat_template.jinja file in its folder), or give the records as prompt "
        "and completion (data.format=prompt_completion)")
    named = load_recipe(None, [f"data.source={src}", "data.format=chat", f"model.path={folder}",
                               "model.config=null", "data.tokenizer=null",
                               "data.chat_template=chatml"], seq_len=64)
    rows = prepare_data(named.data, load_tokenizer(named))  # the fixes the message gives work
    assert rows.info["format"] == "chat" and rows.info["samples"] == 1
    (folder / "chat_template.jinja").write_text(CHATML)
    rows = prepare_data(pretrained.data, load_tokenizer(pretrained))
    assert rows.info["format"] == "chat" and rows.info["samples"] == 1


@pytest.mark.parametrize("template", ["prefix", "generation"])
def test_byte_tokenizer_with_a_template_file_trains_on_the_replies_bytes(tmp_path, template):
    """data.tokenizer=bytes with a .jinja template: its rendered UTF-8 bytes, the replies and
    their <|im_end|> trained on, whether or not the template marks them with {% generation %}
    (without the markers, prefix rendering once failed: the bytes tokenizer has no
    apply_chat_template)."""
    jinja = tmp_path / "chat.jinja"
    jinja.write_text(CHATML if template == "prefix" else CHATML_GENERATION)
    messages = [{"role": "user", "content": "2+2? é"}, {"role": "assistant", "content": "4 ✓"},
                {"role": "user", "content": "ok"}, {"role": "assistant", "content": "yes"}]
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"messages": messages}) + "\n")
    cfg = load_recipe(None, [f"data.source={src}", "data.tokenizer=bytes",
                             f"data.chat_template={jinja}"], seq_len=256)
    rows = prepare_data(cfg.data, ByteTokenizer())
    ids, targets = [], []  # by hand: the ChatML text's bytes, replies + <|im_end|> marked
    for m in messages:
        pieces = [(f"<|im_start|>{m['role']}\n", False)]
        pieces += ([(m["content"] + "<|im_end|>", True), ("\n", False)] if m["role"] == "assistant"
                   else [(m["content"] + "<|im_end|>\n", False)])
        for text, flag in pieces:
            ids += list(text.encode())
            targets += [flag] * len(text.encode())
    row = rows[0]
    assert row["input_ids"][:len(ids)].tolist() == ids
    labels = [ids[i + 1] if targets[i + 1] else IGNORE for i in range(len(ids) - 1)] + [IGNORE]
    assert row["labels"][:len(ids)].tolist() == labels
