"""README's flag tables against the parser `tokenline serve` uses.

Every row of a table under README's "## Flags" whose first cell names flags in backticks is a
flag's row: that cell holds every option string of one flag (`--enable-metrics` /
`--no-enable-metrics`), the second its default, in one rule:

- `VALUE`: what you would type to get the default. It goes through the flag's own type, as the
  command line would (`4` and `4.0` both read 4.0 for a float), and must equal the default;
- `—`: unset (the default is None or empty);
- `on` / `off`: a switch (store_true, or --x / --no-x) and its default state.

The defaults are the parser's with no TOKENLINE_* variable set (each flag reads its own).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
from pathlib import Path

import pytest

from common.config import server_parser
from tokenline import cli

README = Path(__file__).resolve().parents[2] / "README.md"
UNSET = "—"
SWITCH = {"on": True, "off": False}


@pytest.fixture(autouse=True)
def _no_tokenline_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TOKENLINE_"):
            monkeypatch.delenv(name)


def flags_section(text: str) -> str:
    start = text.index("\n## Flags\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def readme_rows(text: str) -> list[tuple[int, list[str], str]]:
    """(line number, option strings, default cell) of every flag row under "## Flags"."""
    section = flags_section(text)
    first_line = text[: text.index(section)].count("\n") + 1
    rows = []
    for i, line in enumerate(section.splitlines()):
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        options = re.findall(r"`(--[a-z0-9-]+)`", cells[0])
        if not options:  # the header and the |---| line
            continue
        assert len(cells) == 5, (f"README line {first_line + i}: a flag row has 5 cells (flag, "
                                 f"default, what it does, vLLM, SGLang), not {len(cells)}: {line}")
        rows.append((first_line + i, options, cells[1]))
    return rows


def parser_flags() -> dict[str, argparse.Action]:
    """The first option string of each flag (help aside) -> its action."""
    return {a.option_strings[0]: a for a in server_parser("tokenline serve")._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)}


def default_problem(action: argparse.Action, cell: str) -> str | None:
    """Why `cell` is not `action`'s default under the rule above (None: it is)."""
    default = action.default
    if isinstance(default, bool):
        want = "on" if default else "off"
        return None if cell == want else f"a switch that is {want}, not {cell!r}"
    if default is None or default == "":
        return None if cell == UNSET else f"unset ({UNSET}), not {cell!r}"
    m = re.fullmatch(r"`([^`]+)`", cell)
    if not m:
        return f"`{default}`, not {cell!r}"
    try:
        value = (action.type or str)(m.group(1))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        return f"`{default}`; {cell} does not parse: {exc}"
    return None if value == default else f"`{default}`, not {cell}"


def disagreements(text: str) -> list[str]:
    """Each way README `text`'s flag tables and tokenline serve's parser disagree, naming the
    flag: in one and not the other, twice in README, other option strings, another default."""
    flags = parser_flags()
    problems: list[str] = []
    seen: dict[str, int] = {}
    for line, options, cell in readme_rows(text):
        for opt in options:
            if opt in seen:
                problems.append(f"{opt}: in README twice (lines {seen[opt]} and {line})")
            seen.setdefault(opt, line)
        action = flags.get(options[0])
        if action is None:
            problems.append(f"{options[0]}: in README (line {line}) but not in tokenline serve")
            continue
        if sorted(options) != sorted(action.option_strings):
            problems.append(f"{options[0]}: README (line {line}) names {options}, tokenline "
                            f"serve {action.option_strings}")
        if (why := default_problem(action, cell)) is not None:
            problems.append(f"{options[0]}: README (line {line}) default should be {why}")
    for flag, action in flags.items():
        if not any(opt in seen for opt in action.option_strings):
            problems.append(f"{flag}: in tokenline serve but in no README flag table")
    return problems


def test_readme_flag_tables_match_serve_help() -> None:
    problems = disagreements(README.read_text())
    assert not problems, "README's flag tables and tokenline serve disagree:\n" + "\n".join(
        problems)


def test_serve_help_lists_the_parser_flags() -> None:
    """What `tokenline serve --help` prints is the parser the tables are checked against."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--help"])
    assert exit_.value.code == 0
    options = out.getvalue().split("\noptions:\n", 1)[1]
    # an option line: "  --a A, --b A  help" (a flag with an alias repeats its metavar)
    lines = re.findall(r"^  (-\S.*?)(?:  |$)", options, re.M)
    printed = {opt for line in lines for opt in re.findall(r"(?:^|, )(-[-\w]+)", line)} - {
        "-h", "--help"}
    expected = {opt for a in parser_flags().values() for opt in a.option_strings}
    assert printed == expected, (f"only in --help: {sorted(printed - expected)}; "
                                 f"only in the parser: {sorted(expected - printed)}")


def _edit(text: str, row: str, new: str | None = None, twice: bool = False) -> str:
    """`text` with the README row that starts `| `row` |` replaced by `new`, removed (None
    and not twice) or doubled."""
    lines = text.splitlines(keepends=True)
    i = next(i for i, ln in enumerate(lines) if ln.startswith(f"| `{row}` |"))
    if twice:
        lines.insert(i, lines[i])
    elif new is None:
        del lines[i]
    else:
        lines[i] = new
    return "".join(lines)


def test_a_missing_doubled_or_wrong_row_is_named() -> None:
    """The check can fail: each kind of disagreement, made on a copy of README, is named."""
    text = README.read_text()
    assert disagreements(_edit(text, "--page-size")) == [
        "--page-size: in tokenline serve but in no README flag table"]
    doubled = disagreements(_edit(text, "--api-key", twice=True))
    assert len(doubled) == 1 and doubled[0].startswith("--api-key: in README twice")
    port = next(ln for ln in text.splitlines(keepends=True) if ln.startswith("| `--port` |"))
    for old, new, flag in (("| `8000` |", "| `8001` |", "--port"),
                           ("| `8000` |", "| — |", "--port")):
        [problem] = disagreements(_edit(text, flag, port.replace(old, new)))
        assert problem.startswith(f"{flag}: README") and "default should be `8000`, not " in problem
    metrics = "| `--enable-metrics` / `--no-enable-metrics` | on |"
    assert metrics in text
    [problem] = disagreements(text.replace(metrics, metrics.replace("| on |", "| off |")))
    assert problem.startswith("--enable-metrics:") and "a switch that is on" in problem
    [problem] = disagreements(text.replace(metrics, "| `--enable-metrics` | on |"))
    assert "--no-enable-metrics" in problem
    assert sorted(disagreements(_edit(text, "--port", port.replace("`--port`", "`--prot`")))) == [
        "--port: in tokenline serve but in no README flag table",
        f"--prot: in README (line {text[:text.index(port)].count(chr(10)) + 1}) but not in "
        "tokenline serve"]
