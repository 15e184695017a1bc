"""Conversation formats people bring from axolotl, LLaMA-Factory and TRL, against expectations
built by hand, piece by piece:

- ShareGPT (``conversations`` of ``{from, value}``) and Alpaca (``instruction``, ``input``,
  ``output``) are detected, named in the banner and encoded byte for byte; ``data.fields`` maps
  other names;
- an unknown role and a chat without an assistant turn are one sentence naming file:line, or
  (``data.turns=all_or_skip``) counted skips; ``data.turns=last`` trains the last reply only;
- every named ``data.chat_template`` renders as its hand-written Python twin, and its mask is
  exact (bytes: piece by piece; a BPE: as transformers' own assistant mask);
- the exported tokenizer renders a training record to the ids training used;
- one real run (two gloo ranks) on ShareGPT records through chatml learns the fixed reply only.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from lctrain.config import load_recipe
from lctrain.data import ByteTokenizer, RecordReader, prepare_data, rows_summary
from lctrain.data.chat_templates import TEMPLATES
from lctrain.data.formats import Encoder, encode_chat
from lctrain.errors import ConfigError, DataError

WORDS = "the model reads long documents and answers questions about them quickly".split()
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "observation": "tool",
                  "function": "tool", "tool": "tool"}
ALPACA_HEAD = ("Below is an instruction that describes a task{}. Write a response that "
               "appropriately completes the request.\n\n### Instruction:\n")


def _rng():
    return random.Random(torch.initial_seed())


def _words(rng, lo=1, hi=6):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _encoded(path: Path, tok, *sets, seq_len=512):
    """(encoder, samples) of the file as preparing it encodes them."""
    cfg = load_recipe(None, [f"data.source={path}", *sets], seq_len=seq_len)
    records = list(RecordReader(cfg.data))
    encoder = Encoder.for_data(cfg.data, tok, records[0])
    return encoder, encoder.encode(records)


def _byte_chat(messages, last=False):
    """The bytes tokenizer's own chat format, built by hand: ids and the assistant flags."""
    ids, mask = [256], [False]
    final = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    for i, m in enumerate(messages):
        head, body = list(f"<|{m['role']}|>\n".encode()), list(m["content"].encode())
        end = [257] if m["role"] == "assistant" else [10]
        flag = m["role"] == "assistant" and (not last or i == final)
        ids += head + body + end
        mask += [False] * len(head) + [flag] * (len(body) + len(end))
    return ids, mask


def _sharegpt(rng, tool=False):
    turns = [{"from": "system", "value": "Answer briefly."}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        turns += [{"from": "human", "value": _words(rng)}, {"from": "gpt", "value": _words(rng)}]
        if tool and rng.random() < 0.5:
            turns.append({"from": rng.choice(["observation", "function", "tool"]),
                          "value": _words(rng)})
    return turns


def _openai(turns):
    return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]


def test_sharegpt_is_detected_named_and_encoded(tmp_path):
    rng, tok = _rng(), ByteTokenizer()
    convs = [_sharegpt(rng, tool=True) for _ in range(8)]
    src = _write(tmp_path / "sg.jsonl", [{"conversations": c} for c in convs])
    rows = prepare_data(load_recipe(None, [f"data.source={src}"], seq_len=512).data, tok)
    assert (f"data: {src}, format chat (records have a ShareGPT conversations list); "
            f"{len(convs)} samples") in rows_summary(rows)[0]
    for last in (False, True):
        encoder, samples = _encoded(src, tok, f"data.turns={'last' if last else 'all'}")
        assert encoder.why == "records have a ShareGPT conversations list"
        for conv, sample in zip(convs, samples, strict=True):
            ids, mask = _byte_chat(_openai(conv), last)
            assert sample.ids.tolist() == ids and sample.targets.tolist() == mask
    encoder, _ = _encoded(src, tok, "data.format=chat")
    assert encoder.why == "data.format; records have a ShareGPT conversations list"
    odd = load_recipe(None, [f"data.source={_write(tmp_path / 'odd.jsonl', [{'body': 'x'}])}",
                             "data.format=text"]).data
    first = next(iter(RecordReader(odd)))  # no field says its format: the setting alone
    assert Encoder.for_data(odd, tok, first).why == "data.format"


