"""The documentation says what the code does.

The README's "what applies on my Mac and torch" table and its recipe table are generated from the
registry and the gate (:mod:`mpsboost.docs`, written by ``python benchmarks/tables.py``): these tests
check that the committed text is the generated one, that a recipe registered later gets its rows,
that the statements written by hand next to the tables hold (the VAE recipes' numerical bound, which
recipes are defaults as ``mpsboost doctor`` reports them), and that links and snippets are live.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import mpsboost
from mpsboost import Env, docs
from mpsboost.registry import Decision, Recipe, all_recipes, register, unregister

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: Every hand-written document a user reads.
PAGES = [
    README,
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "recipes" / "README.md",
    ROOT / "benchmarks" / "README.md",
    ROOT / "src" / "mpsboost" / "recipes" / "README.md",
]
#: The bound the README and docs/usage.md state for the VAE recipes against stock (fp32, CPU).
VAE_BOUND = 1e-5

import tiny_models  # noqa: E402


def _block(text: str, name: str) -> str:
    m = re.search(rf"<!-- tables:{name}:begin -->\n(.*?)\n?<!-- tables:{name}:end -->", text, re.S)
    assert m, f"no generated block {name!r}"
    return m.group(1).strip()


def _rows(block: str) -> dict[str, list[str]]:
    """{recipe name: cells} of a generated markdown table whose first column is `` `recipe` ``."""
    out = {}
    for line in block.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if cells and cells[0].startswith("`"):
            out[cells[0].strip("`")] = cells
    return out


# ------------------------------------------------------------------------------------ generated tables


def test_readme_tables_are_the_generated_ones():
    text = README.read_text()
    assert _block(text, "support") == (docs.support_table() + "\n\n" + docs.samples_line()).strip()
    assert _block(text, "recipe-list") == docs.recipe_table(columns=docs.README_ENVS, fold=3, summary=False).strip()
    names = [r.name for r in all_recipes()]
    assert list(_rows(_block(text, "support"))) == names
    assert list(_rows(_block(text, "recipe-list"))) == names


def test_the_table_cells_are_what_plan_decides():
    """Spot checks of the generated cells against plan() on a real tiny model, outside the generator."""
    from diffusers import AutoencoderKLHunyuanVideo, AutoencoderKLWan

    with torch.device("meta"):
        wan = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        )
        hv = AutoencoderKLHunyuanVideo(
            block_out_channels=(8, 8, 8, 8), norm_num_groups=4, layers_per_block=1, latent_channels=4
        )
    cells = docs.decide()
    for version in ("2.14.1", "2.15.0", "2.16.0.dev20261201"):
        wan_rows = mpsboost.plan(wan, device="mps", torch_version=version, recipes=["wan_vae_pad"]).rows_for(
            "wan_vae_pad"
        )
        hv_rows = mpsboost.plan(hv, device="mps", torch_version=version, recipes=["video_vae_pad"]).rows_for(
            "video_vae_pad"
        )
        wan_cell = cells[("wan_vae_pad", ("mps", version))]
        hv_cell = cells[("video_vae_pad", ("mps", version))]
        # The VAE recipe applies on every Mac build (speed from 2.15 on), video_vae_pad only before 2.15.
        assert wan_rows[0].status == "would apply" and wan_cell.status == docs.APPLIES
        assert wan_rows[0].backing in wan_cell.backings
        before_215 = version.startswith("2.14")
        assert (hv_rows[0].status == "would apply") is before_215
        assert hv_cell.status == (docs.APPLIES if before_215 else docs.STEPS_ASIDE)
        if not before_215:
            assert hv_cell.reason == hv_rows[0].reason
            assert "for speed" in wan_cell.reason  # the reason the report gives on 2.15+


def test_a_recipe_registered_later_gets_its_rows():
    @register
    class DocsProbe(Recipe):
        name = "docs_probe"
        summary = "a recipe registered by a test"
        targets = ("diffusers.models.autoencoders.autoencoder_kl_wan.AvgDown3D",)
        default = True

        def decide(self, match, env, options):
            if env.device_type == "mps" and env.torch_version.minor < (2, 15):
                return Decision.apply("probe path", "old build")
            return Decision.skip("stock is fine here; opt in with options={'docs_probe': {}} never")

        def apply(self, match, decision, env, options):  # pragma: no cover - plan() only
            raise AssertionError("not applied by the docs")

    try:
        rows = _rows(docs.support_table())
        cells = rows["docs_probe"]
        assert cells[1] == "default"
        assert cells[2] == "**applies**: probe path"  # MPS 2.14.x
        assert cells[3].startswith("steps aside: stock is fine here; opt in with options=")  # MPS 2.15.0
        assert "`docs_probe`" in docs.recipe_table() and "`AvgDown3D`" in _rows(docs.recipe_table())["docs_probe"][2]
        assert "#### `docs_probe` (default)" in docs.support_details()
    finally:
        unregister("docs_probe")
    assert "docs_probe" not in _rows(docs.support_table())


def test_every_recipe_finds_a_target_in_the_workloads():
    """A recipe whose targets none of docs.SAMPLES holds would read "no target" everywhere: add a sample."""
    cells = docs.decide()
    blind = [r.name for r in all_recipes() if all(cells[(r.name, c.key)].status == docs.NO_TARGET for c in docs.ENVS)]
    assert not blind, f"no workload of mpsboost.docs.SAMPLES holds a target of {blind}; add a tiny one there"


def test_selected_column_agrees_with_doctor(capsys):
    """`mpsboost doctor` and the README say the same about which recipes are defaults (mps_streams once
    disagreed: the README said opt-in, doctor said default)."""
    from mpsboost.cli import main

    assert main(["doctor", "--json", "--device", "mps", "--torch", "2.15.0"]) == 0
    info = json.loads(capsys.readouterr().out)
    doctor = {r["name"]: r["default"] and r["lossless"] for r in info["recipes"]}
    table = _rows(_block(README.read_text(), "recipe-list"))
    assert set(doctor) == set(table)
    for name, default in doctor.items():
        assert table[name][-1].startswith("default") is default, (name, table[name][-1])


def test_headline_keeps_the_first_clause_and_an_opt_in():
    reason = (
        "device streams: in torch 2.4 (a long aside that names several upstream changes, #1, #2, #3); "
        "this is torch 2.15.0; slower here; opt in with options={'mps_streams': {'on_cuda': True}}"
    )
    assert (
        docs.headline(reason) == "device streams: in torch 2.4; opt in with options={'mps_streams': {'on_cuda': True}}"
    )
    assert docs.headline("short (pytorch#1)") == "short (pytorch#1)"
    long = "word " * 60
    out = docs.headline(long, limit=50)
    assert len(out) <= 50 and out.endswith("…")
    assert docs.headline("") == ""


# ------------------------------------------------------------------------------------ hand-written statements


@pytest.mark.parametrize(
    "name, shape", [("wan22_vae", {"frames": 3}), ("wan21_vae", {"frames": 3}), ("qwen_image_vae", {"frames": 1})]
)
def test_vae_recipes_stay_within_the_documented_bound(name, shape, rng_seed):
    """README and docs/usage.md: on torch 2.15+ the VAE recipes still apply, lossless but not bit-identical,
    within 1e-5 relative of stock in fp32 (summation order of the folded and 2-D convolutions; a
    wrong fold or pad is at 1e-2 or more)."""
    for page in (README, ROOT / "docs" / "usage.md"):
        assert "within 1e-5 relative" in " ".join(page.read_text().split()), page
    vae = tiny_models.build(name)
    ref = tiny_models.run(name, vae, rng_seed, **shape)
    report = mpsboost.patch(vae, device=Env.simulate("mps", "2.15.0"))
    try:
        assert {"wan_vae_pad", "qwen_image_vae"} & set(report.recipes("applied"))
        out = tiny_models.run(name, vae, rng_seed, **shape)
    finally:
        mpsboost.unpatch(vae)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel <= VAE_BOUND, rel


# ------------------------------------------------------------------------------------ form


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    text = "\n".join(lines)
    # No record-derived figures in the front door: those live in docs/figures.md.
    assert "NVIDIA H200;" not in text
    for heading in (
        "## Mac quick start",
        "## What applies on my Mac and torch",
        "## Recipes",
        "## Workloads, one call each",
    ):
        assert heading in lines, heading
    for link in ("docs/contributing.md", "docs/figures.md", "docs/support.md"):
        assert f"]({link})" in text, link


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_deprecated_torch_dtype(page):
    assert "torch_dtype=" not in page.read_text()


def test_cookbook_scripts_use_dtype():
    offenders = [p.name for p in (ROOT / "recipes").glob("*.py") if "torch_dtype=" in p.read_text()]
    assert not offenders, offenders


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = page.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
            continue
        if anchor and dest.suffix == ".md":
            slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
            if anchor not in slugs:
                broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"


def _python_blocks(text: str) -> list[str]:
    """The python code blocks of a page, list-item indentation removed."""
    import textwrap

    return [textwrap.dedent(m.group(2)) for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M)]


@pytest.mark.parametrize(
    "page",
    [README, ROOT / "docs" / "usage.md", ROOT / "docs" / "contributing.md", ROOT / "docs" / "fp8-checkpoints.md"],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_snippets_parse_and_name_only_public_api(page):
    blocks = _python_blocks(page.read_text())
    assert blocks
    for code in blocks:
        tree = ast.parse(code.replace("...", "None"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "mpsboost":
                assert hasattr(mpsboost, node.attr), f"{page.name}: mpsboost.{node.attr} does not exist"
            if isinstance(node, ast.keyword):
                assert node.arg != "torch_dtype"


def test_regeneration_is_one_command():
    """README names the one command that rewrites every generated table, and that command knows the
    README's blocks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mpsboost_tables_for_docs", ROOT / "benchmarks" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tables  # its dataclasses look their module up
    spec.loader.exec_module(tables)
    assert "python benchmarks/tables.py" in README.read_text()
    for doc in ("README.md", "docs/support.md"):
        assert doc in tables.DOCS
    names = set(re.findall(r"<!-- tables:([a-z0-9-]+):begin -->", README.read_text()))
    assert names and names <= set(tables.all_blocks())
    # Whether every document is current: tests/core/test_tables.py::test_committed_documents_match_the_records.


