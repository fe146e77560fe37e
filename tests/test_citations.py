"""One citation per concept, checked against the README: its citation key (which section of the paper holds each
concept, equation, algorithm, lemma and theorem) and its table "From the paper to the code" (each row: a section, a
paper object, the functions that compute it, the tests that check it).

- every section a table function's docstring cites is one the table gives that function's rows;
- every equation, Algorithm 1, lemma or theorem that a top-level module's docstring or comment writes next to a
  section (the same parenthesis or clause: "Section 5, Eq. (2)", "Eq. (5) (Section 5)", "Section 5 (Eqs.
  (6)-(7))") names the section the key gives it;
- the table agrees with the key, names functions that exist and tests that exist;
- every relative link in the README and docs/*.md reaches a file, and its anchor a heading there.

Text and ``ast`` only: no model, no torch.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TOP_MODULES = sorted(p.stem for p in ROOT.glob("*.py"))

SECTION = re.compile(r"\b(?:Sections?|Secs?\.)\s*(\d+)(?:\.\d+)*((?:\s*(?:-|–|,|/|and)\s*\d+(?:\.\d+)*)*)")
EQUATION = re.compile(r"\bEqs?\.\s*\(?(\d+)\)?((?:\s*(?:-|–|to|,|and)\s*\(?\d+\)?)*)")
ALGORITHM = re.compile(r"\bAlg(?:orithm|\.)\s*(\d+)\b")
THEOREM = re.compile(r"\b(Theorem|Lemma)s?\s*(\d+\.\d+)((?:\s*(?:,|/|and|or)\s*\d+\.\d+)*)|"
                     r"\b(Thm)s?\.\s*(\d+\.\d+)((?:\s*(?:,|/|and|or)\s*\d+\.\d+)*)")
CLAUSE_END = re.compile(r"[;:]|\.(?=\s|$)|\n\s*\n|\n\s*- ")


# ---------------------------------------------------------------------------
# Mentions: sections and the paper's numbered objects in a text
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Mention:
    start: int
    end: int
    kind: str  # "section" or "object"
    sections: frozenset  # a section mention: the sections it names (4.3 is Section 4)
    labels: tuple  # an object mention: "Eq. (5)", "Algorithm 1", "Theorem 4.2", "Lemma 4.1"


def listed_numbers(first: str, rest: str) -> list[str]:
    """"3" + "-5" -> 3, 4, 5; "4.7" + " and 4.9" -> 4.7, 4.9: a range where a dash joins two integers."""
    parts = re.findall(r"(-|–|to|,|/|and|or)?\s*\(?(\d+(?:\.\d+)*)\)?", rest)
    out = [first]
    for sep, number in parts:
        if sep in ("-", "–", "to") and "." not in number and "." not in out[-1]:
            out += [str(k) for k in range(int(out[-1]) + 1, int(number) + 1)]
        else:
            out.append(number)
    return out


def section_mentions(text: str) -> list[Mention]:
    out = []
    for m in SECTION.finditer(text):
        numbers = listed_numbers(m.group(1), m.group(2))
        out.append(Mention(m.start(), m.end(), "section", frozenset(int(n.split(".")[0]) for n in numbers), ()))
    return out


def object_mentions(text: str) -> list[Mention]:
    out = []
    for m in EQUATION.finditer(text):
        labels = tuple(f"Eq. ({n})" for n in listed_numbers(m.group(1), m.group(2)))
        out.append(Mention(m.start(), m.end(), "object", frozenset(), labels))
    for m in ALGORITHM.finditer(text):
        out.append(Mention(m.start(), m.end(), "object", frozenset(), (f"Algorithm {m.group(1)}",)))
    for m in THEOREM.finditer(text):
        kind, first, rest = (m.group(1), m.group(2), m.group(3)) if m.group(1) else ("Theorem", m.group(5), m.group(6))
        labels = tuple(f"{kind} {n}" for n in listed_numbers(first, rest))
        out.append(Mention(m.start(), m.end(), "object", frozenset(), labels))
    return out


# ---------------------------------------------------------------------------
# Structure: parentheses and clauses, with the mentions' own parentheses masked
# ---------------------------------------------------------------------------
def groups_and_clauses(text: str, mentions: list[Mention]) -> tuple[list[int], list[int], dict[int, int]]:
    """For each character: its innermost parenthesis (the index of its "(", -1 outside any), its clause within that
    parenthesis (separators ; : a full stop, a blank line, a list item), and each "(" -> its ")"."""
    masked = list(text)
    for m in mentions:  # "Eq. (5)" and "Sec. 5" are words here: no parenthesis, no full stop
        masked[m.start:m.end] = "x" * (m.end - m.start)
    masked = "".join(masked)
    ends = {m.start() for m in CLAUSE_END.finditer(masked)}
    group, clause, close = [0] * len(text), [0] * len(text), {}
    stack, count = [-1], {-1: 0}
    for i, c in enumerate(masked):
        if c == ")" and len(stack) > 1:
            close[stack.pop()] = i
        group[i], clause[i] = stack[-1], count[stack[-1]]
        if c == "(":
            stack.append(i)
            count[i] = 0
        elif i in ends:
            count[stack[-1]] += 1
    return group, clause, close


def pairings(text: str) -> list[tuple[Mention, Mention]]:
    """(object, section) pairs written next to each other:
    - the nearest section in the object's own parenthesis and clause ("Section 5, Eq. (2)", "Eq. (5), Section 5");
    - a parenthesis right after the object that opens with a section ("Eq. (5) (Section 5)");
    - a section right before the parenthesis whose first clause holds the object ("Section 5 (Eqs. (6)-(7))")."""
    sections, objects = section_mentions(text), object_mentions(text)
    group, clause, close = groups_and_clauses(text, sections + objects)
    by_start = {s.start: s for s in sections}
    out = []
    for o in objects:
        g, c = group[o.start], clause[o.start]
        near = [s for s in sections if group[s.start] == g and clause[s.start] == c]
        if near:
            out.append((o, min(near, key=lambda s: min(abs(s.start - o.end), abs(o.start - s.end)))))
        after = o.end + len(text[o.end:]) - len(text[o.end:].lstrip(" \n"))
        if after < len(text) and text[after] == "(" and after in close:
            first = [s for s in sections if group[s.start] == after and clause[s.start] == 0]
            out += [(o, s) for s in first[:1]]
        if g >= 0 and c == 0:
            before = text[:g].rstrip(" \n")
            out += [(o, s) for s in sections if s.end == len(before) and s.start in by_start]
    return out


# ---------------------------------------------------------------------------
# The README: the key and the table
# ---------------------------------------------------------------------------
def table_cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def citation_key(readme: str) -> dict[str, int]:
    """Object label -> section, from the key's rows ("| Section N | what it holds |")."""
    key = {}
    for line in readme.splitlines():
        cells = table_cells(line) if line.startswith("|") else []
        if len(cells) == 2 and re.fullmatch(r"Section \d+", cells[0]):
            for m in object_mentions(cells[1]):
                key.update({label: int(cells[0].split()[1]) for label in m.labels})
    return key


