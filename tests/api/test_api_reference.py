"""docs/problem.md and docs/job.md: generated from the api models, in sync, complete, linked."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, Field

from adaptis.api.crd import crd_manifest
from adaptis.api.job import JobSpec, parse_job
from adaptis.api.problem import Problem, parse_problem
from adaptis.api.reference import REFERENCES, job_reference, model_tables, problem_reference

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def _adaptis(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaptis", *argv], capture_output=True,
                          text=True, cwd=REPO, check=False)


def _rows(text: str) -> dict[str, list[str]]:
    """Table rows by key (the first such key wins): ``{key: [type, default, bounds, text]}``."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"\| `([^`]+)` \| (.*) \|$", line)
        if m:
            rows.setdefault(m.group(1), [c.strip() for c in m.group(2).split(" | ")])
    return rows


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_checked_in_docs_match_the_models(name: str) -> None:
    assert (DOCS / name).read_text() == REFERENCES[name](), (
        f"docs/{name} drifted from the models: run `adaptis docs`")


def test_cli_writes_and_check_detects_drift(tmp_path: Path) -> None:
    written = _adaptis("docs", str(tmp_path))
    assert written.returncode == 0, written.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(REFERENCES)
    assert _adaptis("docs", "--check", str(tmp_path)).returncode == 0
    job = tmp_path / "job.md"
    job.write_text(job.read_text().replace("| `workers` |", "| `ranks` |"))
    stale = _adaptis("docs", "--check", str(tmp_path))
    assert stale.returncode == 1
    assert "job.md is out of date" in stale.stderr and "problem.md" not in stale.stderr
    (tmp_path / "problem.md").unlink()
    assert "problem.md is out of date" in _adaptis("docs", "--check", str(tmp_path)).stderr


def test_cli_writes_and_checks_the_generated_section_of_a_hand_written_doc(tmp_path: Path) -> None:
    assert _adaptis("docs", str(tmp_path)).returncode == 0
    metrics = tmp_path / "metrics.md"
    shutil.copy(DOCS / "metrics.md", metrics)
    assert _adaptis("docs", "--check").returncode == 0, "the checked-in docs are stale: run `adaptis docs`"
    assert _adaptis("docs", "--check", str(tmp_path)).returncode == 0
    # A HELP text edited in the doc (not in the code) is drift; the write puts the code's back
    # and leaves the prose around the section as written.
    metrics.write_text(metrics.read_text().replace("Tokens trained.", "Tokens seen.")
                       .replace("## Series", "## Series (edited prose)"))
    stale = _adaptis("docs", "--check", str(tmp_path))
    assert stale.returncode == 1 and "metrics.md is out of date" in stale.stderr, stale.stderr
    assert _adaptis("docs", str(tmp_path)).returncode == 0
    repaired = metrics.read_text()
    assert "| `adaptis_tokens_total` | counter | Tokens trained. |" in repaired and "Tokens seen." not in repaired
    assert "## Series (edited prose)" in repaired
    # A doc without its markers is an error that says what to add, not a silently skipped section.
    metrics.write_text("# Metrics\n")
    missing = _adaptis("docs", str(tmp_path))
    assert missing.returncode != 0
    assert "has no generated section" in missing.stderr and "<!-- END generated -->" in missing.stderr


def test_every_key_of_every_model_is_documented_with_its_bounds() -> None:
    problem, job = _rows(problem_reference()), _rows(job_reference())
    for key in ("action_overhead_s", "backward_fused", "weight_groups", "graph_walk",
                "time_unit", "per_node", "bandwidth_bytes_per_s", "repeat", "list"):
        assert key in problem, key
    assert problem["forward"][1:3] == ["**required**", "> 0"]
    assert "time_unit" in problem["graph_walk"][3]
    assert problem["time_unit"][0] == "one of `s`, `ms`, `us`"
    # camelCase on the wire, as the CRD; nested models at their dotted path.
    assert job["gpusPerWorker"][1:3] == ["`1`", "≥ 0, ≤ 16"]
    assert job["gradClip"][0] == "number or null" and job["gradClip"][2] == "> 0"
    assert "At `spec.training.optimizer`." in job_reference()
    assert ("At `network.intra_node`, `network.inter_node`, `network.data_parallel`, `network.tensor`."
            in problem_reference())


def test_every_cel_rule_of_the_crd_is_in_the_job_reference() -> None:
    def rules(node: dict) -> list[str]:  # type: ignore[type-arg]
        found = [r["rule"] for r in node.get("x-kubernetes-validations", ())]
        for sub in (node.get("properties") or {}).values():
            found += rules(sub)
        if "items" in node:
            found += rules(node["items"])
        return found

    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    crd_rules = rules(schema)
    assert len(crd_rules) >= 3
    text = job_reference()
    for rule in crd_rules:
        assert f"`{rule}`" in text, rule


def test_a_field_added_to_a_model_shows_up() -> None:
    class Knobs(BaseModel):
        depth: int = Field(default=2, ge=2, le=9, description="How deep the knob turns.")

    class ExtendedProblem(Problem):
        knobs: Knobs = Field(default=Knobs(), description="New optional knobs.")

    class ExtendedSpec(JobSpec):
        extra_knob: float | None = Field(default=None, gt=0, description="A new spec knob.")

    problem = problem_reference(problem=ExtendedProblem)
    assert _rows(problem)["knobs"][0] == "[Knobs](#knobs)"
    assert _rows(problem)["depth"] == ["integer", "`2`", "≥ 2, ≤ 9", "How deep the knob turns."]
    assert "At `knobs`." in problem and problem != (DOCS / "problem.md").read_text()
    job = job_reference(spec=ExtendedSpec)
    assert _rows(job)["extraKnob"] == ["number or null", "null", "> 0", "A new spec knob."]


def test_a_field_without_a_description_is_refused() -> None:
    class Bare(BaseModel):
        documented: int = Field(description="Fine.")
        bare: int = 0

    with pytest.raises(ValueError, match=r"Bare.bare: every documented field needs a description"):
        model_tables(Bare, root_path="", title="Bare")


def test_the_examples_in_the_docs_parse() -> None:
    def example(name: str) -> object:
        block = re.search(r"```yaml\n(.*?)```", (DOCS / name).read_text(), re.S)
        assert block, f"docs/{name} has no YAML example"
        return yaml.safe_load(block.group(1))

    problem = parse_problem(example("problem.md"))
    assert problem.action_overhead_s > 0 and problem.device_count == 4
    assert any(layer.graph_walk for layer in problem.expanded_layers())
    assert parse_job(example("job.md")).spec.parallelism.workers == 2


def test_anchors_resolve_and_user_docs_stay_inside_the_repository() -> None:
    for name in REFERENCES:
        text = (DOCS / name).read_text()
        for anchor in re.findall(r"\]\(#([^)]+)\)", text):
            assert f'<a id="{anchor}"></a>' in text, f"docs/{name}: #{anchor}"
    for doc in [REPO / "README.md", *DOCS.glob("*.md")]:
        text = doc.read_text()
        assert "shared/" not in text, f"{doc.name} points outside a user's clone"
        prose = re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.S)  # code is not a link
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", prose):
            assert (doc.parent / target).exists(), f"{doc.name}: broken link {target}"
    readme = (REPO / "README.md").read_text()
    assert "(docs/problem.md)" in readme and "(docs/job.md)" in readme


def test_the_generator_runs_without_a_checkout(tmp_path: Path) -> None:
    # The references render from the installed package alone (no examples/ or docs/ read).
    copy = tmp_path / "adaptis"
    shutil.copytree(REPO / "adaptis", copy)
    run = subprocess.run([sys.executable, "-c", "from adaptis.api.reference import REFERENCES;"
                          "print(sum(len(r()) for r in REFERENCES.values()))"],
                         capture_output=True, text=True, cwd=tmp_path, check=False)
    assert run.returncode == 0 and int(run.stdout) > 5000, run.stderr
