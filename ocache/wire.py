"""The bytes of a forwarded request and answer: which headers cross the proxy hop, and which
request bodies ocache may re-encode (``parse_body``) and how a plan's fields enter them
(``with_fields``). Pure functions, no I/O (the proxy, ``ocache/proxy.py``, applies them)."""

from __future__ import annotations

import json
import re
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

#: a header collection as aiohttp hands it over (a request's or a client response's headers)
Headers = CIMultiDict[str] | CIMultiDictProxy[str]

#: RFC 9110 §7.6.1 hop-by-hop fields (plus the non-standard Proxy-Connection); ``Proxy-*`` too.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade",
    "proxy-connection", "proxy-authenticate", "proxy-authorization",
})
#: Request headers not forwarded: hop-by-hop, plus those the upstream hop sets itself.
_REQ_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}
#: Response headers not copied: hop-by-hop, plus Content-Length (set by aiohttp for the body sent).
_RESP_DROP = HOP_BY_HOP | {"content-length"}
#: aiohttp client headers never added on its own: the client's own are forwarded instead.
SKIP_AUTO = frozenset({"User-Agent", "Accept", "Accept-Encoding", "Content-Type"})
#: A JSON escape of a UTF-16 surrogate: only a body with one can hold a lone surrogate.
_SURROGATE_ESC = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


class Unparseable(ValueError):
    """A request body ocache does not plan (it is forwarded byte for byte); the message says why."""


