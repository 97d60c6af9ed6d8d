"""The Anthropic Messages and OpenAI Responses bodies in llama-server's chat-completions form.

llama-server serves ``POST /v1/messages`` (Claude Code) and ``POST /v1/responses`` (Codex CLI) by
converting the body to a chat-completions body and then running the same
``oaicompat_chat_params_parse`` + template as ``/v1/chat/completions``
(tools/server/server-context.cpp:4968-4984 and 5018-5034 of the pinned source, src-832db069, unpatched). The
token view of such a request is therefore: this module's conversion, then the usual
``/apply-template`` + ``/tokenize`` (``ocache.tokens``). The conversions are faithful ports of the
server's own functions, field for field and in the same key order (the template renders tools
with ``tojson``, so key order is part of the prompt):

* ``anthropic_to_chat``: ``server_chat_convert_anthropic_to_oai``, tools/server/server-chat.cpp:348-619;
* ``responses_to_chat``: ``server_chat_convert_responses_to_chatcmpl``, tools/server/server-chat.cpp:6-306.

What they imply (and the tests check against the server's own ``/v1/messages/count_tokens`` and
``/v1/responses/input_tokens``, tests/test_convert.py):

* the rendered prompt never contains Anthropic ``metadata`` (it becomes ``__metadata_user_id``,
  server-chat.cpp:609-616, which nothing renders), ``cache_control`` markers, ``thinking``,
  ``context_management``; nor Responses item ids, ``prompt_cache_key``, ``client_metadata``,
  ``store``, ``include``;
* the Anthropic ``system`` blocks are concatenated *without* a separator (server-chat.cpp:361-366),
  each block first passed through the ``cch=`` clean-up of the billing header (server-chat.cpp:326-346);
* the Responses converter keeps only ``type: function`` tools (server-chat.cpp:271-276: Codex's
  ``namespace`` and ``web_search`` tools are dropped) and adds ``"strict": true`` when absent;
* the Anthropic converter builds a new body with a fixed list of fields (server-chat.cpp:592-597):
  ``id_slot`` is **not** carried, so the stock server ignores a slot pin on ``/v1/messages``
  (patches/0003-anthropic-id-slot.patch carries it); the Responses converter copies the whole body
  (server-chat.cpp:15), ``id_slot`` included.

A body the server would reject (a missing ``messages``/``input``, an unknown item type, ...)
raises ``ConversionError`` with the server's own message; the proxy then forwards it untouched and
the server answers with its error.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, MutableMapping
from typing import Any

#: Routes whose body is an Anthropic Messages request (tools/server/server.cpp:268).
ANTHROPIC_ROUTES = frozenset({"/v1/messages"})
#: Routes whose body is an OpenAI Responses request (tools/server/server.cpp:264-265).
RESPONSES_ROUTES = frozenset({"/v1/responses", "/responses"})
CONVERTED_ROUTES = ANTHROPIC_ROUTES | RESPONSES_ROUTES

_BILLING = b"x-anthropic-billing-header:"


class ConversionError(ValueError):
    """The server would reject this body (its converter throws); ``str()`` is the server's message."""


def _dump(obj: Any) -> str:
    """``nlohmann::ordered_json::dump()``: compact, key order kept, UTF-8 not escaped."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _value(obj: Any, key: str, default: Any) -> Any:
    """``json_value(obj, key, default)`` (tools/server/server-common.h:42-56): the value when present,
    not null and of the default's type, else the default (a wrong type is only a warning there)."""
    if not isinstance(obj, Mapping) or key not in obj or obj[key] is None:
        return default
    v = obj[key]
    if default is None:  # json(): any type
        return v
    if isinstance(default, bool):
        return v if isinstance(v, bool) else default
    if isinstance(default, int):
        return v if isinstance(v, int) and not isinstance(v, bool) else default
    if isinstance(default, str):
        return v if isinstance(v, str) else default
    if isinstance(default, dict):
        return v if isinstance(v, dict) else default
    return v


# --------------------------------------------------------------------------------------------------
# Anthropic Messages -> chat completions
# --------------------------------------------------------------------------------------------------

