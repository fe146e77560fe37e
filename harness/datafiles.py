"""A user's data: problems from .jsonl, .json, .csv or .parquet files, or a Hub id, read with ``datasets``.

TRL and verl users bring a dataset file whose columns they name: ``--problem-key`` and ``--answer-key`` (dotted
names reach nested fields, as verl's ``reward_model.ground_truth``). Every other column travels with its row to
the reward function (``harness.user_reward``), and a chat prompt (a list of messages) keeps its system turn. A
missing column, or a row without a problem or answer, is one line naming what the file has. An environment's rows
(``--env``) need neither: its ``reset`` reads what it needs from the row's columns, and the id keys seeds and pairing.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from team import Problem

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # suffix -> datasets builder
HUB_SPEC = re.compile(r"^([A-Za-z0-9][\w.-]*/[\w.-]+)(?::([\w.-]+))?(?::([\w.\[\]%:-]+))?$")  # id[:config][:split]
# The reward's own keyword arguments (harness.user_reward): a dataset column may not take these names.
RESERVED_COLUMNS = ("prompts", "completions", "agent_answers", "protocol")


def is_data_file(spec: str) -> bool:
    """Whether ``spec`` names a data file (by its suffix, or an existing file: read as JSONL) rather than a Hub id
    or a dataset name."""
    return Path(spec).suffix.lower() in FILE_FORMATS or Path(spec).is_file()


def parse_hub_spec(spec: str) -> tuple[str, str | None, str]:
    """(hub id, config or None, split) of ``org/name[:config][:split]``; the split defaults to train."""
    m = HUB_SPEC.match(spec.strip())
    if not m:
        raise ValueError(f"{spec!r} is neither a data file ({', '.join(FILE_FORMATS)}) nor a Hub id; "
                         "pass a file, or org/name[:config][:split]")
    return m.group(1), m.group(2) or None, m.group(3) or "train"


def read_rows(spec: str) -> list[dict]:
    """Every row of a data file or Hub dataset, as plain dicts (nested fields as nested dicts)."""
    import datasets  # lazy: heavy, and unused by the built-in tasks

    if is_data_file(spec):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"{spec}: no such file; pass a {', '.join(FILE_FORMATS)} file, a Hub id "
                                    "org/name[:config][:split] or a dataset name (dapo-math-17k, aime24, aime25, "
                                    "math500, deepscaler)")
        if path.suffix.lower() not in (".json", ".csv", ".parquet"):  # JSONL, line by line: a bad line is named
            return read_jsonl(path)
        builder = FILE_FORMATS[path.suffix.lower()]
        try:
            return list(datasets.load_dataset(builder, data_files=str(path), split="train"))
        except Exception as e:  # pyarrow, pandas and json errors all look different
            raise ValueError(f"{spec}: not readable as {path.suffix} ({type(e).__name__}: {first_line(e)}); "
                             f"a {path.suffix} file must hold one record per row") from e
    hub_id, config, split = parse_hub_spec(spec)
    try:
        return list(datasets.load_dataset(hub_id, config, split=split))
    except Exception as e:  # network, auth, cache and hub errors all look different
        raise RuntimeError(f"could not fetch dataset {spec!r} ({type(e).__name__}: {first_line(e)}); download it "
                           "where there is network and pass it as a file (.jsonl, .json, .csv, .parquet)") from e


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file, blank lines skipped; a line that is not one is named in one line."""
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object, e.g. "
                             '{"problem": "2+2", "answer": 4}') from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def first_line(err: Exception) -> str:
    """An exception's message cut to its first line (and 200 characters), for a one-line error."""
    return (str(err).strip().splitlines() or [""])[0][:200]


def get_field(row: dict, dotted: str) -> tuple[bool, object]:
    """(found, value) of row["a"]["b"] for "a.b", or of a column named "a.b" itself (a CSV of flattened fields)."""
    if dotted in row:
        return True, row[dotted]
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def field_names(rows: list[dict]) -> list[str]:
    """The column names a file has, with one level of nested fields as dotted names (for error messages)."""
    names: dict[str, None] = {}
    for row in rows[:100]:
        for key, value in row.items():
            names[key] = None
            if isinstance(value, dict):
                names.update({f"{key}.{sub}": None for sub in value})
    return list(names)