@dataclass(frozen=True)
class Row:
    sections: frozenset  # the row's section column
    implied: frozenset  # the sections the key gives the objects the paper column cites, and any it names
    labels: tuple  # the objects the paper column cites
    names: tuple  # module.function (or module.Class[.method]) of the top-level modules in the code column
    tests: tuple  # the tests the last column names
    text: str


def mapping_rows(readme: str) -> list[Row]:
    lines = readme.splitlines()
    at = next(i for i, line in enumerate(lines) if re.match(r"\|\s*sec\.\s*\|\s*paper\s*\|\s*code\s*\|", line))
    key, rows = citation_key(readme), []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        sec, paper, code, checked = table_cells(line)
        labels = tuple(label for m in object_mentions(paper) for label in m.labels)
        named = frozenset().union(*(m.sections for m in section_mentions(paper)))
        names = tuple(n for n in re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)", code)
                      if n.split(".")[0] in TOP_MODULES)
        tests = tuple(re.findall(r"`(?:[\w/]+\.py::)?(test_\w+)`", checked))
        rows.append(Row(frozenset(int(n) for n in re.findall(r"\d+", sec)),
                        named | frozenset(key[label] for label in labels if label in key), labels, names, tests, line))
    return rows


# ---------------------------------------------------------------------------
# The top-level modules: docstrings (ast) and comments (tokenize)
# ---------------------------------------------------------------------------
def definition(module: str, qualname: list[str]) -> ast.AST | None:
    """The def or class ``qualname`` of a top-level module, or None."""
    node = ast.parse((ROOT / f"{module}.py").read_text())
    for name in qualname:
        node = next((n for n in getattr(node, "body", []) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                             ast.ClassDef)) and n.name == name), None)
        if node is None:
            return None
    return node


def cited_texts(path: Path) -> list[tuple[str, str]]:
    """(where, text) for every docstring (module, class, function) and every comment of a module; a run of
    whole-line comments is one text."""
    source = path.read_text()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                out.append((f"{path.name}:{getattr(node, 'lineno', 1)} docstring", doc))
    block, last = [], None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        whole_line = tok.line.strip().startswith("#")
        if block and (not whole_line or last is None or tok.start[0] != last + 1):
            out.append(block_text(path, block))
            block = []
        block.append(tok)
        last = tok.start[0] if whole_line else None
        if not whole_line:
            out.append(block_text(path, block))
            block = []
    if block:
        out.append(block_text(path, block))
    return out


def block_text(path: Path, block: list) -> tuple[str, str]:
    return f"{path.name}:{block[0].start[0]} comment", "\n".join(t.string.lstrip("#").strip() for t in block)


def wrong_pairings(where: str, text: str, key: dict[str, int]) -> list[str]:
    out = []
    for o, s in pairings(text):
        for label in o.labels:
            excerpt = " ".join(text[max(0, min(o.start, s.start) - 20):max(o.end, s.end) + 20].split())
            if label not in key:
                out.append(f"{where}: {label} is not in the README's citation key: ...{excerpt}...")
            elif key[label] not in s.sections:
                out.append(f"{where}: {label} is written next to Section {'/'.join(map(str, sorted(s.sections)))}, "
                           f"but the README's key puts it in Section {key[label]}: ...{excerpt}...")
    return out


