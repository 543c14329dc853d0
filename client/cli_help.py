"""``--help`` that shows every flag's default (shared by the dasc command-line tools)."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already names its default.

    A flag whose default is None says in its own help what happens when it is left out, so
    that case is not printed as "(default: None)"; switches (default False) show nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)
