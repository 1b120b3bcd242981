"""The English text the serving, prefix, spec, quality and soak workloads cut their prompts from.

`tests/data/GPL-3.txt` is a verbatim copy of Debian's `/usr/share/common-licenses/GPL-3` (its licence allows
verbatim copies; source and hash in `tests/data/GPL-3.README.md`), so the prompts are real prose without a download
and without depending on the system's files. Workloads tokenize it with the model's own tokenizer.

`CODE_FILE` is the second text of the quality workload, of another kind: Python source, CPython 3.12.1's
`Lib/textwrap.py` copied verbatim (PSF licence; source, hash and licence note in `tests/data/textwrap.README.md`).
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
TEXT_FILE = DATA / "GPL-3.txt"
CODE_FILE = DATA / "textwrap-3.12.1.py.txt"


def read_text(workload: str) -> str:
    """The text of `TEXT_FILE` (about 35 kB of English).

    Raises:
      ValueError: the file is missing (the message names the workload that needs it).
    """
    if not TEXT_FILE.is_file():
        raise ValueError(f"{TEXT_FILE} is missing: the {workload} workload takes its prompts from it")
    return TEXT_FILE.read_text(encoding="utf-8")