def parse_body(body: bytes) -> dict | None:
    """The JSON object of a completion body, or None for an empty body. Raises ``Unparseable``
    for anything ocache must not re-encode: bytes that are not UTF-8 (RFC 8259 §8.1 requires UTF-8
    between systems; Python's ``json.loads`` would silently accept UTF-16/32), a UTF-8 BOM, invalid
    JSON, nesting deeper than Python's recursion limit (``RecursionError``), a JSON value that is not
    an object, or a string with a lone surrogate (``"\\ud800"``: not encodable as UTF-8)."""
    if not body:
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unparseable(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise Unparseable("JSON nested too deeply for the cache layer") from None
    except ValueError as exc:
        raise Unparseable(f"not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise Unparseable(f"JSON {type(obj).__name__}, not an object")
    if _SURROGATE_ESC.search(body) and _has_lone_surrogate(obj):
        raise Unparseable("a string holds a lone UTF-16 surrogate")
    return obj


#: top-level body fields that steer which tokens llama-server serves: ``id_slot`` pins a slot
#: (tools/server/server-context.cpp reads it for every completion and a pinned slot keeps its
#: prompt cache), ``ocache_splice`` (patches/0008) serves a slot's first tokens in place of the
#: prompt's, ``ocache_generated`` (patches/0010) reports the sampled ids. Only a plan of ocache's
#: sets them: a client's own never reaches the server (:func:`with_fields` drops those a plan does
#: not set, :func:`unplanned_body` and :func:`other_body` all of them), since they would serve one
#: session another's slot (docs/usage.md "Substitutions").
STEERING: tuple[str, ...] = ("id_slot", "ocache_splice", "ocache_generated")
#: the steering fields dropped without a cache layer (``no_cache``): the patches' own
NULL_DROPS: tuple[str, ...] = ("ocache_splice", "ocache_generated")


def with_fields(raw: bytes, obj: dict, updates: dict, drop: tuple[str, ...] = STEERING) -> bytes:
    """The body ``raw`` (whose parsed object is ``obj``, ``parse_body``) with the top-level fields of
    ``updates`` added (``id_slot``) and the client's fields named in ``drop`` removed (every
    ``STEERING`` field; without a cache layer only ``ocache_splice``, llama-server's own
    ``id_slot`` then reaching it as without ocache). When ``obj`` holds neither they are spliced in after the opening brace: the client's bytes stay as
    sent and the cost does not grow with the prompt (re-encoding a 126k-token body took ~3 ms). A
    field the client set itself is replaced or removed by re-encoding the whole object (a duplicate
    key would leave the choice to the server's parser)."""
    if not updates and not any(k in obj for k in drop):
        return raw
    if any(k in obj for k in updates) or any(k in obj for k in drop):
        kept = {k: v for k, v in obj.items() if k not in drop}
        return json.dumps({**kept, **updates}, ensure_ascii=False, separators=(",", ":")).encode()
    i = raw.index(b"{") + 1      # parse_body accepted a JSON object (no BOM): "{" comes first
    fields = ",".join(json.dumps(k) + ":" + json.dumps(v, ensure_ascii=False, separators=(",", ":"))
                      for k, v in updates.items()).encode()
    sep = b"" if raw[i:].lstrip().startswith(b"}") else b","
    return raw[:i] + fields + sep + raw[i:]


#: bytes that can spell a ``STEERING`` key in a JSON text: the keys themselves, or a ``\\u``
#: escape of any ASCII character (``"\\u0069d_slot"``): a body ocache did not parse and holds
#: none of them cannot steer the server
_STEERING_SPELLING = re.compile(rb"id_slot|ocache_splice|ocache_generated|\\u00[0-7][0-9a-fA-F]")


def unplanned_body(raw: bytes, obj: dict | None, drop: tuple[str, ...] = STEERING) -> bytes | None:
    """The body to forward for a completion ocache did not plan (``raw`` as sent; ``obj``: its
    parsed object, None when ``parse_body`` refused it): ``raw`` when it cannot steer the server,
    ``raw`` re-encoded without its top-level ``STEERING`` fields when ``obj`` has one, and None
    (answer 400) when it may hold one and cannot be rewritten: an unparsed body (UTF-8 BOM, deep
    nesting: llama-server parses both, nlohmann's ``parse`` skips a BOM and has no depth limit, and
    would honour the field) whose bytes can spell a key, or an object too deep to encode again. A
    client's ``id_slot`` outside a plan would overwrite another session's live slot; its
    ``ocache_splice`` would serve another session's tokens."""
    if obj is None:
        return None if _STEERING_SPELLING.search(raw) else raw
    if not any(k in obj for k in drop):
        return raw
    try:
        return json.dumps({k: v for k, v in obj.items() if k not in drop}, ensure_ascii=False,
                          separators=(",", ":")).encode()
    except (RecursionError, ValueError):
        return None


def other_body(raw: bytes, drop: tuple[str, ...] = STEERING) -> bytes | None:
    """The body to forward for a POST to a route ocache does not plan (``/infill``, ``/embeddings``,
    ``/tokenize``, a route of a later llama-server): as :func:`unplanned_body`, the body parsed
    here only when its bytes can spell a steering key. llama-server runs a completion on more
    routes than ocache plans, each reading the same fields (tools/server/server-context.cpp:
    ``post_infill`` ends in ``handle_completions_impl``, where ``id_slot`` and the patches' fields
    are read), so a client's ``id_slot`` on ``/infill`` would run on another session's slot and its
    ``ocache_splice`` would ask that slot's tokens. Returns None (answer 400) as
    :func:`unplanned_body` does."""
    if not raw or not _STEERING_SPELLING.search(raw):
        return raw
    try:
        obj = parse_body(raw)
    except Unparseable:
        obj = None
    return unplanned_body(raw, obj, drop)


def _has_lone_surrogate(obj: Any) -> bool:
    """Whether any key or string value holds a surrogate code point (``json.loads`` joins valid
    pairs, so any that is left is lone). Iterative: no recursion limit."""
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _hop_names(headers: Headers) -> set[str]:
    """Hop-by-hop names: the fixed set plus every name listed in ``Connection``."""
    names = set(HOP_BY_HOP)
    for value in headers.getall("Connection", ()):
        names.update(t.strip().lower() for t in value.split(",") if t.strip())
    return names


def _end_to_end(headers: Headers, extra_drop: set[str] | frozenset[str]) -> CIMultiDict[str]:
    """``headers`` without hop-by-hop ones (RFC 9110 §7.6.1), ``Proxy-*`` and ``extra_drop``;
    multi-valued headers and their order kept."""
    drop = _hop_names(headers) | extra_drop
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk in drop or lk.startswith("proxy-"):
            continue
        out.add(k, v)
    return out


def forward_request_headers(headers: Headers) -> CIMultiDict[str]:
    """Client request headers to send upstream: end to end ones, but none named ``X-OCache-*``
    (ocache's own to the server, such as the aligned route's ``X-OCache-Splice``, are added by the
    plan after this; a client's own never pass)."""
    out = _end_to_end(headers, _REQ_DROP)
    for k in [k for k in out if k.lower().startswith("x-ocache-")]:
        out.popall(k, None)
    return out


def forward_response_headers(headers: Headers) -> CIMultiDict[str]:
    """Upstream response headers to send to the client."""
    return _end_to_end(headers, _RESP_DROP)


def host_name(host_header: str) -> str:
    """The name part of a Host header value, lower case (``[::1]:8081`` -> ``[::1]``)."""
    h = host_header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        return h[: end + 1] if end >= 0 else h
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    return h

