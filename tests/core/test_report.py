"""str(report) is for people, to_json() for tools.

On the reports of real tiny models (a Qwen3-MoE LM with fp8, a two-transformer Wan pipeline, a Qwen-Image
pipeline), planned for simulated MPS 2.14.1 and 2.15.0: no line of ``str(report)`` is longer than 120
characters; "not applicable" rows name at most two classes (every class is in the row's details); a
recipe's targets are counted per model; a footnote explains the notation; ``to_json()`` still lists every
target and every full reason.
"""

from __future__ import annotations

import json

import pytest

import mpsboost
from mpsboost.gate import Env
from mpsboost.report import NOT_APPLICABLE

import tiny_models as tm

WIDTH = 120


@pytest.fixture(scope="module", params=["qwen3_moe", "wan22_a14b_pipeline", "qwen_image_pipeline"])
def reports(request):
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    obj = tm.build(request.param)
    fp8 = "rowwise" if request.param == "qwen3_moe" else None
    return request.param, [mpsboost.plan(obj, env=Env.simulate("mps", tv), fp8=fp8) for tv in ("2.14.1", "2.15.0")]


def test_no_line_longer_than_the_width(reports):
    name, reps = reports
    for rep in reps:
        text = str(rep)
        longest = max(text.splitlines(), key=len)
        assert len(longest) <= WIDTH, (name, len(longest), longest)
        assert len(rep.rows) > 5  # a real report, not an empty one
        # Nothing is cut when asked for the whole text: the longest reason appears in full.
        full = rep.format(width=None)
        assert max((r.reason for r in rep.rows), key=len) in full


def test_not_applicable_rows_fold_their_class_lists(reports):
    _, reps = reports
    for rep in reps:
        for row in rep.by_status(NOT_APPLICABLE):
            classes = row.details["target_classes"]
            named = sum(1 for c in classes if c.rsplit(".", 1)[-1] in row.reason)
            assert named <= 2, row.reason
            if len(classes) > 2:
                assert f"no target in this object ({len(classes)} classes; see to_json())" == row.reason
        # str(report) puts them in one paragraph by recipe name (wrapped at the line width), before the summary
        missing = [r.recipe for r in rep.by_status(NOT_APPLICABLE)]
        if missing:
            lines = str(rep).splitlines()
            start = next(i for i, ln in enumerate(lines) if ln.startswith("not applicable"))
            end = next(
                i for i in range(start, len(lines)) if lines[i].split(" ", 1)[0].isdigit() and " recipes:" in lines[i]
            )
            paragraph = " ".join(lines[start:end])
            assert all(m in paragraph for m in missing), paragraph


def test_counts_per_recipe_and_model_and_a_footnote(reports):
    name, reps = reports
    for rep in reps:
        text = str(rep)
        applying = rep.recipes("would apply")
        assert applying, text
        summary = next(ln for ln in text.splitlines() if " recipes: " in ln)
        assert summary.startswith(f"{len(rep.recipes())} recipes: {len(applying)} would apply"), summary
        assert "Notation:" in text and "* stands for any layer index" in text
        # per model: a pipeline's components by name, a model by its class
        flat = " ".join(text.split())
        for recipe in applying:
            models = {rep._model_of(r.target) for r in rep.rows_for(recipe) if r.status == "would apply"}
            for m in models:
                n = sum(1 for r in rep.rows_for(recipe) if r.status == "would apply" and rep._model_of(r.target) == m)
                assert f"{recipe} ({n})" in flat and f"{m}:" in flat, (recipe, m, n)
        if name.endswith("pipeline"):
            assert rep.components and all(
                c in flat
                for c in rep.components
                if any(rep._model_of(r.target) == c and r.status == "would apply" for r in rep.rows)
            )


def test_to_json_keeps_every_target_and_reason(reports):
    _, reps = reports
    for rep in reps:
        data = json.loads(rep.to_json())
        assert [(r["recipe"], r["target"], r["status"], r["reason"]) for r in data["rows"]] == [
            (r.recipe, r.target, r.status, r.reason) for r in rep.rows
        ]
        targets = {r["target"] for r in data["rows"] if r["status"] == "would apply"}
        assert len(targets) == len({r.target for r in rep.rows if r.status == "would apply"})
