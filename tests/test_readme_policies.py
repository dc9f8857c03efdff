"""README.md lists the served policies: every policy the registry serves has
a bullet under "## Policies", no bullet names a policy that is not served,
and the "Shared prompts" paragraph gives each policy's compress_prompt
default as the registry does."""

import re
from pathlib import Path

from kvsieve.policies import get_policy, policy_names

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def served() -> dict:
    """The built-in policies (tests register extra ones in this process)."""
    return {n: get_policy(n) for n in policy_names() if get_policy(n).__module__.startswith("kvsieve.policies")}


def section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def test_the_readme_lists_every_served_policy_and_no_other():
    listed = re.findall(r"^- `([a-z0-9_]+)`", section("Policies"), re.M)
    assert len(listed) == len(set(listed)), f"a policy is listed twice: {listed}"
    assert sorted(listed) == sorted(served()), (
        f"README.md's '## Policies' list {sorted(listed)} differs from the registry's {sorted(served())}")


def test_the_readme_gives_each_policy_its_compress_prompt_default():
    paragraph = re.search(r"Shared prompts:(.*?)\n\n", README, re.S)
    assert paragraph, "README.md has no 'Shared prompts:' paragraph"
    on, off = re.findall(r"\(default for ([^)]*)\)", paragraph.group(1))

    def names(text):
        return sorted(re.findall(r"`([a-z0-9_]+)`", text))

    compressing = {n: cls for n, cls in served().items() if cls.compresses}
    assert names(on) == sorted(n for n, cls in compressing.items() if cls.compress_prompt)
    assert names(off) == sorted(n for n, cls in compressing.items() if not cls.compress_prompt)