def test_alpaca_is_trained_as_prompt_and_completion(tmp_path):
    rng, tok = _rng(), ByteTokenizer()
    recs = [{"instruction": _words(rng), "input": rng.choice(["", _words(rng)]),
             "output": _words(rng)} for _ in range(8)] + [{"instruction": "hi", "output": "yo"}]
    src = _write(tmp_path / "alpaca.jsonl", recs)
    encoder, samples = _encoded(src, tok)
    assert (encoder.fmt, encoder.why) == ("prompt_completion",
                                          "Alpaca records: instruction, input, output")
    for rec, sample in zip(recs, samples, strict=True):
        extra = rec.get("input")
        head = ALPACA_HEAD.format(", paired with an input that provides further context"
                                  if extra else "") + rec["instruction"] + "\n\n"
        head += (f"### Input:\n{extra}\n\n" if extra else "") + "### Response:\n"
        prompt, reply = [256, *head.encode()], [*rec["output"].encode(), 257]
        assert sample.ids.tolist() == prompt + reply
        assert sample.targets.tolist() == [False] * len(prompt) + [True] * len(reply)
    assert "format prompt_completion (Alpaca records: instruction, input, output)" in \
        rows_summary(prepare_data(load_recipe(None, [f"data.source={src}"]).data, tok))[0]


def test_data_fields_map_other_names(tmp_path):
    rng, tok = _rng(), ByteTokenizer()
    convs = [_openai(_sharegpt(rng)) for _ in range(5)]
    theirs = {"system": "sys", "user": "customer", "assistant": "agent"}
    dialog = [{"dialog": [{"speaker": theirs[m["role"]], "text": m["content"]} for m in c]}
              for c in convs]
    src = _write(tmp_path / "d.jsonl", dialog)
    maps = [f"data.fields.{k}={v}" for k, v in {"messages": "dialog", "role": "speaker",
                                                  "content": "text", **theirs}.items()]
    encoder, samples = _encoded(src, tok, *maps)
    assert encoder.why == "records have a dialog list"
    assert [s.ids.tolist() for s in samples] == [_byte_chat(c)[0] for c in convs]
    assert [s.targets.tolist() for s in samples] == [_byte_chat(c)[1] for c in convs]
    dolly = _write(tmp_path / "dolly.jsonl", [{"instruction": "a", "context": "b", "response": "c"}])
    plain = _write(tmp_path / "alpaca.jsonl", [{"instruction": "a", "input": "b", "output": "c"}])
    mapped = _encoded(dolly, tok, "data.fields={input: context, output: response}")[1]
    assert mapped[0].ids.tolist() == _encoded(plain, tok)[1][0].ids.tolist()
    with pytest.raises(ConfigError, match=r"^data.fields.rol is not one of our names; map "
                                          r"text, messages, .*; did you mean 'role'\?"):
        load_recipe(None, ["data.fields.rol=speaker"])


def test_unknown_roles_and_chats_without_a_reply(tmp_path):
    tok = ByteTokenizer()
    good = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    typo = {"conversations": [{"from": "humman", "value": "a"}, {"from": "gpt", "value": "b"}]}
    src = _write(tmp_path / "c.jsonl", [good, typo])
    with pytest.raises(DataError) as info:
        _encoded(src, tok)
    assert str(info.value) == (
        f"{src}:2: message 0 has role 'humman', which is none of system, user, assistant, tool "
        "(nor ShareGPT's human, gpt, function_call, observation, function); correct the record, "
        "or map the role with data.fields (such as data.fields.user=humman)")
    assert len(_encoded(src, tok, "data.fields.user=humman")[1]) == 2  # the fix it gives works
    asked = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}
    src = _write(tmp_path / "q.jsonl", [good, good, asked, good, asked, {"messages": []}])
    with pytest.raises(DataError) as info:
        _encoded(src, tok)
    assert str(info.value) == (
        f"{src}:3: the conversation has no assistant turn, so nothing in it is trained on; add "
        "one, or set data.turns to all_or_skip (or last_or_skip) to skip such records")
    cfg = load_recipe(None, [f"data.source={src}", "data.turns=last_or_skip"], seq_len=64)
    rows = prepare_data(cfg.data, tok)
    assert rows.info["samples"] == 3
    assert f"; 3 skipped (no assistant turn: 3, first at {src}:3)" in rows_summary(rows)[0]


