"""The results pages are made from the committed JSON alone: they are current in the repository,
and the marked blocks of the READMEs are filled from it, never typed."""
from __future__ import annotations

import json

import pytest

from prefixcache_bench import pages


def test_the_committed_pages_are_current(capsys):
    """Fails when a results JSON changed without `python -m prefixcache_bench.pages`, or when a
    figure was typed into docs/results/README.md or a results block of a README."""
    code = pages.main(["--check"])
    assert code == 0, (f"{capsys.readouterr().err}run `python -m prefixcache_bench.pages` "
                       "and commit what it writes")


def test_a_block_is_filled_indented_and_refilled_the_same():
    text = ("intro\n"
            "  <!-- results:one -->\n"
            "  a figure someone typed\n"
            "  <!-- /results:one -->\n"
            "outro\n")
    filled = pages.fill_blocks(text, {"one": ["- 1.5x", "", "- done"]})
    assert filled == ("intro\n  <!-- results:one -->\n  - 1.5x\n\n  - done\n"
                      "  <!-- /results:one -->\noutro\n")
    assert pages.fill_blocks(filled, {"one": ["- 1.5x", "", "- done"]}) == filled


@pytest.mark.parametrize(("text", "message"), [
    ("<!-- results:nope -->\n<!-- /results:nope -->\n", "unknown results block 'nope'"),
    ("<!-- results:one -->\nx\n", "never closed"),
    ("<!-- /results:one -->\n", "closed but never opened"),
    ("<!-- results:one -->\n<!-- results:one -->\n", "inside the block"),
    ("text <!-- results:one -->\n", "malformed results marker"),
])
def test_bad_markers_are_clear_errors(text, message):
    with pytest.raises(pages.BlockError, match=message) as err:
        pages.fill_blocks(text, {"one": ["x"]}, "README.md")
    assert "README.md:1" in str(err.value) or "README.md:2" in str(err.value)


def make_repo(tmp_path, readme: str) -> None:
    results = tmp_path / "docs" / "results" / "cache"
    results.mkdir(parents=True)
    (results / "bench.json").write_text(json.dumps({
        "command": "python -m prefixcache_bench.cache --json docs/results/cache/bench.json",
        "match_us_p50": 12.5, "goals": {"match_us_p50": {"goal": "<= 200", "pass": True}},
        "machine": {"cpu_count": 2, "python": "3.11.7", "python_loop_s": 0.18}}))
    (tmp_path / "README.md").write_text(readme)


def test_check_then_write_then_check(tmp_path, capsys):
    make_repo(tmp_path, "# x\n<!-- results:summary -->\n- typed: 3 of 3 pass\n"
                        "<!-- /results:summary -->\n")
    assert pages.main(["--check"], root=tmp_path) == 1
    assert "stale: docs/results/README.md" in capsys.readouterr().err
    assert pages.main([], root=tmp_path) == 0
    assert pages.main(["--check"], root=tmp_path) == 0
    readme = (tmp_path / "README.md").read_text()
    assert "- `docs/results/cache/bench.json`: 1 of 1 goals pass" in readme
    assert "typed" not in readme
    page = (tmp_path / "docs" / "results" / "README.md").read_text()
    assert "do not edit" in page
    assert "python -m prefixcache_bench.cache --json docs/results/cache/bench.json" in page
    assert "| match_us_p50 | 12.5 | <= 200 | PASS |" in page
    assert "a 10M-iteration Python loop 0.18 s" in page  # how fast the machine ran
    # A figure typed into the page afterwards is caught.
    (tmp_path / "docs" / "results" / "README.md").write_text(page.replace("12.5", "10"))
    assert pages.main(["--check"], root=tmp_path) == 1


def test_an_unknown_marker_fails_the_command(tmp_path, capsys):
    make_repo(tmp_path, "<!-- results:typo -->\n<!-- /results:typo -->\n")
    assert pages.main(["--check"], root=tmp_path) == 2
    assert "README.md:1: unknown results block 'typo'" in capsys.readouterr().err


def test_the_command_comes_from_the_txt_header_when_the_json_has_none(tmp_path):
    folder = tmp_path / "docs" / "results" / "gateway"
    folder.mkdir(parents=True)
    (folder / "a.json").write_text("{}")
    (folder / "a.txt").write_text("# python -m prefixcache_bench.sim.simulate --json a.json\n# a note\nbody\n")
    (folder / "b.json").write_text("{}")
    (folder / "c.txt").write_text("# python -m prefixcache_bench.sim.simulate --json c.json\n"
                                  "# the same, --no-l3-events (b.json)\n")
    by_rel = {s.rel: s for s in pages.load_sources(tmp_path)}
    assert by_rel["gateway/a.json"].commands == ["python -m prefixcache_bench.sim.simulate --json a.json"]
    assert by_rel["gateway/b.json"].commands == ["python -m prefixcache_bench.sim.simulate --json c.json",
                                                 "the same, --no-l3-events (b.json)"]
