"""One owner per state: only ``ocache/slots.py`` (the slot table's verbs, its slot calls and its
reconcile with ``GET /slots``) writes a ``SlotState``. Everyone else asks the table
(``SlotTable.assign``/``finish``/``interrupted``/``mark_origin``/``mark_head``/``adopt``/
``mark_unknown``/``forget``). An AST scan of every module under ``ocache/``, no server."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from ocache.slots import SlotState

ROOT = Path(__file__).resolve().parents[1] / "ocache"
FIELDS = frozenset(f.name for f in dataclasses.fields(SlotState))
#: SlotState's own mutators (called on a state they change it)
MUTATORS = frozenset({"clear", "unknown", "hold", "reconcile"})


def _terminal(node: ast.AST) -> str | None:
    """``table`` for ``table``, ``self.table``, ``x.y.table``; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_table(node: ast.AST) -> bool:
    """An expression naming a slot table or its list of states (``table``, ``self.table``,
    ``self.table.slots``, ``snap``/``snapshot`` lists)."""
    t = _terminal(node)
    return t is not None and ("table" in t.lower() or t in ("slots", "snap", "snapshot"))


def _is_states(node: ast.AST) -> bool:
    """An iterable of slot states: ``X.slots``, ``X.snapshot()``, ``list(...)`` of either."""
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute) and node.func.attr == "snapshot":
            return True
        if isinstance(node.func, ast.Name) and node.func.id in ("list", "sorted", "tuple") and node.args:
            return _is_states(node.args[0])
        return False
    return isinstance(node, ast.Attribute) and node.attr == "slots"


class _Scan(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.found: list[str] = []
        self.names: list[set[str]] = [set()]

    def _state(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.names[-1]
        if isinstance(node, ast.Subscript):
            return _is_table(node.value) or _is_states(node.value)
        return False

    def _fn(self, node: ast.AST) -> None:
        names: set[str] = set()
        args = node.args  # type: ignore[attr-defined]
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            ann = ast.unparse(a.annotation) if a.annotation is not None else ""
            if "SlotState" in ann:
                names.add(a.arg)
        self.names.append(names)
        self.generic_visit(node)
        self.names.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _fn  # type: ignore[assignment]

    def _bind(self, target: ast.AST, value: ast.AST | None) -> None:
        if isinstance(target, ast.Name) and value is not None and self._state(value):
            self.names[-1].add(target.id)

    def _check_target(self, t: ast.AST, line: int) -> None:
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                self._check_target(e, line)
        elif isinstance(t, ast.Attribute) and t.attr in FIELDS and self._state(t.value):
            self.found.append(f"{self.path}:{line}: {ast.unparse(t)} =")

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._check_target(t, node.lineno)
            self._bind(t, node.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_target(node.target, node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check_target(node.target, node.lineno)
        if "SlotState" in ast.unparse(node.annotation) and isinstance(node.target, ast.Name):
            self.names[-1].add(node.target.id)
        self._bind(node.target, node.value)
        self.generic_visit(node)

    def _for(self, node: ast.AST) -> None:
        if isinstance(node.target, ast.Name) and _is_states(node.iter):  # type: ignore[attr-defined]
            self.names[-1].add(node.target.id)  # type: ignore[attr-defined]
        self.generic_visit(node)

    visit_For = visit_AsyncFor = _for  # type: ignore[assignment]

    def visit_comprehension(self, node: ast.comprehension) -> None:
        if isinstance(node.target, ast.Name) and _is_states(node.iter):
            self.names[-1].add(node.target.id)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in MUTATORS and self._state(f.value):
            self.found.append(f"{self.path}:{node.lineno}: {ast.unparse(f)}()")
        if (isinstance(f, ast.Name) and f.id == "setattr" or ast.unparse(f) == "object.__setattr__") \
                and node.args and self._state(node.args[0]):
            self.found.append(f"{self.path}:{node.lineno}: {ast.unparse(node)}")
        self.generic_visit(node)


def scan(source: str, path: str = "<src>") -> list[str]:
    s = _Scan(path)
    s.visit(ast.parse(source))
    return s.found


def test_the_scan_finds_each_kind_of_write():
    src = '''
def a(self, slot):
    st = self.table[slot]
    st.owner = "x"
    st.n_total, st.pending = None, True
def b(table, slot):
    table[slot].unknown(None)
    table[slot].seq += 1
def c(self):
    for s in self.table.slots:
        s.kind = "head"
def d(st: SlotState):
    st.clear()
def e(self):
    for s in list(self.table.slots):
        setattr(s, "owner", None)
'''
    assert len(scan(src)) == 8, scan(src)   # a: 3, b: 2, c, d, e: 1 each
    # reads, other objects' fields, the table's own verbs: not writes of a slot state
    ok = '''
def f(self, slot, rec):
    st = self.table[slot]
    n = st.n_total
    rec.tokens = list(st.tokens)
    self.tokens = []
    self.table.assign(slot, st.tokens, owner=st.owner)
    self._lines.clear()
    for s in self.table.slots:
        self.table.mark_unknown(s.id, s.n_total)
'''
    assert scan(ok) == []


def test_only_the_slot_table_writes_slot_state():
    found: list[str] = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        if rel == "ocache/slots.py":
            continue
        found += scan(path.read_text(), rel)
    assert found == [], "SlotState written outside ocache/slots.py:\n" + "\n".join(found)
