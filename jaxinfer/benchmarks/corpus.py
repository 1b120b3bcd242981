"""The English text the serving, prefix and spec workloads cut their prompts from.

The GPL-3 licence text ships with every Debian machine (`../shared/JAX_ON_CPU.md`), so the prompts are real prose
without a download. Workloads tokenize it with the model's own tokenizer.
"""

from __future__ import annotations

from pathlib import Path

TEXT_FILE = Path("/usr/share/common-licenses/GPL-3")


def read_text(workload: str) -> str:
    """The text of `TEXT_FILE` (about 35 kB of English).

    Raises:
      ValueError: the file is missing (the message names the workload that needs it).
    """
    if not TEXT_FILE.is_file():
        raise ValueError(f"{TEXT_FILE} is missing: the {workload} workload takes its prompts from it")
    return TEXT_FILE.read_text()
