"""The README stays a newcomer's page (issue 18): what it is, the two commands, the demos, the
fleet by hand, where the docs are; figures and history live in bench/ and docs/."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_readme_is_about_120_lines() -> None:
    assert len(README.splitlines()) <= 130


def test_the_readme_keeps_benchmarks_and_scores_out() -> None:
    # The moved content has its homes; the README only links them.
    for moved in ("bench/README.md", "docs/reliability.md", "docs/mutation.md", "docs/development.md"):
        assert moved in README
        assert (ROOT / moved).is_file()
    assert not re.search(r"\d+(\.\d+)? ?% of [\d,]+ (mutants|killed)", README)


def test_every_relative_link_in_the_readme_exists() -> None:
    for target in re.findall(r"\]\(([^)#:]+)\)", README):
        assert (ROOT / target).exists(), target