def normalize_billing_header(text: str) -> str:
    """``normalize_anthropic_billing_header`` (server-chat.cpp:326-346): in a system text that starts
    with ``x-anthropic-billing-header:``, the 5 characters after the first ``cch=`` become ``fffff``
    when a ``;`` follows them. Claude Code 2.1.328 sends no ``cch=`` (shared/fixtures README), so its
    ``cc_version=…<3 hex>`` suffix passes unchanged. Works on UTF-8 bytes as the C++ does."""
    raw = text.encode("utf-8")
    if not raw.startswith(_BILLING):
        return text
    i = raw.find(b"cch=", len(_BILLING))
    if i < 0:
        return text
    j = i + 4
    if j + 5 < len(raw) and raw[j + 5:j + 6] == b";":
        raw = raw[:j] + b"fffff" + raw[j + 5:]
        return raw.decode("utf-8", "replace")
    return text


def anthropic_to_chat(body: Mapping) -> dict:
    """The chat-completions body llama-server builds from an Anthropic Messages ``body``
    (``server_chat_convert_anthropic_to_oai``, server-chat.cpp:348-619). Raises ConversionError
    when ``messages`` is missing (server-chat.cpp:377-379)."""
    if not isinstance(body, Mapping):
        raise ConversionError("body must be a JSON object")
    oai: dict[str, Any] = {}
    messages: list[Any] = []
    system = _value(body, "system", None)
    if system is not None:  # server-chat.cpp:353-373
        messages.append({"role": "system", "content": _anthropic_system(system)})
    if "messages" not in body:
        raise ConversionError("'messages' is required")
    msgs = body["messages"]
    if isinstance(msgs, list):
        for msg in msgs:  # server-chat.cpp:381-545
            messages.extend(_anthropic_message(msg))
    oai["messages"] = messages
    tools = body.get("tools")
    if "tools" in body and isinstance(tools, list):  # server-chat.cpp:548-565
        oai["tools"] = [{"type": "function", "function": {
            "name": _value(t, "name", ""), "description": _value(t, "description", ""),
            "parameters": copy.deepcopy(t["input_schema"]) if isinstance(t, Mapping) and "input_schema" in t else {}}}
            for t in tools]
    if "tool_choice" in body:  # server-chat.cpp:567-578
        tc = body["tool_choice"]
        if isinstance(tc, Mapping):
            ttype = _value(tc, "type", "")
            if ttype == "auto":
                oai["tool_choice"] = "auto"
            elif ttype in ("any", "tool"):
                oai["tool_choice"] = "required"
    if "stop_sequences" in body:
        oai["stop"] = copy.deepcopy(body["stop_sequences"])
    oai["max_tokens"] = copy.deepcopy(body["max_tokens"]) if "max_tokens" in body else 4096
    for key in ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs"):  # :592-597
        if key in body:
            oai[key] = copy.deepcopy(body[key])
    if "thinking" in body:  # server-chat.cpp:599-607
        thinking = _value(body, "thinking", {})
        if _value(thinking, "type", "") == "enabled":
            oai["thinking_budget_tokens"] = _value(thinking, "budget_tokens", 10000)
    if "metadata" in body:  # server-chat.cpp:609-616
        uid = _value(_value(body, "metadata", {}), "user_id", "")
        if uid:
            oai["__metadata_user_id"] = uid
    return oai


def _anthropic_system(system: Any) -> str:
    """The system message's content (server-chat.cpp:353-373): a string, or the text blocks of a
    list concatenated without a separator, each through :func:`normalize_billing_header`."""
    if isinstance(system, str):
        return normalize_billing_header(system)
    content = ""
    if isinstance(system, list):
        for block in system:
            if _value(block, "type", "") == "text":
                content += normalize_billing_header(_value(block, "text", ""))
    return content


def _image_part(source: Any) -> dict | None:
    """An Anthropic image ``source`` as a chat ``image_url`` part (a ``data:`` URL for base64), None
    for another source type (skipped, server-chat.cpp:418-436)."""
    stype = _value(source, "type", "")
    if stype == "base64":
        url = "data:" + _value(source, "media_type", "image/jpeg") + ";base64," + _value(source, "data", "")
        return {"type": "image_url", "image_url": {"url": url}}
    if stype == "url":
        return {"type": "image_url", "image_url": {"url": _value(source, "url", "")}}
    return None


