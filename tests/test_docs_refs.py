"""Every code name the docs give exists (README.md, docs/*.md, patches/README.md). No server needed.

A backticked span in those files (fenced code blocks left out) is checked when it reads as one of:

- a path in the repository: ``ocache/cache/align_route.py``, ``patches/0009-...patch``,
  ``scripts/test``, ``tests/fakes.py`` (a trailing ``:LINE`` or ``:A-B`` is dropped; a ``*`` globs),
  or a bare ``name.py`` (some file of that name under ocache/, scripts/ or tests/);
- a dotted name in the package: ``ocache.align.decide``, ``ocache.slots.SlotTable.warm`` (the
  longest importable module, then ``getattr`` down the rest; an instance attribute of a class is
  found in its source, as below);
- ``Class.member``: ``SlotTable.lease``, ``Attempts._plan_again`` (a class of that name defined in
  ``ocache/`` whose body, or a base's, defines the member: a method, a class-level name or
  annotation, or a ``self.member =`` in one of its methods);
- ``module.member`` for a module of ``ocache/`` named by its last part (``router.cost_s``), except
  the roots that name stats or response fields rather than modules (``layer.align`` is the
  ``layer`` object of ``GET /v1/cache/stats``, ``tokens.cache_n`` a response's field);
- a config key: ``tiers.resident.align``, ``store.remote.url``, ``response_cache.ttl_s`` (the keys
  ``ocache serve --help-config`` lists: ``ocache.config.FIELDS``, ``TIER_KEYS``, the
  ``tiers.resident.<ServerParams field>`` flags, ``STORE_REMOTE_KEYS``, ``RESPONSE_CACHE_KEYS``).

Anything else (JSON fields, llama.cpp's own names, shell) is not a reference to this repository.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "patches" / "README.md"]

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"(?:ocache|docs|patches|scripts|tests|scenarios)/[\w.*/-]*")
BARE_PY = re.compile(r"\w+\.py")
PATCH = re.compile(r"\d{4}-[\w-]+\.patch")
#: a file name of another kind (``ocache.yaml``, llama.cpp's ``server.cpp``, ``X.ckpt``): not Python
OTHER_FILE = re.compile(r"[\w.-]+\.(?:yaml|yml|json|jsonl|txt|cpp|h|hpp|c|ckpt|md|gguf|log|toml|sh|bin)")
DOTTED = re.compile(r"ocache(?:\.\w+)+")
CLASS_MEMBER = re.compile(r"[A-Z]\w*(?:\.\w+)+")
MODULE_MEMBER = re.compile(r"[a-z_]\w*\.\w+")
CONFIG = re.compile(r"(?:tiers|store|response_cache)\.[\w.<>]+")

#: ``ocache.*`` names that are fields of the patched llama-server's JSON, not Python (patches/README.md)
SERVER_FIELDS = {"ocache.launch", "ocache.restore_xxh3", "ocache.generated_ids", "ocache.anthropic_id_slot",
                 "ocache.if_boot", "ocache.splice"}
#: first parts of ``a.b`` that name a stats object or a response field, not a module
FIELD_ROOTS = {"layer", "tokens"}


def spans(text: str) -> list[str]:
    """The backticked spans of ``text`` outside fenced code blocks, each with a trailing ``()``,
    ``(args)``, ``: value`` (a config example) or ``:LINE`` dropped."""
    out = []
    for raw in SPAN.findall(FENCE.sub("", text)):
        s = raw.strip()
        s = re.sub(r"\(.*\)$", "", s)
        s = re.sub(r":(\s.*|\d[\d,-]*)$", "", s)
        out.append(s)
    return out


def references() -> list[tuple[str, str]]:
    """(doc file relative to the repository, span) for every span of every doc file, unique."""
    seen: dict[tuple[str, str], None] = {}
    for doc in DOCS:
        for s in spans(doc.read_text()):
            seen[(str(doc.relative_to(ROOT)), s)] = None
    return list(seen)


# --- the package's classes, read from source ------------------------------------------------------

@cache
def class_index() -> dict[str, list[tuple[set[str], list[str]]]]:
    """Class name -> (members its body defines, its base names) per class of that name in ocache/."""
    index: dict[str, list[tuple[set[str], list[str]]]] = {}
    for path in sorted((ROOT / "ocache").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                index.setdefault(node.name, []).append((_members(node), [_base_name(b) for b in node.bases]))
    return index


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript):   # Generic[T], Protocol[T]
        node = node.value
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _members(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
    for node in ast.walk(cls):   # self.X = ..., self.X: T = ..., self.X += ...
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    names.add(el.attr)
    return names


def class_has(name: str, member: str, _seen: frozenset[str] = frozenset()) -> bool:
    """Whether a class ``name`` of ocache/ (or one of its bases there) defines ``member``."""
    if name in _seen:
        return False
    for members, bases in class_index().get(name, []):
        if member in members or any(class_has(b, member, _seen | {name}) for b in bases):
            return True
    return False


# --- the checks -----------------------------------------------------------------------------------

def check_path(s: str) -> str | None:
    if "*" in s:
        return None if any(ROOT.glob(s)) else "matches no file"
    if re.fullmatch(r"patches/\d{4}", s):   # a patch by its number
        return None if any(ROOT.glob(s + "-*.patch")) else "no patch of that number"
    return None if (ROOT / s.rstrip("/")).exists() else "no such file or folder"


def check_bare_py(s: str) -> str | None:
    for folder in ("ocache", "scripts", "tests"):
        if any((ROOT / folder).rglob(s)):
            return None
    return "no file of that name under ocache/, scripts/ or tests/"


def check_dotted(s: str) -> str | None:
    if s in SERVER_FIELDS:
        return None
    parts = s.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:], start=cut):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, type) and i == len(parts) - 1 and class_has(obj.__name__, attr):
                return None   # an instance attribute
            else:
                return f"{'.'.join(parts[:i])} has no {attr!r}"
        return None
    return "no such module"


def check_class_member(s: str) -> str | None:
    cls, member = s.split(".")[:2]
    if cls not in class_index():
        return f"no class {cls} in ocache/"
    return None if class_has(cls, member) else f"class {cls} has no {member!r}"


@cache
def module_basenames() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in (ROOT / "ocache").rglob("*.py"):
        if path.stem != "__init__":
            mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out.setdefault(path.stem, []).append(mod)
    return out


def check_module_member(s: str) -> str | None:
    mod, member = s.split(".")[:2]
    for name in module_basenames()[mod]:
        if hasattr(importlib.import_module(name), member):
            return None
    return f"no module {mod} of ocache/ defines {member!r}"


@cache
def config_keys() -> set[str]:
    from ocache import config
    from ocache.llama.flags import ServerParams

    keys = set(config.FIELDS)
    for tier, names in config.TIER_KEYS.items():
        keys |= {f"tiers.{tier}", *(f"tiers.{tier}.{k}" for k in names)}
    keys |= {f"tiers.resident.{f}" for f in ServerParams.__dataclass_fields__}
    keys |= {"tiers.<name>", "tiers.resident.<ServerParams.field>", "store.remote",
             *(f"store.remote.{k}" for k in config.STORE_REMOTE_KEYS),
             *(f"response_cache.{k}" for k in config.RESPONSE_CACHE_KEYS)}
    return keys


def check_config(s: str) -> str | None:
    return None if s in config_keys() else "not a config key (ocache serve --help-config)"


def check(s: str) -> str | None:
    """Why ``s`` names nothing that exists, None when it does or is not a reference."""
    if PATH.fullmatch(s):
        return check_path(s)
    if BARE_PY.fullmatch(s):
        return check_bare_py(s)
    if PATCH.fullmatch(s):
        return None if (ROOT / "patches" / s).exists() else "no such file in patches/"
    if OTHER_FILE.fullmatch(s):
        return None
    if DOTTED.fullmatch(s):
        return check_dotted(s)
    if CONFIG.fullmatch(s):
        return check_config(s)
    if CLASS_MEMBER.fullmatch(s):
        return check_class_member(s)
    if MODULE_MEMBER.fullmatch(s) and s.split(".")[0] in module_basenames() \
            and s.split(".")[0] not in FIELD_ROOTS:
        return check_module_member(s)
    return None


def test_every_named_reference_exists() -> None:
    stale = [f"{doc}: `{s}`: {why}" for doc, s in references() if (why := check(s)) is not None]
    assert not stale, "stale references in the docs:\n" + "\n".join(stale)


def test_the_check_sees_each_kind() -> None:
    """The parser finds references of every kind in the docs (a regex that stopped matching would
    pass the test above on nothing)."""
    spans_ = {s for _, s in references()}
    for kind in (PATH, BARE_PY, DOTTED, CLASS_MEMBER, CONFIG):
        assert any(kind.fullmatch(s) for s in spans_), kind.pattern


def test_a_renamed_method_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method the docs name (``SlotTable.lease``), renamed in the source the check reads, fails."""
    assert check("SlotTable.lease") is None and check("ocache.slots.SlotTable.lease") is None
    from ocache.slots import SlotTable

    owner = next(c for c in SlotTable.__mro__ if "lease" in vars(c))   # defined in a base
    source = (ROOT / "ocache" / "slots.py").read_text()
    renamed = source.replace("def lease(", "def lease_slot(")
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text",
                        lambda self, *a, **k: renamed if self.name == "slots.py" else real_read(self, *a, **k))
    monkeypatch.delattr(owner, "lease")
    class_index.cache_clear()
    try:
        assert check("SlotTable.lease") == "class SlotTable has no 'lease'"
        assert check("ocache.slots.SlotTable.lease") == "ocache.slots.SlotTable has no 'lease'"
    finally:
        class_index.cache_clear()


def test_a_missing_path_and_key_are_caught() -> None:
    assert check("ocache/cache.py") == "no such file or folder"
    assert check("tiers.resident.aligned") is not None
    assert check("ocache.align.no_such_function") is not None
