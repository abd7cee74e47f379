"""The multi-turn benchmark's workload (:mod:`pdserve.bench.serving.bench_multiturn`): a fixed
system prompt, seeded user messages per conversation, and each turn's chat messages. Benchmark
code only."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SYSTEM_SENTENCES = (
    "You are a careful, friendly assistant for the staff of a mid-sized engineering company.",
    "Answer in plain English, in short paragraphs, and never invent facts you are unsure of.",
    "When a question is ambiguous, state the most likely reading and answer that one.",
    "Prefer concrete steps, numbers and examples over general advice.",
    "If a task involves safety, money or personal data, point out the main risk first.",
    "Keep answers short unless the user asks for detail; three sentences are often enough.",
    "Use metric units, twenty-four hour times and ISO dates such as 2026-11-25.",
    "Quote commands and file names exactly, and say which system they apply to.",
    "When you list options, give the trade-off of each in one line.",
    "Do not repeat the question back to the user, and do not apologise without a reason.",
    "If the user corrects you, accept the correction and carry on from there.",
    "Refer back to earlier parts of the conversation when they matter for the answer.",
)
_SUBJECTS = (
    "a small web service in Python",
    "a garden irrigation plan",
    "a database schema for a library",
    "a weekly running schedule",
    "a home network with two routers",
    "a household budget spreadsheet",
    "a unit test suite for a parser",
    "a sourdough bread recipe",
    "a command-line tool for renaming photos",
    "a three-city train trip",
    "a talk for a team meeting",
    "a backup plan for family photos",
    "a bookshelf made of pine boards",
    "a study plan for a statistics exam",
    "a small vegetable patch on a balcony",
    "a migration from one email provider to another",
)
_DETAILS = (
    "It has to be finished by the end of the month and I have little experience with it.",
    "A colleague started it, left no notes, and now I am in charge of it.",
    "I have about two hours on most evenings and a modest budget for it.",
    "My first attempt went badly, so this time I want to plan it properly.",
    "Several people will depend on it, so it should not break in surprising ways.",
    "I would like to keep it simple enough that I can explain it to a friend.",
)
_ASKS = (
    "What should I do first, and why?",
    "Which part usually turns out to be the hardest?",
    "How would you check that it really works?",
    "What is a common mistake to avoid here?",
    "Can you suggest a simpler alternative?",
    "How long should each step take, roughly?",
    "What would you change if the budget were halved?",
    "Which tools or materials would you pick?",
)
_FOLLOW_UPS = ("Thanks, that helps.", "I see.", "Good point.", "That makes sense.", "Hm, okay.")


def approx_tokens(text: str) -> int:
    """A tokenizer-free estimate of the tokens of English ``text``: 4/3 per word."""
    return max(1, round(len(text.split()) * 4 / 3))


def system_prompt(tokens: int, count: Callable[[str], int] = approx_tokens, start: int = 0) -> str:
    """A deterministic system prompt of at least ``tokens`` tokens by ``count`` (numbered rules
    cycling through fixed sentences; ``start`` rotates the first sentence, so prompts with a
    different ``start`` share no prefix)."""
    lines = ["The following rules apply to every conversation."]
    i = 0
    while count(" ".join(lines)) < tokens:
        sentence = SYSTEM_SENTENCES[(start + i) % len(SYSTEM_SENTENCES)]
        lines.append(f"Rule {i + 1}: {sentence}")
        i += 1
    if start:
        lines[0] = f"Read these {i} rules before answering."
    return " ".join(lines)


def user_message(rng: random.Random, turn: int) -> str:
    """One user message (a few dozen tokens) for ``turn`` (0-based) drawn with ``rng``."""
    ask = rng.choice(_ASKS)
    if turn == 0:
        return f"I am working on {rng.choice(_SUBJECTS)}. {rng.choice(_DETAILS)} {ask}"
    return f"{rng.choice(_FOLLOW_UPS)} {rng.choice(_DETAILS)} {ask} Please answer briefly."


@dataclass(frozen=True)
class Workload:
    """The fixed part of the workload: the shared system prompt and each conversation's user
    messages (``users[conversation][turn]``); the assistant replies come from the server."""

    system: str
    users: tuple[tuple[str, ...], ...]
    seed: int
    systems: tuple[str, ...] = ()
    """Per conversation, its own system prompt ("" or missing: :attr:`system`)."""

    def system_of(self, conversation: int) -> str:
        """The system prompt of ``conversation``."""
        own = self.systems[conversation] if conversation < len(self.systems) else ""
        return own or self.system


def make_workload(
    conversations: int,
    turns: int,
    system_tokens: int,
    seed: int = 0,
    count: Callable[[str], int] = approx_tokens,
    distinct: bool = False,
) -> Workload:
    """``conversations`` x ``turns`` user messages and a system prompt of about
    ``system_tokens`` tokens (by ``count``); the same for the same arguments. ``distinct``:
    conversation ``c`` gets its own system prompt (rules rotated by ``c + 1``)."""
    users = []
    for c in range(conversations):
        rng = random.Random(f"{seed}:{c}")
        users.append(tuple(user_message(rng, t) for t in range(turns)))
    systems = tuple(
        system_prompt(system_tokens, count, start=c + 1) if distinct else ""
        for c in range(conversations)
    )
    return Workload(system_prompt(system_tokens, count), tuple(users), seed, systems)


def turn_messages(
    system: str, users: Sequence[str], replies: Sequence[str]
) -> list[dict[str, str]]:
    """The chat messages of turn ``len(replies)`` (0-based): the system prompt, every earlier
    user message with its reply, then the turn's user message. Turn t+1's list extends turn
    t's by t's reply and the next user message."""
    messages = [{"role": "system", "content": system}]
    for user, reply in zip(users, replies, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": users[len(replies)]})
    return messages