def _anthropic_message(msg: Any) -> list[Any]:
    """The chat messages one Anthropic message becomes (server-chat.cpp:381-545): none (an assistant
    message without content), the message as it is (no content list), or the converted message
    (text and image parts, ``tool_calls``, ``reasoning_content``) followed by one ``tool`` message
    per ``tool_result`` block."""
    role = _value(msg, "role", "")
    if not isinstance(msg, Mapping) or "content" not in msg:
        return [] if role == "assistant" else [copy.deepcopy(msg)]
    content = msg["content"]
    if not isinstance(content, list):  # a string, or anything else: as is
        return [copy.deepcopy(msg)]
    tool_calls: list = []
    converted: list = []
    tool_results: list = []
    reasoning = ""
    for block in content:
        btype = _value(block, "type", "")
        if btype == "text":
            converted.append(copy.deepcopy(block))
        elif btype == "thinking":
            reasoning += _value(block, "thinking", "")
        elif btype == "image":
            part = _image_part(_value(block, "source", {}))
            if part is not None:
                converted.append(part)
        elif btype == "tool_use":
            tool_calls.append({"id": _value(block, "id", ""), "type": "function",
                               "function": {"name": _value(block, "name", ""),
                                            "arguments": _dump(_value(block, "input", {}))}})
        elif btype == "tool_result":
            tool_results.append(_anthropic_tool_result(block))
    out: list[Any] = []
    if converted or tool_calls or reasoning:  # server-chat.cpp:527-540
        new_msg: dict[str, Any] = {"role": role, "content": converted if converted else ""}
        if tool_calls:
            new_msg["tool_calls"] = tool_calls
        if reasoning:
            new_msg["reasoning_content"] = reasoning
        out.append(new_msg)
    return out + tool_results  # after the message's own text: server-chat.cpp:542-544


def _anthropic_tool_result(block: Any) -> dict:
    """A ``tool_result`` block as a ``tool`` message (server-chat.cpp:455-525): a string content as
    it is; a list as its texts concatenated, or as text and image parts when it holds an image;
    anything else as ``""``."""
    tid = _value(block, "tool_use_id", "")
    rc = _value(block, "content", None)
    if isinstance(rc, str):
        return {"role": "tool", "tool_call_id": tid, "content": rc}
    if not isinstance(rc, list):
        return {"role": "tool", "tool_call_id": tid, "content": ""}
    text, parts, has_images = "", [], False  # server-chat.cpp:467-522
    for c in rc:
        ctype = _value(c, "type", "")
        if ctype == "text":
            t = _value(c, "text", "")
            text += t
            parts.append({"type": "text", "text": t})
        elif ctype == "image":
            has_images = True
            part = _image_part(_value(c, "source", {}))
            if part is not None:
                parts.append(part)
    return {"role": "tool", "tool_call_id": tid, "content": parts if has_images else text}


# --------------------------------------------------------------------------------------------------
# OpenAI Responses -> chat completions
# --------------------------------------------------------------------------------------------------

def _is_str(item: Any, key: str) -> bool:
    return isinstance(item, Mapping) and isinstance(item.get(key), str)


def _is_list(item: Any, key: str) -> bool:
    return isinstance(item, Mapping) and isinstance(item.get(key), list)


