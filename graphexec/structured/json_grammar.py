"""The EBNF a JSON schema compiles from: xgrammar's, with every string character JSON-legal.

xgrammar 0.1.34 writes strings that carry maxLength/minLength with the character class
`[^"\\\r\n]`, which lets raw control characters (U+0000-U+001F) through; JSON forbids them
unescaped, and strict parsers (Python's json.loads) reject such output.  Its unbounded strings
already exclude them, so the bounded ones get the same class.  Classes derived from a schema's
`pattern` are the pattern's business and stay as written.
"""

from __future__ import annotations

import xgrammar as xgr

_LAX_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def json_schema_ebnf(schema: str, *, strict: bool) -> str:
    """EBNF for a JSON value valid under `schema`, on one line (", " and ": " separators); with
    `strict`, objects carry no properties the schema does not name."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    return str(grammar).replace(_LAX_STRING_CHAR, _JSON_STRING_CHAR)