def split_chat(prompt) -> tuple[str | None, str | None]:
    """(system turn, problem text) of a prompt: a plain string, or a chat list [{"role", "content"}] of an
    optional system turn and one user turn (other turns are refused by ``problem_of``: None, None)."""
    if isinstance(prompt, str):
        return None, prompt.strip() or None
    if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
        return None, None
    roles = [m.get("role") for m in prompt]
    if roles not in (["user"], ["system", "user"]):
        return None, None
    text = prompt[-1].get("content")
    system = prompt[0].get("content") if len(prompt) == 2 else None
    return (system.strip() or None) if isinstance(system, str) else None, (text.strip() or None) if isinstance(
        text, str) else None


def answer_text(value) -> str | None:
    """A gold answer as text: a string stripped, a number as written (38.0 -> "38"), a list or dict as JSON;
    None for an empty or missing answer (and for a bool, never a real answer)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        return value.strip() or None
    return json.dumps(value, ensure_ascii=False, sort_keys=True) if value else None


def check_keys(spec: str, rows: list[dict], problem_key: str, answer_key: str, required: bool = True) -> None:
    """Refuse, in one line naming the columns the data has, a key no row holds (unless not ``required``: an
    environment's rows) or a column that would take the name of one of the reward's own arguments."""
    names = field_names(rows)
    for option, key in (("--problem-key", problem_key), ("--answer-key", answer_key)) if required else ():
        if not any(get_field(row, key)[0] for row in rows[:100]):
            raise ValueError(f"{spec}: no column {key!r} ({option}); it has: {', '.join(names)}; pass {option} "
                             "NAME (a dotted name reaches a nested field, e.g. reward_model.ground_truth)")
    taken = [name for name in RESERVED_COLUMNS if name in rows[0]]
    if answer_key != "answer" and "answer" in rows[0]:
        taken.append("answer")
    if taken:
        raise ValueError(f"{spec}: column {taken[0]!r} would hide the reward's own argument of that name (answer= "
                         f"holds --answer-key {answer_key!r}); rename the column, or pass --answer-key {taken[0]} "
                         f"if it holds the gold answers")


def problem_of(row: dict, index: int, spec: str, keys: tuple[str, str, str], required: bool = True) -> Problem:
    """One row -> Problem: the problem text (and a chat prompt's system turn), the gold answer as text,
    the id (the id column, else "<name>-<row>"), every other column raw; one line for a row that lacks one.
    Not ``required`` (an environment's row): a missing or empty problem or answer is "", and the row's columns
    are exactly the file's (no ``answer`` added)."""
    problem_key, answer_key, id_key = keys
    where = f"{spec}: row {index + 1}"
    system, text = split_chat(get_field(row, problem_key)[1])
    if text is None and required:
        raise ValueError(f"{where}: {problem_key!r} is empty or not a problem (text, or a chat list of an optional "
                         "system turn and one user turn); fix the row or drop it")
    has_gold, gold = get_field(row, answer_key)
    if answer_text(gold) is None and required:
        raise ValueError(f"{where}: {answer_key!r} is empty (got {gold!r}); every row needs a gold answer for the "
                         "reward; fix the row or drop it")
    found, raw_id = get_field(row, id_key)
    pid = str(raw_id) if found and raw_id is not None else f"{Path(spec).stem}-{index + 1}"
    columns = {k: v for k, v in row.items() if k != problem_key}
    if has_gold:
        columns["answer"] = gold  # the raw value at --answer-key, as TRL hands a column to its reward
    return Problem(pid, text or "", answer_text(gold) or "", system, columns)


def load_problems(spec: str, problem_key: str | None = None, answer_key: str = "answer",
                  id_key: str = "id", environment: bool = False) -> list[Problem]:
    """The problems of a data file or Hub id (``read_rows``). ``problem_key`` None takes "problem", else
    "prompt" (the JSONL files tasks.load_jsonl reads). Ids must be unique: evaluations key their samples by id.
    ``environment``: the rows of an environment, whose ``reset`` reads them: no column is required."""
    rows = read_rows(spec)
    if not rows:
        return []
    check_keys(spec, rows, problem_key or ("problem" if any("problem" in row for row in rows[:100]) or not any(
        "prompt" in row for row in rows[:100]) else "prompt"), answer_key, required=not environment)
    default_key = lambda row: "problem" if "problem" in row else "prompt"  # noqa: E731  (per row, as JSONL mixes)
    problems = [problem_of(row, i, spec, (problem_key or default_key(row), answer_key, id_key),
                           required=not environment) for i, row in enumerate(rows)]
    seen: dict[str, int] = {}
    for i, p in enumerate(problems):
        if p.id in seen:
            raise ValueError(f"{spec}: rows {seen[p.id] + 1} and {i + 1} share the id {p.id!r} (column {id_key!r}); "
                             "give every row its own id, or drop the column to number the rows")
        seen[p.id] = i
    return problems
