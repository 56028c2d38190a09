"""The docs say what the code does: the README's configuration table, the `ls` example in
docs/cli.md, and the key list in docs/key-schema.md are checked against the code here."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from test_imports import modules as package_modules

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import ConfigError
from lmcache_remote.naming.keys import CacheEngineKey, engine_stats_key, probe_key
from lmcache_remote.values.serde import header_nbytes
from lmcache_remote.values.sizing import plan_part_size

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CLI_DOC = (ROOT / "docs" / "cli.md").read_text()
KEY_DOC = (ROOT / "docs" / "key-schema.md").read_text()


def _config_rows() -> dict[str, str]:
    """field -> the default the README's configuration table shows."""
    table = README.split("## Configuration", 1)[1].split("\n\n###", 1)[0]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            rows[name] = cells[1].strip("`")
    return rows


def _shown(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def test_readme_table_lists_every_field_with_its_default() -> None:
    rows = _config_rows()
    fields = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
    assert set(rows) == set(fields)
    assert {name: rows[name] for name in fields} == {n: _shown(d) for n, d in fields.items()}


def test_readme_states_the_part_size_bounds_the_config_enforces() -> None:
    row = next(line for line in README.splitlines() if line.startswith("| `remote_part_size`"))
    assert "4096 to 512 MiB" in row
    CacheConfig(remote_part_size=4096)
    CacheConfig(remote_part_size=512 * 1024 * 1024)
    for bad in (4095, 512 * 1024 * 1024 + 1):
        with pytest.raises(ConfigError, match="remote_part_size"):
            CacheConfig(remote_part_size=bad)


def test_cli_ls_example_is_bytes_the_code_writes() -> None:
    section = CLI_DOC.split("### `ls`", 1)[1]
    doc = json.loads(section.split("```json", 1)[1].split("```", 1)[0])
    entry = doc["entries"][0]
    part_size = plan_part_size(entry["raw_bytes"], CacheConfig().remote_part_size)
    assert entry["part_size"] == part_size
    assert entry["parts"] == -(-entry["raw_bytes"] // part_size)
    assert entry["header_bytes"] == header_nbytes(entry["parts"])
    assert entry["bytes"] == entry["stored_bytes"] + entry["header_bytes"]
    shape = entry["shape"]
    assert shape[2] == entry["num_tokens"]
    assert entry["raw_bytes"] == 2 * shape[0] * shape[1] * shape[2] * shape[3] * shape[4]


def _documented(rendered: str, **placeholders: str) -> str:
    for value, name in placeholders.items():
        rendered = rendered.replace(value, "{" + name + "}")
    return rendered


def test_key_schema_lists_every_key_the_project_writes() -> None:
    table = KEY_DOC.split("## Every key under a prefix", 1)[1].split("\n\n", 2)[1]
    chunk = CacheEngineKey("MODEL", 1, 0, "bfloat16", "ab" * 16).redis_key("PFX")
    expected = [
        _documented(chunk, PFX="key_prefix", MODEL="model_name").replace(
            ":1:0:bfloat16:", ":{world_size}:{worker_id}:{dtype}:").replace("ab" * 16,
                                                                            "{chunk_hash}"),
        _documented(engine_stats_key("PFX", "ENGINE"), PFX="key_prefix", ENGINE="engine_id"),
        _documented(probe_key("PFX", "TOKEN"), PFX="key_prefix", TOKEN="token"),
    ]
    for key in expected:
        assert f"| `{key}` |" in table, key


def test_metrics_doc_names_every_counter_the_code_counts() -> None:
    """Every counter name written out in the library (`metrics.inc("scope.name")`, and the
    per-tier `f"{tier}.name"` ones for both tiers) is in docs/metrics.md's table."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    source = "\n".join(p.read_text() for p in (ROOT / "lmcache_remote").rglob("*.py"))
    names = set(re.findall(r"\.(?:inc|observe)\(\s*\"([a-z_]+\.[a-z_]+)\"", source))
    for leaf in re.findall(r"\.inc\(\s*f\"\{tier\}\.([a-z_]+)\"", source):
        names |= {f"local.{leaf}", f"remote.{leaf}"}
    assert len(names) > 20
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert missing == []


def test_the_package_and_pyproject_name_one_release() -> None:
    """`lmcache_remote.__version__` (lmcache_remote/version.py) is pyproject.toml's version."""
    from lmcache_remote import __version__

    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared is not None and declared.group(1) == __version__


def test_every_module_and_path_the_docs_name_is_there() -> None:
    """A path (`lmcache_remote/...`) or a dotted name (`lmcache_remote.x.y`, a module and at
    most its attributes) in the docs names what the tree holds: the docs follow the folders.
    A dotted name may also be a logger the package logs to by that name."""
    modules = package_modules()
    source = "\n".join(path.read_text() for path in modules.values() if path is not None)
    loggers = set(re.findall(r'getLogger\("(lmcache_remote[\w.]*)"\)', source))
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "benchmarks").glob("*.md"))]
    wrong = []
    for doc in docs:
        text = doc.read_text()
        for path in set(re.findall(r"\blmcache_remote/[\w./*]*[\w*]", text)):
            if not list(ROOT.glob(path)):
                wrong.append(f"{doc.name}: {path}")
        for dotted in set(re.findall(r"\blmcache_remote(?:\.\w+)+", text)):
            if dotted in loggers:
                continue
            parts = dotted.split(".")
            depth = max((n for n in range(1, len(parts) + 1)
                         if ".".join(parts[:n]) in modules), default=0)
            found = modules.get(".".join(parts[:depth]))  # None: not a module, or the C one
            code = found.read_text() if found is not None else ""
            attributes = parts[depth:]
            if depth == 0 or len(attributes) > 1 or (attributes and attributes[0] not in code):
                wrong.append(f"{doc.name}: {dotted}")
    assert sorted(wrong) == []


def test_every_import_the_docs_show_runs() -> None:
    """The import statements in the docs' Python examples are paths users copy: each runs
    (`from lmcache_remote import prometheus` among them, a module that moved into a layer's
    folder and stays importable at the documented path)."""
    importing = re.compile(r"\s*(from lmcache_remote[\w.]* import |import lmcache_remote)")
    statements = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
            statements += [line.split("#")[0].strip() for line in block.splitlines()
                           if importing.match(line)]
    assert "from lmcache_remote import prometheus" in statements
    for statement in statements:
        exec(compile(statement, "<docs>", "exec"), {})