# ---------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------
def test_pairings_read_each_layout_the_key_names():
    """The rule's own cases: each layout pairs, a list does not, and the nested groups keep their own section."""
    def pairs(text):
        return sorted((o.labels[0], tuple(sorted(s.sections))) for o, s in pairings(text))

    assert pairs("the group (paper, Section 5, Eq. (2)).") == [("Eq. (2)", (5,))]
    assert pairs("-L_i, the paper's Eq. (5) (Section 3), on b rows") == [("Eq. (5)", (3,))]
    assert pairs("Eq. (5), Section 3: the objective") == [("Eq. (5)", (3,))]
    assert pairs("Paper, Section 5 (Eqs. (6)-(7)) and Section 4.3 (invariance).") == [("Eq. (6)", (5,))]
    assert pairs("Section 3 (the surrogate L_i, Eq. (5)) and Section 5 (Algorithm 1, line 8)") == [
        ("Algorithm 1", (5,)), ("Eq. (5)", (3,))]
    assert pairs("the surrogate L_i (Section 3) in its practical form, Eq. (5) of Section 5") == [("Eq. (5)", (5,))]
    assert pairs("Theorem 4.2. The loop is Section 5.") == []
    assert pairs("Paper, Section 4.3: one factor changes (``plug_and_play``, Eqs. (6)-(7)).") == []
    assert [m.labels for m in object_mentions("Thms. 4.7 / 4.9 and Eqs. (3)-(5)")] == [
        ("Eq. (3)", "Eq. (4)", "Eq. (5)"), ("Theorem 4.7", "Theorem 4.9")]
    assert [set(m.sections) for m in section_mentions("Sections 3-5; Sec. 4.3 and 5")] == [{3, 4, 5}, {4, 5}]


def test_readme_key_covers_every_numbered_object_and_section():
    key = citation_key(README.read_text())
    assert {f"Eq. ({k})" for k in range(1, 8)} <= set(key) and key["Eq. (5)"] == 5, key
    assert key["Algorithm 1"] == 5
    assert {label: key.get(label) for label in ("Lemma 4.1", "Theorem 4.2", "Lemma 4.3", "Theorem 4.4",
                                                "Theorem 4.7", "Theorem 4.9")} == dict.fromkeys(
        ("Lemma 4.1", "Theorem 4.2", "Lemma 4.3", "Theorem 4.4", "Theorem 4.7", "Theorem 4.9"), 4)


def test_readme_table_rows_agree_with_the_key():
    """A row's section column holds the section the key gives every object its paper column cites."""
    key = citation_key(README.read_text())
    for row in mapping_rows(README.read_text()):
        assert set(row.labels) <= set(key), f"an object the key lacks: {row.text}"
        missing = set(row.implied - row.sections)
        assert not missing, f"the row's section column lacks {missing}: {row.text}"


def test_readme_table_names_functions_and_tests_that_exist():
    tests_text = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    for row in mapping_rows(README.read_text()):
        for name in row.names:
            module, *qualname = name.split(".")
            assert definition(module, qualname) is not None, f"{name} is not defined in {module}.py: {row.text}"
        for test in row.tests:
            assert re.search(rf"def {test}\(", tests_text), f"{test} is not a test: {row.text}"


def test_citation_of_each_table_function_is_the_section_its_rows_give():
    """Every section a table function's docstring cites is one of its rows' sections (or implied by them)."""
    rows = mapping_rows(README.read_text())
    allowed: dict[str, set] = {}
    for row in rows:
        for name in row.names:
            allowed.setdefault(name, set()).update(row.sections | row.implied)
    problems = []
    for name, sections in sorted(allowed.items()):
        module, *qualname = name.split(".")
        doc = ast.get_docstring(definition(module, qualname)) or ""
        for m in section_mentions(doc):
            if not m.sections <= sections:
                problems.append(f"{name}'s docstring cites {doc[m.start:m.end]!r}, but the README's table gives it "
                                f"Section {', '.join(map(str, sorted(sections))) or 'none'}")
    assert not problems, "\n".join(problems)


def test_citation_of_an_equation_algorithm_or_theorem_names_the_section_of_the_key():
    """Across every top-level module's docstrings and comments, an object written next to a section names the
    section the README's key gives it."""
    key = citation_key(README.read_text())
    problems = [p for module in TOP_MODULES for where, text in cited_texts(ROOT / f"{module}.py")
                for p in wrong_pairings(where, text, key)]
    assert not problems, "\n".join(problems)


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_and_docs_links_resolve():
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            assert file.exists(), f"{doc.relative_to(ROOT)}: {target} does not exist"
            if anchor:
                anchors = {heading_anchor(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}
                assert anchor in anchors, f"{doc.relative_to(ROOT)}: no heading #{anchor} in {file.name}"
