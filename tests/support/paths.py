"""The repository's folders, for tests that run scripts or read files."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # helpers and torchrun workers
TESTS = SUPPORT.parent
ROOT = TESTS.parent
DATA = TESTS / "data"
