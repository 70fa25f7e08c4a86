"""Print a fenced code block of README.md: the first ```LANG block after the heading HEADING (for .ci/run)."""

import sys
from pathlib import Path

heading, lang = sys.argv[1], sys.argv[2]
readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
start = readme.index(f"```{lang}\n", readme.index(heading)) + len(f"```{lang}\n")
print(readme[start : readme.index("```", start)], end="")