def _conversation(rng):
    """Random OpenAI messages: an optional system turn, user/assistant pairs, tool results;
    contents with stray spaces (templates that trim them must)."""
    pad = lambda: rng.choice(["", " ", "  "])  # noqa: E731
    messages = [{"role": "system", "content": _words(rng)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        messages += [{"role": "user", "content": pad() + _words(rng) + pad()},
                     {"role": "assistant", "content": pad() + _words(rng) + pad()}]
        if rng.random() < 0.3:
            messages.append({"role": "tool", "content": _words(rng)})
    return messages


def _pieces(name, messages, bos, eos):
    """The template ``name`` rendered by hand: (text, trained) pieces in order."""
    out, system = [], ""
    if name in ("mistral", "gemma", "llama3"):
        out.append((bos, False))
    if name in ("mistral", "gemma") and messages[0]["role"] == "system":
        system, messages = messages[0]["content"] + "\n\n", messages[1:]
    if name == "qwen2" and messages[0]["role"] != "system":
        out.append(("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                    "helpful assistant.<|im_end|>\n", False))
    for i, m in enumerate(messages):
        role, text, mine = m["role"], m["content"], m["role"] == "assistant"
        first = system if i == 0 else ""
        if name in ("chatml", "qwen2"):
            if name == "qwen2" and role == "tool":
                out.append((f"<|im_start|>user\n<tool_response>\n{text}\n</tool_response>"
                            "<|im_end|>\n", False))
            elif mine:
                out += [("<|im_start|>assistant\n", False), (text + "<|im_end|>", True),
                        ("\n", False)]
            else:
                out.append((f"<|im_start|>{role}\n{text}<|im_end|>\n", False))
        elif name == "llama3":
            out += [(f"<|start_header_id|>{'ipython' if role == 'tool' else role}"
                     "<|end_header_id|>\n\n", False), (text.strip() + "<|eot_id|>", mine)]
        elif name == "mistral":
            out.append((text + eos, True) if mine else (f"[INST] {first}{text} [/INST]", False)
                       if role == "user" else (f"[TOOL_RESULTS] {text} [/TOOL_RESULTS]", False))
        else:  # gemma
            out.append((f"<start_of_turn>{'model' if mine else 'user'}\n", False))
            out += [(text.strip() + "<end_of_turn>", True), ("\n", False)] if mine else [
                (first + text.strip() + "<end_of_turn>\n", False)]
    return out


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_named_templates_render_and_mask_exactly(name):
    from model_folders import build_tokenizer

    rng, byte = _rng(), ByteTokenizer()
    bpe = build_tokenizer("llama3")
    for _ in range(6):
        messages = _conversation(rng)
        pieces = _pieces(name, messages, "<bos>", "<eos>")
        for last in (False, True):
            final = max(i for i, (_, mine) in enumerate(pieces) if mine)
            ids, mask = encode_chat(byte, messages, "here", last=last, template=TEMPLATES[name])
            assert ids == [b for text, _ in pieces for b in text.encode()]
            assert mask == [mine and (not last or i == final) for i, (text, mine)
                            in enumerate(pieces) for _ in text.encode()]
        pieces = _pieces(name, messages, "<|begin_of_text|>", "<|end_of_text|>")
        text = "".join(t for t, _ in pieces)
        bpe.chat_template = TEMPLATES[name]
        assert bpe.apply_chat_template(messages, tokenize=False) == text
        want = bpe.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = encode_chat(bpe, messages, "here")
        assert ids == want["input_ids"] == bpe(text, add_special_tokens=False)["input_ids"]
        assert mask == [bool(m) for m in want["assistant_masks"]]
        split = [bpe(t, add_special_tokens=False)["input_ids"] for t, _ in pieces]
        if sum(split, []) == ids:  # the pieces tokenize as the whole: their flags are the mask
            assert mask == [mine for (_, mine), p in zip(pieces, split) for _ in p]
        assert bpe.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) \
            .startswith(pieces[0][0])


@pytest.mark.parametrize("name", ["mistral", "gemma"])
def test_a_system_message_opens_the_next_user_turn_and_is_never_lost(name):
    """Templates without a system turn put the system text into the next user turn: after an
    opening reply, and later in the conversation too (both were once dropped silently)."""
    system = {"role": "system", "content": "Be brief."}
    user, reply = {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}
    messages = [system, {"role": "assistant", "content": "Hi."}, user, reply, system, user, reply]
    if name == "mistral":
        want = ("<bos>Hi.<eos>[INST] Be brief.\n\n2+2? [/INST]4<eos>"
                "[INST] Be brief.\n\n2+2? [/INST]4<eos>")
    else:
        turn = ("<start_of_turn>user\nBe brief.\n\n2+2?<end_of_turn>\n"
                "<start_of_turn>model\n4<end_of_turn>\n")
        want = "<bos><start_of_turn>model\nHi.<end_of_turn>\n" + turn + turn
    tok = ByteTokenizer()
    ids, _ = encode_chat(tok, messages, "here", template=TEMPLATES[name])
    assert tok.decode(ids, skip_special_tokens=False) == want


def test_a_bad_template_is_one_sentence(tmp_path):
    from lctrain.data import load_tokenizer

    for value in ("chatm", str(tmp_path / "missing.jinja")):
        with pytest.raises(ConfigError) as info:
            load_tokenizer(load_recipe(None, [f"data.chat_template={value}"]))
        hint = "; did you mean 'chatml'?" if value == "chatm" else ""
        assert str(info.value) == (f"data.chat_template {value!r} is neither a template name "
                                   f"(chatml, qwen2, llama3, mistral, gemma) nor an existing "
                                   f".jinja file{hint}")
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}{{ m.role }}: {% generation %}{{ m.content }}"
                   "{% endgeneration %}{{ '\\n' }}{% endfor %}")
    tok = load_tokenizer(load_recipe(None, [f"data.chat_template={own}"]))
    ids, mask = encode_chat(tok, [{"role": "user", "content": "a"},
                                  {"role": "assistant", "content": "b"}], "here")
    assert bytes(ids) == b"user: a\nassistant: b\n"
    assert bytes(i for i, f in zip(ids, mask) if f) == b"ab"  # this template marks every content


@pytest.mark.parametrize("kind", ["sharegpt", "alpaca", "bytes"])
def test_the_exported_tokenizer_renders_training_ids(tmp_path, kind):
    """The export writes the run's tokenizer with data.chat_template; transformers loads it and
    renders a record's messages to the ids training used (the bytes tokenizer's stand-in too)."""
    from model_folders import make_model_folder
    from transformers import AutoTokenizer

    from lctrain.export import write
    from lctrain.model import load_tokenizer

    rng = _rng()
    folder = make_model_folder(tmp_path, "qwen2", weights=False)
    if kind != "alpaca":
        recs = [{"conversations": _sharegpt(rng)} for _ in range(4)]
        chats = [_openai(r["conversations"]) for r in recs]
    else:
        recs = [{"instruction": _words(rng), "input": rng.choice(["", _words(rng)]),
                 "output": _words(rng)} for _ in range(4)]
        chats = [[{"role": "user", "content": r["instruction"] + (f"\n\n{r['input']}" if
                                                                    r["input"] else "")},
                  {"role": "assistant", "content": r["output"]}] for r in recs]
    src = _write(tmp_path / "d.jsonl", recs)
    model = [] if kind == "bytes" else [f"model.path={folder}", "model.config=null",
                                        "data.tokenizer=null"]
    cfg = load_recipe(None, [f"data.source={src}", *model, "data.chat_template=qwen2"],
                      seq_len=512)
    tokenizer = write.run_tokenizer(cfg)
    write.save_tokenizer(tokenizer, tmp_path / "export")
    exported = AutoTokenizer.from_pretrained(tmp_path / "export")
    records = list(RecordReader(cfg.data))
    samples = Encoder.for_data(cfg.data, load_tokenizer(cfg), records[0]).encode(records)
    for chat, sample in zip(chats, samples, strict=True):
        out = exported.apply_chat_template(chat, return_dict=True,
                                           return_assistant_tokens_mask=True)
        assert sample.ids.tolist() == out["input_ids"]
        assert sample.targets.tolist() == [bool(m) for m in out["assistant_masks"]]
    assert exported.chat_template == TEMPLATES["qwen2"]


def _learn(rank, world, cfg):
    from lctrain.train.runner import run_worker

    assert run_worker(cfg) == 0
    path = Path(cfg.train.output_dir) / "metrics.jsonl"
    return [json.loads(x)["loss"] for x in path.read_text().splitlines()] if rank == 0 else None


@pytest.mark.slow
def test_sharegpt_through_chatml_trains_on_the_replies_only(tmp_path):
    """Random prompts (ln 62 nats a character), one fixed reply: trained on the replies only,
    the loss falls far below the prompts' entropy; the final export renders a record as trained."""
    from spawn import run_on_ranks
    from transformers import AutoTokenizer

    rng = _rng()
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    convs = [[{"from": "human", "value": "".join(rng.choice(chars) for _ in range(40))},
              {"from": "gpt", "value": "ok"}] for _ in range(120)]
    src = _write(tmp_path / "sg.jsonl", [{"conversations": c} for c in convs])
    sets = {"data.source": src, "data.format": "chat", "data.chat_template": "chatml",
            "data.seq_len": 256, "train.max_steps": 30, "train.warmup_steps": 2,
            "train.lr": 1e-2, "train.min_lr_ratio": 1.0, "train.loss_chunk_tokens": 128,
            "parallel.attention_backend": "reference", "parallel.fsdp": "off",
            "checkpoint.every": 0}
    cfg = load_recipe(None, [f"{k}={v}" for k, v in sets.items()], output_dir=str(tmp_path / "run"))
    rows = prepare_data(cfg.data, ByteTokenizer())
    assert rows.info["target_tokens"] == len(convs) * len("ok<|im_end|>")  # the replies only
    losses = run_on_ranks(_learn, 2, cfg)[0]
    assert losses[0] > 4.0 and losses[-1] < 1.0, losses  # trained on prompts: > 2
    final = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    ids, _ = encode_chat(ByteTokenizer(), _openai(convs[0]), "here", template=TEMPLATES["chatml"])
    assert final.apply_chat_template(_openai(convs[0]))["input_ids"] == ids