def test_gate_table_is_the_gate():
    from mpsboost.gate import FEATURES, check

    rows = _rows(docs.gate_table("mps"))
    assert set(rows) == {n for n, f in FEATURES.items() if "mps" in f.rules}
    columns = [c for c in docs.ENVS if c.device == "mps"]
    for name, cells in rows.items():
        assert cells[5:] == ["yes" if check(name, c.env()).ok else "no" for c in columns], name
    # The facts the hand-written text around it relies on.
    assert rows["pad_constant_native"][5:] == ["no", "no", "yes", "yes"]
    assert rows["device_streams"][5:] == ["no", "no", "yes", "yes"]
    assert rows["cross_stream_events"][5:] == ["no", "no", "no", "yes"]
    # the evidence column: what the macOS wheels show per MPS row
    assert rows["solve_triangular_fast"][4] == "triangular_solve_small_16 from the 2.15.0 macOS wheel"
    assert rows["sdpa_metal_gqa"][4].startswith("behavioural")
    assert "gate-mps" in (ROOT / "docs" / "support.md").read_text()


def test_the_list_of_what_each_mps_build_adds_is_the_gate():
    """docs/support.md's list by build (it once said, by hand, that streams and the fp8 GEMV were in no build
    while the gate table beside it had both in 2.15.0): each feature sits under the first build whose
    verdict is yes, and under "none" when no build has it."""
    from mpsboost.gate import FEATURES, check

    columns = [c for c in docs.ENVS if c.device == "mps"]
    where: dict[str, str] = {}
    section = None
    for line in docs.gate_releases("mps").splitlines():
        if line.startswith("- **"):
            section = line
        else:
            where[re.match(r"  - `(\w+)`", line).group(1)] = section
    assert set(where) == {n for n, f in FEATURES.items() if "mps" in f.rules}
    for name, head in where.items():
        first = next((c for c in columns if check(name, c.env()).ok), None)
        assert (first.heading in head) if first else ("none" in head), (name, head)
    assert "torch 2.15.0" in where["device_streams"] and "torch 2.15.0" in where["fp8_gemv"]
    assert "none" in where["sdpa_large_scores_correct"]
    support = (ROOT / "docs" / "support.md").read_text()
    assert _block(support, "gate-mps-releases") == docs.gate_releases("mps")
    assert "not in any build" not in support.lower()