def responses_to_chat(body: Mapping) -> dict:
    """The chat-completions body llama-server builds from a Responses ``body``
    (``server_chat_convert_responses_to_chatcmpl``, server-chat.cpp:6-306); every other field of
    the body (``id_slot`` too) is kept. Raises ConversionError where the server throws."""
    if not isinstance(body, Mapping):
        raise ConversionError("body must be a JSON object")
    if "input" not in body:
        raise ConversionError("'input' is required")
    if _value(body, "previous_response_id", ""):
        raise ConversionError("llama.cpp does not support 'previous_response_id'.")
    inp = body["input"]
    out = {k: copy.deepcopy(v) for k, v in body.items() if k != "input"}
    msgs: list[dict] = []
    if "instructions" in body:
        msgs.append({"role": "system", "content": _value(body, "instructions", "")})
        out.pop("instructions", None)
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for item in inp:  # server-chat.cpp:43-264
            _responses_item(msgs, copy.deepcopy(item))
    else:
        raise ConversionError("'input' must be a string or array of objects")
    out["messages"] = msgs
    if "tools" in body:  # server-chat.cpp:268-292
        if not isinstance(body["tools"], list):
            raise ConversionError("'tools' must be an array of objects")
        tools = []
        for tool in body["tools"]:
            tool = copy.deepcopy(tool)
            if _value(tool, "type", "") != "function":
                continue  # "unsupported Responses tool type skipped" (namespace, web_search, ...)
            tool.pop("type", None)
            if "strict" not in tool:
                tool["strict"] = True
            tools.append({"type": "function", "function": tool})
        out.pop("tools", None)
        if tools:
            out["tools"] = tools
    if "max_output_tokens" in body:
        out.pop("max_output_tokens", None)
        out["max_tokens"] = copy.deepcopy(body["max_output_tokens"])
    if "reasoning" in body:  # server-chat.cpp:299-306: only "effort"
        reasoning = body["reasoning"]
        if isinstance(reasoning, Mapping) and "effort" in reasoning:
            out["reasoning_effort"] = copy.deepcopy(reasoning["effort"])
        out.pop("reasoning", None)
    return out


def _responses_item(msgs: list[dict], item: Any) -> None:
    """Append what one ``input`` item (a copy, changed in place) becomes to ``msgs``
    (server-chat.cpp:43-264): a user/system/developer message, an assistant message, a function
    call or a reasoning item (merged into the previous assistant turn when there is one), or a
    ``tool`` message. Raises ConversionError for an item the server cannot type."""
    merge_prev = bool(msgs) and msgs[-1].get("role", "") == "assistant"
    if _is_str(item, "content"):
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    if _is_list(item, "content") and _is_str(item, "role") and item["role"] in ("user", "system", "developer"):
        parts = _input_parts(item["content"])
        item.pop("type", None)
        item.pop("status", None)
        item["content"] = parts
        msgs.append(item)
    elif _is_str(item, "role") and item["role"] == "assistant" and _is_str(item, "type") \
            and item["type"] == "message":
        parts = _output_parts(item)
        if merge_prev:  # server-chat.cpp:150-157 (appends to the previous assistant turn)
            prev = msgs[-1]
            if not isinstance(prev.get("content"), list):
                prev["content"] = []
            prev["content"].extend(parts)
        else:
            item.pop("status", None)
            item.pop("type", None)
            item["content"] = parts
            msgs.append(item)
    elif (_is_str(item, "arguments") and _is_str(item, "call_id") and _is_str(item, "name")
          and _is_str(item, "type") and item["type"] == "function_call"):
        call = {"function": {"arguments": item["arguments"], "name": item["name"]},
                "id": item["call_id"], "type": "function"}
        if merge_prev:
            prev = msgs[-1]
            if not isinstance(prev.get("tool_calls"), list):
                prev["tool_calls"] = []
            prev["tool_calls"].append(call)
        else:
            msgs.append({"role": "assistant", "tool_calls": [call]})
    elif (_is_str(item, "call_id") and (_is_str(item, "output") or _is_list(item, "output"))
          and _is_str(item, "type") and item["type"] == "function_call_output"):
        output = item["output"] if isinstance(item["output"], str) else _tool_outputs(item["output"])
        msgs.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})
    elif _is_list(item, "summary") and _is_str(item, "type") and item["type"] == "reasoning":
        text = _reasoning_text(item)
        if merge_prev:
            msgs[-1]["reasoning_content"] = text
        else:
            msgs.append({"role": "assistant", "content": [], "reasoning_content": text})
    else:
        raise ConversionError("Cannot determine type of 'item'")


def _input_parts(content: list) -> list[dict]:
    """The content parts of a user/system/developer item: ``input_text`` -> text, ``input_image``
    -> ``image_url``; ConversionError for ``input_file`` and any other type."""
    parts = []
    for part in content:
        ptype = _value(part, "type", "")
        if ptype == "input_text":
            if not isinstance(part, Mapping) or "text" not in part:
                raise ConversionError("'Input text' requires 'text'")
            parts.append({"text": part["text"], "type": "text"})
        elif ptype == "input_image":
            if "image_url" not in part:
                raise ConversionError("'image_url' is required")
            parts.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
        elif ptype == "input_file":
            raise ConversionError("'input_file' is not supported by llamacpp at this moment")
        else:
            raise ConversionError("'type' must be one of 'input_text', 'input_image', or 'input_file'")
    return parts


