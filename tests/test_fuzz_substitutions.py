"""A short seeded run of ``scripts/fuzz-substitutions`` (the differential fuzzer of the aligned and
continued routes, its checks in the script's docstring) on the tiny hybrid with Qwen3.5's template:
the cases it draws, through ``ocache serve`` and against llama-server alone, end without a
violation, and it substitutes at least some of them (else it checked nothing of the gate)."""

from __future__ import annotations

import importlib.util
import sys
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz-substitutions"


def test_a_short_seeded_fuzz_run_finds_no_violation(engine_patched, models_tiny, tmp_path, monkeypatch):
    loader = SourceFileLoader("fuzz_substitutions", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    fz = importlib.util.module_from_spec(spec)
    # registered while it runs: its dataclasses resolve their annotations through sys.modules
    monkeypatch.setitem(sys.modules, loader.name, fz)
    loader.exec_module(fz)
    lines: list[str] = []
    out = fz.fuzz(["hybrid-qwen35"], 24, 3, tmp_path, log=lines.append)
    counts = out["configs"]["hybrid-qwen35"]["counts"]
    print(fz.summary(out))
    assert counts["cases"] >= 24
    assert counts.get("substituted", 0) >= 3, counts
    assert not out["configs"]["hybrid-qwen35"]["violations"], "\n".join(l for l in lines if "VIOLATION" in l)
