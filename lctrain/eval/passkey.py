"""The passkey retrieval test (Mohtashami & Jaggi): a number hidden in filler text, asked for at the
end. The prompt is built from token ids, so its length is exact: introduction, filler with the
needle at the sentence boundary at or before ``depth``, the question. The answer is the first run
of digits the model decodes."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from lctrain.data.formats import leading_specials, plain_ids
from lctrain.errors import UserError

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyPrompt:
    """One test prompt: its ids, the needle's token span, and the filler's start and length
    (needle excluded)."""

    ids: list[int]
    needle_start: int
    needle_stop: int
    filler_start: int
    filler_tokens: int

    @property
    def placed_depth(self) -> float:
        """Where the needle landed, as a share of the filler."""
        return (self.needle_start - self.filler_start) / max(self.filler_tokens, 1)


def passkey_prompt(tokenizer: Any, length: int, depth: float, passkey: str) -> PasskeyPrompt:
    """The test prompt of ``length`` tokens with ``passkey`` hidden at ``depth`` (0: start of the
    filler, 1: its end; UserError: ``length`` too short for the fixed text)."""
    lead = leading_specials(tokenizer)
    intro, needle, question = plain_ids(tokenizer, [INTRO, " " + NEEDLE.format(key=passkey),
                                                    " " + QUESTION])
    sentences = plain_ids(tokenizer, [" " + s for s in FILLER])
    head = len(lead) + len(intro)
    room = length - head - len(needle) - len(question)
    if room < 0:
        raise UserError(f"a passkey prompt of {length} tokens is too short: its introduction, "
                        f"needle and question alone take {length - room}; give longer --lengths")
    filler: list[int] = []
    ends = []  # where each whole sentence ends
    while len(filler) < room:
        filler += sentences[len(ends) % len(sentences)]
        ends.append(len(filler))
    drop = len(filler) - room  # a window of the endless filler: cut at its start
    filler = filler[drop:]
    bounds = [0] + [end - drop for end in ends if end > drop]
    cut = max(b for b in bounds if b <= round(depth * room))
    ids = lead + intro + filler[:cut] + needle + filler[cut:] + question
    return PasskeyPrompt(ids=ids, needle_start=head + cut, needle_stop=head + cut + len(needle),
                         filler_start=head, filler_tokens=room)


def answer_tokens(tokenizer: Any, passkey: str) -> int:
    """Tokens to generate for ``passkey``: those of " <passkey>." and one more."""
    return len(plain_ids(tokenizer, [f" {passkey}."])[0]) + 1


def answer_text(tokenizer: Any, ids: list[int]) -> str:
    """The generated ``ids`` as text, up to the end-of-text token where the model ends there."""
    eos = tokenizer.eos_token_id
    return tokenizer.decode(ids[:ids.index(eos)] if eos in ids else ids, skip_special_tokens=True)


def parse_answer(text: str) -> str | None:
    """The number the model answered: the first run of digits in ``text`` (None if none)."""
    found = re.search(r"\d+", text)
    return found.group(0) if found else None


@dataclass(frozen=True)
class PasskeyCase:
    """One (length, depth, trial) of a passkey run, with its random passkey."""

    length: int
    depth: float
    trial: int
    passkey: str


def passkey_cases(lengths: list[int], depths: list[float], trials: int,
                  seed: int) -> list[PasskeyCase]:
    """Every case of a run, each with a 5-digit passkey drawn from ``seed`` (same on every rank)."""
    rng = random.Random(seed)
    return [PasskeyCase(length, depth, trial, str(rng.randint(10000, 99999)))
            for length in lengths for depth in depths for trial in range(trials)]


def summarize(cases: list[PasskeyCase], outcomes: list[dict]) -> list[dict]:
    """Result rows, one per (length, depth): accuracy over the trials and the first answer;
    ``outcomes`` hold per case its answer text, needle_start and placed_depth."""
    rows: dict[tuple[int, float], dict] = {}
    for case, outcome in zip(cases, outcomes):
        answer, got = outcome["answer"], parse_answer(outcome["answer"])
        shown = "".join(c if c.isprintable() else "·" for c in answer.strip())
        row = rows.setdefault((case.length, case.depth), {
            "seq_len": case.length, "depth": case.depth,
            "needle_position": outcome["needle_start"], "placed_depth": outcome["placed_depth"],
            "passkey": case.passkey, "answer": shown, "trials": 0, "correct": 0, "samples": []})
        row["trials"] += 1
        row["correct"] += got == case.passkey
        row["samples"].append({"passkey": case.passkey, "answer": answer, "parsed": got,
                               "correct": got == case.passkey,
                               "needle_start": outcome["needle_start"]})
    for row in rows.values():
        row["accuracy"] = row["correct"] / row["trials"]
    return list(rows.values())