def _output_parts(item: Mapping) -> list[dict]:
    """The content parts of an assistant ``message`` item: a string as one text part;
    ``output_text``/``input_text`` -> text, ``refusal`` kept; ConversionError for another type."""
    parts = []
    if isinstance(item.get("content"), str):
        parts.append({"text": item["content"], "type": "text"})
    elif _is_list(item, "content"):
        for part in item["content"]:
            ptype = _value(part, "type", "")
            if ptype in ("output_text", "input_text"):
                if not _is_str(part, "text"):
                    raise ConversionError("'Output text' requires 'text'")
                parts.append({"text": part["text"], "type": "text"})
            elif ptype == "refusal":
                if not _is_str(part, "refusal"):
                    raise ConversionError("'Refusal' requires 'refusal'")
                parts.append({"refusal": part["refusal"], "type": "refusal"})
            else:
                raise ConversionError("'type' must be one of 'output_text' or 'refusal'")
    return parts


def _tool_outputs(outs: list) -> list:
    """A ``function_call_output``'s list output, its parts retyped in place: ``input_text`` ->
    ``text``, ``input_image`` -> ``image_url``; ConversionError for a part without or of another
    type."""
    for o in outs:
        if not isinstance(o, MutableMapping) or "type" not in o:   # a JSON object (a dict)
            raise ConversionError("Output of tool call missing 'type' field")
        if o["type"] not in ("input_text", "input_image"):
            raise ConversionError("Output of tool call should be 'Input text' or 'Input image'")
        if o["type"] == "input_text":
            o["type"] = "text"
        else:
            if "image_url" not in o:
                raise ConversionError("'image_url' is required")
            o["type"] = "image_url"
            o["image_url"] = {"url": o["image_url"]}
    return outs


def _reasoning_text(item: Mapping) -> str:
    """The text of a ``reasoning`` item: its first ``content`` part's ``text``; ConversionError when
    ``content`` is not a non-empty list starting with a text."""
    if not _is_list(item, "content"):
        raise ConversionError("item['content'] is not an array")
    if not item["content"]:
        raise ConversionError("item['content'] is empty")
    if not _is_str(item["content"][0], "text"):
        raise ConversionError("item['content']['text'] is not a string")
    return item["content"][0]["text"]


def to_chat(path: str, body: Mapping) -> dict:
    """The chat-completions body the server renders for a request to ``path`` (a
    ``CONVERTED_ROUTES`` path). Raises ConversionError (server would reject) or ValueError (route)."""
    if path in ANTHROPIC_ROUTES:
        return anthropic_to_chat(body)
    if path in RESPONSES_ROUTES:
        return responses_to_chat(body)
    raise ValueError(f"not a converted route: {path}")


def timings_from_usage(usage: Mapping | None) -> dict | None:
    """``timings``-shaped ``{"cache_n", "prompt_n"[, "predicted_n"]}`` (tokens) from the ``usage``
    of an answer that carries no ``timings``: an Anthropic answer (``cache_read_input_tokens`` is
    the server's ``n_prompt_tokens_cache``, ``input_tokens`` the prompt tokens minus those,
    tools/server/server-task.cpp:787-790 final, 1343-1346 ``message_start``) or a non-streamed
    OpenAI Responses answer (``input_tokens`` is all prompt tokens and
    ``input_tokens_details.cached_tokens`` the reused ones, server-task.cpp:587-592). ``output_tokens``
    -> ``predicted_n``. None when ``usage`` has neither shape."""
    if not isinstance(usage, Mapping):
        return None
    i = usage.get("input_tokens")
    details = usage.get("input_tokens_details")
    if isinstance(details, Mapping) and isinstance(details.get("cached_tokens"), int) and isinstance(i, int):
        c = details["cached_tokens"]
        out = {"cache_n": c, "prompt_n": max(0, i - c)}
    else:
        c = usage.get("cache_read_input_tokens")
        if not isinstance(c, int) or not isinstance(i, int):
            return None
        out = {"cache_n": c, "prompt_n": i}
    if isinstance(usage.get("output_tokens"), int):
        out["predicted_n"] = usage["output_tokens"]
    return out