def test_the_busy_machine_spread_the_docs_state_is_the_harness_threshold():
    """docs/usage.md said 25% while the harness (every entry point's busy-machine check) warns at 10%."""
    from mpsboost.bench.harness import BUSY_SPREAD

    text = (ROOT / "docs" / "usage.md").read_text()
    stated = re.findall(r"repeats spread more\s+than (\d+)%", text)
    assert stated == [f"{BUSY_SPREAD * 100:.0f}"], stated


def test_a_load_error_that_is_not_the_fp8_layers_says_so_beside_the_figure():
    """The 40-layer Qwen3.6 load with the default recipes is 5.7e-01 off the file's exact dequantisation while
    the fp8 layers alone are bit-equal: the fp8 page's cell says why, not only docs/known-gaps.md."""
    block = _block((ROOT / "docs" / "fp8-checkpoints.md").read_text(), "fp8-load")
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in block.splitlines()[2:] if line.startswith("|")]
    qwen36 = [c for c in cells if c[0].startswith("qwen3.6")]
    alone = [c for c in qwen36 if "the fp8 layers alone" in c[0]]
    default = [c for c in qwen36 if "the fp8 layers alone" not in c[0]]
    assert alone and default and alone[0][6].endswith("(bit-equal)")
    assert not default[0][6].startswith("0.0e+00")
    assert "not the fp8 layers'" in default[0][6] and "docs/known-gaps.md" in default[0][6]


