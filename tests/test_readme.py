"""The README stays short and every command it cites still works.

Checked without a server (about 30 s on the shared 2-core machine, most of it two subprocess steps):

* README.md is under ``MAX_LINES`` lines (the measurement log lives in docs/benchmarks.md);
* every ``ocache <subcommand> [--option ...]`` cited (in code spans and ``sh`` blocks) names a
  subcommand of ``ocache.cli.build_parser()`` and options that subcommand accepts;
* every ``scripts/NAME`` exists, and every ``--option`` given to a Python script is in its ``--help``;
* every ``pytest`` command cited (files, node ids, ``-k``, ``-m``) selects at least one test, by
  pytest's own ``-k`` / ``-m`` matching (``_pytest.mark``) over one ``--collect-only`` run in a
  subprocess (the suite's own session is left alone);
* every ``X-OCache-*`` header and ``/v1/cache/*``, ``/ocache/*`` route in ``ocache/`` is in the README;
* every relative link and ``#anchor`` resolves.

The command and link checks run over the README and every doc that carries commands
(``COMMAND_DOCS``), so each figure's command in docs/benchmarks.md keeps working too.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from ocache.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the README stays under this many lines
MAX_LINES = 300
#: the docs whose commands are checked like the README's (each figure's command must still run)
COMMAND_DOCS = ["README.md", "docs/benchmarks.md", "docs/testing.md", "docs/usage.md", "docs/architecture.md",
                "docs/decisions.md", "docs/llama-server.md"]

FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.M | re.S)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def command_texts(markdown: str) -> list[str]:
    """The shell text of a Markdown file: each code span, and each line of the ``sh``/``bash``/
    unlabelled fenced blocks (``\\`` continuations joined, ``#`` comments dropped); other fenced
    blocks (json, yaml, toml) are not commands."""
    out: list[str] = []
    prose = markdown
    for m in FENCE.finditer(markdown):
        prose = prose.replace(m.group(0), "\n")
        if m.group(1) not in ("", "sh", "bash"):
            continue
        for line in m.group(2).replace("\\\n", " ").splitlines():
            line = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())
            if line:
                out.append(line)
    for m in SPAN.finditer(prose):
        out.append(" ".join(m.group(2).split()))
    return out


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote in prose-like code: fall back to whitespace
        return text.split()


def _clean(token: str) -> str:
    return token.strip("[]()`,;")


def _commands(text: str, start: re.Pattern[str]) -> list[list[str]]:
    """Token lists of each command in ``text`` that ``start`` finds, up to a shell separator."""
    found = []
    for m in start.finditer(text):
        tokens = []
        for tok in _split(text[m.end():]):
            if tok in ("&", "&&", "||", ";", "|") or tok.startswith("#"):
                break
            if ")" in tok:  # the end of a ``$(...)``
                tokens += [tok.split(")")[0]] if tok.split(")")[0] else []
                break
            tokens.append(tok)
        found.append(tokens)
    return found


#: ``ocache X``, ``.venv/bin/ocache X``, ``python -m ocache X``; not ``from ocache import``
OCACHE = re.compile(r"(?:^|(?<=[\s(]))(?<!from )(?<!import )(?:\S*/)?ocache\s+(?=[a-z])")
PYTEST = re.compile(r"(?:^|(?<=[\s(]))(?:\S*/)?pytest(?=\s|$)")
SCRIPT = re.compile(r"(?:^|(?<=[\s(]))(?:\.venv/bin/python\s+)?(scripts/[a-z][\w-]*)")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def check_ocache(tokens: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Problems of one ``ocache ...`` command: an unknown subcommand (each ``a|b`` alternative is
    checked) or an option its parser does not take. Everything after ``--`` is llama-server's."""
    problems = []
    paths: list[tuple[str, argparse.ArgumentParser]] = [("ocache", parser)]
    for raw in tokens:
        tok = _clean(raw)
        if tok == "--" or raw == "...":
            break
        if tok.startswith("-"):
            opt = tok.split("=", 1)[0]
            for name, p in paths:
                if opt.startswith("--") and opt not in _options(p) and opt not in ("--help",):
                    problems.append(f"{name}: no option {opt}")
            continue
        subs = [(name, _subparsers(p)) for name, p in paths]
        if not any(subs_ for _, subs_ in subs):
            continue  # a positional argument or an option's value
        alternatives = [a for a in tok.split("|") if a]
        if not alternatives or not all(re.fullmatch(r"[a-z][a-z-]*", a) for a in alternatives):
            continue
        new_paths = []
        for name, subs_ in subs:
            for alt in alternatives if subs_ else ():
                if alt in subs_:
                    new_paths.append((f"{name} {alt}", subs_[alt]))
                else:
                    problems.append(f"{name}: no subcommand {alt!r}")
        if not new_paths:
            return problems  # nothing left to check the rest against
        paths = new_paths
    return problems


@dataclass(frozen=True)
class Selection:
    """One cited pytest command: the files / node ids it names, its ``-k`` and ``-m``."""

    text: str
    targets: tuple[str, ...]
    keyword: str
    marks: str

    @classmethod
    def parse(cls, tokens: list[str]) -> Selection:
        targets, keyword, marks = [], "", ""
        it = iter(tokens)
        for tok in it:
            if tok == "-k":
                keyword = next(it, "")
            elif tok == "-m":
                marks = next(it, "")
            elif tok.startswith("tests"):
                targets.append(_clean(tok))
            elif not tok.startswith("-"):
                break  # prose after the command
        return cls(" ".join(tokens), tuple(targets) or ("tests",), keyword, marks)


COLLECT = textwrap.dedent("""
    import json, sys
    import pytest
    from _pytest.mark import KeywordMatcher, MarkMatcher
    from _pytest.mark.expression import Expression

    selections = json.loads(sys.argv[1])

    class Count:
        counts = None

        @pytest.hookimpl(trylast=True)  # after tests/conftest.py has marked the server tests
        def pytest_collection_modifyitems(self, items):
            self.counts = []
            for sel in selections:
                k = Expression.compile(sel["keyword"]) if sel["keyword"] else None
                m = Expression.compile(sel["marks"]) if sel["marks"] else None
                n = 0
                for item in items:
                    if not any(item.nodeid == t or item.nodeid.startswith(t.rstrip("/") + s)
                               for t in sel["targets"] for s in ("/", "::", "[")):
                        continue
                    if k is not None and not k.evaluate(KeywordMatcher.from_item(item)):
                        continue
                    if m is not None and not m.evaluate(MarkMatcher.from_markers(item.iter_markers())):
                        continue
                    n += 1
                self.counts.append(n)

    plugin = Count()
    files = sorted({t.split("::")[0] for sel in selections for t in sel["targets"]})
    rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *files], plugins=[plugin])
    print("COUNTS " + json.dumps(plugin.counts))
""")


def collected(selections: list[Selection]) -> list[int]:
    """How many tests each selection collects, from one ``pytest --collect-only`` subprocess over
    every file they name (bounded: 300 s)."""
    spec = json.dumps([{"targets": list(s.targets), "keyword": s.keyword, "marks": s.marks}
                       for s in selections])
    proc = subprocess.run([sys.executable, "-c", COLLECT, spec], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("COUNTS ")), None)
    assert line is not None and json.loads(line[7:]) is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[7:])


