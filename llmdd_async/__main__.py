"""``python -m llmdd_async demo``."""

from ._cli import entry

entry()
