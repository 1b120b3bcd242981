"""The prompts of `jaxinfer bench spec`: a copy-heavy paragraph to repeat with one word changed, chat questions,
and the concurrent batch built from distinct GPL-3 paragraphs (rendered with the model's chat template)."""

from __future__ import annotations

import re

from jaxinfer.tokenizer import Tokenizer

PARAGRAPH = (
    "The old lighthouse stood at the edge of the northern cliffs for more than two hundred years. Every night its "
    "keeper climbed the narrow spiral staircase, carrying a small brass lantern and a notebook in which he recorded "
    "the weather, the passing ships, and the strange lights that sometimes appeared far out over the water. "
    "Fishermen in the village below trusted the beam more than any map, and children grew up believing that the "
    "keeper never slept. When the storms of winter arrived, waves crashed against the rocks with such force that "
    "the whole tower trembled, yet the light never failed. In the spring, seabirds nested in the cracks of the stone "
    "walls, and the keeper would sit on the steps in the morning sun, mending nets and telling stories to anyone who "
    "cared to listen. Years later, when an automatic lamp replaced him, the villagers said the sea itself seemed "
    "quieter, as if it missed the old man.")
COPY_INSTRUCTION = "Repeat the following paragraph exactly, word for word, but change the word \"{old}\" to \"{new}\":"
CHAT_QUESTION = "What are the main differences between a lake and a sea? Explain in a few sentences."
CHAT_QUESTIONS = [
    CHAT_QUESTION,
    "Why is the sky blue during the day and red at sunset?",
    "Give me three tips for learning a new language as an adult.",
    "What is the difference between weather and climate?",
    "How does a refrigerator keep food cold?",
    "What should I pack for a weekend hiking trip in the mountains?",
    "Explain what photosynthesis is to a ten-year-old.",
    "Why do cats purr?",
    "What are some healthy breakfast ideas that take less than ten minutes?",
    "How do airplanes stay in the air?",
    "What is the best way to prepare for a job interview?",
    "Why do leaves change color in autumn?",
    "How can I improve my sleep?",
    "What causes earthquakes?",
    "Describe the water cycle in a few sentences.",
    "What are the benefits of reading books regularly?",
]
REPLACEMENTS = ["agreement", "program", "document", "product", "system", "person", "method", "object"]


def copy_prompt(tok: Tokenizer) -> list[int]:
    """The batch-1 copy-heavy prompt: repeat PARAGRAPH with "lighthouse" changed to "tower"."""
    instruction = COPY_INSTRUCTION.format(old="lighthouse", new="tower")
    return tok.apply_chat_template([{"role": "user", "content": instruction + "\n\n" + PARAGRAPH}])


def chat_prompt(tok: Tokenizer) -> list[int]:
    """The batch-1 free-form chat prompt (CHAT_QUESTION)."""
    return tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}])


def tput_prompts(tok: Tokenizer, text: str, requests: int) -> list[list[int]]:
    """`requests` prompts, alternating: a copy-heavy one (a distinct 60-100-word paragraph of `text` to repeat with
    its most frequent long word changed) and a chat question.

    Raises:
      ValueError: `text` has too few such paragraphs, or `requests` asks for more chat questions than there are.
    """
    half = requests // 2
    if not 1 <= half <= len(CHAT_QUESTIONS):
        raise ValueError(f"--requests must be in [2, {2 * len(CHAT_QUESTIONS)}]")
    paras = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    paras = [p for p in paras if 60 <= len(p.split()) <= 100][:half]
    if len(paras) < half:
        raise ValueError(f"the text has too few paragraphs of 60-100 words for {requests} requests")
    out = []
    for i in range(half):
        words = [w for w in re.findall(r"[A-Za-z]+", paras[i]) if len(w) >= 5]
        old = max(set(words), key=lambda w: (words.count(w), w))
        instr = COPY_INSTRUCTION.format(old=old, new=REPLACEMENTS[i % len(REPLACEMENTS)])
        out.append(tok.apply_chat_template([{"role": "user", "content": f"{instr}\n\n{paras[i]}"}]))
        out.append(tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTIONS[i]}]))
    return out