def doc_texts() -> dict[str, list[str]]:
    return {name: command_texts((ROOT / name).read_text(encoding="utf-8"))
            for name in COMMAND_DOCS if (ROOT / name).is_file()}


def test_readme_is_under_the_line_limit():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < MAX_LINES, f"README.md has {lines} lines; the measurement log belongs in docs/benchmarks.md"


def test_the_extractors_find_commands():
    """The checks below bite only if the extraction finds the commands: a sample of each form."""
    texts = command_texts(textwrap.dedent("""\
        Run `ocache cache ls|gc|clear` and `pytest -s tests/test_x.py -k a_b`.

        ```sh
        OCACHE_X=1 .venv/bin/ocache serve --port 8081 \\
            --launch -- -m model.gguf   # a comment: ocache bogus
        ```

        ```json
        {"ocache nothing": 1}
        ```
        """))
    assert texts == ["OCACHE_X=1 .venv/bin/ocache serve --port 8081 --launch -- -m model.gguf",
                     "ocache cache ls|gc|clear", "pytest -s tests/test_x.py -k a_b"]
    parser = build_parser()
    assert [check_ocache(t, parser) for c in texts for t in _commands(c, OCACHE)] == [[], []]
    assert check_ocache(["cache", "ls|bogus"], parser) == ["ocache cache: no subcommand 'bogus'"]
    assert check_ocache(["serve", "--no-such-flag"], parser) == ["ocache serve: no option --no-such-flag"]
    assert check_ocache(["frobnicate"], parser) == ["ocache: no subcommand 'frobnicate'"]
    sel = Selection.parse(_commands(texts[2], PYTEST)[0])
    assert (sel.targets, sel.keyword, sel.marks) == (("tests/test_x.py",), "a_b", "")


