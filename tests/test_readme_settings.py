"""README.md's settings table names every setting of service/config.py and
no other: `section.field` sets the section, a bare `field` after it is of
the same section (`ray.autoscaling.min_replicas`, `max_replicas`: nested)."""

import re
from pathlib import Path

from pydantic import BaseModel

from kvsieve.service.config import Settings

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def schema_settings(model: type[BaseModel], prefix: str = "") -> set[str]:
    names = set()
    for name, field in model.model_fields.items():
        names.add(prefix + name)
        nested = [t for t in getattr(field.annotation, "__args__", (field.annotation,))
                  if isinstance(t, type) and issubclass(t, BaseModel)]
        for sub in nested:
            names |= schema_settings(sub, f"{prefix}{name}.")
    return names


def readme_settings() -> set[str]:
    table = re.search(r"^\| setting \| default \| \|\n\| --- \| --- \| --- \|\n((?:\|.*\n)+)", README, re.M)
    assert table, "README.md has no settings table (| setting | default | |)"
    names = set()
    for row in table.group(1).splitlines():
        section = ""
        for name in re.findall(r"`([a-z_][a-z0-9_.]*)`", row.split("|")[1]):
            if "." in name:
                section = name.rsplit(".", 1)[0] + "."
                names.add(name)
            else:
                names.add(section + name)
    return names


def test_the_settings_table_matches_the_config_schema():
    leaves = {n for n in schema_settings(Settings) if "." in n}  # the sections themselves are not settings
    listed = readme_settings()
    assert not leaves - listed, f"settings missing from README.md's table: {sorted(leaves - listed)}"
    assert not listed - leaves, f"README.md's table names settings that do not exist: {sorted(listed - leaves)}"
