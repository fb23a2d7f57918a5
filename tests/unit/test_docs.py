"""The docs say what the code does: the metric, route and request-field tables match the code,
the results data is well formed, the generated pages cover what they are generated from, and
the README stays a short front page whose links lead into the site. `mkdocs build --strict`
(`make docs`, run by `make test`) checks every link and anchor."""

from __future__ import annotations

import ast
import csv
import importlib.util
import re
from datetime import date
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from cluster.config import config_from_dict
from cluster.config.reference import config_keys
from cluster.router import requests
from cluster.serving.metrics import METRIC_NAMES

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"docs_hook_{name}", DOCS / "hooks" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_column(page: Path, header: str) -> list[str]:
    """The first column's code spans of the table whose header row starts with ``header``."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    cells = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells.append(line.split("|")[1])
    return cells


def test_the_metrics_page_lists_exactly_the_exported_metrics() -> None:
    cells = table_column(DOCS / "api/metrics.md", "name")
    listed = [re.fullmatch(r" `(ray_pdserve_\w+)` ", cell) for cell in cells]
    assert all(listed), cells
    assert {m[1] for m in listed if m} == set(METRIC_NAMES)


def declared_routes() -> set[tuple[str, str]]:
    tree = ast.parse((ROOT / "cluster/router/ingress.py").read_text())
    routes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id == "app" and node.args:
                path = node.args[0]
                if isinstance(path, ast.Constant) and node.func.attr in ("get", "post"):
                    routes.add((node.func.attr.upper(), str(path.value)))
    return routes


def test_the_http_page_lists_exactly_the_declared_routes() -> None:
    page = (DOCS / "api/http.md").read_text()
    listed = set(re.findall(r"^\| (GET|POST) \| `(/[\w/]*)` \|", page, re.M))
    assert declared_routes() >= {("POST", "/v1/completions"), ("GET", "/health")}
    assert listed == declared_routes()


def test_the_http_page_lists_exactly_the_accepted_fields() -> None:
    listed = set()
    for cell in table_column(DOCS / "api/http.md", "field"):
        listed |= set(re.findall(r"`(\w+)`", cell))
    accepted = requests._COMPLETION_FIELDS | requests._CHAT_FIELDS
    assert listed == accepted, (sorted(listed - accepted), sorted(accepted - listed))


RESULTS = DOCS / "benchmarks" / "results.csv"
NUMBER = r"-?\d+(\.\d+)?(e-?\d+)?"


def test_every_results_row_is_well_formed() -> None:
    module = hook("bench_results")
    rows = module.read_results(RESULTS)
    assert len(rows) >= 50
    for i, row in enumerate(rows, start=2):
        where = f"{RESULTS.name}:{i}"
        date.fromisoformat(row["date"])
        assert re.fullmatch(r"[a-z0-9_]+", row["key"]), where
        value = row["value"]
        if ".." in value:
            lo, hi = value.split("..")
            assert re.fullmatch(NUMBER, lo) and re.fullmatch(NUMBER, hi), where
            assert float(lo) <= float(hi), where
        else:
            assert re.fullmatch(NUMBER, value), where
        assert row["runs"] == "" or int(row["runs"]) >= 1, where
        assert row["mode"] in ("full", "quick", "full+quick", "smoke"), where
        assert row["host"], where
        assert re.fullmatch(r"[0-9a-f]{7,40}", row["commit"]), where


def test_an_unknown_benchmark_id_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "results.csv"
    header = RESULTS.read_text().splitlines()[0]
    bad.write_text(f"{header}\n2026-12-01,P99,x,1,1,full,h,abcdef0,\n")
    with pytest.raises(ValueError, match="unknown benchmark 'P99'"):
        hook("bench_results").read_results(bad)


def test_the_results_page_renders_every_row() -> None:
    module = hook("bench_results")
    page = module.render()
    rows = list(csv.DictReader(RESULTS.open()))
    assert page.count("\n| 20") == len(rows)


def test_the_config_reference_renders_every_key() -> None:
    page = hook("config_reference").render()
    for key in config_keys():
        if key.section is not None:
            assert f"## `{key.path}`" in page
        else:
            section, _, name = key.path.rpartition(".")
            block = page[page.index(f"## `{section}`") :]
            block = block[: block.find("\n## ", 1) if "\n## " in block[1:] else len(block)]
            assert f"| `{name}` |" in block, key.path


def test_the_grpc_reference_renders_every_rpc_message_and_field() -> None:
    module = hook("grpc_reference")
    page = module.render()
    for f in module.descriptor_set().file:
        for svc in f.service:
            for method in svc.method:
                assert f"| `{method.name}` |" in page
        for msg in f.message_type:
            assert f"### `{msg.name}`" in page
            for fld in msg.field:
                assert f"| `{fld.name}` | {fld.number} |" in page
    assert "pdserve's public gRPC API" in page  # the file's header comment


def test_the_readme_is_a_front_page_that_links_into_the_site() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 350
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 5
    for link in links:
        assert (ROOT / link).is_file(), link
    cited = set(re.findall(r"`((?:docs|tests|cluster|deploy|protos|benchmarks)/[\w./-]+)`", text))
    for path in cited:
        assert (ROOT / path).exists(), f"README cites {path}, which is not in the repo"


def config_examples() -> list[tuple[str, str]]:
    """Every YAML block of the README and the docs whose top-level keys are config sections."""
    sections = {k.path for k in config_keys() if "." not in k.path}
    found = []
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and data and set(data) <= sections:
                found.append((str(page.relative_to(ROOT)), block))
    return found


def test_every_config_example_in_the_docs_loads() -> None:
    examples = config_examples()
    assert len(examples) >= 4
    for where, block in examples:
        try:
            config_from_dict(yaml.safe_load(block))
        except ValueError as e:
            raise AssertionError(f"{where}: {e}\n{block}") from e