@pytest.mark.parametrize("doc", COMMAND_DOCS)
def test_every_ocache_command_exists(doc):
    texts = doc_texts().get(doc)
    assert texts is not None, f"{doc} is cited by the README and must exist"
    parser = build_parser()
    problems = {}
    for text in texts:
        for tokens in _commands(text, OCACHE):
            found = check_ocache(tokens, parser)
            if found:
                problems[text] = found
    assert not problems, problems


@functools.lru_cache(maxsize=None)
def script_help(name: str) -> str:
    """``scripts/NAME --help`` (the Python scripts parse their options in ``ocache/bench``; bounded: 60 s)."""
    proc = subprocess.run([sys.executable, str(ROOT / name), "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, f"{name} --help: {proc.stderr[-2000:]}"
    return proc.stdout


@pytest.mark.parametrize("doc", COMMAND_DOCS)
def test_every_script_and_its_options_exist(doc):
    texts = doc_texts().get(doc)
    assert texts is not None, f"{doc} is cited by the README and must exist"
    problems: dict[str, str] = {}
    wanted: dict[str, set[str]] = {}
    for text in texts:
        for m in SCRIPT.finditer(text):
            name = m.group(1)
            if not (ROOT / name).is_file():
                problems[text] = f"{name} does not exist"
                continue
            if not (ROOT / name).read_text(encoding="utf-8").startswith("#!/usr/bin/env python"):
                continue  # the shell scripts hand their arguments on ("$@")
            for tok in _split(text[m.end():]):
                if tok in ("&", "&&", "|", ";") or (not tok.startswith("-") and "/" in tok):
                    break
                opt = _clean(tok).split("=", 1)[0]
                if opt.startswith("--"):
                    wanted.setdefault(name, set()).add(opt)
    with ThreadPoolExecutor(4) as pool:
        helps = dict(zip(wanted, pool.map(script_help, wanted)))
    for name, opts in wanted.items():
        for opt in sorted(opts):
            if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", helps[name]):
                problems[f"{name} {opt}"] = f"not in {name} --help"
    assert not problems, problems


def test_every_pytest_selection_collects_a_test():
    selections: dict[Selection, str] = {}
    for doc, texts in doc_texts().items():
        for text in texts:
            for tokens in _commands(text, PYTEST):
                sel = Selection.parse(tokens)
                selections.setdefault(sel, doc)
    assert len(selections) >= 10, "the docs cite pytest selections; the extraction lost them"
    missing = [t for sel in selections for t in sel.targets if not (ROOT / t.split("::")[0]).exists()]
    assert not missing, missing
    counts = collected(list(selections))
    empty = {f"{doc}: {sel.text}": n for (sel, doc), n in zip(selections.items(), counts) if n < 1}
    assert not empty, empty


def _code_strings(pattern: str) -> set[str]:
    """Every match of ``pattern`` in the runtime's source (``ocache/**/*.py``)."""
    return {m for path in (ROOT / "ocache").rglob("*.py")
            for m in re.findall(pattern, path.read_text(encoding="utf-8"))}


def test_every_response_header_and_admin_route_is_in_the_readme():
    """A header or route ocache adds shows up in README.md's tables (the full text: docs/usage.md)."""
    readme = README.read_text(encoding="utf-8")
    headers = _code_strings(r"X-OCache-[A-Za-z]+(?:-[A-Za-z]+)*")
    routes = _code_strings(r"\"(/(?:v1/cache|ocache)/[a-z/]*)\"") - {"/ocache/static/"}
    assert {"X-OCache-Tier", "X-OCache-Request-Id"} <= headers and "/v1/cache/stats" in routes
    missing = sorted(h for h in headers if h not in readme) + sorted(r for r in routes if r not in readme)
    assert not missing, f"not in README.md: {missing}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-``/``_`` dropped, spaces
    to ``-``."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@pytest.mark.parametrize("doc", COMMAND_DOCS)
def test_every_relative_link_resolves(doc):
    """Each ``[text](path)`` / ``[text](path#anchor)`` of the README and the docs names a file of the
    checkout and, with an anchor, one of its headings (the README's detail moved into docs/)."""
    path = ROOT / doc
    assert path.is_file(), f"{doc} is cited by the README and must exist"
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            problems.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+\s+(.*)$", linked.read_text(encoding="utf-8"), re.M)
            if anchor not in {_anchor(h) for h in headings}:
                problems.append(f"{target}: no such heading")
    assert not problems, problems