# ------------------------------------------------------------------------------------ the front door


def _sources() -> list[Path]:
    """Every text a user may read or be told: the pages, the docs' and reports' templates in the package,
    its data, the benchmark scripts and the recipe scripts. docs/mac-results.md is generated from
    benchmarks/mac_results.py (checked here instead); benchmarks/results/ holds past runs' own words."""
    pages = [p for p in PAGES if p.is_file() and p.name != "mac-results.md"]
    code = [
        *sorted((ROOT / "src" / "mpsboost").rglob("*.py")),
        *sorted((ROOT / "src" / "mpsboost" / "data").glob("*.json")),
        *sorted((ROOT / "benchmarks").glob("*.py")),
        *sorted((ROOT / "recipes").glob("*.py")),
    ]
    return pages + code


def test_no_placeholder_url_is_left():
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0)!r}"
        for p in _sources()
        for m in re.finditer(r"URL_OF_[A-Z_]+|URL to be published|to be published\)", p.read_text(encoding="utf-8"))
    ]
    assert not found, found


def test_nothing_says_to_install_from_the_index_under_its_other_projects_name():
    """The index's `mpsboost` is another project (gradient boosting): no text tells anyone to
    `pip install mpsboost` or `pip install "mpsboost[...]"`, except to warn against it. A wheel or a
    checkout named with `mpsboost[extra] @ file:///...` is fine."""
    bad = []
    for p in _sources():
        text = p.read_text(encoding="utf-8")
        for m in re.finditer(r"pip install\s+[\"'`]?mpsboost(\[[^\]]*\])?", text):
            after = text[m.end() : m.end() + 160].replace("\n", " ")
            before = text[max(0, m.start() - 12) : m.start()]
            if after.lstrip("\"'` ").startswith("@"):
                continue  # mpsboost[extra] @ file:///... (a wheel built from the checkout)
            if re.search(r"another project|different project|other project", after) or "Not '" in before:
                continue  # the warning itself
            bad.append(f"{p.relative_to(ROOT)}: {text[m.start() : m.end() + 40]!r}")
    assert not bad, bad


def test_the_readme_says_first_what_was_measured_where_and_how_to_send_evidence():
    top = "\n".join(README.read_text(encoding="utf-8").splitlines()[:30])
    assert "Nothing in this repository has been measured on a Mac yet" in top
    assert "CPU" in top and "H200" in top and "docs/figures.md" in top
    assert "What a Mac user can expect" in top and "mpsboost selftest --validate" in top


def test_one_selftest_duration_everywhere():
    """The selftest's duration is stated once per page, the same everywhere: its default budget (from the
    code) and the one measured run (`--size test` on a 2-core Linux CPU); no other figure for it."""
    from mpsboost.selftest import BUDGET_S

    pages = [README, ROOT / "docs" / "support.md", ROOT / "src" / "mpsboost" / "selftest" / "__init__.py"]
    measured = set()
    for p in pages:
        text = " ".join(p.read_text(encoding="utf-8").split())
        assert f"{BUDGET_S['quick']:.0f} s budget" in text, p
        measured |= set(re.findall(r"--size test`{0,2} took (\d+) s", text))
        for stale in ("8 minutes", "minute or so", "minutes on a Mac"):
            assert stale not in text, (p, stale)
    assert len(measured) == 1, measured
    mac = (ROOT / "benchmarks" / "mac_results.py").read_text(encoding="utf-8")
    assert f"{BUDGET_S['quick']:.0f} s budget" in mac and "8 minutes" not in mac
