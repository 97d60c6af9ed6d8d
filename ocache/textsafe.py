"""Text from requests made safe for where ocache shows it.

Folder names, client names, model aliases and error messages come from request bodies and from
llama-server; a terminal interprets their control characters (``ESC ] 0 ; title BEL`` retitles the
operator's terminal, ``ESC [ 2 J`` clears it) and rich interprets ``[...]`` as markup. Every such
string goes through :func:`term` before ``print`` and through :func:`rich_text` before a rich table.
(HTML is escaped by the dashboard's script, which sets ``textContent`` only.)
"""

from __future__ import annotations

import unicodedata

from rich.text import Text

#: Unicode categories shown as escapes: controls (C0, DEL, C1), format characters (bidi overrides,
#: zero-width joiners), line/paragraph separators, surrogates, unassigned and private-use code points.
_UNSAFE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Cn", "Co"})


def term(value: object) -> str:
    """``str(value)`` with every character a terminal could act on written as a Python escape
    (``\\x1b``, ``\\u202e``): printable text is unchanged, nothing is dropped, so two different
    names never print alike."""
    s = str(value)
    if s.isprintable() and s.isascii():
        return s
    return "".join(c if unicodedata.category(c) not in _UNSAFE else
                   (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}" if ord(c) < 0x10000
                    else f"\\U{ord(c):08x}") for c in s)


def rich_text(value: object, style: str = "") -> Text:
    """A rich ``Text`` of :func:`term` (value): never parsed as markup."""
    return Text(term(value), style=style)
